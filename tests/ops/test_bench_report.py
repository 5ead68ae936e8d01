"""The benchmark's report: the kernel's share of a router's CPU."""

import os

from ops.bench.procs import cpu_seconds
from ops.bench.report import render
from ops.bench.runner import Measurement


def _row(table: str, system: str) -> list[str]:
    line = next(x for x in table.splitlines() if x.startswith(f"| {system} |"))
    return [c.strip() for c in line.strip("|").split("|")]


def test_stream_table_gives_the_kernels_share_of_the_routers_cpu():
    ms = [Measurement(1, "S2", "direct", ok=10, tokens=640, events=640),
          Measurement(1, "S2", "fairstream", ok=10, tokens=640, events=640, router_cpu_s=0.8, router_sys_s=0.2),
          Measurement(1, "S2", "vllm-router", ok=10, tokens=640, events=640, router_cpu_s=0.5, router_sys_s=0.3)]
    table = render(ms, [], {"S2": "S2"})
    head = _row(table, "system")
    col = head.index("of it kernel %")
    assert _row(table, "fairstream")[col] == "25"
    assert _row(table, "vllm-router")[col] == "60"
    assert _row(table, "direct")[col] == "-"  # no router, no CPU of its own


def test_cpu_seconds_system_only_is_the_kernels_part():
    import time

    user0 = os.times().user
    end = time.process_time() + 0.3
    while time.process_time() < end:  # user-space work only
        sum(range(1000))
    total = cpu_seconds(os.getpid())
    kernel = cpu_seconds(os.getpid(), system_only=True)
    assert os.times().user - user0 >= 0.2
    assert 0 <= kernel <= total - 0.2  # the loop's user time is not in it
