"""Keeps serving when Redis is down, by the configured outage mode.

``fail-open``: operations fall back to an in-process ``MemoryStore`` (each
router enforces the limits locally) until Redis answers again.
``fail-closed``: operations raise ``StoreUnavailable``, which the router turns
into 503. Either way the outage is logged once, counted in metrics, shown by
``/ready``, and a background probe reconnects by itself (its first try
0.1 s after the outage began, then less often, up to every
``probe_interval``: one slow answer costs a moment of local limits, not a
second of them).

Starting (``start``): a router that has never had an answer from Redis is
not in an outage, it is connecting. It tries for ``connect_timeout``
seconds (each try up to the store's own timeout); meanwhile ``/ready`` is
503 and every operation waits for the answer, so a slow first answer (a
router starting on a busy host, whose own loop is slow too) does not begin
the router in an outage that serves with local limits. From the first try
that fails to the answer, ``on_change`` says down
(``fairstream_state_store_up`` 0). No answer by then: an outage as above.

Leases and reservations remember which store took them, so a stream admitted
during an outage is released and settled where it was counted. In fail-open,
the fallback counts this router's running streams from the outage's start
(their leases are held there too until Redis is back), so a tenant gets up
to its limits from each router, its streams already running included. Once Redis is
back, the leases the fallback took move to it with their next renewal, which
the lease keeper makes at once (``generation`` changes with every return),
so every router counts those streams again; the
releases and settlements Redis missed during the outage are made when it
returns (at most ``MAX_OWED``; a lease whose release is dropped still expires
with its TTL). One that timed out on a Redis that only hung may have run when
it woke: made again, a release changes nothing, nor does a settlement (the
store keeps settled lease ids: ``SETTLED_TTL``); an admission, whose answer
the router never used, is undone (``undo_admit``), in its place among them
(the list is made oldest first; the undo touches no other lease's). The
resume buffers the fallback took move to Redis before it counts as back
(``router.state.stream_move``).
"""

from __future__ import annotations

import asyncio
import collections
import contextvars
import logging
from collections.abc import Awaitable, Callable

from policies.ratelimit import Decision
from router.background import KeepGoing
from router.state.base import AdmitRequest, StateStore, StoreUnavailable, TenantUsage
from router.state.memory import MemoryStore
from router.state.stream_move import StreamMove
from router.stopping import stop

__all__ = ["ResilientStore"]

log = logging.getLogger("fairstream.state")

MAX_OWED = 10_000  # releases and settlements kept for Redis's return
CONNECT_RETRY = 0.2  # seconds between two tries of the first contact
PROBE_FIRST = 0.1  # seconds from an outage's start to the probe's first try (then doubling)


