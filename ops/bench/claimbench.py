"""Renewing a router's resume claims in Redis: one round trip per stream
(``stream_claim`` each, what the router did before) against
``stream_renew``, one pipeline per ``CLAIMS_PER_TRIP`` streams, side by side.

A router renews the claim of every stream it generates every
``RENEW_INTERVAL`` (CLAIM_TTL / 3, 3.3 s) so that a quiet live stream is not
taken over (router/resume.py). This opens ``--streams`` resume buffers in a
real redis-server (``--redis-url``, or one started here on a free loopback
port and stopped at the end), then renews all their claims ``--rounds``
times both ways and prints the medians and their ratio. Loopback only:
across hosts every round trip costs the link's latency too, so the ratio
grows with it.

``python -m ops.bench.claimbench [--streams 2000] [--rounds 5] [--redis-url redis://127.0.0.1:6379/0]``
"""

from __future__ import annotations

import argparse
import asyncio
import shutil
import socket
import statistics
import tempfile
import time
from contextlib import contextmanager
from pathlib import Path

from ops.bench.procs import Proc, free_port
from router.state.base import CLAIM_TTL
from router.state.redis_store import RedisStore

__all__ = ["measure", "main"]


async def measure(url: str, streams: int = 2000, rounds: int = 5) -> dict[str, float]:
    """Milliseconds to renew ``streams`` claims, each way (medians over
    ``rounds``), and how many claims each way renewed in its last round."""
    store = RedisStore(url, prefix=f"claimbench-{time.monotonic_ns()}")
    try:
        sids = [f"s{i}" for i in range(streams)]
        for sid in sids:
            await store.stream_open(sid, b"meta", "bench", 300)
        one, piped = [], []
        for _ in range(rounds):
            t = time.perf_counter()
            singles = [await store.stream_claim(sid, "bench", CLAIM_TTL) for sid in sids]
            one.append((time.perf_counter() - t) * 1000)
            t = time.perf_counter()
            bulk = await store.stream_renew(sids, "bench", CLAIM_TTL)
            piped.append((time.perf_counter() - t) * 1000)
        return {"streams": streams, "one_at_a_time_ms": statistics.median(one),
                "pipelined_ms": statistics.median(piped), "renewed_one_at_a_time": sum(singles),
                "renewed_pipelined": sum(bulk)}
    finally:
        await store.close()


@contextmanager
def _redis_server():
    """A throwaway redis-server on a free loopback port: its URL."""
    binary = shutil.which("redis-server")
    if binary is None:
        raise SystemExit("redis-server is not on PATH (apt-get install redis-server), or pass --redis-url")
    port = free_port()
    with tempfile.TemporaryDirectory(prefix="claimbench-") as d:
        proc = Proc("redis-server", [binary, "--port", str(port), "--bind", "127.0.0.1", "--save", "",
                                     "--appendonly", "no", "--dir", d], Path(d) / "redis.log")
        try:
            deadline = time.monotonic() + 10
            while True:
                try:
                    socket.create_connection(("127.0.0.1", port), timeout=0.2).close()
                    break
                except OSError:
                    if time.monotonic() > deadline or not proc.alive():
                        raise SystemExit(f"redis-server did not start: {proc.tail()}") from None
                    time.sleep(0.05)
            yield f"redis://127.0.0.1:{port}/0"
        finally:
            proc.stop()


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--streams", type=int, default=2000)
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--redis-url", default=None, help="an existing Redis (default: start one on loopback)")
    args = p.parse_args()
    if args.redis_url:
        r = asyncio.run(measure(args.redis_url, args.streams, args.rounds))
    else:
        with _redis_server() as url:
            r = asyncio.run(measure(url, args.streams, args.rounds))
    print(f"renewing {r['streams']} claims (median of {args.rounds}): one round trip per stream "
          f"{r['one_at_a_time_ms']:.0f} ms, pipelined {r['pipelined_ms']:.0f} ms "
          f"(x{r['one_at_a_time_ms'] / r['pipelined_ms']:.1f})")


if __name__ == "__main__":
    main()
