"""ops/bench_scheduler.py's bounds: a run whose measured window is empty (its
--seconds not above --warmup, 5 by default), or with no clients or tokens to
ask for, printed a full table of zeros ("share gold 0", "throughput -0") and
exited 0."""

from __future__ import annotations

import subprocess
import sys

import pytest

from tests.helpers import ROOT


@pytest.mark.parametrize("args, said", [
    (["--seconds", "3"], "--seconds must be more than --warmup"),
    (["--seconds", "3", "--warmup", "-1"], "--warmup must not be negative"),
    (["--seconds", "6", "--clients", "0"], "--clients must be at least 1"),
    (["--seconds", "6", "--max-tokens", "0"], "--max-tokens must be at least 1"),
])
def test_arguments_that_measure_nothing_are_refused(args: list[str], said: str) -> None:
    r = subprocess.run([sys.executable, str(ROOT / "ops" / "bench_scheduler.py"), "--configs", "fifo+fixed", *args],
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 2, (r.returncode, r.stdout[-800:], r.stderr[-800:])
    assert said in r.stderr, r.stderr
