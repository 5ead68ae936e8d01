r"""``python -m ops.bench``: run every system through every scenario, print tables.

    python -m ops.bench --rounds 2                       # everything, ~8 min on 2 cores
    python -m ops.bench --systems direct,fairstream,vllm-router --scenarios S1,S2
    python -m ops.bench --install                        # create ops/bench/.venvs/{vllm-router,litellm}
    python -m ops.bench --rounds 1 --systems direct,fairstream --scenarios S2 \
        --profile fairstream:S2=ops/profiles/S2-fairstream.svg

Loopback only; every load is bounded in count and time. Results (JSON and
markdown) go to ops/out/bench-<time>/ unless --out says otherwise.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import resource
import shutil
import subprocess
import sys
import tempfile
import time
from dataclasses import replace
from pathlib import Path

from ops.bench import report
from ops.bench.procs import loadavg
from ops.bench.runner import Measurement, measure, warmup
from ops.bench.scenarios import build
from ops.bench.systems import (
    ROOT,
    SIM_SYSTEMS,
    UPSTREAM_SYSTEMS,
    VENVS,
    Env,
    MockPair,
    sim_target,
    start_sims,
    start_system,
)

VLLM_ROUTER_VERSION = "0.1.17"


def _log(msg: str) -> None:
    print(f"[bench {time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


def install() -> None:
    """Create the third-party venvs (git-ignored) from PyPI."""
    VENVS.mkdir(parents=True, exist_ok=True)
    gi = VENVS / ".gitignore"
    if not gi.exists():
        gi.write_text("*\n!.gitignore\n")
    for name, spec in (("vllm-router", f"vllm-router=={VLLM_ROUTER_VERSION}"), ("litellm", "litellm[proxy]")):
        venv = VENVS / name
        if not (venv / "bin" / "python").exists():
            subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True)
        _log(f"installing {spec} into {venv}")
        subprocess.run([str(venv / "bin" / "pip"), "install", "-q", spec], check=True)


def _wait_quiet(threshold: float, max_wait: float) -> float:
    """Wait (up to ``max_wait`` s) until the 1-minute load average is below ``threshold``."""
    end = time.monotonic() + max_wait
    load = loadavg()
    while load >= threshold and time.monotonic() < end:
        _log(f"load average {load:.2f} >= {threshold}; waiting")
        time.sleep(15)
        load = loadavg()
    return load


def _profile_path(args, system: str, scen: str, rnd: int) -> Path | None:
    if rnd != 1:
        return None
    for item in args.profile:
        key, _, path = item.partition("=")
        if key == f"{system}:{scen}":
            return Path(path or f"ops/profiles/{scen}-{system}.svg")
    return None


def process_batches(names: list[str], scens: dict) -> list[list[str]]:
    """The scenarios ``names`` in the processes a system runs them in: those
    that share one, in order, then each ``fresh`` one in a process of its own."""
    shared = [s for s in names if not scens[s].fresh]
    return ([shared] if shared else []) + [[s] for s in names if scens[s].fresh]


def _run_round(rnd: int, args, env: Env, mocks: MockPair | None, scens: dict, ms: list[Measurement]) -> None:
    up_systems = [s for s in args.systems if s in UPSTREAM_SYSTEMS]
    sim_systems = [s for s in args.systems if s in SIM_SYSTEMS]
    if rnd % 2 == 0:  # alternate the order between rounds (drift, warm caches)
        up_systems = up_systems[:1] + up_systems[1:][::-1]
    up_scens = [s for s in args.scenarios if scens[s].upstream]
    for system in up_systems:
        if not up_scens:
            break
        t0 = time.monotonic()
        for batch in process_batches(up_scens, scens):
            try:
                target = start_system(system, env)
            except (RuntimeError, FileNotFoundError) as e:
                _log(f"round {rnd}: {system} failed to start: {e}")
                break
            try:
                mocks.configure({})
                warmup(target, scens[batch[0]])
                for sc in batch:
                    scen = scens[sc]
                    mocks.configure(scen.mock)
                    m = measure(target, scen, rnd, args.workers, mocks.cpu, _profile_path(args, system, sc, rnd))
                    ms.append(m)
                    _log(f"round {rnd} {sc} {system}: {_summary(m)}")
                    _save_partial(args, ms)
            except Exception as e:  # noqa: BLE001 - one system's failure must not lose the run
                _log(f"round {rnd} {system} failed: {type(e).__name__}: {e}")
            finally:
                target.stop()
        _log(f"round {rnd} {system} done in {time.monotonic() - t0:.0f}s")
    sim_scens = [s for s in args.scenarios if scens[s].on_sim or (s == "S3" and args.sim_idle)]
    if not sim_systems:
        return
    for sc in sim_scens:
        scen = scens[sc]
        try:
            sims = start_sims(env, scen.sim, f"{sc}-r{rnd}")
        except RuntimeError as e:
            _log(f"round {rnd} {sc}: sim replicas failed to start: {e}")
            continue
        try:
            order = sim_systems if rnd % 2 else sim_systems[::-1]
            for system in order:
                try:
                    target = sim_target(system, env, sims, scen.sim_cap)
                except RuntimeError as e:
                    _log(f"round {rnd}: {system} failed to start: {e}")
                    continue
                try:
                    warmup(target, replace(scen, max_tokens=min(16, scen.max_tokens)))
                    m = measure(target, scen, rnd, args.workers, sims.cpu, _profile_path(args, system, sc, rnd))
                    ms.append(m)
                    _log(f"round {rnd} {sc} {system}: {_summary(m)}")
                    _save_partial(args, ms)
                except Exception as e:  # noqa: BLE001
                    _log(f"round {rnd} {sc} {system} failed: {type(e).__name__}: {e}")
                finally:
                    target.stop()
        finally:
            sims.stop()


def _save_partial(args, ms: list[Measurement]) -> None:
    path = Path(args.out_dir) / "partial.json"
    path.write_text(json.dumps([m.to_json() for m in ms]))


def _summary(m: Measurement) -> str:
    def ms_(v):
        return "-" if v is None else f"{v * 1000:.1f}"
    cpu = "-" if m.cpu_per_1k is None else f"{m.cpu_per_1k:.3f}"
    per = "" if m.rss_per_stream is None else f" {m.rss_per_stream / 1024:.1f}KB/stream@{m.open_peak}"
    tpe = m.tokens / m.events if m.events else 0.0
    return (f"ok {m.ok}/{m.requests} tok {m.tokens} ({tpe:.2f}/event) {m.tok_s:.0f} tok/s "
            f"ttft p50 {ms_(m.ttft_p50)} p99 {ms_(m.ttft_p99)} ms "
            f"itl p50 {ms_(m.itl_p50)} p99 {ms_(m.itl_p99)} ms cpu/1k {cpu}{per} "
            f"client cpu {m.client_cpu_s:.1f}s load {m.load1:.2f}")


def _micro(args) -> list[dict]:
    src = str(Path(args.fairstream_src).resolve())
    out = subprocess.run([sys.executable, "-c", "from ops.bench.schedbench import main; main()", "--waiters", "1000",
                          "--tenants", args.micro_tenants], capture_output=True, text=True, cwd=src, timeout=300,
                         env=dict(os.environ, PYTHONPATH=os.pathsep.join(dict.fromkeys([src, str(ROOT)]))))
    if out.returncode != 0:
        _log(f"schedbench failed: {out.stderr[-2000:]}")
        return []
    return json.loads(out.stdout)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m ops.bench", description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter,
                                epilog=__doc__.split("\n\n", 1)[1] if "\n\n" in __doc__ else None)
    p.add_argument("--rounds", type=int, default=2, help="rounds of every scenario (medians and spread; default 2)")
    p.add_argument("--systems", default=",".join(UPSTREAM_SYSTEMS + SIM_SYSTEMS),
                   help="comma-separated, of: " + ", ".join(UPSTREAM_SYSTEMS + SIM_SYSTEMS) + " (default: all)")
    p.add_argument("--scenarios", default="S1,S2,S5,S3,S4",
                   help="comma-separated, of S1-S5 (docs/perf.md, \"What runs\"; default: all)")
    p.add_argument("--workers", type=int, default=2, help="load-client processes")
    p.add_argument("--waves", type=int, default=6, help="S1: requests per virtual user")
    p.add_argument("--s2-waves", type=int, default=3, help="S2: requests per virtual user")
    p.add_argument("--idle-streams", type=int, default=2000, help="S3: open streams")
    p.add_argument("--hold", type=float, default=8.0, help="S3: seconds each stream stays open after its first token")
    p.add_argument("--budget", type=float, default=20.0, help="seconds after which no new request starts")
    p.add_argument("--sim-idle", action="store_true", help="run S3 on the sim systems too")
    p.add_argument("--micro-tenants", default="4,100,1000", help="S4 micro: tenant counts for 1000 queued")
    p.add_argument("--wait-load", type=float, default=1.0, help="wait until the 1-min load average is below this")
    p.add_argument("--wait-max", type=float, default=1200.0, help="longest wait for a quiet machine (s)")
    p.add_argument("--profile", action="append", default=[], metavar="SYSTEM:SCENARIO[=PATH]",
                   help="py-spy the router during that run (round 1); .svg flamegraph or .json speedscope")
    p.add_argument("--fairstream-src", default=str(ROOT),
                   help="run the fairstream systems from this source tree (e.g. a scratch copy with a patch)")
    p.add_argument("--out", help="results directory (default ops/out/bench-<time>)")
    p.add_argument("--install", action="store_true", help="create the third-party venvs and exit")
    args = p.parse_args(argv)
    if args.install:
        install()
        return 0
    args.systems = [s for s in args.systems.split(",") if s]
    args.scenarios = [s for s in args.scenarios.split(",") if s]
    scens = build(args.waves, args.s2_waves, args.idle_streams, args.hold, args.budget)
    unknown = [s for s in args.systems if s not in UPSTREAM_SYSTEMS + SIM_SYSTEMS] + [
        s for s in args.scenarios if s not in scens]
    if unknown:
        p.error(f"unknown systems/scenarios: {unknown}")
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))  # children inherit it (2,000 streams)

    out = Path(args.out) if args.out else ROOT / "ops" / "out" / time.strftime("bench-%Y%m%d-%H%M%S")
    out.mkdir(parents=True, exist_ok=True)
    args.out_dir = str(out)
    env = Env(run_dir=out, cfg_dir=Path(tempfile.mkdtemp(prefix="fsbench-")),
              fairstream_src=Path(args.fairstream_src).resolve())
    os.environ.setdefault("PYTHONUNBUFFERED", "1")
    load_start = _wait_quiet(args.wait_load, args.wait_max) if args.wait_load > 0 else loadavg()
    _log(f"results in {out}; load average at start {load_start:.2f}")
    t_start = time.monotonic()
    ms: list[Measurement] = []
    micro: list[list[dict]] = []
    mocks = MockPair(env) if any(s in UPSTREAM_SYSTEMS for s in args.systems) else None
    try:
        for rnd in range(1, args.rounds + 1):
            _run_round(rnd, args, env, mocks, scens, ms)
            if "S4" in args.scenarios:
                micro.append(_micro(args))
                _log(f"round {rnd} S4 micro: " + ", ".join(
                    f"{r['tenants']} tenants p50 {r['dispatch_us']['p50']:.1f}us" for r in micro[-1]))
    finally:
        if mocks is not None:
            mocks.stop()
        shutil.rmtree(env.cfg_dir, ignore_errors=True)
    elapsed = time.monotonic() - t_start
    load_end = loadavg()

    titles = {k: v.title for k, v in scens.items()}
    tables = report.render(ms, micro, titles)
    verdicts, results = report.targets(ms, micro)
    cmd = "python -m ops.bench " + " ".join(argv if argv is not None else sys.argv[1:])
    header = (f"## fairstream benchmark ({args.rounds} rounds, {elapsed / 60:.1f} min, "
              f"{os.cpu_count()} cores, load average {load_start:.2f} at start, {load_end:.2f} at end)\n\n"
              f"`{cmd}`\n\nPython systems run on {sys.executable} (Python {platform.python_version()}; its build "
              f"matters: docs/perf.md, \"Session 31\"). Each cell: median over rounds [min-max]; xN: median ratio to direct in the same round "
              f"(fairstream-sim: to sim-direct). Client: {args.workers} processes.")
    text = header + "\n" + tables + "\n\n### Targets\n\n" + verdicts + "\n"
    print(text)
    (out / "results.md").write_text(text)
    (out / "results.json").write_text(json.dumps({
        "command": cmd, "python": sys.executable, "python_version": platform.python_version(),
        "load_start": load_start, "load_end": load_end, "elapsed_s": elapsed,
        "measurements": [m.to_json() for m in ms], "micro": micro,
        "targets": [{"target": n, "pass": ok} for n, ok in results],
    }, indent=1))
    _log(f"wrote {out / 'results.md'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
