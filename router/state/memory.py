"""In-process state store: the pure policies applied to dicts.

Every method runs without awaiting, so each is atomic on the event loop.
"""

from __future__ import annotations

import time
from collections.abc import Callable

from policies import ratelimit
from policies.ratelimit import Bucket, Decision
from router.state.base import (CLAIM_TTL, LINE_SLACK, SETTLED_TTL, AdmitRequest, StateStore, StreamSnapshot,
                               TenantUsage)

__all__ = ["MemoryStore"]


class _Tenant:
    __slots__ = ("requests", "tokens", "leases", "next_prune", "line", "held", "took", "settled")

    def __init__(self) -> None:
        self.requests: Bucket | None = None
        self.tokens: Bucket | None = None
        self.leases: dict[str, float] = {}
        self.next_prune = 0.0
        self.line: dict[str, float] = {}  # waiting lease id -> until when; in arrival order
        # lease id -> (reserved tokens, base, until when, hold) of reservations
        # kept for a continuation (``AdmitRequest.hold``); tokens -1: taken over
        self.held: dict[str, tuple[int, int, float, float]] = {}
        # taken-over lease id -> (the lease that took it over, its record
        # before, what its own settlement gave back if it came since: None
        # until then), for an admission its router never used (``undo_admit``)
        self.took: dict[str, tuple[str, tuple[int, int, float, float], int | None]] = {}
        # lease id -> until when: settled, a second settlement changes nothing
        # (``SETTLED_TTL``; in expiry order, as each gets the same TTL)
        self.settled: dict[str, float] = {}


SWEEP_INTERVAL = 1.0  # expired leases and buffers are swept at most this often (O(n) each)


class _Stream:
    __slots__ = ("meta", "token_ids", "text_len", "events", "finished", "owner", "owner_until", "expires", "broken",
                 "lease", "lost", "charged")

    def __init__(self, meta: bytes, owner: str, owner_until: float, expires: float) -> None:
        self.meta = meta
        self.token_ids: list[int] = []
        self.text_len = 0
        self.events: list[bytes] = []
        self.finished = False
        self.owner = owner
        self.owner_until = owner_until
        self.expires = expires
        self.broken = False
        self.lease = ""
        self.lost = False  # (a router that held it died: StreamSnapshot.lost)
        self.charged = 0  # (StreamSnapshot.charged)


