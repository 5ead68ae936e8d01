"""One measurement: a scenario's load against one target, with the router watched.

The load is split over ``workers`` client processes (forked; each runs
``loadclient.run_job`` on uvloop). Meanwhile the parent samples the router's
RSS (process tree) and the number of open streams every 0.2 s. Router CPU is
``/proc`` utime+stime of the router's process tree before and after.
"""

from __future__ import annotations

import json
import multiprocessing as mp
import subprocess
import time
from array import array
from dataclasses import asdict, dataclass, field
from pathlib import Path

import msgspec

from ops.bench.loadclient import Job, WorkerResult, _worker_main
from ops.bench.procs import loadavg, rss_bytes
from ops.bench.scenarios import Scenario
from ops.bench.systems import Target

__all__ = ["Measurement", "measure", "warmup"]


@dataclass
class Measurement:
    round: int
    scenario: str
    system: str
    requests: int = 0
    ok: int = 0
    errors: dict = field(default_factory=dict)
    tokens: int = 0
    events: int = 0  # content events the client received
    wall_s: float = 0.0
    tok_s: float = 0.0
    ttft_p50: float | None = None
    ttft_p99: float | None = None
    itl_p50: float | None = None
    itl_p99: float | None = None
    router_cpu_s: float | None = None
    router_sys_s: float | None = None  # the kernel's part of router_cpu_s
    cpu_per_1k: float | None = None
    rss_before: int | None = None
    rss_peak: int | None = None
    rss_after: int | None = None
    open_peak: int = 0
    rss_per_stream: float | None = None  # bytes
    client_cpu_s: float = 0.0
    client_cpu_per_1k: float | None = None
    upstream_cpu_s: float = 0.0
    load1: float = 0.0

    def to_json(self) -> dict:
        return asdict(self)


def _pct(xs, p: float) -> float | None:
    if not len(xs):
        return None
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(p * len(xs)))]


