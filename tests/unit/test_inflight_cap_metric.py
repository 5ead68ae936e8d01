"""fairstream_replica_inflight_cap is the cap the router enforces on a replica:
the adaptive cap, never above the replica's ``max_concurrency`` (as
/admin/replicas' ``cap`` and the dispatch use it)."""

from __future__ import annotations

from policies.batching import AimdSettings
from replicas.pool import ReplicaPool
from replicas.spec import ReplicaSpec
from router.metrics import Metrics
from router.scheduler import Scheduler
from router.scheduler_settings import SchedulerSettings


def _cap_samples(metrics: Metrics) -> dict[str, float]:
    return {s.labels["replica"]: s.value for s in metrics.replica_cap.collect()[0].samples}


def test_the_cap_gauge_is_the_cap_the_router_enforces() -> None:
    pool = ReplicaPool([ReplicaSpec(name="small", max_concurrency=4), ReplicaSpec(name="big")])
    metrics = Metrics()
    Scheduler(pool, metrics, SchedulerSettings(), AimdSettings(initial=32))
    assert {s.name: s.cap for s in pool.slots} == {"small": 4, "big": 32}
    assert _cap_samples(metrics) == {"small": 4.0, "big": 32.0}


def test_a_fixed_cap_gauge_is_max_concurrency() -> None:
    pool = ReplicaPool([ReplicaSpec(name="small", max_concurrency=2)])
    metrics = Metrics()
    Scheduler(pool, metrics, SchedulerSettings(), AimdSettings(enabled=False))
    assert _cap_samples(metrics) == {"small": 2.0}