class ResilientStore(StateStore):
    def __init__(
        self,
        primary: StateStore,
        *,
        fail_open: bool,
        probe_interval: float = 1.0,
        connect_timeout: float = 10.0,
        on_change: Callable[[bool], None] | None = None,
        on_error: Callable[[str], None] | None = None,
    ) -> None:
        self.primary = primary
        self.fallback = MemoryStore()
        self.fail_open = fail_open
        self.name = primary.name
        self.shared = primary.shared
        self.healthy = True
        self.connecting = False  # (``start`` until the first answer, or the outage it ends in)
        self._probe_interval = probe_interval
        self._connect_timeout = connect_timeout
        self._connect: asyncio.Task[None] | None = None  # the first contact, while under way
        self._returns = 0  # outages Redis came back from (``generation``)
        self._on_change = on_change or (lambda up: None)
        self._said_up = True  # (what on_change said last: it hears each change once)
        self._on_error = on_error or (lambda op: None)
        self._probe: asyncio.Task[None] | None = None
        self._lease_store: dict[str, StateStore] = {}  # where each live lease is counted (it may move)
        self._lease_of: dict[str, tuple[str, float]] = {}  # each live lease's tenant and TTL
        self._reserve_store: dict[str, StateStore] = {}  # where each reservation was taken (it never moves)
        # what Redis missed while it was down, made when it answers again
        self._owed: collections.deque[Callable[[StateStore], Awaitable[None]]] = collections.deque(maxlen=MAX_OWED)
        # the fallback's resume buffers, moved to Redis before it counts as back
        self._streams = StreamMove(primary, self.fallback)

    def _down(self, op: str, err: Exception) -> None:
        self._on_error(op)
        if self.healthy:
            self.healthy = False
            mode = "serving with local limits (fail-open)" if self.fail_open else "rejecting with 503 (fail-closed)"
            log.error("state store %s unavailable (%s); %s until it returns", self.name, err, mode)
            if self.fail_open:
                self._hold_locally()
            self._say(False)
            if self._probe is None or self._probe.done():
                # (its own context: started by whichever request met the outage, its
                # log lines must not carry that request's id)
                self._probe = asyncio.get_running_loop().create_task(self._reconnect(), name="state-probe",
                                                                     context=contextvars.Context())

    def _hold_locally(self) -> None:
        """The fallback counts the leases Redis holds for this router's
        running streams (it starts empty: each router admitted a tenant's
        whole ``max_concurrent`` again on top of them)."""
        for lid, store in self._lease_store.items():
            if store is self.primary:
                tenant, ttl = self._lease_of[lid]
                self.fallback.hold(tenant, [lid], ttl)

    def _say(self, up: bool) -> None:
        if up != self._said_up:
            self._said_up = up
            self._on_change(up)

    async def start(self) -> None:
        """Begin the first contact; ``connecting`` until it ends."""
        if self._connect is None and not self.connecting:
            self.connecting = True
            self._connect = asyncio.get_running_loop().create_task(self._first_contact(), name="state-connect")

    async def _first_contact(self) -> None:
        loop = asyncio.get_running_loop()
        began = loop.time()
        tries = 0
        try:
            while True:
                tries += 1
                try:
                    await self.primary.ping()
                    await self.primary.prepare()
                except Exception as e:  # (StoreUnavailable; anything else must not leave it connecting for good)
                    if not isinstance(e, StoreUnavailable):
                        log.exception("state store %s: the first contact failed unexpectedly", self.name)
                    self._say(False)  # (down until it answers: fairstream_state_store_up 0)
                    if loop.time() + CONNECT_RETRY - began >= self._connect_timeout:
                        log.error("state store %s could not be used within connect_timeout (%gs, %d tries): %s",
                                  self.name, self._connect_timeout, tries, e)
                        self.connecting = False
                        self._down("connect", e)
                        return
                    if tries == 1:
                        log.warning("state store %s could not be used at the first try (%s); trying again for up "
                                    "to %gs before it counts as an outage", self.name, e, self._connect_timeout)
                    await asyncio.sleep(CONNECT_RETRY)
                    continue
                if tries > 1:
                    log.warning("state store %s answered after %.1fs (%d tries)", self.name, loop.time() - began,
                                tries)
                self.connecting = False
                self._say(True)
                return
        except asyncio.CancelledError:  # (stop_connecting: no probe, no outage logged, the router stops)
            self.connecting = self.healthy = False
            raise
        finally:
            self._connect = None

    async def _connected(self) -> None:
        """Wait for the first contact to end (while ``start``'s is under way)."""
        task = self._connect
        if task is not None:
            await asyncio.wait((task,))  # (neither's cancel cancels the other, as shield's did: stop_connecting's)

    async def _reconnect(self) -> None:
        delay = min(PROBE_FIRST, self._probe_interval)
        guard = KeepGoing(f"state store {self.name} probe", log)
        guard.backoff = self._probe_interval  # (what its log line says it waits, at most)
        while True:
            await asyncio.sleep(delay)
            delay = min(2 * delay, self._probe_interval)
            try:
                await self.primary.ping()
                await self.primary.prepare()  # (a restarted Redis has no scripts)
                await self._pay_back()
                await self._streams.move()
                # (and those owed while the buffers moved: from the last look at the list to
                # ``healthy``, no await lets one in; the moved ones are written in Redis meanwhile)
                await self._pay_back()
            except Exception as e:  # noqa: BLE001 - a bug must not end the probe: the outage would last for good
                if not isinstance(e, StoreUnavailable):
                    guard.failed(e)  # (with its traceback, at most once a LOG_EVERY: it runs every probe_interval)
                continue
            finally:
                self._streams.done()  # (and no await from here to ``healthy``)
            self.healthy = True
            self._returns += 1
            for lid, store in self._lease_store.items():  # (Redis counts them again: ``_hold_locally``'s go)
                if store is self.primary:
                    self.fallback.drop(self._lease_of[lid][0], lid)
            # (the resume buffers the fallback took cannot be read from now on:
            # resumes read Redis. Kept, they stayed in memory for good.)
            self.fallback.drop_streams()
            log.warning("state store %s is back", self.name)
            self._say(True)
            return

    def _stream_store(self, sid: str) -> StateStore:
        """Where stream ``sid``'s buffer is (while the fallback's buffers
        move to Redis, maybe in Redis already: ``StreamMove.where``)."""
        store = self._streams.where(sid)
        return self._current() if store is None else store

    async def _pay_back(self) -> None:
        """Make the releases and settlements Redis missed, oldest first;
        ``StoreUnavailable`` leaves the rest for the next try."""
        if self._owed:
            log.warning("state store %s: making %d releases and settlements it missed", self.name, len(self._owed))
        while self._owed:
            await self._owed[0](self.primary)
            self._owed.popleft()

    def _owe(self, op: Callable[[StateStore], Awaitable[None]]) -> None:
        if len(self._owed) == MAX_OWED:
            log.warning("state store %s: over %d releases and settlements missed; the oldest is dropped",
                        self.name, MAX_OWED)
        self._owed.append(op)

    def _current(self) -> StateStore:
        if self.healthy:
            return self.primary
        if self.fail_open:
            return self.fallback
        raise StoreUnavailable(f"state store {self.name} is unavailable")

    async def admit(self, tenant: str, req: AdmitRequest) -> Decision:
        if self._connect is not None:
            await self._connected()
        store = self._current()
        try:
            decision = await store.admit(tenant, req)
        except StoreUnavailable as e:
            self._down("admit", e)
            if store is self.primary:
                # (a call that timed out was sent: a Redis that only hung runs it
                # when it wakes, and the tenant paid a request and tokens for an
                # answer never used, its lease held a slot on every router until
                # its TTL, a continuation's took over a dead router's reservation
                # that nothing settled then. Undone on Redis's return; its lease
                # stays if its stream still runs: the renewal that moves it counts it.
                # Each try asks again: one made again after its stream ended, its
                # reply lost, ends the lease and gives nothing back twice)
                if req.lease_id:
                    self._owe(lambda s: s.undo_admit(tenant, req, keep_lease=req.lease_id in self._lease_store))
            store = self._current()
            decision = await store.admit(tenant, req)
        if decision.ok and req.lease_id:
            self._lease_store[req.lease_id] = store
            self._lease_of[req.lease_id] = (tenant, req.lease_ttl)
            self._reserve_store[req.lease_id] = store
            if store is self.primary and not self.healthy and self.fail_open:
                # (Redis took it, but an outage began meanwhile: ``_hold_locally`` ran without it)
                self.fallback.hold(tenant, [req.lease_id], req.lease_ttl)
        return decision

    async def undo_admit(self, tenant: str, req: AdmitRequest, *, keep_lease: bool = False) -> None:
        # (``admit`` undoes its own that timed out; one asked for goes to Redis, now or on its return)
        async def undo(s: StateStore) -> None:
            await s.undo_admit(tenant, req, keep_lease=keep_lease)

        if not self.healthy:
            self._owe(undo)
            return
        try:
            await undo(self.primary)
        except StoreUnavailable as e:
            self._down("undo_admit", e)
            self._owe(undo)

    async def leave(self, tenant: str, lease_id: str) -> None:
        if self._connect is not None:
            await self._connected()
        await self.fallback.leave(tenant, lease_id)  # (it may have waited there during an outage)
        if self.healthy:
            try:
                await self.primary.leave(tenant, lease_id)
            except StoreUnavailable as e:
                self._down("leave", e)  # (its place in the line expires within seconds)

    async def settle(self, tenant: str, *, tpm: int, reserved: int, used: int, lease_id: str = "",
                     held: bool = False) -> None:
        if self._connect is not None:
            await self._connected()
        store = self._reserve_store.pop(lease_id, self.primary) if lease_id else self.primary
        if store is self.primary and not self.healthy:
            # (known to be down: made on its return, without waiting here for a
            # timeout, which held back the tenant's next request in line)
            self._owe(lambda s: s.settle(tenant, tpm=tpm, reserved=reserved, used=used, lease_id=lease_id, held=held))
            return
        try:
            await store.settle(tenant, tpm=tpm, reserved=reserved, used=used, lease_id=lease_id, held=held)
        except StoreUnavailable as e:
            self._down("settle", e)
            self._owe(lambda s: s.settle(tenant, tpm=tpm, reserved=reserved, used=used, lease_id=lease_id, held=held))

    async def renew(self, tenant: str, lease_ids: list[str], ttl: float) -> None:
        if self._connect is not None:
            await self._connected()
        by_store: dict[int, tuple[StateStore, list[str]]] = {}
        moving: list[str] = []
        for lid in lease_ids:
            store = self._lease_store.get(lid, self.primary)
            if store is self.primary and not self.healthy and self.fail_open:
                store = self.fallback  # (counted there until Redis is back: ``_hold_locally``; the probe watches)
            if store is self.fallback and self.healthy:  # (taken during the outage: Redis counts it from now on)
                store = self.primary
                moving.append(lid)
            by_store.setdefault(id(store), (store, []))[1].append(lid)
        for store, ids in by_store.values():
            if store is self.primary and not self.healthy:
                # (fail-closed, Redis known to be down: not sent to wait out its
                # timeout; the first renewal once it is back adds them again)
                continue
            # (not one released while an earlier group's renewal was on its way)
            ids = [lid for lid in ids if lid in self._lease_store]
            try:
                await store.renew(tenant, ids, ttl)
            except StoreUnavailable as e:
                self._down("renew", e)  # (the other groups are renewed all the same)
                if store is self.primary:  # (those on their way from the fallback stay counted there)
                    staying = [lid for lid in moving if lid in self._lease_store]
                    if staying:
                        await self.fallback.renew(tenant, staying, ttl)
                continue
            if store is self.primary:
                for lid in moving:
                    if lid in self._lease_store:  # (not released meanwhile)
                        self._lease_store[lid] = self.primary
                        if self.healthy or not self.fail_open:
                            self.fallback.drop(tenant, lid)
                        # (else an outage began while it moved: the fallback counts it on, as
                        # ``_hold_locally`` does Redis's leases, until Redis is back)

    async def release(self, tenant: str, lease_id: str) -> None:
        if self._connect is not None:
            await self._connected()
        self._reserve_store.pop(lease_id, None)  # (settled before, or nothing to settle: tpm 0)
        self._lease_of.pop(lease_id, None)
        store = self._lease_store.pop(lease_id, self.primary)
        if store is self.primary and not self.healthy:
            self.fallback.drop(tenant, lease_id)  # (``_hold_locally``'s count)
            self._owe(lambda s: s.release(tenant, lease_id))  # (as ``settle``)
            return
        try:
            await store.release(tenant, lease_id)
        except StoreUnavailable as e:
            self._down("release", e)
            self._owe(lambda s: s.release(tenant, lease_id))

    async def usage(self, tenant: str, *, rpm: int, tpm: int) -> TenantUsage:
        if self._connect is not None:
            await self._connected()
        # (fail-open: the fallback's, what this router admits by in the
        # outage; fail-closed: none, the fallback's being empty and unused)
        store = self._current()
        try:
            return await store.usage(tenant, rpm=rpm, tpm=tpm)
        except StoreUnavailable as e:
            self._down("usage", e)
            return await self._current().usage(tenant, rpm=rpm, tpm=tpm)

    # Resume buffers: on an outage they live in the local fallback (fail-open)
    # so streams keep going; resuming on another router needs Redis back.

    async def _stream_op(self, op: str, call, sid: str | None = None):
        if self._connect is not None:
            await self._connected()
        store = self._current() if sid is None else self._stream_store(sid)
        try:
            return await call(store)
        except StoreUnavailable as e:
            self._down(op, e)
            return await call(self._current())

    async def stream_open(self, sid, meta, owner, ttl, *, lease="", lost=False, charged=0) -> None:
        await self._stream_op("stream_open", lambda s: s.stream_open(sid, meta, owner, ttl, lease=lease, lost=lost,
                                                                     charged=charged),
                              sid)

    async def stream_append(self, sid, events, token_ids, text_len, finished, owner, ttl, first=-1) -> bool:
        # (during an outage, one of a buffer Redis holds goes to the fallback,
        # which has no such buffer: refused, as the events are kept nowhere)
        return await self._stream_op(
            "stream_append",
            lambda s: s.stream_append(sid, events, token_ids, text_len, finished, owner, ttl, first), sid,
        )

    async def stream_read(self, sid, after, tokens=True):
        return await self._stream_op("stream_read", lambda s: s.stream_read(sid, after, tokens), sid)

    async def stream_claim(self, sid, owner, claim_ttl, lease="") -> bool:
        return await self._stream_op("stream_claim", lambda s: s.stream_claim(sid, owner, claim_ttl, lease), sid)

    async def stream_renew(self, sids, owner, claim_ttl) -> list[bool]:
        if self._streams.under_way:  # (each where it is: ``_stream_store``)
            return [(await self._stream_op("stream_renew", lambda s, i=i: s.stream_renew([i], owner, claim_ttl), i))[0]
                    for i in sids]
        return await self._stream_op("stream_renew", lambda s: s.stream_renew(sids, owner, claim_ttl))

    async def stream_release(self, sid, owner, charged=0) -> None:
        await self._stream_op("stream_release", lambda s: s.stream_release(sid, owner, charged), sid)

    async def peers(self, router: str, digest: str, ttl: float) -> dict[str, str]:
        if self._connect is not None:
            await self._connected()
        # (the other routers are in Redis only: while it is down, none is known)
        if not self.healthy:
            raise StoreUnavailable(f"state store {self.name} is unavailable")
        try:
            return await self.primary.peers(router, digest, ttl)
        except StoreUnavailable as e:
            self._down("peers", e)
            raise

    def watch(self, on_turn: Callable[[str], None]) -> None:
        self.primary.watch(on_turn)

    async def ping(self) -> None:
        await self.primary.ping()

    async def generation(self) -> str:
        # (Redis's own, and how often it came back from an outage: the
        # fallback's leases move to it, and it may have lost its own meanwhile)
        if self._connect is not None:
            await self._connected()
        if self.healthy:
            try:
                return f"{await self.primary.generation()}/{self._returns}"
            except StoreUnavailable as e:
                self._down("generation", e)
        raise StoreUnavailable(f"state store {self.name} is unavailable")

    async def check(self) -> None:
        # (while down, the probe task watches for its return; while
        # connecting, the first contact does)
        if self.healthy and not self.connecting:
            try:
                await self.primary.ping()
            except StoreUnavailable as e:
                self._down("ping", e)

    def stop_connecting(self) -> None:
        """The router stops: a first contact under way ends now, as an outage."""
        if self._connect is not None:
            self._connect.cancel()

    async def close(self) -> None:
        await asyncio.gather(stop(self._connect), stop(self._probe))
        await self.primary.close()
