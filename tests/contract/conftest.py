"""One state-store contract, every backend: the ``backend`` fixture.

Each contract test takes ``backend`` (parametrized over ``memory`` and
``redis``) and gets its store at ``backend.store``. Time differs by backend:

* memory: the store reads a fake clock; ``backend.sleep(dt)`` advances it,
  so the memory run is exact and does not wait;
* redis: the Lua scripts read the Redis server's ``TIME``; ``backend.sleep``
  really sleeps and time-based assertions allow ``backend.slack`` seconds.

``backend.until(fn, timeout)`` polls a condition with a deadline on the
backend's own clock; nothing sleeps as an assertion. Tests use a fresh
tenant name (``backend.tenant()``) so they never share keys in Redis.
"""

from __future__ import annotations

import asyncio
import time
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator
from typing import Any

import pytest

from router.state import MemoryStore, StateStore
from tests.redis_server import RedisServer, require_redis_server

__all__ = ["Backend", "FakeClock"]

BACKENDS = ["memory", pytest.param("redis", marks=pytest.mark.redis)]


class FakeClock:
    """A clock that moves only when told (``MemoryStore(clock=...)``)."""

    def __init__(self, start: float = 1000.0) -> None:
        self.t = start

    def __call__(self) -> float:
        return self.t

    def advance(self, dt: float) -> None:
        assert dt >= 0
        self.t += dt


class Backend:
    """A store under test and the clock it runs on."""

    def __init__(self, name: str, store: StateStore, clock: FakeClock | None, redis: RedisServer | None) -> None:
        self.name = name
        self.store = store
        self.clock = clock
        self.redis = redis
        # Seconds that pass between reading a level and asserting on it:
        # none on the fake clock, a generous bound for a real server.
        self.slack = 0.0 if clock is not None else 0.5

    @staticmethod
    def tenant(tag: str = "t") -> str:
        return f"{tag}-{uuid.uuid4().hex[:12]}"

    def now(self) -> float:
        return self.clock() if self.clock is not None else time.monotonic()

    async def sleep(self, dt: float) -> None:
        if self.clock is not None:
            self.clock.advance(dt)
            await asyncio.sleep(0)
        else:
            await asyncio.sleep(dt)

    async def until(
        self, fn: Callable[[], Awaitable[Any] | Any], timeout: float, *, step: float = 0.05, what: str = "condition"
    ) -> Any:
        """Poll ``fn`` every ``step`` s of backend time until truthy; fail after ``timeout`` s."""
        end = self.now() + timeout
        while True:
            value = fn()
            if asyncio.iscoroutine(value):
                value = await value
            if value:
                return value
            if self.now() >= end:
                raise AssertionError(f"[{self.name}] timed out after {timeout}s waiting for {what} (last: {value!r})")
            await self.sleep(step)

    def level_range(self, expected: float, per_minute: int) -> tuple[float, float]:
        """Where a level read a little late may be: refill only raises it, by at most ``slack`` s worth."""
        return expected - 1e-6, min(float(per_minute), expected + self.slack * per_minute / 60.0) + 1e-6

    def wait_range(self, expected: float) -> tuple[float, float]:
        """Where a retry_after read a little late may be: at most ``slack`` s shorter."""
        return expected - self.slack - 1e-6, expected + 1e-6


@pytest.fixture(scope="session")
def redis_server() -> Iterator[RedisServer]:
    """One redis-server for the whole session (tests use distinct tenants)."""
    with RedisServer(require_redis_server()) as server:
        yield server


@pytest.fixture(params=BACKENDS)
async def backend(request) -> AsyncIterator[Backend]:
    if request.param == "memory":
        clock = FakeClock()
        b = Backend("memory", MemoryStore(clock=clock), clock, None)
    else:
        from router.state.redis_store import RedisStore

        server: RedisServer = request.getfixturevalue("redis_server")
        b = Backend("redis", RedisStore(server.url, prefix="fs-test", timeout=2.0), None, server)
    try:
        yield b
    finally:
        await b.store.close()
