"""Scheduler benchmark: the same overload against four router configurations.

    .venv/bin/python ops/bench_scheduler.py [--seconds 20] [--runs 2]

Not a test: it measures and prints. One run starts a real router (``fairstream
serve``) with two local ``sim`` replicas on loopback, drives it with
closed-loop streaming clients of three tenants for a bounded time, scrapes
``/metrics`` and stops it. Every configuration runs ``--runs`` times (at least
two) one after another:

=====================  =====================  ==========================
configuration          scheduler              per-replica in-flight cap
=====================  =====================  ==========================
fair + adaptive        priority/aging + VTC   AIMD (``batching.enabled``)
fair + fixed           priority/aging + VTC   ``max_inflight``, constant
fifo + adaptive        one global FIFO        AIMD
fifo + fixed           one global FIFO        ``max_inflight``, constant
=====================  =====================  ==========================

Workload. Tenants as in configs/tenants.yaml: gold (high, weight 3), silver
(normal, weight 1), free (low, weight 1), with no rate limits (only the
scheduler limits throughput) and long queue waits (nothing is refused).
Each keeps ``--clients`` streamed completions outstanding (``max_tokens``
fixed, ``ignore_eos``): far more than the cluster holds.

Replicas are set up so that adaptive batching matters: ``max_num_seqs`` 16
and ``step_per_seq_ms`` 2, so one engine step (= the inter-token latency)
takes 4 + 2 * running ms: 36 ms with 16 running, 20 ms with 8. The fixed cap
is 24 per replica (more than the engine runs at once: the rest waits in the
engine's own FIFO queue); the adaptive cap starts at 24 with ``target_itl``
20 ms, so the AIMD limiter has to cut it to about 8.

Reported per configuration (one column per run, then the spread max - min):
each tenant's share of the completion tokens received in the measurement
window (after ``--warmup``, until the clients stop), TTFT p50/p99 per
priority (client side, from sending the request to its first token; a
request still waiting when the run ends counts with its wait so far, a
lower bound, so starvation shows in the tail), requests completed in the
window and requests still waiting for a first token at the end, inter-token
latency p50/p90 (per completed request: (last - first token time) /
(tokens - 1)), total throughput in completion tokens/s, and the in-flight
caps the limiter settled on (``fairstream_replica_inflight_cap`` at the
end, and its mean over the window).
"""

from __future__ import annotations

import argparse
import asyncio
import hashlib
import json
import math
import os
import shutil
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import yaml

ROOT = Path(__file__).resolve().parents[1]
MODEL = "fairstream-sim"

TENANTS = {  # name: (priority, weight)
    "gold": ("high", 3),
    "silver": ("normal", 1),
    "free": ("low", 1),
}
PRIORITY = {name: prio for name, (prio, _) in TENANTS.items()}

SIM = {"max_num_seqs": 16, "step_base_ms": 4.0, "step_per_seq_ms": 2.0}
FIXED = {"enabled": False, "initial": 24, "max_inflight": 24}  # initial must lie in [min, max] even when disabled
ADAPTIVE = {
    "enabled": True, "initial": 24, "min_inflight": 2, "max_inflight": 24,
    "target_itl": 0.02, "target_ttft": 0.5, "window": 0.5, "increase": 1, "backoff": 0.8,
}
AGING = 5.0

CONFIGS: dict[str, dict[str, Any]] = {
    "fair+adaptive": {"scheduler": {"policy": "fair", "aging": AGING}, "batching": ADAPTIVE},
    "fair+fixed": {"scheduler": {"policy": "fair", "aging": AGING}, "batching": FIXED},
    "fifo+adaptive": {"scheduler": {"policy": "fifo", "aging": AGING}, "batching": ADAPTIVE},
    "fifo+fixed": {"scheduler": {"policy": "fifo", "aging": AGING}, "batching": FIXED},
}


def key_of(tenant: str) -> str:
    return f"fs-bench-sched-{tenant}"


