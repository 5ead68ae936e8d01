"""A wait in a tenant's admission line (``on_limit: queue``) ends at the
request's first-token or total limit when that comes before ``queue_wait``,
as a wait for a replica does: with that limit's ``StreamTimeout`` (the
caller's 504), and with the line left as a ``queue_wait`` refusal leaves it
(its place, the store's line, the waiting gauge). The real ``Admission`` on
a ``MemoryStore``."""

from __future__ import annotations

import asyncio
import time

import msgspec
import pytest

from router.admission import Admission
from router.deadlines import Deadlines, StreamTimeout
from router.errors import RateLimited
from router.metrics import Metrics
from router.state.memory import MemoryStore
from tests.unit.test_admission import _drained, _policy


class CountingDeadlines(Deadlines):
    """Counts how often its wait limit is asked."""

    asked = 0

    def wait_limit(self, delivered: bool):
        self.asked += 1
        return super().wait_limit(delivered)


def _waiting(m: Metrics) -> float:
    return m.child(m.admission_waiting, "t")._value.get()


async def test_the_first_token_limit_ends_the_heads_wait_with_its_504_and_leaves_nothing_behind() -> None:
    # (it waited its whole queue_wait, 5 s here, and got its 504 right after)
    policy = _policy(5.0, rpm=0, concurrent=1)
    store = MemoryStore()
    m = Metrics()
    adm, other = Admission(store, m), Admission(store, Metrics())
    held = await adm.admit(policy, 1)
    loop = asyncio.get_running_loop()
    t = loop.time()
    with pytest.raises(StreamTimeout) as ended:
        await asyncio.wait_for(adm.admit(policy, 1, deadlines=Deadlines(first_token=0.3)), 3)
    assert 0.28 <= loop.time() - t < 0.8, loop.time() - t
    assert ended.value.which == "first_token" and ended.value.code == "first_token_timeout"
    assert adm.queued("t") == 0 and not adm._lines and _waiting(m) == 0
    assert not store._tenants["t"].line  # (its place in the store's line, as a queue_wait refusal leaves it)
    assert 'limit="queue_wait"' not in m._text().decode()  # (a timeout, counted as one by the caller)
    await adm.finish(held, 1)
    assert await asyncio.wait_for(other.admit(policy, 1), 0.2) is not None


async def test_the_total_limit_ends_a_wait_behind_the_head_and_the_head_keeps_its_turn() -> None:
    policy = _policy(5.0, rpm=0, concurrent=1)
    m = Metrics()
    adm = Admission(MemoryStore(), m)
    held = await adm.admit(policy, 1)
    head = asyncio.create_task(adm.admit(policy, 1))
    await asyncio.sleep(0.02)
    loop = asyncio.get_running_loop()
    t = loop.time()
    with pytest.raises(StreamTimeout) as ended:
        await asyncio.wait_for(adm.admit(policy, 1, deadlines=Deadlines(first_token=4.0, total=0.3)), 3)
    assert 0.2 <= loop.time() - t < 0.8 and ended.value.which == "total"
    assert adm.queued("t") == 1 and _waiting(m) == 1 and not head.done()
    await adm.finish(held, 1)
    await adm.finish(await asyncio.wait_for(head, 1), 1)
    assert adm.queued("t") == 0 and _waiting(m) == 0


async def test_a_rate_limit_that_frees_before_the_first_token_limit_admits() -> None:
    policy = _policy(5.0)  # (drained: the next request in ~1 s)
    adm = await _drained(policy)
    assert await asyncio.wait_for(adm.admit(policy, 1, deadlines=Deadlines(first_token=3.0)), 3) is not None


async def test_a_queue_wait_that_ends_first_is_still_a_429() -> None:
    policy = _policy(0.3, rpm=0, concurrent=1)
    adm = Admission(MemoryStore(), Metrics())
    await adm.admit(policy, 1)
    with pytest.raises(RateLimited):
        await asyncio.wait_for(adm.admit(policy, 1, deadlines=Deadlines(first_token=0.6, total=2.0)), 3)


async def test_a_first_token_limit_already_past_ends_the_wait_at_once() -> None:
    policy = _policy(5.0, rpm=0, concurrent=1)
    adm = Admission(MemoryStore(), Metrics())
    await adm.admit(policy, 1)
    loop = asyncio.get_running_loop()
    t = loop.time()
    with pytest.raises(StreamTimeout):
        await adm.admit(policy, 1, deadlines=Deadlines(first_token=0.5, start=time.monotonic() - 1))
    assert loop.time() - t < 0.1 and adm.queued("t") == 0


async def test_a_resumed_stream_s_wait_ends_at_its_total_limit_only() -> None:
    # (it has output: its first-token limit is behind it, as in Scheduler.acquire)
    policy = _policy(0.6, rpm=0, concurrent=1)
    policy = msgspec.structs.replace(policy, limits=msgspec.structs.replace(policy.limits, queue_wait=0.6))
    adm = Admission(MemoryStore(), Metrics())
    await adm.admit(policy, 1)
    loop = asyncio.get_running_loop()
    t = loop.time()
    with pytest.raises(RateLimited):  # not its first_token of 0.1
        await adm.admit(policy, 1, count_request=False, deadlines=Deadlines(first_token=0.1), delivered=True)
    assert loop.time() - t >= 0.5
    with pytest.raises(StreamTimeout) as ended:
        await adm.admit(policy, 1, count_request=False, deadlines=Deadlines(first_token=0.1, total=0.2),
                        delivered=True)
    assert ended.value.which == "total"


async def test_the_limits_are_asked_only_when_the_request_has_to_wait() -> None:
    policy = _policy(5.0, rpm=0, concurrent=1)
    adm = Admission(MemoryStore(), Metrics())
    dl = CountingDeadlines(first_token=0.2)
    await adm.admit(policy, 1, deadlines=dl)
    assert dl.asked == 0
    with pytest.raises(StreamTimeout):
        await adm.admit(policy, 1, deadlines=dl)
    assert dl.asked == 1
