"""What the router adds to a token stream: TTFT, inter-token latency and CPU.

Starts a router with two fast ``sim`` replicas on loopback and, in the same
run, streams N concurrent requests of T tokens

* **direct**: straight to the router's own two replica processes over the
  replica protocol (``replicas.client.connect`` + ``generate``; streams spread
  round-robin), and
* **router**: through the router's HTTP API (``/v1/completions``, SSE), with
  an httpx async client (not the openai SDK, to keep client CPU low),

alternating the two for ``--rounds`` rounds after a warm-up, and prints a
markdown table: TTFT p50/p99, inter-token latency p50/p99 (each event's gap
spread over the tokens it carries, as the router's own histogram does), the
router's added TTFT/ITL, tokens/s, and the router's CPU seconds per 1000
tokens (``/proc/<pid>/stat`` utime+stime around the router rounds). Values
are medians over rounds. Both paths use the same replica processes, so the
difference is the router (HTTP parsing, auth, admission, scheduling, relay,
SSE encoding) and the HTTP client.

    python ops/bench_core.py --streams 64 --tokens 128 --rounds 3

Bounded: at most 1024 streams and 4000 tokens per stream, every round has a
deadline, everything listens on 127.0.0.1 or a Unix socket in a temp dir.
"""

from __future__ import annotations

import argparse
import asyncio
import hashlib
import json
import os
import secrets
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

import httpx
import msgspec

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:  # run as a script from anywhere
    sys.path.insert(0, str(ROOT))

from replicas.client import ReplicaClient, connect  # noqa: E402
from replicas.protocol import FinishReason, SamplingParams  # noqa: E402

__all__ = ["main"]

MODEL = "fairstream-sim"
_CLK_TCK = os.sysconf("SC_CLK_TCK")


# -- measurements -------------------------------------------------------------------


@dataclass
class StreamStats:
    ttft: float = 0.0
    gaps: list[float] = field(default_factory=list)  # one entry per token after the first
    tokens: int = 0
    events: int = 0  # arrivals that carried tokens


@dataclass
class RoundStats:
    streams: list[StreamStats]
    wall: float
    router_cpu: float | None = None
    queue_wait: float | None = None  # mean seconds requests waited in the router's queue

    @property
    def tokens(self) -> int:
        return sum(s.tokens for s in self.streams)

    @property
    def tokens_per_event(self) -> float:
        return self.tokens / max(1, sum(s.events for s in self.streams))

    def ttft(self, q: float) -> float:
        return _quantile([s.ttft for s in self.streams], q)

    def itl(self, q: float) -> float:
        return _quantile([g for s in self.streams for g in s.gaps], q)


def _quantile(values: list[float], q: float) -> float:
    if not values:
        return float("nan")
    v = sorted(values)
    return v[min(len(v) - 1, int(q * len(v)))]


class _Clock:
    """Records one stream's arrivals: ``event(n)`` when n tokens arrive together."""

    def __init__(self, start: float) -> None:
        self.start = start
        self.last: float | None = None
        self.stats = StreamStats()

    def event(self, n: int) -> None:
        if n <= 0:
            return
        now = time.perf_counter()
        if self.last is None:
            # tokens that came with the first one have no gap of their own
            self.stats.ttft = now - self.start
        else:
            self.stats.gaps.extend([(now - self.last) / n] * n)
        self.last = now
        self.stats.tokens += n
        self.stats.events += 1


# -- the two paths ---------------------------------------------------------------------


def _prompt(i: int) -> str:
    return f"Stream {i:04d}: The "


async def _direct_stream(client: ReplicaClient, i: int, tokens: int) -> StreamStats:
    params = SamplingParams(max_tokens=tokens, temperature=0.0, ignore_eos=True)
    clock = _Clock(time.perf_counter())
    col = client.generate(params, prompt=_prompt(i))
    try:
        while True:
            ids, _text, finish = await col.get()
            clock.event(len(ids))
            if finish != FinishReason.NONE:
                if finish != FinishReason.LENGTH:
                    raise RuntimeError(f"direct stream {i} ended with {finish.name}: {col.error}")
                break
    finally:
        client.release(col)
    return clock.stats


