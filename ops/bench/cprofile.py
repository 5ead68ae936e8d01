r"""``python -m ops.bench.cprofile``: one scenario through fairstream under cProfile.

    python -m ops.bench.cprofile --scenario S5 --out /tmp/s5.prof   # then the summary
    python -m ops.bench.cprofile --summary /tmp/s5.prof --top 40     # a saved one's
    python -m ops.bench.cprofile --scenario S2 --concurrency 64 --out /tmp/s2.prof \
        --under http11.py:data_received --per 64    # calls per token under the upstream reads
    python -m ops.bench.cprofile --system py-floor-features --scenario S2 --concurrency 64 ...

The router runs as the benchmark runs it (``fairstream`` in front of the two
mock upstreams), from a directory of links to this tree's packages and a
``sitecustomize.py`` that starts ``cProfile`` on SIGUSR1 and writes the
profile on SIGUSR2; the load is sent between the two (after the warm-up),
so the profile holds the scenario's requests only. What it is for: Python
calls per request (each function's ``ncalls`` over the requests), a
measure the host's load does not move, unlike its times (docs/perf.md,
"Session 37"). Loopback only; the load is the scenario's, bounded.

``--concurrency`` runs fewer streams at once than the scenario: under the
profiler the router is slower, and in S2 a read of an upstream connection
then holds two or three tokens where the unprofiled router's holds one, so
the per-token path would be counted at a load it does not run at.
``--under FILE:NAME`` sums the calls made inside the functions called NAME
in files ending in FILE (``http11.py:data_received``, the upstream
connections' reads: the relay path down to the
client's ``transport.write``), per ``--per`` of a request (64: per token
of S2), by the edges of the profile's call graph (a function called both
inside and outside counts its callees in proportion). ``--system
py-floor-features`` profiles the Python floor the same way
(ops/bench/floor_proxy.py).
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


def profile(scenario: str, out: Path, per_user: int | None, concurrency: int | None = None,
            system: str = "fairstream") -> int:
    """Run ``scenario`` through a profiled ``system``; the requests it sent."""
    scen = build()[scenario]
    if concurrency is not None:
        scen = replace(scen, concurrency=concurrency, requests=concurrency * scen.requests // scen.concurrency)
    if per_user is not None:
        scen = replace(scen, requests=scen.concurrency * per_user)
    run = Path(tempfile.mkdtemp(prefix="fs-cprofile-"))
    src = run / "src"
    src.mkdir()
    for pkg in ("router", "replicas", "policies"):
        (src / pkg).symlink_to(ROOT / pkg)
    (src / "sitecustomize.py").write_text(_HOOK)
    os.environ["FS_CPROFILE_OUT"] = str(out.resolve())  # (the router inherits it)
    if system != "fairstream":  # (the floor runs from this tree: the hook's directory on its path)
        os.environ["PYTHONPATH"] = str(src)
    env = Env(run_dir=run, cfg_dir=run / "cfg", fairstream_src=src)
    mocks = MockPair(env)
    try:
        target = start_system(system, env)
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


def under(path: Path, requests: int, root: str, per: int, top: int) -> str:
    """The calls made inside the functions named ``root`` (and theirs), per
    ``per`` of a request, by function: each call-graph edge counts in the
    proportion of its caller's calls that were inside."""
    stats = pstats.Stats(str(path)).stats
    where, _, name = root.rpartition(":")
    roots = {f for f in stats if f[2] == name and f[0].endswith(where)}
    inside = {f: float(stats[f][1]) for f in roots}
    for _ in range(50):  # (to a fixed point: the relay path is a few levels deep, no recursion)
        new = dict(inside)
        for f, (_, n, _, _, callers) in stats.items():
            if f in roots:
                continue
            got = sum(e[1] * inside[c] / max(stats[c][1], 1) for c, e in callers.items() if c in inside)
            if got:
                new[f] = got
        if new == inside:
            break
        inside = new
    units = requests * per
    calls = sum(inside.values())
    lines = [f"{requests} requests x {per}: {calls / units:.2f} calls per unit under {root}",
             f"{'per unit':>9}  function"]
    root_dir = f"{ROOT}/"
    for (file, line, name), n in sorted(inside.items(), key=lambda kv: -kv[1])[:top]:
        file = file.replace(root_dir, "").split("site-packages/")[-1].split("lib/python3.11/")[-1]
        if "fs-cprofile-" in file:
            file = file.split("/src/", 1)[-1]
        lines.append(f"{n / units:9.3f}  {file}:{line}({name})")
    return "\n".join(lines)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--scenario", default="S5")
    p.add_argument("--out", type=Path, help="where the profile goes (pstats format)")
    p.add_argument("--requests-per-user", type=int, help="instead of the scenario's count")
    p.add_argument("--summary", type=Path, help="summarize this saved profile instead of running one")
    p.add_argument("--requests", type=int, help="with --summary: the requests it holds (else the .n file beside it)")
    p.add_argument("--top", type=int, default=40)
    p.add_argument("--system", default="fairstream", choices=["fairstream", "py-floor", "py-floor-features"])
    p.add_argument("--concurrency", type=int, help="streams at once, instead of the scenario's")
    p.add_argument("--under", help="sum the calls inside the functions of this name, or FILE:NAME "
                   "(e.g. http11.py:data_received)")
    p.add_argument("--per", type=int, default=1, help="with --under: per this many of a request (its tokens)")
    args = p.parse_args()
    if args.summary is None:
        if args.out is None:
            p.error("--out (or --summary) is required")
        n = profile(args.scenario, args.out, args.requests_per_user, args.concurrency, args.system)
        Path(f"{args.out}.n").write_text(str(n))
        args.summary = args.out
    n = args.requests or int(Path(f"{args.summary}.n").read_text())
    print(under(args.summary, n, args.under, args.per, args.top) if args.under else summary(args.summary, n, args.top))


if __name__ == "__main__":
    main()
