"""The S4 micro-benchmark (ops/bench/schedbench.py) runs against the real
scheduler and pool: a small run must make every decision it is asked for.
(Its stand-in replica connection once lacked an attribute the pool reads,
and the benchmark failed with AttributeError; no test ran it.)"""

from __future__ import annotations

from ops.bench.schedbench import measure


def test_schedbench_makes_its_decisions_on_the_real_scheduler() -> None:
    out = measure(waiters=50, tenants=[4, 20], decisions=50)
    assert [r["tenants"] for r in out] == [4, 20]
    for r in out:
        assert r["decisions"] == 50 and r["waiters"] == 50
        assert 0 < r["dispatch_us"]["p50"] <= r["dispatch_us"]["max"]
        assert 0 < r["index_pick_us"]["p50"]
