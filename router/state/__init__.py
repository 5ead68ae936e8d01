"""Shared state (rate-limit buckets, concurrency leases, resume buffers and
stream claims) behind one interface."""

from __future__ import annotations

from typing import Literal

import msgspec

from router.state.base import AdmitRequest, StateStore, StoreUnavailable, StreamSnapshot, TenantUsage
from router.state.memory import MemoryStore
from router.state.resilient import ResilientStore

__all__ = [
    "StateConfig",
    "StateStore",
    "AdmitRequest",
    "TenantUsage",
    "StoreUnavailable",
    "StreamSnapshot",
    "MemoryStore",
    "ResilientStore",
    "create_store",
]


class StateConfig(msgspec.Struct, forbid_unknown_fields=True, kw_only=True):
    """router.yaml ``state``: where limits, leases and resume buffers live."""

    backend: Literal["memory", "redis"] = "memory"
    """``memory`` (one router process) or ``redis`` (shared by several)."""
    url: str = "redis://127.0.0.1:6379/0"
    """Redis URL for the redis backend."""
    prefix: str = "fs"
    """Key prefix in Redis (several deployments can share one Redis)."""
    on_outage: Literal["open", "closed"] = "open"
    """Redis down: ``open`` keeps serving with per-process limits; ``closed`` answers 503."""
    timeout: float = 0.5
    """Seconds a Redis call may take before it counts as an outage (more than 0)."""
    connect_timeout: float = 10.0
    """Seconds a starting router tries to reach Redis (again every 0.2 s, each try up to ``timeout``) before it counts as an outage; until Redis has answered once, ``/ready`` is 503 and requests wait for the answer, so that a slow first answer (a router starting on a busy host) does not start the router in an outage (``on_outage: open``: serving with local limits). 0: one try."""
    max_connections: int = 128
    """Redis connections one router process keeps open at most (each request's admission, lease and buffer calls take one for a moment); a call that finds them all busy waits for one, up to ``timeout``, and then counts as an outage (as a Redis that does not answer)."""


def create_store(config: StateConfig, **hooks) -> StateStore:
    if config.backend == "memory":
        return MemoryStore()  # cannot fail: no outage hooks
    from router.state.redis_store import RedisStore

    return ResilientStore(
        RedisStore(config.url, config.prefix, config.timeout, config.max_connections),
        fail_open=config.on_outage == "open",
        connect_timeout=config.connect_timeout,
        **hooks,
    )
