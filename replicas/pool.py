"""The set of replicas the router can dispatch to, and their load handles.

``ReplicaPool.choose`` snapshots the ready replicas' loads and lets the pure
``policies.balance.choose`` pick one. A ``LoadHandle`` is entered at dispatch
and left when the stream ends (not when headers go out), so the in-flight
counts the balancer sees are exact.
"""

from __future__ import annotations

import logging
import random
import time

from collections import OrderedDict
from collections.abc import Callable, Collection, Mapping

from policies.balance import ReplicaLoad, choose
from replicas.client import KeyRefused, ReplicaClient, ReplicaRefused
from replicas.protocol import Feature
from replicas.sim import DEFAULT_MODEL as SIM_DEFAULT_MODEL
from replicas.spec import ReplicaSpec

log = logging.getLogger("fairstream.pool")

__all__ = ["ReplicaSlot", "ReplicaPool", "LoadHandle", "NoReplica", "CONTINUES"]


AFFINITY_ENTRIES = 4096  # prompt prefixes remembered for affinity

# A bit of ``needs`` that is no protocol ``Feature``: the request continues
# a stream from its token ids (``prefix_token_ids``: a failover, a resume),
# which a replica's client can (``continues``) unless it is an upstream
# that returns no token ids.
CONTINUES = 1 << 30


class NoReplica(RuntimeError):
    """No ready replica serves the model."""


class ReplicaSlot:
    """One configured replica: its spec, its live client (when connected),
    its supervision counters and the router's own load accounting."""

    def __init__(self, spec: ReplicaSpec, cap: Callable[[], int] | None = None) -> None:
        self.spec = spec
        self.cap_fn = cap
        self.name = spec.name
        self.client: ReplicaClient | None = None
        self.pid: int | None = None
        self.restarts = 0  # the router restarted its process (a local replica; fairstream_replica_restarts_total)
        # the router connected to it again after it was lost, failed or refused
        # (a replica it does not start: ``address``, ``url``)
        self.reconnects = 0
        self.refusal: ReplicaRefused | None = None  # its last connect's refusal, until one succeeds
        self.state = "starting"  # starting | ready | down (and ``status``: stalled)
        self.last_error: str | None = None  # why it last failed, kept after it is back (/admin/replicas)
        self.last_error_at: float | None = None  # (Unix time)
        self.inflight = 0
        self.inflight_tokens = 0
        self.served = 0
        # (time.monotonic()) when a stream's stall limit last caught it producing nothing: out of
        # dispatch until it answers a ping sent after that (``answered``), which a frozen process
        # never does; the health check alone decides to kill it
        self.stalled_at: float | None = None
        # (the supervisor's watch of it, while one runs: ping it at once, for a stall)
        self.ping_now: Callable[[], None] | None = None

    @property
    def usable(self) -> bool:
        """It is up and its connection takes requests (not closed, refused or refusing the router's key)."""
        c = self.client
        return (self.state == "ready" and c is not None and c.closed is None and not c.refused
                and c.credentials_refused is None)

    @property
    def ready(self) -> bool:
        """Connected and not caught stalling: chosen for new requests and failovers."""
        return self.stalled_at is None and self.usable

    def stalled(self) -> bool:
        """A stream's stall limit caught it producing nothing: out of dispatch
        until it answers a ping sent from now on. Whether that is news (it
        was not out already)."""
        news = self.stalled_at is None
        self.stalled_at = time.monotonic()
        return news

    def answered(self, sent: float) -> bool:
        """It answered a ping sent at ``sent`` (time.monotonic()): back in
        dispatch if it was out for a stall caught before that ping (a pong
        to an older one may have been on its way when it froze). Whether it
        came back. Not while its client says its requests still get no
        answer (``stalling``: an upstream whose /models answers)."""
        if self.stalled_at is None or sent < self.stalled_at or getattr(self.client, "stalling", None):
            return False
        self.stalled_at = None
        return True

    def failed(self, why: str) -> None:
        """It failed (the supervisor's reason, as logged). Not for a refusal
        any more: one after this is news again, and the 503's reason is
        not the key while the upstream cannot even be reached."""
        self.last_error = why
        self.last_error_at = time.time()
        self.refusal = None

    def refused(self, e: ReplicaRefused) -> bool:
        """Its connect was refused (a wrong secret or API key, a model it
        does not serve): whether that is news to log (it was not refused
        so at the last attempt), since it is tried again and again with the
        backoff."""
        new = self.refusal is None or str(self.refusal) != str(e)
        self.failed(str(e))
        self.refusal = e
        return new

    def connected(self) -> ReplicaRefused | None:
        """A connect succeeded: the refusal that ends, if any."""
        refusal, self.refusal = self.refusal, None
        return refusal

    @property
    def credentials_refused(self) -> str | None:
        """Why it refuses the router's API key: at its last connect, or (its
        client's) a generation request's; None while it takes it."""
        if isinstance(self.refusal, KeyRefused):
            return str(self.refusal)
        return self.client.credentials_refused if self.client is not None else None

    @property
    def status(self) -> str:
        """``state`` as ``/ready`` and ``/admin/replicas`` show it: ``down``
        as soon as its connection is closed or refused, before the
        supervisor has noticed (``state`` still ``ready``); ``stalled``
        while it is out of dispatch for a stall (``stalled_at``)."""
        if self.state != "ready":
            return self.state
        if not self.usable:
            return "down"
        return "ready" if self.stalled_at is None else "stalled"

    @property
    def model(self) -> str:
        """The model it serves: its connection's, or else the one its spec
        names ("" when only a connection will tell, e.g. an ``address``)."""
        if self.client is not None:
            return self.client.model
        spec = self.spec
        cfg = spec.config
        name = cfg.get("served_name") or cfg.get("model") or (spec.upstream_model if spec.url is not None else "")
        if not name and spec.engine == "sim" and spec.address is None and spec.url is None:
            name = SIM_DEFAULT_MODEL  # (a local sim replica's model when its config names none)
        return str(name or "")

    @property
    def cap(self) -> int:
        """The router's in-flight cap for this replica (adaptive batching),
        never above the spec's ``max_concurrency``."""
        cap = self.cap_fn() if self.cap_fn is not None else 1 << 30
        limit = self.spec.max_concurrency
        return cap if limit is None else min(cap, limit)

    @property
    def has_room(self) -> bool:
        return self.inflight < self.cap

    def snapshot(self) -> ReplicaLoad:
        rep = self.client.load if self.client is not None else None
        return ReplicaLoad(
            inflight=self.inflight,
            inflight_tokens=self.inflight_tokens,
            running=rep.running if rep else 0,
            waiting=rep.waiting if rep else 0,
            kv_usage=rep.kv_usage if rep else 0.0,
        )