# -- the router process ----------------------------------------------------------


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Router:
    """``fairstream serve`` with two sim replicas in a temp dir; loopback only."""

    def __init__(self, settings: dict[str, Any]) -> None:
        self.dir = Path(tempfile.mkdtemp(prefix="fsbs-"))
        (self.dir / "t").mkdir()
        tenants = {
            name: {"keys": [hashlib.sha256(key_of(name).encode()).hexdigest()], "priority": prio, "weight": w}
            for name, (prio, w) in TENANTS.items()
        }
        (self.dir / "t" / "tenants.yaml").write_text(yaml.safe_dump({
            "priority_classes": ["high", "normal", "low"],
            "defaults": {
                "limits": {"requests_per_minute": 0, "tokens_per_minute": 0, "max_concurrent": 0,
                           "max_prompt_tokens": 0, "max_tokens": 0},
                "timeouts": {"queue_wait": 120, "first_token": 180, "stall": 60, "total": 600},
                "queue_depth": 256,
                "on_limit": "reject",
            },
            "tenants": tenants,
        }, sort_keys=False))
        config = {
            "host": "127.0.0.1",
            "tenants": str(self.dir / "t" / "tenants.yaml"),
            "replicas": [
                {"name": f"sim-{i}", "engine": "sim", "config": {"model": MODEL, "seed": 0, **SIM}}
                for i in range(2)
            ],
            **settings,
        }
        (self.dir / "router.yaml").write_text(yaml.safe_dump(config, sort_keys=False))
        self.port = _free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.proc: subprocess.Popen[bytes] | None = None

    def start(self, timeout: float = 60.0) -> None:
        env = dict(os.environ, TMPDIR=str(self.dir), PYTHONUNBUFFERED="1")
        # The router and its replicas import the project from this checkout.
        env["PYTHONPATH"] = str(ROOT) + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
        self.log = open(self.dir / "router.log", "wb")
        self.proc = subprocess.Popen(
            [sys.executable, "-c", "from router.cli import main; main()", "serve",
             "--config", str(self.dir / "router.yaml"), "--host", "127.0.0.1", "--port", str(self.port)],
            cwd=self.dir, env=env, stdout=self.log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
        )
        end = time.monotonic() + timeout
        while time.monotonic() < end:
            if self.proc.poll() is not None:
                raise RuntimeError(f"router exited with {self.proc.returncode}: {self.log_tail()}")
            try:
                r = httpx.get(self.url + "/ready", timeout=2)
                if r.status_code == 200 and all(v == "ready" for v in r.json()["replicas"].values()):
                    return
            except httpx.HTTPError:
                pass
            time.sleep(0.1)
        self.stop()
        raise RuntimeError(f"router not ready after {timeout}s: {self.log_tail()}")

    def log_tail(self) -> str:
        try:
            return (self.dir / "router.log").read_text(errors="replace")[-2000:]
        except OSError:
            return ""

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(20)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(5)
        self.proc = None
        self.log.close()
        shutil.rmtree(self.dir, ignore_errors=True)


# -- load --------------------------------------------------------------------------


@dataclass
class Req:
    tenant: str
    sent: float
    status: int = 0
    first: float | None = None
    last: float | None = None
    tokens: int = 0
    done: bool = False  # saw [DONE]
    events: list[tuple[float, int]] = field(default_factory=list)  # (time, tokens)


async def one_request(client: httpx.AsyncClient, url: str, req: Req, max_tokens: int) -> None:
    """Stream one completion into ``req`` (filled as events arrive, so a
    request cut off at the end of the run still counts what it received)."""
    body = {"model": MODEL, "prompt": f"Tell {req.tenant} a story.", "max_tokens": max_tokens, "stream": True,
            "ignore_eos": True}
    async with client.stream("POST", url + "/v1/completions", json=body,
                             headers={"authorization": f"Bearer {key_of(req.tenant)}"}) as r:
        req.status = r.status_code
        if r.status_code != 200:
            await r.aread()
            return
        async for line in r.aiter_lines():
            if not line.startswith("data:"):
                continue
            data = line[5:].strip()
            if data == "[DONE]":
                req.done = True
                break
            chunk = json.loads(data)
            if "error" in chunk:
                req.status = 599
                break
            text = chunk["choices"][0].get("text") if chunk.get("choices") else None
            if text:
                now = time.monotonic()
                n = len(text.encode("utf-8"))  # the sim's tokens are bytes
                req.first = req.first or now
                req.last = now
                req.tokens += n
                req.events.append((now, n))


async def closed_loop(client, url, tenant, max_tokens, until, out: list[Req]) -> None:
    while time.monotonic() < until:
        req = Req(tenant, time.monotonic())
        out.append(req)
        try:
            await one_request(client, url, req, max_tokens)
        except httpx.HTTPError as e:
            req.status = -1
            print(f"  ({tenant}: {type(e).__name__}: {e})", file=sys.stderr)
            await asyncio.sleep(0.1)


