"""S4 micro-benchmark: the cost of one scheduling decision with 1,000 queued.

Builds fairstream's real ``Scheduler`` (real metrics, real ``ReplicaPool``
and ``policies``) over two replica slots whose in-flight caps are full, and
queues ``--waiters`` requests through ``Scheduler.acquire`` across
``--tenants`` tenants in three priority classes. Then, many times: one
in-flight handle is released and ``Scheduler._dispatch`` is timed as it
hands the freed slot to the next waiter (fair-share pick over the tenants'
heads, replica choice, future resolution, metrics) and finds nothing else
fits; a new waiter is queued right after, so the queue stays at
``--waiters``. The choice alone is timed too: the scheduler's
``HeadIndex.pick`` over its queued heads, and the reference
``policies.fairshare.pick`` (a scan) over one head per tenant.

``python -m ops.bench.schedbench --waiters 1000 --tenants 4,100,1000`` prints
one JSON object (microseconds).
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import json
import statistics
import time

__all__ = ["measure"]


class _FakeClient:
    """Just enough of a ReplicaClient for the pool: a ready connection."""

    def __init__(self, model: str) -> None:
        from replicas.protocol import LoadReport

        self.model = model
        self.closed = None
        self.refused = False
        self.credentials_refused = None
        self.load = LoadReport(0, 0, 0.0)


def _policies(n: int):
    from router.tenants import ResolvedLimits, TenantPolicy

    classes = ["high", "normal", "low"]
    out = []
    for i in range(n):
        out.append(TenantPolicy(
            name=f"t{i}", priority=classes[i % 3], rank=i % 3, weight=float(1 + i % 4), models=["*"], queue_depth=100_000,
            chunk_tokens=16, on_limit="queue", log_content=False,
            limits=ResolvedLimits(requests_per_minute=0, tokens_per_minute=0, max_concurrent=0, max_prompt_tokens=0,
                                  max_tokens=0, max_sockets=0, queue_wait=0.0, first_token=0.0, stall=0.0, total=0.0),
        ))
    return out


def _pct(xs: list[float], p: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(p * len(xs)))]


async def _measure(waiters: int, tenants: int, decisions: int, cap: int) -> dict:
    from policies.batching import AimdSettings
    from policies.fairshare import Head, pick
    from replicas.pool import ReplicaPool
    from replicas.spec import ReplicaSpec
    from router.metrics import Metrics
    from router.scheduler import Scheduler
    from router.scheduler_settings import SchedulerSettings

    model = "m"
    pool = ReplicaPool([ReplicaSpec(name=f"r{i}", address=f"127.0.0.1:{9000 + i}") for i in range(2)])
    for s in pool.slots:
        s.client = _FakeClient(model)  # type: ignore[assignment]
        s.state = "ready"
    sched = Scheduler(pool, Metrics(), SchedulerSettings(), AimdSettings(enabled=False, max_inflight=cap))
    pols = _policies(tenants)
    held = []
    for i in range(2 * cap):  # fill both replicas to their caps (fast path)
        p = pols[i % tenants]
        held.append(await sched.acquire(p, p.rank, model, 64))
    n_added = 0

    async def waiter(p) -> None:
        held.append(await sched.acquire(p, p.rank, model, 64))

    tasks = set()

    def add() -> None:
        nonlocal n_added
        p = pols[n_added % tenants]
        n_added += 1
        t = asyncio.get_running_loop().create_task(waiter(p))
        tasks.add(t)
        t.add_done_callback(tasks.discard)

    for _ in range(waiters):
        add()
    for _ in range(5):
        await asyncio.sleep(0)
    assert sched.queued() == waiters, (sched.queued(), waiters)
    # some served history so the VTC counters differ between tenants
    for i, p in enumerate(pols):
        sched.charge(p, 50 + i % 7, 100 + (i * 37) % 300)

    times = []
    gc_was = gc.isenabled()
    # warm-up: one decision per tenant at least, so that every tenant's metric
    # series exist, as in a router that has served them (a tenant's first
    # dispatch creates its queue-wait histogram's child, ~20 us, once)
    warm = max(50, tenants)
    for k in range(decisions + warm):
        h = held.pop(0)
        h.release()  # frees one slot (and schedules a dispatch for later)
        t0 = time.perf_counter_ns()
        sched._dispatch()
        t1 = time.perf_counter_ns()
        if k >= warm:
            times.append((t1 - t0) / 1000)
        add()
        await asyncio.sleep(0)
        await asyncio.sleep(0)
    assert sched.queued() == waiters, sched.queued()

    now = time.monotonic()
    heads = [Head(p.name, p.rank, now - (i % 50) * 0.01) for i, p in enumerate(pols)]
    pick_times = []
    for _ in range(2000):
        t0 = time.perf_counter_ns()
        pick(heads, sched.counters, now, 10.0)
        pick_times.append((time.perf_counter_ns() - t0) / 1000)
    index_times = []
    for _ in range(2000):
        t0 = time.perf_counter_ns()
        sched._heads.pick(sched.counters, now)
        index_times.append((time.perf_counter_ns() - t0) / 1000)

    for t in list(tasks):
        t.cancel()
    await asyncio.gather(*tasks, return_exceptions=True)
    if gc_was:
        gc.enable()
    return {
        "waiters": waiters,
        "tenants": tenants,
        "decisions": len(times),
        "dispatch_us": {"p50": statistics.median(times), "p99": _pct(times, 0.99), "mean": statistics.fmean(times),
                        "max": max(times)},
        "pick_us": {"p50": statistics.median(pick_times), "p99": _pct(pick_times, 0.99),
                    "mean": statistics.fmean(pick_times)},
        "index_pick_us": {"p50": statistics.median(index_times), "p99": _pct(index_times, 0.99),
                          "mean": statistics.fmean(index_times)},
    }


def measure(waiters: int = 1000, tenants: list[int] | None = None, decisions: int = 1000, cap: int = 32) -> list[dict]:
    import uvloop

    return [uvloop.run(_measure(waiters, t, decisions, cap)) for t in (tenants or [4, 100, 1000])]


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(prog="schedbench", description="fairstream scheduling-decision micro-benchmark")
    p.add_argument("--waiters", type=int, default=1000)
    p.add_argument("--tenants", default="4,100,1000", help="comma-separated tenant counts")
    p.add_argument("--decisions", type=int, default=1000)
    a = p.parse_args(argv)
    out = measure(a.waiters, [int(x) for x in a.tenants.split(",")], a.decisions)
    print(json.dumps(out))


if __name__ == "__main__":
    main()