class MemoryStore(StateStore):
    name = "memory"

    def __init__(self, clock: Callable[[], float] = time.monotonic) -> None:
        self._clock = clock
        self._tenants: dict[str, _Tenant] = {}
        self._streams: dict[str, _Stream] = {}
        self._next_sweep = 0.0

    def _t(self, tenant: str) -> _Tenant:
        t = self._tenants.get(tenant)
        if t is None:
            t = self._tenants[tenant] = _Tenant()
        return t

    async def admit(self, tenant: str, req: AdmitRequest) -> Decision:
        now = self._clock()
        t = self._t(tenant)
        if now >= t.next_prune:
            # Amortized: a lease that expired less than SWEEP_INTERVAL ago
            # may still count; leases are released explicitly at stream end.
            t.leases = ratelimit.prune_leases(t.leases, now)
            if t.held:
                t.held = {k: h for k, h in t.held.items() if h[2] > now}
                t.took = {k: v for k, v in t.took.items() if k in t.held}
            t.next_prune = now + SWEEP_INTERVAL
        # (a continuation's: never a new request's, which pays nothing for it)
        replaced = {lid for lid in req.replaces if lid in t.leases and lid != req.lease_id} if req.replaces else ()
        # the reservations it takes over (if admitted): kept, and not taken over before
        took = [(lid, h) for lid in dict.fromkeys(req.replaces) if lid != req.lease_id
                and (h := t.held.get(lid)) is not None and h[0] >= 0 and h[2] > now] if req.tpm and t.held else ()
        taken = sum(h[0] for _, h in took)
        base = min(h[1] for _, h in took) if took else req.base
        blocked = False
        if req.line and t.line:
            for lid in [k for k, until in t.line.items() if until <= now]:
                del t.line[lid]
            blocked = bool(t.line) and next(iter(t.line)) != req.lease_id
        decision, t.requests, t.tokens = ratelimit.admit(
            t.requests,
            t.tokens,
            len(t.leases) - len(replaced),  # (the leases it replaces are not counted against it)
            rpm=req.rpm,
            tpm=req.tpm,
            max_concurrent=req.max_concurrent,
            cost_tokens=max(0, req.cost_tokens - taken),
            now=now,
            behind=blocked,
        )
        if decision.ok:
            for lid in replaced:
                del t.leases[lid]
            for lid, h in took:
                t.held[lid] = (-1, 0, max(h[2], now + req.hold), 0.0)  # (its settlement, if it comes, changes nothing)
                t.took[lid] = (req.lease_id, h, None)
            if took:
                decision.taken, decision.base = taken, base
            if req.hold > 0 and req.tpm:
                t.held[req.lease_id] = (max(req.cost_tokens, taken), base, now + req.hold, req.hold)
            if req.lease_id:  # ("": a resume's charge, requests only)
                t.leases[req.lease_id] = now + req.lease_ttl
            t.line.pop(req.lease_id, None)
        elif req.line and decision.reason != "too_large":
            t.line[req.lease_id] = now + decision.retry_after + LINE_SLACK
        return decision

    async def leave(self, tenant: str, lease_id: str) -> None:
        t = self._tenants.get(tenant)
        if t is not None:
            t.line.pop(lease_id, None)

    async def settle(self, tenant: str, *, tpm: int, reserved: int, used: int, lease_id: str = "",
                     held: bool = False) -> None:
        self.settle_now(tenant, tpm=tpm, reserved=reserved, used=used, lease_id=lease_id, held=held)

    def settle_now(self, tenant: str, *, tpm: int, reserved: int, used: int, lease_id: str = "",
                   held: bool = False) -> None:
        """``settle``, at once (``Admission.finish_now``)."""
        t = self._t(tenant)
        now = self._clock()
        if lease_id and tpm and not self._once(t, lease_id, now):  # (as Redis, which keeps nothing for tpm 0)
            return  # (settled already: this is the same settlement made again)
        rec = t.held.pop(lease_id, None) if lease_id and t.held else None
        took = t.took.pop(lease_id, None)
        if rec is not None and rec[0] < 0 and rec[2] > now:
            # (a continuation took its reservation over, and settles it; unless
            # it is undone, its router never having used it: then what this
            # would have given back counts, as its reservation was)
            if took is not None:
                if took[2] is None:
                    back = reserved - used
                    if held and took[1][2] <= now:
                        back = min(back, 0)
                    took = (took[0], took[1], back)
                t.held[lease_id], t.took[lease_id] = rec, took
            return
        if held and (rec is None or rec[0] < 0 or rec[2] <= now):
            reserved = min(reserved, used)  # (maybe taken over and settled: no refund, only what it used beyond)
        t.tokens = ratelimit.settle(t.tokens, tpm=tpm, reserved=reserved, used=used, now=now)

    @staticmethod
    def _once(t: _Tenant, key: str, now: float) -> bool:
        """False if ``key`` was done within ``SETTLED_TTL``; else marks it done."""
        settled = t.settled
        while settled:  # (the expired ones, oldest first)
            oldest = next(iter(settled))
            if settled[oldest] > now:
                break
            del settled[oldest]
        if key in settled:
            return False
        settled[key] = now + SETTLED_TTL
        return True

    async def undo_admit(self, tenant: str, req: AdmitRequest, *, keep_lease: bool = False) -> None:
        t = self._t(tenant)
        now = self._clock()
        lid = req.lease_id
        if not lid or lid not in t.leases:
            return  # (refused, never made, or undone already)
        mark = "undo:" + lid  # (not its settlement's mark, which may come too)
        if not keep_lease:
            del t.leases[lid]  # (made again, it finds no lease; not marked: admitted again, undone again)
            if t.settled.get(mark, 0.0) > now:
                return  # (given back with its lease kept, which ended since)
        elif not self._once(t, mark, now):
            return
        if req.rpm:
            t.requests = ratelimit.settle(t.requests, tpm=req.rpm, reserved=1, used=0, now=now)
        if not req.tpm:
            return
        own = t.held.get(lid)
        if own is not None and own[0] < 0:
            return  # (taken over since, with what it took over: that continuation settles for them)
        t.held.pop(lid, None)
        taken = given = 0  # (what it did not charge; what their own settlements since give back)
        for r in dict.fromkeys(req.replaces):
            prior = t.took.get(r)
            if prior is not None and prior[0] == lid:
                del t.took[r]
                taken += prior[1][0]
                if prior[2] is not None:
                    given += prior[2]
                    t.held.pop(r, None)
                elif prior[1][2] > now:
                    t.held[r] = prior[1]
                else:
                    t.held.pop(r, None)
        t.tokens = ratelimit.settle(t.tokens, tpm=req.tpm, reserved=max(0, req.cost_tokens - taken) + given, used=0,
                                    now=now)

    async def renew(self, tenant: str, lease_ids: list[str], ttl: float) -> None:
        self.hold(tenant, lease_ids, ttl)
        t = self._t(tenant)
        if t.held:
            # (a stream that runs on keeps its reservation for ``hold`` after its last renewal)
            now = self._clock()
            for lid in lease_ids:
                h = t.held.get(lid)
                if h is not None and h[0] >= 0 and h[2] > now:
                    t.held[lid] = (h[0], h[1], max(h[2], now + ttl + h[3]), h[3])

    def hold(self, tenant: str, lease_ids: list[str], ttl: float) -> None:
        """Count ``lease_ids`` for ``tenant`` for ``ttl`` seconds from now
        (``renew``, at once: what an outage's fallback starts with)."""
        now = self._clock()
        t = self._t(tenant)
        for lid in lease_ids:
            t.leases[lid] = now + ttl

    async def release(self, tenant: str, lease_id: str) -> None:
        self.drop(tenant, lease_id)

    def drop(self, tenant: str, lease_id: str) -> None:
        """``release``, at once."""
        t = self._tenants.get(tenant)
        if t is not None:
            t.leases.pop(lease_id, None)

    async def usage(self, tenant: str, *, rpm: int, tpm: int) -> TenantUsage:
        now = self._clock()
        t = self._t(tenant)
        t.leases = ratelimit.prune_leases(t.leases, now)
        return TenantUsage(
            requests_available=ratelimit.level(t.requests, rpm, now) if rpm else 0.0,
            tokens_available=ratelimit.level(t.tokens, tpm, now) if tpm else 0.0,
            active_streams=len(t.leases),
        )

    # -- stream resume buffers ----------------------------------------------

    def _stream(self, sid: str, now: float) -> _Stream | None:
        st = self._streams.get(sid)
        if st is not None and st.expires <= now:
            del self._streams[sid]
            return None
        return st

    def held_streams(self) -> list[str]:
        """The ids of the live buffers that missed nothing (a fallback's,
        handed to the store it stood in for once that is back)."""
        now = self._clock()
        return [sid for sid, st in self._streams.items() if st.expires > now and not st.broken]

    def held_stream(self, sid: str) -> tuple[StreamSnapshot, float] | None:
        """One of ``held_streams``, as ``stream_read`` gives it, and its
        seconds left; None when it is gone, expired or broken."""
        now = self._clock()
        st = self._stream(sid, now)
        return None if st is None or st.broken else (self._snapshot(st, now, 0, True), st.expires - now)

    def drop_streams(self) -> None:
        """Forget every resume buffer (a fallback's, once the store it stood in for is back)."""
        self._streams.clear()

    def _expire(self, now: float) -> None:
        if len(self._streams) > 64 and now >= self._next_sweep:
            self._next_sweep = now + SWEEP_INTERVAL
            for sid in [k for k, v in self._streams.items() if v.expires <= now]:
                del self._streams[sid]

    async def stream_open(self, sid: str, meta: bytes, owner: str, ttl: float, *, lease: str = "",
                          lost: bool = False, charged: int = 0) -> None:
        now = self._clock()
        self._expire(now)
        st = self._streams[sid] = _Stream(meta, owner, now + CLAIM_TTL, now + ttl)
        st.lease, st.lost, st.charged = lease, lost, charged

    async def stream_append(self, sid, events, token_ids, text_len, finished, owner, ttl, first=-1) -> bool:
        # (the same checks as stream_append.lua: this store is also the
        # local fallback of a shared one, written by the batched writer)
        now = self._clock()
        st = self._stream(sid, now)
        if st is None:
            return False  # (no such buffer: gone, expired, or never made; as the Redis store answers it)
        if (st.owner and st.owner != owner) or st.finished:
            return False
        if st.broken or (first >= 0 and len(st.events) != first):
            st.broken = True
            st.expires = now + ttl
            return False
        self.append_now(sid, events, token_ids, text_len, finished, owner, ttl)
        return True

    def append_now(self, sid, events, token_ids, text_len, finished, owner, ttl) -> None:
        """``stream_append`` without an await: this store is in-process, so
        the resume writer appends each event at once instead of batching
        (``text_len`` None: unchanged)."""
        now = self._clock()
        st = self._stream(sid, now)
        if st is None:
            return
        st.events.extend(events)
        if token_ids:
            st.token_ids.extend(token_ids)
        if text_len is not None:
            st.text_len = text_len
        st.finished = st.finished or finished
        st.expires = now + ttl
        if st.owner == owner:
            st.owner_until = now + CLAIM_TTL

    def appender(self, sid: str, owner: str, ttl: float):
        """``append_now`` of one event at a time to stream ``sid``, its record
        looked up once (the token lane's: router/lane.py). Once that record
        is gone (expired), every call goes through ``append_now``."""
        rec = self._streams.get(sid)
        clock = self._clock
        streams = self._streams

        def append(event: bytes, token_ids: list[int], text_len: int) -> None:
            now = clock()
            if rec is None or rec.expires <= now or streams.get(sid) is not rec:
                self.append_now(sid, (event,), token_ids, text_len, False, owner, ttl)
                return
            rec.events.append(event)
            rec.token_ids += token_ids
            rec.text_len = text_len
            rec.expires = now + ttl
            if rec.owner == owner:
                rec.owner_until = now + CLAIM_TTL

        return append

    async def stream_read(self, sid: str, after: int, tokens: bool = True) -> StreamSnapshot | None:
        now = self._clock()
        st = self._stream(sid, now)
        if st is None:
            return None
        return self._snapshot(st, now, after, tokens)

    @staticmethod
    def _snapshot(st: _Stream, now: float, after: int, tokens: bool) -> StreamSnapshot:
        owner = st.owner if st.owner and st.owner_until > now else ""
        return StreamSnapshot(
            st.meta, list(st.token_ids) if tokens else [], st.text_len, st.events[max(0, after):], len(st.events),
            st.finished, owner, st.broken, st.lease, st.lost or bool(st.owner and not owner), st.charged,
        )

    async def stream_claim(self, sid: str, owner: str, claim_ttl: float, lease: str = "") -> bool:
        now = self._clock()
        st = self._stream(sid, now)
        if st is None or st.finished:
            return False
        if st.owner and st.owner != owner and st.owner_until > now:
            return False
        if st.owner and st.owner_until <= now:
            st.lost = True  # (its claim ran out unreleased: that router died)
        st.owner = owner
        st.owner_until = now + claim_ttl
        st.lease = lease
        return True

    async def stream_renew(self, sids: list[str], owner: str, claim_ttl: float) -> list[bool]:
        now = self._clock()
        out = []
        for sid in sids:
            st = self._stream(sid, now)
            mine = st is not None and not st.finished and st.owner == owner
            if mine:
                st.owner_until = now + claim_ttl
            out.append(mine)
        return out

    async def stream_release(self, sid: str, owner: str, charged: int = 0) -> None:
        self.stream_release_now(sid, owner, charged)

    def stream_release_now(self, sid: str, owner: str, charged: int = 0) -> None:
        """``stream_release`` without an await (``ResumeWriter.end_now``)."""
        st = self._streams.get(sid)
        if st is not None and st.owner == owner:
            st.owner = ""
            st.charged = max(st.charged, charged)