async def scrape_caps(url: str, until: float, out: list[tuple[float, dict[str, float]]]) -> None:
    async with httpx.AsyncClient(timeout=5) as c:
        while time.monotonic() < until:
            try:
                text = (await c.get(url + "/metrics")).text
            except httpx.HTTPError:
                text = ""
            caps = {}
            for line in text.splitlines():
                if line.startswith("fairstream_replica_inflight_cap{"):
                    name = line.split('replica="', 1)[1].split('"', 1)[0]
                    caps[name] = float(line.rsplit(" ", 1)[1])
            out.append((time.monotonic(), caps))
            await asyncio.sleep(0.5)


async def drive(url: str, clients: int, seconds: float, max_tokens: int) -> tuple[list[Req], list, float]:
    reqs: list[Req] = []
    caps: list[tuple[float, dict[str, float]]] = []
    t0 = time.monotonic()
    until = t0 + seconds
    limits = httpx.Limits(max_connections=4 * clients * len(TENANTS), max_keepalive_connections=4 * clients * len(TENANTS))
    async with httpx.AsyncClient(timeout=httpx.Timeout(120.0), limits=limits) as client:
        tasks = [asyncio.create_task(closed_loop(client, url, t, max_tokens, until, reqs))
                 for _ in range(clients) for t in TENANTS]
        scraper = asyncio.create_task(scrape_caps(url, until, caps))
        await asyncio.sleep(seconds)
        # The clients stop sending now; what is running is cut off (the
        # window ends here, late requests would only measure the drain).
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, scraper, return_exceptions=True)
    return reqs, caps, t0


# -- statistics ----------------------------------------------------------------------


def pct(xs: list[float], q: float) -> float:
    if not xs:
        return float("nan")
    xs = sorted(xs)
    return xs[min(len(xs) - 1, max(0, math.ceil(q / 100 * len(xs)) - 1))]  # nearest rank


def summarize(reqs: list[Req], caps: list[tuple[float, dict[str, float]]], t0: float, seconds: float, warmup: float,
              settings: dict[str, Any]) -> dict[str, float]:
    lo, hi = t0 + warmup, t0 + seconds
    row: dict[str, float] = {}
    tokens = {t: sum(n for r in reqs if r.tenant == t for ts, n in r.events if lo <= ts <= hi) for t in TENANTS}
    total = sum(tokens.values()) or 1
    for t in TENANTS:
        row[f"share {t}"] = tokens[t] / total
    for t in TENANTS:
        row[f"completed {t}"] = sum(1 for r in reqs if r.tenant == t and r.done and r.last is not None
                                    and lo <= r.last <= hi)
    for t in TENANTS:
        # Requests still waiting for their first token when the run ends
        # count with their wait so far (a lower bound), so a starved class
        # shows up in the tail instead of vanishing from it.
        ttfts = [r.first - r.sent for r in reqs if r.tenant == t and r.first is not None and lo <= r.first <= hi]
        ttfts += [hi - r.sent for r in reqs if r.tenant == t and r.first is None and r.status in (0, 200)
                  and hi - r.sent > 0 and r.sent < hi]
        row[f"waiting at end {t}"] = sum(1 for r in reqs if r.tenant == t and r.first is None and r.status in (0, 200))
        row[f"TTFT p50 {PRIORITY[t]} (s)"] = pct(ttfts, 50)
        row[f"TTFT p99 {PRIORITY[t]} (s)"] = pct(ttfts, 99)
    itls = [(r.last - r.first) / (r.tokens - 1) for r in reqs
            if r.done and r.first is not None and r.last is not None and r.tokens > 1 and lo <= r.first]
    row["ITL p50 (ms)"] = 1000 * pct(itls, 50)
    row["ITL p90 (ms)"] = 1000 * pct(itls, 90)
    row["throughput (tok/s)"] = sum(tokens.values()) / (hi - lo)
    row["errors"] = sum(1 for r in reqs if r.status not in (0, 200))  # HTTP errors, stream errors
    if settings["batching"]["enabled"]:
        names = sorted({n for _, c in caps for n in c})
        for n in names:
            vals = [c[n] for ts, c in caps if n in c and ts >= lo]
            row[f"cap {n} end"] = caps[-1][1].get(n, float("nan")) if caps else float("nan")
            row[f"cap {n} mean"] = statistics.fmean(vals) if vals else float("nan")
    else:
        for n in ("sim-0", "sim-1"):
            row[f"cap {n} end"] = float(settings["batching"]["max_inflight"])
    return row


def fmt(v: float) -> str:
    if v != v:  # nan
        return "-"
    if abs(v) >= 100 or float(v).is_integer():
        return f"{v:.0f}"
    if abs(v) >= 10:
        return f"{v:.1f}"
    return f"{v:.3f}" if abs(v) < 1 else f"{v:.2f}"


