"""What one tenant's large request bodies cost another tenant's streams.

Starts a real router (``tests.helpers.RouterProcess``, on loopback) with two
sim replicas, one per model, so that the replica that serves the large
requests is not the one that streams to the other tenant: what is measured
is the router. Tenant ``a`` keeps ``--streams`` streams running (one token
per event) and the client stamps every event; tenant ``b`` sends ``--bodies``
concurrent large valid requests, ``--rounds`` times, while it does. The
report gives the other tenant's longest and p99 gap between two events of a
stream, without and with the large bodies, and how long the large requests
took. Kinds of large body (``--kind``, about 4 MB each, under the default
``max_body_bytes`` of 4 MiB):

* ``stop``:   a completion with 400,000 ``stop_token_ids``
* ``chat``:   a chat completion with 120,000 messages
* ``gzip``:   that chat body sent gzip-encoded
* ``prompt``: a completion whose prompt is 400,000 token ids
* ``kwargs``: a chat whose ``chat_template_kwargs`` are 1.2 MB of lists
  nested 30 levels deep (a 400 since the router limits their size)
* ``parts``:  a chat of one message of 150,000 text content parts
* ``parts75``: a chat of 2,000 messages of 75 text content parts each

    .venv/bin/python ops/bigbody.py --kind stop --bodies 6 --rounds 3

Bounded: two windows of ``--window`` seconds plus the router's start.
"""

from __future__ import annotations

import argparse
import asyncio
import gzip
import hashlib
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import httpx  # noqa: E402
import yaml  # noqa: E402

from tests.helpers import RouterProcess, aiter_sse  # noqa: E402

KEY_A, KEY_B = "fs-bigbody-a", "fs-bigbody-b"
MODEL_A, MODEL_B = "model-a", "model-b"


def _tenants(path: Path) -> Path:
    roomy = {"requests_per_minute": 0, "tokens_per_minute": 0, "max_concurrent": 0, "max_prompt_tokens": 0,
             "max_tokens": 0}
    path.write_text(yaml.safe_dump({
        "priority_classes": ["normal"],
        "defaults": {"priority": "normal", "weight": 1, "models": ["*"], "limits": roomy,
                     "timeouts": {"queue_wait": 60, "first_token": 60, "stall": 30, "total": 600},
                     "queue_depth": 128, "on_limit": "queue"},
        "tenants": {
            "a": {"keys": [hashlib.sha256(KEY_A.encode()).hexdigest()], "chunk_tokens": 1},
            "b": {"keys": [hashlib.sha256(KEY_B.encode()).hexdigest()]},
        },
    }))
    return path


def big_body(kind: str) -> tuple[str, bytes, dict[str, str]]:
    """(path, body, headers) of one large valid request of ``kind``."""
    if kind == "stop":
        body = {"model": MODEL_B, "prompt": "hello", "max_tokens": 1,
                "stop_token_ids": [1_000_000 + i for i in range(400_000)]}
        return "/v1/completions", json.dumps(body).encode(), {}
    if kind == "prompt":
        body = {"model": MODEL_B, "prompt": [i % 250 for i in range(400_000)], "max_tokens": 1}
        return "/v1/completions", json.dumps(body).encode(), {}
    chat: dict = {"model": MODEL_B, "max_tokens": 1}
    if kind == "kwargs":
        leaf: list = [0]
        for _ in range(29):
            leaf = [leaf]
        chat.update(messages=[{"role": "user", "content": "hi"}], chat_template_kwargs={"x": [leaf] * 19_500})
    elif kind == "parts":
        chat["messages"] = [{"role": "user", "content": [{"type": "text", "text": "p"}] * 150_000}]
    elif kind == "parts75":
        chat["messages"] = [{"role": "user", "content": [{"type": "text", "text": "p"}] * 75} for _ in range(2_000)]
    else:
        chat["messages"] = [{"role": "user", "content": f"m{i % 100}"} for i in range(120_000)]
    raw = json.dumps(chat, separators=(",", ":")).encode()
    if kind != "gzip":
        return "/v1/chat/completions", raw, {}
    return "/v1/chat/completions", gzip.compress(raw, 6), {"content-encoding": "gzip"}


async def _stream(client: httpx.AsyncClient, i: int, gaps: list[float], stop: asyncio.Event) -> None:
    while not stop.is_set():
        body = {"model": MODEL_A, "prompt": f"stream {i}", "max_tokens": 4000, "ignore_eos": True,
                "stream": True}
        last = None
        async with client.stream("POST", "/v1/completions", json=body,
                                 headers={"authorization": f"Bearer {KEY_A}"}) as r:
            r.raise_for_status()
            async for _ in aiter_sse(r):
                now = time.monotonic()
                if last is not None:  # (from the first event on: the wait for it is no gap)
                    gaps.append(now - last)
                last = now
                if stop.is_set():
                    break


