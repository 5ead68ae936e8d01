"""One ``Retry-After`` value for every answer that has one
(``router.errors.retry_after_header``): whole seconds rounded up (a client
that waits that long is not refused for the rest, and never below the
``x-ratelimit-reset-*`` figure of the same wait), at least 1; the estimates
are capped where they are made (``MAX_RETRY_AFTER``), a rate limit's exact
wait is not. The scheduler's 503 ``queue_timeout`` counts the
tenant's queue and its own dispatch, and the stall it waited through. (There
were three roundings: ``int(x + 0.999)`` said 59 for 59.0005 s; the
queue_timeout's ``int(x) + 1`` said 2 for exactly 1 s and 301 past the
300 s cap, with every tenant's queued requests counted ahead.)"""

from __future__ import annotations

import asyncio
import math

import msgspec
import pytest

from policies.dispatch_pace import MAX_RETRY_AFTER
from policies.ratelimit import Decision
from router.errors import RateLimited, ServiceUnavailable, retry_after_header
from router.ticket import fmt_duration
from tests.unit.pools import MODEL, queueing_policy
from tests.unit.test_dispatch_pace import Clock, _scheduler


@pytest.mark.parametrize("seconds, header", [
    (0.0, "1"), (0.2, "1"), (1.0, "1"), (1.0000000001, "1"), (1.0004, "2"), (1.5, "2"),
    (1.0000005, "2"), (59.0005, "60"), (60.0, "60"), (299.2, "300"), (300.0, "300"), (300.5, "301"),
    (940.0, "940"),
])
def test_whole_seconds_rounded_up_at_least_1(seconds: float, header: str) -> None:
    # (1.0000005: x-ratelimit-reset says 1.01s; 940: a token bucket driven below
    # zero by a stream that used more than it reserved needs that long)
    assert retry_after_header(seconds) == header


@pytest.mark.parametrize("seconds", [0.0011, 1.0000005, 1.0004, 2.0005, 9.999, 10.0004, 10.0000005, 59.0005,
                                     59.99, 60.0000005, 125.0000005])
def test_a_429_s_retry_after_is_never_sooner_than_its_reset_header(seconds: float) -> None:
    # (a tenant of 1 request a minute: the wait for one request is the bucket's reset)
    e = RateLimited("x", retry_after=seconds)
    assert int(e.headers["retry-after"]) >= seconds - 1e-6  # (what both forgive as float noise)
    reset = fmt_duration(Decision(False, "requests", seconds, reset_requests=seconds).reset_requests)
    if reset.endswith("ms"):
        as_seconds = float(reset[:-2]) / 1000
    elif "m" in reset:
        minutes, rest = reset[:-1].split("m")
        as_seconds = 60 * int(minutes) + float(rest)
    else:
        as_seconds = float(reset[:-1])
    assert int(e.headers["retry-after"]) == max(1, math.ceil(as_seconds - 1e-9)), (reset, e.headers)


def test_inf_and_none_never_name_a_time() -> None:
    assert retry_after_header(math.inf) == retry_after_header(math.nan) == str(int(MAX_RETRY_AFTER)) == "300"
    e = RateLimited("x", retry_after=None)
    assert "retry-after" not in e.headers and e.headers["x-should-retry"] == "false"


def _short(policy, wait: float):
    return msgspec.structs.replace(policy, limits=msgspec.structs.replace(policy.limits, queue_wait=wait))


async def test_a_queue_timeout_with_nobody_behind_says_1_not_2() -> None:
    # (the estimate is exactly MIN_RETRY_AFTER, 1 s: int(1) + 1 said 2)
    sched = _scheduler(1, Clock())
    held = await sched.acquire(queueing_policy("a"), 1, MODEL, 8)
    with pytest.raises(ServiceUnavailable) as timed_out:
        await sched.acquire(_short(queueing_policy("a"), 0.02), 1, MODEL, 8)
    assert timed_out.value.code == "queue_timeout"
    assert timed_out.value.headers["retry-after"] == "1"
    held.release()


async def test_a_queue_timeout_counts_its_tenant_s_queue_and_its_own_dispatch() -> None:
    # 9 of tenant b queued, none of a: a's Retry-After is a's queue and its
    # own dispatch (1 s at the pace's 1 s a turn), not the 10 s of everyone's
    sched = _scheduler(1, Clock())
    held = await sched.acquire(queueing_policy("b"), 1, MODEL, 8)
    others = [asyncio.create_task(sched.acquire(queueing_policy("b"), 1, MODEL, 8)) for _ in range(9)]
    await asyncio.sleep(0)
    assert sched.queued() == 9
    with pytest.raises(ServiceUnavailable) as timed_out:
        await sched.acquire(_short(queueing_policy("a"), 0.02), 1, MODEL, 8)
    assert timed_out.value.headers["retry-after"] == "1", timed_out.value.headers
    for t in others:
        t.cancel()
    await asyncio.gather(*others, return_exceptions=True)
    held.release()


async def test_a_queue_timeout_alone_in_its_queue_counts_the_stall_it_waited_through() -> None:
    # nothing dispatched for the 50 s it waited: a retry needs a dispatch
    # too, 0.8 x 1 s + 0.2 x 50 s at the pace; it said 1 (0 ahead x the pace)
    clock = Clock()
    sched = _scheduler(1, clock)
    held = await sched.acquire(queueing_policy("a"), 1, MODEL, 8)
    waiting = asyncio.create_task(sched.acquire(_short(queueing_policy("a"), 0.05), 1, MODEL, 8))
    await asyncio.sleep(0)
    clock.now = 50.0
    with pytest.raises(ServiceUnavailable) as timed_out:
        await waiting
    assert timed_out.value.headers["retry-after"] == "11", timed_out.value.headers
    held.release()


async def test_a_queue_timeout_s_retry_after_stays_within_the_cap() -> None:
    # a stall of an hour with 9 queued: the pace's 300 s, not 301
    clock = Clock()
    sched = _scheduler(1, clock)
    a = queueing_policy("a")
    held = await sched.acquire(a, 1, MODEL, 8)
    others = [asyncio.create_task(sched.acquire(a, 1, MODEL, 8)) for _ in range(9)]
    await asyncio.sleep(0)
    clock.now = 3600.0
    with pytest.raises(ServiceUnavailable) as timed_out:
        await sched.acquire(_short(a, 0.02), 1, MODEL, 8)
    assert timed_out.value.headers["retry-after"] == "300", timed_out.value.headers
    for t in others:
        t.cancel()
    await asyncio.gather(*others, return_exceptions=True)
    held.release()