def table(name: str, rows: list[dict[str, float]]) -> str:
    keys = list(rows[0])
    head = "| metric | " + " | ".join(f"run {i + 1}" for i in range(len(rows))) + " | spread (max-min) |"
    sep = "|---|" + "---:|" * (len(rows) + 1)
    lines = [f"### {name}", "", head, sep]
    for k in keys:
        vals = [r.get(k, float("nan")) for r in rows]
        ok = [v for v in vals if v == v]
        spread = (max(ok) - min(ok)) if ok else float("nan")
        lines.append(f"| {k} | " + " | ".join(fmt(v) for v in vals) + f" | {fmt(spread)} |")
    return "\n".join(lines)


def overview(results: dict[str, list[dict[str, float]]]) -> str:
    cols = ["share gold", "share silver", "share free", "TTFT p50 high (s)", "TTFT p50 normal (s)",
            "TTFT p50 low (s)", "TTFT p99 low (s)", "ITL p90 (ms)", "throughput (tok/s)"]
    lines = ["### overview (mean of runs)", "", "| configuration | " + " | ".join(cols) + " |",
             "|---|" + "---:|" * len(cols)]
    for name, rows in results.items():
        means = []
        for c in cols:
            vals = [r[c] for r in rows if r.get(c, float("nan")) == r.get(c, float("nan"))]
            means.append(fmt(statistics.fmean(vals)) if vals else "-")
        lines.append(f"| {name} | " + " | ".join(means) + " |")
    return "\n".join(lines)


# -- main ------------------------------------------------------------------------------


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--seconds", type=float, default=20.0, help="load time per run (default 20)")
    p.add_argument("--warmup", type=float, default=5.0, help="seconds not measured at the start of a run")
    p.add_argument("--runs", type=int, default=2, help="runs per configuration (at least 2)")
    p.add_argument("--clients", type=int, default=24, help="closed-loop clients per tenant (default 24)")
    p.add_argument("--max-tokens", type=int, default=48)
    p.add_argument("--configs", default=",".join(CONFIGS), help="comma-separated subset of " + ", ".join(CONFIGS))
    args = p.parse_args()
    # (a run measures from --warmup to --seconds: without this an empty window,
    # no clients or max_tokens 0 printed a whole table of zeros and exited 0)
    if args.warmup < 0:
        p.error("--warmup must not be negative")
    if not args.seconds > args.warmup:
        p.error(f"--seconds must be more than --warmup ({args.seconds:g} <= {args.warmup:g}): "
                "nothing would be measured")
    if args.clients < 1:
        p.error("--clients must be at least 1")
    if args.max_tokens < 1:
        p.error("--max-tokens must be at least 1")
    runs = max(2, args.runs)
    names = [c for c in args.configs.split(",") if c]
    for c in names:
        if c not in CONFIGS:
            p.error(f"unknown configuration {c!r}")

    print("# fairstream scheduler benchmark\n")
    print(f"- replicas: 2 x sim {json.dumps(SIM)} (step = 4 + 2 x running ms)")
    print("- tenants: " + ", ".join(f"{t} ({prio}, weight {w})" for t, (prio, w) in TENANTS.items())
          + f"; {args.clients} closed-loop streaming clients each, max_tokens {args.max_tokens}")
    print(f"- fixed caps: {json.dumps(FIXED)}")
    print(f"- adaptive caps: {json.dumps(ADAPTIVE)}")
    print(f"- aging {AGING:g} s; {args.seconds:g} s per run, first {args.warmup:g} s not measured; "
          f"{runs} runs per configuration")
    print(f"- machine: {os.cpu_count()} CPUs, load average {os.getloadavg()[0]:.1f} at start\n", flush=True)

    results: dict[str, list[dict[str, float]]] = {}
    for name in names:
        settings = CONFIGS[name]
        rows = []
        for i in range(runs):
            router = Router(settings)
            try:
                router.start()
                reqs, caps, t0 = asyncio.run(drive(router.url, args.clients, args.seconds, args.max_tokens))
            finally:
                router.stop()
            rows.append(summarize(reqs, caps, t0, args.seconds, args.warmup, settings))
            print(f"  {name} run {i + 1}: {rows[-1]['throughput (tok/s)']:.0f} tok/s, shares "
                  + ", ".join(f"{t} {rows[-1][f'share {t}']:.2f}" for t in TENANTS), file=sys.stderr, flush=True)
        results[name] = rows
        print(table(name, rows) + "\n", flush=True)
    print(overview(results))
    print(f"\n(load average {os.getloadavg()[0]:.1f} at the end)")


if __name__ == "__main__":
    main()
