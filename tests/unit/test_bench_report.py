"""The benchmark's verdicts (ops/bench/report.py) on made-up measurements:
what a full run prints at its end, checked without running one."""

from __future__ import annotations

from ops.bench import report
from ops.bench.runner import Measurement

TITLES = {"S1": "S1 title", "S2": "S2 title", "S3": "S3 title", "S4": "S4 title", "S5": "S5 title"}


def _m(rnd: int, scen: str, system: str, **kw) -> Measurement:
    return Measurement(round=rnd, scenario=scen, system=system, **kw)


def _micro() -> list[list[dict]]:
    us = {"p50": 20.0, "p99": 40.0, "mean": 22.0}
    return [[{"waiters": 1000, "tenants": t, "dispatch_us": us, "index_pick_us": us, "pick_us": us} for t in (4, 100)]]


def _run() -> list[Measurement]:
    ms = []
    for rnd in (1, 2):
        ms += [
            _m(rnd, "S1", "direct", ok=64, tokens=8192, ttft_p50=0.010),
            _m(rnd, "S1", "fairstream", ok=64, tokens=8192, ttft_p50=0.012, cpu_per_1k=0.008 + rnd * 0.001),
            _m(rnd, "S1", "vllm-router", ok=64, tokens=8192, ttft_p50=0.020, cpu_per_1k=0.010),
            _m(rnd, "S2", "direct", ok=256, tokens=16384, ttft_p50=0.002, itl_p99=0.022),
            _m(rnd, "S2", "fairstream", ok=256, tokens=16384, ttft_p50=0.040, itl_p99=0.0286, cpu_per_1k=0.044),
            _m(rnd, "S2", "vllm-router", ok=256, tokens=16384, ttft_p50=0.005, itl_p99=0.023, cpu_per_1k=0.025),
            _m(rnd, "S3", "fairstream", open_peak=2000, rss_per_stream=18.0 * 1024),
            # 990 of 1,000 requests completed, with 1,980 tokens between them (an
            # upstream that sent two): the line is CPU per completed request, not per token
            _m(rnd, "S5", "fairstream", requests=1000, ok=990, tokens=1980, router_cpu_s=0.33 * 0.99 * rnd,
               cpu_per_1k=0.33 * 0.99 * rnd / 1980 * 1000),
            _m(rnd, "S5", "vllm-router", requests=1000, ok=1000, tokens=1000, router_cpu_s=0.1, cpu_per_1k=0.1),
        ]
    return ms


def test_each_target_gets_its_verdict():
    text, results = report.targets(_run(), _micro())
    verdicts = dict(results)
    # S1: fairstream's median 0.0095 s <= vllm-router's 0.010 s
    assert verdicts["S1 router CPU per 1000 tokens, fairstream <= vllm-router"] is True
    assert verdicts["S2 router CPU per 1000 tokens, fairstream <= vllm-router"] is False
    # S1 added TTFT: +2 ms against vllm-router's +10 ms (limit 3.3 ms); S2: +38 against +3
    assert verdicts["S1 added TTFT p50, fairstream <= 1/3 of vllm-router's"] is True
    assert verdicts["S2 added TTFT p50, fairstream <= 1/3 of vllm-router's"] is False
    assert verdicts["S2 inter-token p99 within 10% of direct at 256 streams (fairstream)"] is False  # x1.30
    assert verdicts["S3 router memory per idle open stream <= 20 KB (fairstream)"] is True
    assert verdicts["S4 scheduling decision < 50 us with 1000 queued over 100 tenants"] is True
    assert "x1.30 of direct" in text


def test_s5_reports_cpu_per_completed_request_after_the_targets():
    text, results = report.targets(_run(), _micro())
    last = text.splitlines()[-1]
    # median over rounds of 0.33 and 0.66 ms per completed request; no verdict of its own
    assert last == ("- (no target) S5 router CPU per completed request (1-token streams): "
                    "fairstream 0.495 ms, vllm-router 0.100 ms")
    assert not any(name.startswith("S5") for name, _ in results)


def test_tables_render_every_scenario_run():
    tables = report.render(_run(), _micro(), TITLES)
    for sc in ("S1", "S2", "S3", "S5"):
        assert f"### {sc}: {sc} title" in tables
    assert "### S4 micro-benchmark" in tables
    assert "| 1000 | 100 | 20.0 |" in tables


def test_python_floor_is_printed_beside_the_cpu_targets():
    ms = _run() + [_m(r, "S2", "py-floor-features", ok=256, tokens=16384, cpu_per_1k=0.019) for r in (1, 2)]
    text, results = report.targets(ms, _micro())
    assert ("  - for reference, the Python floor (py-floor-features, ops/bench/floor_proxy.py): "
            "0.01900 s per 1000 tokens") in text.splitlines()
    assert not any("floor" in name for name, _ in results)  # a reference, not a target