_Event = msgspec.json.Decoder()


async def _router_stream(http: httpx.AsyncClient, i: int, tokens: int) -> StreamStats:
    body = {
        "model": MODEL, "prompt": _prompt(i), "max_tokens": tokens, "temperature": 0, "ignore_eos": True,
        "stream": True, "stream_options": {"include_usage": True},
    }
    clock = _Clock(time.perf_counter())
    usage = None
    buf = b""
    async with http.stream("POST", "/v1/completions", json=body) as r:
        if r.status_code != 200:
            raise RuntimeError(f"router stream {i}: HTTP {r.status_code} {(await r.aread())[:200]!r}")
        async for chunk in r.aiter_raw():
            buf += chunk
            while b"\n\n" in buf:
                raw, buf = buf.split(b"\n\n", 1)
                data = raw[raw.find(b"data: ") + 6 :]
                if data == b"[DONE]":
                    continue
                ev = _Event.decode(data)
                if "error" in ev:
                    raise RuntimeError(f"router stream {i}: {ev['error']}")
                if ev.get("usage"):
                    usage = ev["usage"]
                for choice in ev["choices"]:
                    # the sim's tokens are bytes; a character's bytes may be
                    # held back one event, the total is exact
                    clock.event(len(choice["text"].encode()))
    if usage is None or usage["completion_tokens"] != tokens:
        raise RuntimeError(f"router stream {i}: usage {usage}, expected {tokens} completion tokens")
    clock.stats.tokens = tokens
    return clock.stats


async def _round(kind: str, n: int, tokens: int, clients: list[ReplicaClient], http: httpx.AsyncClient,
                 router_pid: int, deadline: float) -> RoundStats:
    q0 = await _queue_wait(http)
    cpu0 = _cpu(router_pid)
    t0 = time.perf_counter()
    if kind == "direct":
        coros = [_direct_stream(clients[i % len(clients)], i, tokens) for i in range(n)]
    else:
        coros = [_router_stream(http, i, tokens) for i in range(n)]
    streams = await asyncio.wait_for(asyncio.gather(*coros), deadline)
    wall = time.perf_counter() - t0
    cpu = _cpu(router_pid) - cpu0
    q1 = await _queue_wait(http)
    waited = (q1[0] - q0[0]) / (q1[1] - q0[1]) if q1[1] > q0[1] else None
    return RoundStats(list(streams), wall, cpu, waited)


async def _queue_wait(http: httpx.AsyncClient) -> tuple[float, float]:
    """(sum, count) of the router's ``fairstream_queue_wait_seconds`` histogram."""
    r = await http.get("/metrics")
    total = count = 0.0
    for line in r.text.splitlines():
        if line.startswith("fairstream_queue_wait_seconds_sum"):
            total += float(line.rsplit(" ", 1)[1])
        elif line.startswith("fairstream_queue_wait_seconds_count"):
            count += float(line.rsplit(" ", 1)[1])
    return total, count


# -- processes ---------------------------------------------------------------------------


def _cpu(pid: int) -> float:
    raw = Path(f"/proc/{pid}/stat").read_text()
    fields = raw[raw.rindex(")") + 2 :].split()
    return (int(fields[11]) + int(fields[12])) / _CLK_TCK


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _replica_sockets(router_pid: int) -> list[str]:
    """Unix sockets of the router's replica children (from their command lines)."""
    out = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            raw = Path(f"/proc/{entry}/stat").read_text()
            ppid = int(raw[raw.rindex(")") + 2 :].split()[1])
            if ppid != router_pid:
                continue
            args = Path(f"/proc/{entry}/cmdline").read_bytes().decode().split("\0")
        except (FileNotFoundError, ProcessLookupError, ValueError):
            continue
        if "--socket" in args:
            out.append(args[args.index("--socket") + 1])
    return sorted(out)


