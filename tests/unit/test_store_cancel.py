"""A cancel that redis-py's own timeout turned into a Redis error is still a cancel."""

from __future__ import annotations

import asyncio

import pytest
from redis.exceptions import TimeoutError as RedisTimeoutError

from router.state.base import StoreUnavailable
from router.state.redis_store import _unavailable


async def test_a_redis_error_met_while_cancelled_is_the_cancel_not_an_outage() -> None:
    # (Python 3.11's asyncio.timeout inside redis-py turns a cancel that
    # arrives as the timeout expires into its TimeoutError; as StoreUnavailable
    # the lease keeper swallowed it and slept again, and the router's
    # shutdown waited on it for good: 3 of 300 closes in a review's harness)
    async def cancelled_then_timed_out() -> None:
        asyncio.current_task().cancel()
        raise _unavailable(RedisTimeoutError("Timeout reading from 127.0.0.1:6379"))

    with pytest.raises(asyncio.CancelledError):
        await asyncio.get_running_loop().create_task(cancelled_then_timed_out())

    async def timed_out() -> None:
        raise _unavailable(RedisTimeoutError("Timeout reading from 127.0.0.1:6379"))

    with pytest.raises(StoreUnavailable):
        await timed_out()