class LoadHandle:
    """Counts one request against a slot from dispatch until release."""

    __slots__ = ("slot", "tokens", "_open", "_on_release")

    def __init__(self, slot: ReplicaSlot, tokens: int, on_release: Callable[[ReplicaSlot], None] | None = None) -> None:
        self.slot = slot
        self.tokens = tokens
        self._open = True
        self._on_release = on_release
        slot.inflight += 1
        slot.inflight_tokens += tokens

    def produced(self, n: int) -> None:
        """``n`` of the expected tokens arrived; they no longer count as load."""
        n = min(n, self.tokens)
        self.tokens -= n
        self.slot.inflight_tokens -= n

    def release(self) -> None:
        if self._open:
            self._open = False
            self.slot.inflight -= 1
            self.slot.inflight_tokens -= self.tokens
            self.slot.served += 1
            if self._on_release is not None:
                self._on_release(self.slot)


def _takes(slot: ReplicaSlot) -> int:
    """The ``needs`` bits a ready replica takes."""
    client = slot.client
    assert client is not None
    return client.ready.features | CONTINUES if client.continues else client.ready.features


class ReplicaPool:
    def __init__(self, specs: list[ReplicaSpec], rng: random.Random | None = None) -> None:
        names = [s.name for s in specs]
        if len(set(names)) != len(names):
            raise ValueError("replica names must be unique")
        self.slots = [ReplicaSlot(s) for s in specs]
        self._rng = rng or random.Random()
        self.on_release: Callable[[ReplicaSlot], None] | None = None
        # called when a replica becomes ready (the scheduler: dispatch what queued)
        self.on_ready: Callable[[], None] | None = None
        # called when a stream's stall limit takes a replica out of dispatch (the metrics)
        self.on_stalled: Callable[[ReplicaSlot], None] | None = None
        # streams waiting to fail over (``when_ready``), called when a replica becomes ready or a ready one
        # may have room: per (model, needs) in registration order (a dict: forgetting one is O(1)), so
        # that a round asks only the waiters of models with room, and a model's only until one finds none
        self._ready_waiters: dict[tuple[str | None, int], dict[Callable[[], bool | None], int]] = {}
        self._waiter_keys: dict[Callable[[], bool | None], tuple[str | None, int]] = {}
        self._waiter_seq = 0  # (the order waiters began to wait in, across keys)
        self._offering = False  # (calling them; a release meanwhile asks for another round: _offer_again)
        self._offer_again = False
        self._affinity: OrderedDict[int, str] = OrderedDict()  # prefix hash -> replica (LRU)

    def models(self) -> list[str]:
        """Models the replicas serve, served last or are configured to serve,
        ready or not: a request for a model whose replicas are all
        restarting gets a 503 to retry, not a 404 (which clients do not
        retry), and the model stays in ``/v1/models``."""
        seen = {s.model for s in self.slots}
        seen.discard("")
        return sorted(seen)

    def serves(self, model: str) -> bool:
        """``model in models()``, without building the list (asked once per request)."""
        if model:
            for s in self.slots:
                if s.model == model:
                    return True
        return False

    def models_unknown(self) -> int:
        """How many replicas serve a model only their connection will tell
        (an ``address`` or ``url`` replica not connected yet): until then a
        request for a model no other replica serves may be theirs."""
        return sum(1 for s in self.slots if not s.model)

    def max_model_len(self, model: str, largest: bool = False) -> int | None:
        """The context length a ready replica of ``model`` reports (the
        smallest, if they differ); None when none is ready or says.

        ``largest``: the most any ready replica of it may take, the largest
        length; None also when one of them does not say (0: a ``url:``
        upstream whose ``/models`` has no ``max_model_len``), as its context
        may be larger than any known."""
        lens = [s.client.ready.max_model_len for s in self.ready_slots(model)]  # type: ignore[union-attr]
        if largest:
            return max(lens) if lens and min(lens) > 0 else None
        known = [n for n in lens if n > 0]
        return min(known) if known else None

    def ready_slots(self, model: str | None = None, exclude: Collection[str] | None = None,
                    needs: int = 0) -> list[ReplicaSlot]:
        """The ready replicas (of ``model``, not in ``exclude``, announcing
        every ``Feature`` bit of ``needs``)."""
        out = []
        for s in self.slots:
            if not s.ready:
                continue
            if model is not None and s.client.model != model:  # type: ignore[union-attr]
                continue
            if exclude and s.name in exclude:
                continue
            if needs and needs & ~_takes(s):
                continue
            out.append(s)
        return out

    def serving(self, model: str, needs: int, exclude: Mapping[str, None] | None = None) -> list[ReplicaSlot]:
        """``ready_slots`` of ``model`` that take ``needs``; ``NoReplica``
        when there are none, saying whether none is ready or none takes
        the request's fields (an older version's replicas: a rolling upgrade).

        ``exclude``: the replicas that failed the request, the latest last.
        When every ready one has, any but the latest is taken before it: a
        stream that stalled on a replica does not go straight back to it
        while another is ready."""
        slots = self.ready_slots(model, exclude, needs)
        if not slots and exclude:
            slots = self.ready_slots(model, (next(reversed(exclude)),), needs) or self.ready_slots(model, None, needs)
        if slots:
            return slots
        serving = self.ready_slots(model) if needs else None
        if serving:
            # (the fields none of them takes; or, each taken by some, all of them)
            lacking = needs
            for s in serving:
                lacking &= ~_takes(s)
            fields = Feature((lacking or needs) & ~CONTINUES)
            if not fields:
                raise NoReplica(f"no ready replica of model {model!r} can continue a stream from its token ids: "
                                "the upstreams serving it return none (token_ids)")
            raise NoReplica(
                f"no ready replica of model {model!r} takes {fields.names()}: the replicas "
                "serving it run an older fairstream, which would ignore it (a rolling upgrade under way?)")
        # (an upstream that refuses the router's credentials: the operator's to fix, so the message says so)
        why = self.credentials_refused(model)
        raise NoReplica(f"no ready replica serves model {model!r}" + (f" ({'; '.join(why)})" if why else ""))

    def caught_stalling(self, slot: ReplicaSlot, why: object) -> None:
        """A stream's stall limit caught ``slot`` producing nothing (``why``):
        it is chosen for nothing (new requests, failovers) until it answers
        a ping sent after this (``ReplicaSlot.answered``), so that a frozen
        replica, which only the health timeout kills, gets no request
        meanwhile. The supervisor sends that ping at once (``ping_now``),
        beside its regular checks: a replica merely slow for one stream
        (whichever tenant's stall limit caught it) is back at its pong, one
        round trip later."""
        if slot.stalled():  # (logged once while it is out; why in /admin/replicas too)
            log.warning("replica %s stalled a stream (%s): not chosen until it answers a health check", slot.name, why)
            slot.failed(f"stalled a stream: {why}")
        if slot.ping_now is not None:
            slot.ping_now()
        if self.on_stalled is not None:
            self.on_stalled(slot)

    def credentials_refused(self, model: str) -> list[str]:
        """Why the replicas of ``model`` refuse the router's credentials
        (``model`` "": those whose model only a connection will tell)."""
        return [why for s in self.slots if s.model == model and (why := s.credentials_refused)]

    def when_ready(self, callback: Callable[[], bool | None], model: str | None = None, needs: int = 0) -> None:
        """Call ``callback`` when a replica of ``model`` (taking ``needs``)
        may have room: one became ready, or a stream on one ended; before the
        scheduler's queue gets the room, and the waiters of a model in the
        order they came. It returns True to go on waiting (every ready
        replica of its model is full), anything else to stop (called once).
        ``model`` None: called when any replica becomes ready."""
        key = (model, needs)
        if self._waiter_keys.get(callback, key) != key:
            self.forget(callback)
        waiters = self._ready_waiters.setdefault(key, {})
        if callback not in waiters:  # (registered again while it waits: it keeps its place)
            self._waiter_seq += 1
            waiters[callback] = self._waiter_seq
        self._waiter_keys[callback] = key

    def forget(self, callback: Callable[[], bool | None]) -> None:
        """``callback`` no longer waits for a ready replica."""
        key = self._waiter_keys.pop(callback, None)
        waiters = self._ready_waiters.get(key) if key is not None else None
        if waiters is not None:
            waiters.pop(callback, None)
            if not waiters:
                del self._ready_waiters[key]  # type: ignore[arg-type]

    @property
    def waiting(self) -> bool:
        """Streams wait for a ready replica with room (``when_ready``)."""
        return bool(self._ready_waiters)

    def notify_ready(self) -> None:
        """A replica became ready (the supervisor): call what waited for one."""
        if self.on_ready is not None:
            try:
                self.on_ready()  # (the queue's dispatch: a turn later, after the waiters below)
            except Exception:  # noqa: BLE001 - the streams waiting below must continue all the same
                log.exception("dispatching the queue to a ready replica failed")
        if self._ready_waiters:
            self._offer(ready=True)

    def any_room(self) -> bool:
        """Whether some ready replica is under its in-flight cap (whatever
        its model): when none is, nothing queued can start, whoever is next."""
        return any(s.has_room for s in self.slots if s.ready)

    def offer_room(self) -> None:
        """A ready replica may have room (a release, a cap that grew): the
        streams waiting for one get it first."""
        if self._ready_waiters:
            self._offer()

    def _offer(self, ready: bool = False) -> None:
        """Ask the waiters of each model that has a ready replica with room,
        in the order they began to wait (across the ``needs`` they have);
        those of one (model, needs) until one finds no room (those after it
        would not either). ``ready``: a replica became ready (the waiters
        of no model too, each of them)."""
        if self._offering:  # (a release by a waiter's own move: one more round after this one)
            self._offer_again = True
            return
        self._offering = True
        try:
            while True:
                self._offer_again = False
                room = {s.client.model for s in self.slots if s.ready and s.has_room}  # type: ignore[union-attr]
                asked = sorted((seq, callback, key) for key, waiters in self._ready_waiters.items()
                               if key[0] in room or (ready and key[0] is None)
                               for callback, seq in waiters.items())
                full: set[tuple[str | None, int]] = set()
                for _, callback, key in asked:
                    waiters = self._ready_waiters.get(key)
                    if key in full or waiters is None or callback not in waiters:
                        continue  # (no room for its kind; or forgotten meanwhile: its stream closed)
                    try:
                        keep = callback()
                    except Exception:  # noqa: BLE001 - one waiter's bug must not keep the others waiting
                        log.exception("a stream waiting for a ready replica failed to continue")
                        keep = False
                    if keep is not True:
                        self.forget(callback)
                    elif key[0] is not None:
                        full.add(key)
                if not (self._offer_again and self._ready_waiters):
                    return
                ready = False
        finally:
            self._offering = False

    def _released(self, slot: ReplicaSlot) -> None:
        """A load handle on ``slot`` was released: room for the streams
        waiting for a replica first, then for the scheduler's queue."""
        if self._ready_waiters:
            self._offer()
        if self.on_release is not None:
            self.on_release(slot)

    def choose(self, model: str, tokens: int, exclude: Mapping[str, None] | None = None,
               needs: int = 0) -> LoadHandle:
        """Pick a replica for a request expected to produce ``tokens`` tokens.

        ``exclude`` names replicas to avoid, the latest to fail the request
        last (e.g. the one that just died); they are used anyway when
        nothing else is ready, the latest only if it is the only one ready.
        ``needs``: the ``Feature`` bits the request needs of its replica.
        """
        slots = self.serving(model, needs, exclude)
        i = choose([s.snapshot() for s in slots], self._rng)
        return LoadHandle(slots[i], tokens, self._released)

    def choose_room(self, model: str, tokens: int, exclude: Mapping[str, None] | None = None,
                    needs: int = 0) -> LoadHandle | None:
        """Like ``choose``, but only among replicas under their in-flight
        cap (``max_concurrency``, the adaptive cap): for a stream that waited
        for a replica. None when every ready one is full; ``NoReplica`` when
        none is ready. ``exclude`` is a preference here: a replica that failed
        the stream and has room is taken before waiting for another."""
        self.serving(model, needs, exclude)
        tiers = (exclude, (next(reversed(exclude)),), None) if exclude else (None,)
        for avoid in tiers:
            room = [s for s in self.ready_slots(model, avoid, needs) if s.has_room]
            if room:
                i = choose([s.snapshot() for s in room], self._rng)
                return LoadHandle(room[i], tokens, self._released)
        return None

    def try_choose(self, model: str, tokens: int, affinity: int | None = None, needs: int = 0) -> LoadHandle | None:
        """Like ``choose`` but only among replicas under their in-flight cap;
        None when all are full. ``NoReplica`` when none serves the model
        (or takes ``needs``). Streams waiting for a replica with room get
        theirs first.

        ``affinity`` is a hash of the prompt's prefix: the replica that last
        served that prefix is preferred while its load allows."""
        if self._ready_waiters:
            self._offer()
        slots = self.serving(model, needs)
        room = [s for s in slots if s.has_room]
        if not room:
            return None
        prefer = None
        if affinity is not None:
            name = self._affinity.get(affinity)
            for j, s in enumerate(room):
                if s.name == name:
                    prefer = j
                    break
        i = choose([s.snapshot() for s in room], self._rng, prefer)
        if affinity is not None:
            self._affinity[affinity] = room[i].name
            self._affinity.move_to_end(affinity)
            if len(self._affinity) > AFFINITY_ENTRIES:
                self._affinity.popitem(last=False)
        return LoadHandle(room[i], tokens, self._released)
