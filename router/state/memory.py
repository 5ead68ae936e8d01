"""In-process state store: the pure policies applied to dicts.

Every method runs without awaiting, so each is atomic on the event loop.
"""

from __future__ import annotations

import time
from collections.abc import Callable

from policies import ratelimit
from policies.ratelimit import Bucket, Decision
from router.state.base import AdmitRequest, StateStore, TenantUsage

__all__ = ["MemoryStore"]


class _Tenant:
    __slots__ = ("requests", "tokens", "leases")

    def __init__(self) -> None:
        self.requests: Bucket | None = None
        self.tokens: Bucket | None = None
        self.leases: dict[str, float] = {}


class MemoryStore(StateStore):
    name = "memory"

    def __init__(self, clock: Callable[[], float] = time.monotonic) -> None:
        self._clock = clock
        self._tenants: dict[str, _Tenant] = {}

    def _t(self, tenant: str) -> _Tenant:
        t = self._tenants.get(tenant)
        if t is None:
            t = self._tenants[tenant] = _Tenant()
        return t

    async def admit(self, tenant: str, req: AdmitRequest) -> Decision:
        now = self._clock()
        t = self._t(tenant)
        t.leases = ratelimit.prune_leases(t.leases, now)
        decision, t.requests, t.tokens = ratelimit.admit(
            t.requests,
            t.tokens,
            len(t.leases),
            rpm=req.rpm,
            tpm=req.tpm,
            max_concurrent=req.max_concurrent,
            cost_tokens=req.cost_tokens,
            now=now,
        )
        if decision.ok:
            t.leases[req.lease_id] = now + req.lease_ttl
        return decision

    async def settle(self, tenant: str, *, tpm: int, reserved: int, used: int, lease_id: str = "") -> None:
        t = self._t(tenant)
        t.tokens = ratelimit.settle(t.tokens, tpm=tpm, reserved=reserved, used=used, now=self._clock())

    async def renew(self, tenant: str, lease_ids: list[str], ttl: float) -> None:
        now = self._clock()
        t = self._t(tenant)
        for lid in lease_ids:
            if lid in t.leases and t.leases[lid] > now:
                t.leases[lid] = now + ttl

    async def release(self, tenant: str, lease_id: str) -> None:
        self._t(tenant).leases.pop(lease_id, None)

    async def usage(self, tenant: str, *, rpm: int, tpm: int) -> TenantUsage:
        now = self._clock()
        t = self._t(tenant)
        t.leases = ratelimit.prune_leases(t.leases, now)
        return TenantUsage(
            requests_available=ratelimit.level(t.requests, rpm, now) if rpm else 0.0,
            tokens_available=ratelimit.level(t.tokens, tpm, now) if tpm else 0.0,
            active_streams=len(t.leases),
        )
