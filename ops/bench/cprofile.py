r"""``python -m ops.bench.cprofile``: one scenario through fairstream under cProfile.

    python -m ops.bench.cprofile --scenario S5 --out /tmp/s5.prof   # then the summary
    python -m ops.bench.cprofile --summary /tmp/s5.prof --top 40     # a saved one's

The router runs as the benchmark runs it (``fairstream`` in front of the two
mock upstreams), from a directory of links to this tree's packages and a
``sitecustomize.py`` that starts ``cProfile`` on SIGUSR1 and writes the
profile on SIGUSR2; the load is sent between the two (after the warm-up),
so the profile holds the scenario's requests only. What it is for: Python
calls per request (each function's ``ncalls`` over the requests), a
measure the host's load does not move, unlike its times (docs/perf.md,
"Session 37"). Loopback only; the load is the scenario's, bounded.
"""

from __future__ import annotations

import argparse
import os
import pstats
import signal
import sys
import tempfile
import time
from dataclasses import replace
from pathlib import Path

from ops.bench.runner import measure, warmup
from ops.bench.scenarios import build
from ops.bench.systems import ROOT, Env, MockPair, start_system

_HOOK = '''import os, signal
if os.environ.get("FS_CPROFILE_OUT"):
    import cProfile
    _p = cProfile.Profile()
    signal.signal(signal.SIGUSR1, lambda *_: _p.enable())
    def _dump(*_):
        _p.disable()
        _p.dump_stats(os.environ["FS_CPROFILE_OUT"])
    signal.signal(signal.SIGUSR2, _dump)
'''


def profile(scenario: str, out: Path, per_user: int | None) -> int:
    """Run ``scenario`` through a profiled fairstream; the requests it sent."""
    scen = build()[scenario]
    if per_user is not None:
        scen = replace(scen, requests=scen.concurrency * per_user)
    run = Path(tempfile.mkdtemp(prefix="fs-cprofile-"))
    src = run / "src"
    src.mkdir()
    for pkg in ("router", "replicas", "policies"):
        (src / pkg).symlink_to(ROOT / pkg)
    (src / "sitecustomize.py").write_text(_HOOK)
    os.environ["FS_CPROFILE_OUT"] = str(out.resolve())  # (the router inherits it)
    env = Env(run_dir=run, cfg_dir=run / "cfg", fairstream_src=src)
    mocks = MockPair(env)
    try:
        target = start_system("fairstream", env)
        try:
            mocks.configure({})
            warmup(target, scen)
            mocks.configure(scen.mock)
            warmup(target, scen)
            os.kill(target.router.pid, signal.SIGUSR1)
            time.sleep(0.3)
            m = measure(target, scen, 1, 1, mocks.cpu)
            os.kill(target.router.pid, signal.SIGUSR2)
            time.sleep(2.0)  # (the dump)
        finally:
            target.stop()
    finally:
        mocks.stop()
    print(f"{m.requests} requests, {m.ok} ok, errors {m.errors}; logs in {run}", file=sys.stderr)
    return m.requests


def summary(path: Path, requests: int, top: int) -> str:
    """The ``top`` functions by calls per request, with their share of the profiled time."""
    stats = pstats.Stats(str(path)).stats
    calls = sum(v[1] for v in stats.values())
    total = sum(v[2] for v in stats.values()) or 1.0
    lines = [f"{requests} requests, {calls} calls, {calls / requests:.1f} calls/request",
             f"{'calls/req':>9} {'tot%':>5} {'cum%':>5}  function"]
    root = f"{ROOT}/"
    for (file, line, name), (_, n, tt, ct, _) in sorted(stats.items(), key=lambda kv: -kv[1][1])[:top]:
        file = file.replace(root, "").split("site-packages/")[-1].split("lib/python3.11/")[-1]
        if "fs-cprofile-" in file:  # (the links' directory: router/..., as in the tree)
            file = file.split("/src/", 1)[-1]
        lines.append(f"{n / requests:9.2f} {100 * tt / total:5.1f} {100 * ct / total:5.1f}  {file}:{line}({name})")
    return "\n".join(lines)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--scenario", default="S5")
    p.add_argument("--out", type=Path, help="where the profile goes (pstats format)")
    p.add_argument("--requests-per-user", type=int, help="instead of the scenario's count")
    p.add_argument("--summary", type=Path, help="summarize this saved profile instead of running one")
    p.add_argument("--requests", type=int, help="with --summary: the requests it holds (else the .n file beside it)")
    p.add_argument("--top", type=int, default=40)
    args = p.parse_args()
    if args.summary is not None:
        n = args.requests or int(Path(f"{args.summary}.n").read_text())
        print(summary(args.summary, n, args.top))
        return
    if args.out is None:
        p.error("--out (or --summary) is required")
    n = profile(args.scenario, args.out, args.requests_per_user)
    Path(f"{args.out}.n").write_text(str(n))
    print(summary(args.out, n, args.top))


if __name__ == "__main__":
    main()