class Router:
    """A router with two sim replicas in a temp dir (removed on close)."""

    def __init__(self, step_ms: float, replicas: int) -> None:
        self.dir = Path(tempfile.mkdtemp(prefix="fsb-"))
        self.key = "bench-" + secrets.token_hex(8)
        digest = hashlib.sha256(self.key.encode()).hexdigest()
        (self.dir / "tenants.yaml").write_text(f"tenants:\n  bench:\n    keys: [{digest}]\n")
        sim = {"model": MODEL, "seed": 0, "step_base_ms": step_ms, "max_num_seqs": 1024}
        config = {
            "host": "127.0.0.1", "tenants": "tenants.yaml",
            "replicas": [{"name": f"sim-{i}", "engine": "sim", "config": sim} for i in range(replicas)],
        }
        (self.dir / "router.yaml").write_text(json.dumps(config))  # JSON is YAML
        self.port = _free_port()
        self.base_url = f"http://127.0.0.1:{self.port}"
        self.log = open(self.dir / "router.log", "wb")
        env = dict(os.environ, TMPDIR=str(self.dir))
        self.proc = subprocess.Popen(
            [sys.executable, "-c", "from router.cli import main; main()", "serve",
             "--config", str(self.dir / "router.yaml"), "--host", "127.0.0.1", "--port", str(self.port)],
            cwd=self.dir, env=env, stdout=self.log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
        )
        self.replicas = replicas

    def wait_ready(self, timeout: float = 60.0) -> None:
        end = time.monotonic() + timeout
        while time.monotonic() < end:
            if self.proc.poll() is not None:
                raise RuntimeError(f"router exited: {(self.dir / 'router.log').read_text()[-2000:]}")
            try:
                r = httpx.get(self.base_url + "/ready", timeout=2)
                if r.status_code == 200 and sum(v == "ready" for v in r.json()["replicas"].values()) == self.replicas:
                    return
            except httpx.HTTPError:
                pass
            time.sleep(0.1)
        raise RuntimeError("router not ready in time")

    def close(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(15)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(5)
        self.log.close()
        shutil.rmtree(self.dir, ignore_errors=True)


# -- main ---------------------------------------------------------------------------------


async def _run(args: argparse.Namespace, router: Router) -> dict[str, list[RoundStats]]:
    sockets = _replica_sockets(router.proc.pid)
    if len(sockets) != args.replicas:
        raise RuntimeError(f"found replica sockets {sockets}")
    clients = [await connect(f"direct-{i}", "unix:" + p, timeout=10) for i, p in enumerate(sockets)]
    limits = httpx.Limits(max_connections=args.streams + 8, max_keepalive_connections=args.streams + 8)
    headers = {"authorization": f"Bearer {router.key}"}
    results: dict[str, list[RoundStats]] = {"direct": [], "router": []}
    try:
        async with httpx.AsyncClient(base_url=router.base_url, headers=headers, limits=limits,
                                     timeout=httpx.Timeout(args.deadline)) as http:
            # warm-up: open the HTTP connections, fill caches
            for kind in ("direct", "router"):
                await _round(kind, args.streams, min(args.tokens, 16), clients, http, router.proc.pid, args.deadline)
            for r in range(args.rounds):
                order = ("direct", "router") if r % 2 == 0 else ("router", "direct")
                for kind in order:
                    results[kind].append(
                        await _round(kind, args.streams, args.tokens, clients, http, router.proc.pid, args.deadline)
                    )
    finally:
        for c in clients:
            await c.close()
    return results


def _median(rounds: list[RoundStats], f) -> float:
    return statistics.median(f(r) for r in rounds)


def report(args: argparse.Namespace, results: dict[str, list[RoundStats]], client_cpu: float) -> str:
    ms = 1000.0
    rows = []
    summary = {}
    for kind, label in (("direct", "direct (replica protocol)"), ("router", "via router (HTTP/SSE)")):
        rounds = results[kind]
        s = {
            "ttft50": _median(rounds, lambda r: r.ttft(0.5)) * ms,
            "ttft99": _median(rounds, lambda r: r.ttft(0.99)) * ms,
            "itl50": _median(rounds, lambda r: r.itl(0.5)) * ms,
            "itl99": _median(rounds, lambda r: r.itl(0.99)) * ms,
            "tps": _median(rounds, lambda r: r.tokens / r.wall),
            "tpe": _median(rounds, lambda r: r.tokens_per_event),
        }
        summary[kind] = s
        rows.append(f"| {label} | {s['ttft50']:.2f} | {s['ttft99']:.2f} | {s['itl50']:.3f} | {s['itl99']:.3f} "
                    f"| {s['tpe']:.2f} | {s['tps']:.0f} |")
    d, r = summary["direct"], summary["router"]
    rows.append(f"| **router adds** | {r['ttft50'] - d['ttft50']:+.2f} | {r['ttft99'] - d['ttft99']:+.2f} "
                f"| {r['itl50'] - d['itl50']:+.3f} | {r['itl99'] - d['itl99']:+.3f} "
                f"| | {100 * (r['tps'] / d['tps'] - 1):+.0f}% |")
    cpu_per_k = _median(results["router"], lambda x: x.router_cpu / x.tokens * 1000)
    idle_cpu_per_k = _median(results["direct"], lambda x: x.router_cpu / x.tokens * 1000)
    head = (
        f"fairstream bench_core: {args.streams} concurrent streams x {args.tokens} tokens, "
        f"{args.rounds} rounds (median), {args.replicas} sim replicas at step_base_ms={args.step_ms}, "
        f"{os.cpu_count()} CPUs, Python {sys.version.split()[0]}\n"
    )
    table = "\n".join([
        "| path | TTFT p50 (ms) | TTFT p99 (ms) | ITL p50 (ms) | ITL p99 (ms) | tokens/event | tokens/s |",
        "|---|---:|---:|---:|---:|---:|---:|",
        *rows,
    ])
    waits = [x.queue_wait for x in results["router"] if x.queue_wait is not None]
    lines = [
        "",
        "",
        "ITL: each arrival's gap spread over the tokens it carries; events that arrive in one read "
        "count as ~0 gaps, and the router merges up to the tenant's chunk_tokens per event when its "
        "client lags (tokens/event > 1): both lower ITL p50 and show up as bursts in p99.",
    ]
    if waits:
        lines.append(f"router queue wait (mean per request, part of TTFT): {statistics.median(waits) * ms:.1f} ms")
    lines += [
        f"router CPU: {cpu_per_k:.3f} s per 1000 tokens streamed through it ({idle_cpu_per_k:.3f} s per "
        "1000 tokens while idle during direct rounds: health pings, load reports)",
        f"benchmark client CPU (both paths, all rounds): {client_cpu:.2f} s",
    ]
    tail = "\n".join(lines)
    return head + "\n" + table + tail


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--streams", type=int, default=64, help="concurrent streams per round (default 64)")
    p.add_argument("--tokens", type=int, default=128, help="tokens per stream (default 128)")
    p.add_argument("--rounds", type=int, default=3, help="measured rounds per path (default 3)")
    p.add_argument("--step-ms", type=float, default=2.0, help="sim step_base_ms (default 2)")
    p.add_argument("--replicas", type=int, default=2, help="sim replicas (default 2)")
    p.add_argument("--deadline", type=float, default=120.0, help="seconds one round may take (default 120)")
    args = p.parse_args(argv)
    if not (1 <= args.streams <= 1024 and 1 <= args.tokens <= 4000 and 1 <= args.rounds <= 20
            and 1 <= args.replicas <= 8):
        p.error("bounds: 1-1024 streams, 1-4000 tokens, 1-20 rounds, 1-8 replicas")
    router = Router(args.step_ms, args.replicas)
    try:
        router.wait_ready()
        cpu0 = time.process_time()
        try:
            import uvloop

            results = uvloop.run(_run(args, router))
        except ImportError:  # pragma: no cover
            results = asyncio.run(_run(args, router))
        client_cpu = time.process_time() - cpu0
    finally:
        router.close()
    print(report(args, results, client_cpu))


if __name__ == "__main__":
    main()
