r"""``python -m ops.bench.instructions``: user-space instructions per token and per request, under callgrind.

    python -m ops.bench.instructions --system fairstream --streams 4
    python -m ops.bench.instructions --system py-floor-features --streams 4
    python -m ops.bench.instructions --fairstream-src /tmp/old-tree   # another tree's router

The router runs under ``valgrind --tool=callgrind`` with instrumentation off
until the warm-up is done, in front of the two mock upstreams; S2's load
(20 ms between tokens) with a few streams, so that each read of an upstream
connection holds one token as in the unprofiled S2 (the router is ~50x
slower under valgrind), twice with 64 tokens per request and twice with 16,
alternating. Per token: (median 64-token count - median 16-token count) /
the token difference; per request: what is left of the 16-token count. A
count the host's load does not move (docs/perf.md, "Session 39"), unlike CPU
seconds: the spread is the router's background work (health checks, timers)
in the measured window, ~1-2k instructions per token with 4 streams. The
dumps stay in ``--out`` for ``callgrind_annotate``. Needs valgrind;
loopback only; the load is bounded.
"""

from __future__ import annotations

import argparse
import glob
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import replace
from pathlib import Path

from ops.bench.runner import measure, warmup
from ops.bench.scenarios import build
from ops.bench.systems import ROOT, Env, MockPair, start_system


def _ctl(*args: str) -> None:
    subprocess.run(["callgrind_control", *args], capture_output=True, timeout=120, check=False)


def run(system: str, streams: int, src: Path, out: Path) -> tuple[float, float]:
    """Instructions per token and per request of ``system``'s router."""
    out.mkdir(parents=True, exist_ok=True)
    wrapper = out / "vg-python"
    wrapper.write_text(f"#!/bin/sh\nexec valgrind --tool=callgrind --instr-atstart=no --dump-instr=no "
                       f"--callgrind-out-file={out}/cg.%p {sys.executable} \"$@\" 2>>{out}/valgrind.log\n")
    wrapper.chmod(0o755)
    base = build()["S2"]
    run_dir = Path(tempfile.mkdtemp(prefix="fs-instructions-"))
    env = Env(run_dir=run_dir, cfg_dir=run_dir / "cfg", fairstream_src=src)
    mocks = MockPair(env)
    env.python = str(wrapper)  # (the router only: the mocks are started)
    counts: dict[int, list[tuple[int, int, int]]] = {64: [], 16: []}
    try:
        target = start_system(system, env)
        pid = target.router.pid
        try:
            small = replace(base, concurrency=streams, requests=streams * 2)
            mocks.configure({})
            warmup(target, small)
            mocks.configure(base.mock)
            warmup(target, small)
            for i, tokens in enumerate((64, 16, 64, 16)):
                scen = replace(base, concurrency=streams, requests=streams * 3, max_tokens=tokens)
                _ctl("-z", str(pid))
                _ctl("-i", "on", str(pid))
                m = measure(target, scen, i, 1, mocks.cpu)
                _ctl("-i", "off", str(pid))
                for f in glob.glob(f"{out}/cg.{pid}.*"):
                    os.remove(f)
                _ctl("-d", str(pid))
                time.sleep(1.0)
                ir = 0
                for f in glob.glob(f"{out}/cg.{pid}.*"):
                    lines = Path(f).read_text().splitlines()
                    ir = max([ir] + [int(x.split()[1]) for x in lines if x.startswith(("summary:", "totals:"))])
                    os.rename(f, out / f"dump-{system}-{tokens}-{i}")
                counts[tokens].append((ir, m.tokens, m.requests))
                print(f"{system}: {tokens} tokens x {m.requests} requests ({m.ok} ok): {ir:,} instructions",
                      file=sys.stderr)
        finally:
            target.stop()
    finally:
        mocks.stop()
    hi, lo = counts[64], counts[16]
    per_token = (statistics.median(c[0] for c in hi) - statistics.median(c[0] for c in lo)) / (hi[0][1] - lo[0][1])
    per_request = (statistics.median(c[0] for c in lo) - per_token * lo[0][1]) / lo[0][2]
    return per_token, per_request


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--system", default="fairstream", choices=["fairstream", "py-floor", "py-floor-features"])
    p.add_argument("--streams", type=int, default=4)
    p.add_argument("--fairstream-src", type=Path, default=ROOT)
    p.add_argument("--out", type=Path, default=Path(tempfile.gettempdir()) / "fs-instructions")
    a = p.parse_args()
    missing = [tool for tool in ("valgrind", "callgrind_control") if shutil.which(tool) is None]
    if missing:
        sys.exit(f"ops.bench.instructions needs {' and '.join(missing)} on PATH (Debian: apt-get install valgrind)")
    per_token, per_request = run(a.system, a.streams, a.fairstream_src.resolve(), a.out.resolve())
    print(f"{a.system}: {per_token:,.0f} instructions per token, {per_request:,.0f} per request")


if __name__ == "__main__":
    main()