def _split(n: int, k: int) -> list[int]:
    return [n // k + (1 if i < n % k else 0) for i in range(k)]


def _jobs(target: Target, scen: Scenario, workers: int, concurrency: int | None = None,
          requests: int | None = None, max_tokens: int | None = None) -> list[Job]:
    conc = concurrency or scen.concurrency
    reqs = requests or scen.requests
    ntok = max_tokens or scen.max_tokens
    body = {
        "model": target.model, "stream": True, "max_tokens": ntok,
        "stream_options": {"include_usage": True},
        "messages": [{"role": "user", "content": "Tell me about the cluster."}],
    } | target.extra_body
    workers = max(1, min(workers, conc))
    cs, rs = _split(conc, workers), _split(reqs, workers)
    return [
        Job(kind=target.kind, ports=target.ports, path=target.path, body=json.dumps(body).encode(),
            keys=target.keys, addresses=target.addresses, max_tokens=ntok, concurrency=cs[w], requests=rs[w],
            budget_s=scen.budget_s, deadline_s=scen.deadline_s, ramp_s=scen.ramp_s, token_chars=target.token_chars,
            worker=w)
        for w in range(workers)
    ]


def _run_jobs(jobs: list[Job], target: Target, sample_rss: bool) -> tuple[list[WorkerResult], list[tuple]]:
    ctx = mp.get_context("fork")
    counter = ctx.Value("i", 0)
    procs, conns = [], []
    for job in jobs:
        parent_end, child_end = ctx.Pipe(duplex=False)
        p = ctx.Process(target=_worker_main, args=(msgspec.msgpack.encode(job), counter, child_end), daemon=True)
        p.start()
        child_end.close()
        procs.append(p)
        conns.append(parent_end)
    results: list[WorkerResult | None] = [None] * len(jobs)
    samples: list[tuple] = []  # (t, rss, open streams)
    router = target.router
    pids = router.pids() if router is not None else []
    last_pids = time.monotonic()
    hard_end = time.monotonic() + max(j.deadline_s for j in jobs) + 30
    while any(r is None for r in results):
        for i, c in enumerate(conns):
            if results[i] is None and c.poll(0.0):
                try:
                    results[i] = msgspec.msgpack.decode(c.recv_bytes(), type=WorkerResult)
                except EOFError:
                    results[i] = WorkerResult(errors={"worker_died": 1})
        if sample_rss:
            now = time.monotonic()
            if router is not None and now - last_pids > 1.0:
                pids, last_pids = router.pids(), now
            samples.append((now, rss_bytes(pids) if pids else 0, counter.value))
        if time.monotonic() > hard_end:
            for i, p in enumerate(procs):
                if results[i] is None:
                    p.kill()
                    results[i] = WorkerResult(errors={"worker_killed": 1})
            break
        if any(r is None for r in results):
            time.sleep(0.2)
    for p in procs:
        p.join(5)
    return [r for r in results if r is not None], samples


def warmup(target: Target, scen: Scenario) -> None:
    """A short load so connection pools, caches and lazy imports are warm."""
    jobs = _jobs(target, scen, 1, concurrency=16, requests=48, max_tokens=16)
    for j in jobs:
        j.budget_s, j.deadline_s, j.ramp_s = 10.0, 20.0, 0.0
    _run_jobs(jobs, target, False)


def measure(target: Target, scen: Scenario, rnd: int, workers: int, upstream_cpu=None,
            profile: Path | None = None) -> Measurement:
    m = Measurement(rnd, scen.name, target.system, load1=loadavg())
    router = target.router
    time.sleep(0.5)  # let background work of the previous run settle
    if router is not None:
        m.rss_before = router.rss()
        cpu0, sys0 = router.cpu(), router.sys_cpu()
    up0 = upstream_cpu() if upstream_cpu else 0.0
    spy = None
    if profile is not None and router is not None:
        spy = _start_profiler(router.pid, profile)
    jobs = _jobs(target, scen, workers)
    results, samples = _run_jobs(jobs, target, True)
    if spy is not None:
        _stop_profiler(spy)
    if router is not None:
        m.router_cpu_s = router.cpu() - cpu0
        m.router_sys_s = router.sys_cpu() - sys0
        m.rss_after = router.rss()
    m.upstream_cpu_s = (upstream_cpu() - up0) if upstream_cpu else 0.0
    ttft: list[float] = []
    itl = array("d")
    for r in results:
        ttft += r.ttft
        itl.frombytes(r.itl)
        m.tokens += r.tokens
        m.events += r.events
        m.ok += r.ok
        m.client_cpu_s += r.cpu_s
        for k, v in r.errors.items():
            m.errors[k] = m.errors.get(k, 0) + v
    m.requests = m.ok + sum(m.errors.values())
    starts = [r.t_start for r in results if r.t_start]
    ends = [r.t_end for r in results if r.t_end]
    if starts and ends:
        m.wall_s = max(ends) - min(starts)
        m.tok_s = m.tokens / m.wall_s if m.wall_s > 0 else 0.0
    m.ttft_p50, m.ttft_p99 = _pct(ttft, 0.5), _pct(ttft, 0.99)
    m.itl_p50, m.itl_p99 = _pct(itl, 0.5), _pct(itl, 0.99)
    if m.tokens:
        if m.router_cpu_s is not None:
            m.cpu_per_1k = m.router_cpu_s / m.tokens * 1000
        m.client_cpu_per_1k = m.client_cpu_s / m.tokens * 1000
    if samples and router is not None:
        m.rss_peak = max(s[1] for s in samples)
        m.open_peak = max(s[2] for s in samples)
        if scen.idle and m.open_peak and m.rss_before is not None:
            # RSS while (nearly) all streams are open
            near = [s for s in samples if s[2] >= 0.95 * m.open_peak]
            best = max(near, key=lambda s: s[1])
            m.rss_per_stream = (best[1] - m.rss_before) / best[2]
    elif samples:
        m.open_peak = max(s[2] for s in samples)
    return m


def _start_profiler(pid: int, out: Path):
    import shutil
    import sys

    spy = shutil.which("py-spy") or str(Path(sys.executable).parent / "py-spy")
    out.parent.mkdir(parents=True, exist_ok=True)
    fmt = {".json": "speedscope", ".txt": "raw"}.get(out.suffix, "flamegraph")
    return subprocess.Popen([spy, "record", "--pid", str(pid), "--rate", "200", "--format", fmt, "-o", str(out),
                             "--subprocesses"], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)


def _stop_profiler(p: subprocess.Popen) -> None:
    import signal

    p.send_signal(signal.SIGINT)
    try:
        p.wait(30)
    except subprocess.TimeoutExpired:
        p.kill()

