"""``Scheduler.follow`` (a reload): the fair-share order of the requests
already queued follows their tenant's policy in force, its weight and its
priority class, not the policy they were admitted with. Before, a weight
raised by a reload reached only the requests that arrived after it, so it
took effect once the tenant's backlog had drained."""

from __future__ import annotations

import asyncio

import msgspec

from policies.batching import AimdSettings
from replicas.pool import LoadHandle, ReplicaPool
from replicas.spec import ReplicaSpec
from router.metrics import Metrics
from router.scheduler import Scheduler
from router.scheduler_settings import SchedulerSettings
from router.tenants import TenantPolicy
from tests.unit.pools import MODEL, ReadyClient, queueing_policy


def _one_slot(aging: float = 10.0) -> tuple[Metrics, Scheduler]:
    """A scheduler over one ready replica that takes one request at a time."""
    pool = ReplicaPool([ReplicaSpec(name="r0", address="127.0.0.1:9")])
    pool.slots[0].client = ReadyClient()  # type: ignore[assignment]
    pool.slots[0].state = "ready"
    metrics = Metrics()
    sched = Scheduler(pool, metrics, SchedulerSettings(aging=aging),
                      AimdSettings(enabled=False, initial=1, min_inflight=1, max_inflight=1))
    return metrics, sched


def _with(policy: TenantPolicy, **changes) -> TenantPolicy:
    return msgspec.structs.replace(policy, **changes)


async def _queue(sched: Scheduler, policy: TenantPolicy, n: int) -> dict[asyncio.Task, TenantPolicy]:
    tasks = {asyncio.create_task(sched.acquire(policy, policy.rank, MODEL, 8)): policy for _ in range(n)}
    await asyncio.sleep(0)
    return tasks


async def _serve(sched: Scheduler, held: LoadHandle, waiting: dict[asyncio.Task, TenantPolicy],
                 n: int) -> list[str]:
    """Release the slot ``n`` times; each request that gets it is charged as
    ``Generation`` charges one (with the policy it was admitted with) before
    it ends. The tenants in the order they got the slot."""
    order = []
    for _ in range(n):
        held.release()
        done, _ = await asyncio.wait(list(waiting), timeout=1, return_when=asyncio.FIRST_COMPLETED)
        assert len(done) == 1
        task = done.pop()
        policy = waiting.pop(task)
        held = task.result()
        sched.charge(policy, 10, 20)
        order.append(policy.name)
    held.release()
    for task in waiting:
        task.cancel()
    await asyncio.gather(*waiting, return_exceptions=True)
    return order


async def _both_queued(sched: Scheduler, n: int):
    """Tenants a and b (weight 1, one class) in force; a holds the slot and
    each queues ``n``: (a, b, the held slot, the waiting tasks)."""
    a, b = queueing_policy("a"), queueing_policy("b")
    sched.follow({"a": a, "b": b})
    held = await sched.acquire(a, a.rank, MODEL, 8)
    return a, b, held, await _queue(sched, a, n) | await _queue(sched, b, n)


async def test_a_weight_raised_by_a_reload_applies_to_the_requests_already_queued() -> None:
    _, sched = _one_slot()
    a, b, held, waiting = await _both_queued(sched, 8)
    assert sched.queued("a") == sched.queued("b") == 8

    sched.follow({"a": _with(a, weight=4.0), "b": b})
    order = await _serve(sched, held, waiting, 10)
    # weights 4:1: a 8 of 10 (equal weights, as before: 5 of 10)
    assert order.count("a") == 8, order


async def test_a_running_request_is_charged_at_its_tenants_new_weight() -> None:
    _, sched = _one_slot()
    a = queueing_policy("a")
    sched.follow({"a": _with(a, weight=4.0)})
    sched.charge(a, 10, 20)  # a stream admitted at weight 1
    assert sched.counters.get("a") == (10 + 2 * 20) / 4
    # (the lane charges the counters directly, with the request's weight)
    sched.counters.charge("a", 0, 2, a.weight)
    assert sched.counters.get("a") == (10 + 2 * 20 + 2 * 2) / 4
    sched.counters.charge("gone", 0, 2, 2.0)  # a tenant the reload removed: its request's weight
    assert sched.counters.get("gone") == 2.0


async def test_a_class_changed_by_a_reload_moves_the_requests_already_queued() -> None:
    metrics, sched = _one_slot()
    a, b = queueing_policy("a"), queueing_policy("b")
    sched.follow({"a": a, "b": b})
    held = await sched.acquire(a, a.rank, MODEL, 8)
    waiting = await _queue(sched, b, 3)
    sched.charge(b, 1000, 0)  # b's counter far ahead: a goes first while they share a class
    waiting |= await _queue(sched, a, 3)
    assert metrics.queued.labels("b", "normal")._value.get() == 3

    sched.follow({"a": a, "b": _with(b, priority="high", rank=0)})
    assert metrics.queued.labels("b", "high")._value.get() == 3
    assert metrics.queued.labels("b", "normal")._value.get() == 0
    # a request of b admitted before the reload that queues after it: b's new class too
    late = await _queue(sched, b, 1)
    assert metrics.queued.labels("b", "high")._value.get() == 4
    order = await _serve(sched, held, waiting | late, 6)
    assert order == ["b"] * 4 + ["a"] * 2, order
    assert metrics.queued.labels("b", "high")._value.get() == 0


async def test_a_reload_that_changes_nothing_keeps_the_order() -> None:
    _, sched = _one_slot()
    a, b, held, waiting = await _both_queued(sched, 4)
    sched.follow({"a": _with(a), "b": _with(b)})  # (a reload makes new policy objects)
    order = await _serve(sched, held, waiting, 8)
    assert sorted(order[:2]) == sorted(order[2:4]) == ["a", "b"], order  # equal weights alternate


async def test_a_reload_forgets_the_counters_of_the_tenants_it_removed() -> None:
    _, sched = _one_slot()
    a, b = queueing_policy("a"), queueing_policy("b")
    sched.follow({"a": a, "b": b})
    sched.charge(a, 10, 0)
    sched.charge(b, 10, 0)
    sched.follow({"a": _with(a)})
    assert set(sched.counters.values) == {"a"}, sched.counters.values