async def _send(base_url: str, kind: str, bodies: int, rounds: int) -> None:
    """Tenant b's side (its own process: writing megabytes from the process
    that stamps tenant a's events would delay the stamps): prints one JSON
    line, [seconds, status] per request."""
    path, body, headers = big_body(kind)
    headers = {"authorization": f"Bearer {KEY_B}", "content-type": "application/json", **headers}
    done: list[tuple[float, int]] = []
    async with httpx.AsyncClient(base_url=base_url, timeout=120, limits=httpx.Limits(max_connections=bodies)) as c:

        async def one() -> None:
            t0 = time.monotonic()
            r = await c.post(path, content=body, headers=headers)
            done.append((time.monotonic() - t0, r.status_code))

        for _ in range(rounds):
            await asyncio.gather(*(one() for _ in range(bodies)))
    print(json.dumps(done), flush=True)


async def _big(base_url: str, kind: str, bodies: int, rounds: int, took: list[float], statuses: list[int]) -> None:
    proc = await asyncio.create_subprocess_exec(
        sys.executable, __file__, "--send", base_url, "--kind", kind, "--bodies", str(bodies),
        "--rounds", str(rounds), stdout=asyncio.subprocess.PIPE)
    out, _ = await proc.communicate()
    if proc.returncode:
        raise RuntimeError(f"the sender failed ({proc.returncode})")
    for t, status in json.loads(out):
        took.append(t)
        statuses.append(status)


def _summary(gaps: list[float]) -> str:
    if len(gaps) < 2:
        return "no gaps"
    q = statistics.quantiles(gaps, n=100)
    return (f"{len(gaps)} gaps, max {max(gaps) * 1000:.0f} ms, p99 {q[98] * 1000:.1f} ms, "
            f"p50 {q[49] * 1000:.1f} ms")


async def measure(base_url: str, kind: str, streams: int, bodies: int, rounds: int, window: float) -> dict:
    limits = httpx.Limits(max_connections=streams + 4)
    async with httpx.AsyncClient(base_url=base_url, timeout=120, limits=limits) as client:
        out: dict = {}
        for phase in ("without", "with"):
            gaps: list[float] = []
            stop = asyncio.Event()
            tasks = [asyncio.create_task(_stream(client, i, gaps, stop)) for i in range(streams)]
            await asyncio.sleep(1.0)  # (the streams under way)
            gaps.clear()
            took: list[float] = []
            statuses: list[int] = []
            t0 = time.monotonic()
            if phase == "with":
                await _big(base_url, kind, bodies, rounds, took, statuses)
            await asyncio.sleep(max(0.0, window - (time.monotonic() - t0)))
            stop.set()
            await asyncio.gather(*tasks)
            out[phase] = (list(gaps), took, statuses)
        return out


def main() -> None:
    p = argparse.ArgumentParser(prog="ops/bigbody.py", description=__doc__.split("\n\n")[0])
    p.add_argument("--kind", choices=["stop", "chat", "gzip", "prompt", "kwargs", "parts", "parts75"], default="stop")
    p.add_argument("--bodies", type=int, default=6, help="large requests sent at once")
    p.add_argument("--rounds", type=int, default=3, help="times the large requests are sent")
    p.add_argument("--streams", type=int, default=4, help="the other tenant's streams")
    p.add_argument("--window", type=float, default=6.0, help="seconds of each measured window (at least)")
    p.add_argument("--send", metavar="URL", help=argparse.SUPPRESS)  # (the sender's own process)
    a = p.parse_args()
    if a.send:
        asyncio.run(_send(a.send, a.kind, a.bodies, a.rounds))
        return
    path, body, _ = big_body(a.kind)
    print(f"{a.kind}: {len(body):,} bytes to {path}, {a.bodies} at once, {a.rounds} rounds", flush=True)
    with tempfile.TemporaryDirectory(prefix="bigbody-") as d:
        sim = {"seed": 0, "max_model_len": 10_000_000, "kv_cache_tokens": 20_000_000,
               "max_num_batched_tokens": 10_000_000}
        router = RouterProcess(Path(d), tenants=_tenants(Path(d) / "tenants.yaml"), settings={"replicas": [
            {"name": "sim-a", "engine": "sim", "config": {**sim, "model": MODEL_A}},
            # (its default max_model_len: a prompt of 120,000 messages is refused
            # once tokenized, not prefilled for seconds on the cores the router has)
            {"name": "sim-b", "engine": "sim", "config": {"seed": 0, "model": MODEL_B}},
        ]})
        router.replica_names = ["sim-a", "sim-b"]
        router.start()
        try:
            res = asyncio.run(measure(router.base_url, a.kind, a.streams, a.bodies, a.rounds, a.window))
        finally:
            router.stop(check=False)
    for phase, (gaps, took, statuses) in res.items():
        print(f"other tenant's gaps {phase} large bodies: {_summary(gaps)}")
        if took:
            codes = sorted(set(statuses))
            print(f"  large requests: {len(took)}, status {codes}, each took {min(took):.2f}-{max(took):.2f} s")


if __name__ == "__main__":
    main()
