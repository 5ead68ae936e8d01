"""The ``StateStore`` interface: everything routers share, behind one API.

Implementations: ``MemoryStore`` (one process) and ``RedisStore`` (several
router processes or hosts; each operation one atomic Lua script). Both obey
the same contract suite (tests/contract).
"""

from __future__ import annotations

import abc

import msgspec

from policies.ratelimit import Decision

__all__ = ["StateStore", "AdmitRequest", "TenantUsage", "StoreUnavailable"]


class StoreUnavailable(ConnectionError):
    """The backing store cannot be reached."""


class AdmitRequest(msgspec.Struct, frozen=True, gc=False):
    """One admission attempt against a tenant's limits (0 = unlimited)."""

    rpm: int
    tpm: int
    max_concurrent: int
    cost_tokens: int
    lease_id: str
    lease_ttl: float


class TenantUsage(msgspec.Struct, frozen=True):
    """Live usage of a tenant, for /admin/tenants."""

    requests_available: float
    tokens_available: float
    active_streams: int


class StateStore(abc.ABC):
    name: str

    @abc.abstractmethod
    async def admit(self, tenant: str, req: AdmitRequest) -> Decision:
        """Atomically check every limit and, if all pass, take one request,
        reserve ``cost_tokens`` and take a concurrency lease."""

    @abc.abstractmethod
    async def settle(self, tenant: str, *, tpm: int, reserved: int, used: int, lease_id: str = "") -> None:
        """Correct the tokens bucket with the real usage (see policies.ratelimit.settle)."""

    @abc.abstractmethod
    async def renew(self, tenant: str, lease_ids: list[str], ttl: float) -> None:
        """Extend live leases so they outlast the next renewal."""

    @abc.abstractmethod
    async def release(self, tenant: str, lease_id: str) -> None:
        """End a lease (idempotent)."""

    @abc.abstractmethod
    async def usage(self, tenant: str, *, rpm: int, tpm: int) -> TenantUsage:
        """Current levels and live leases."""

    async def ping(self) -> None:
        """Raise ``StoreUnavailable`` if the store cannot be reached."""

    async def close(self) -> None:
        """Release connections."""
