"""What reloading a large tenants file costs the streams that run meanwhile.

Starts a real router (``tests.helpers.RouterProcess``, on loopback) with one
sim replica (10 ms a token). ``--streams`` streams run (one token per event)
and the client stamps every event; while they do, the tenants file is
rewritten and reloaded (``POST /admin/reload``) in three steps:

* ``add``:    from 2 tenants to ``--tenants`` (each with a key, a weight and
  a ``limits`` entry, as an admin's generated file has them)
* ``change``: every tenant's weight and limits changed
* ``remove``: back to the 2 tenants

Each step reports the reload's own time (the admin request's answer) and
the streams' longest gap between two events while it ran, next to the
longest gap of a quiet window before (``none``). Bounded: one router start,
``--rounds`` rounds of the three steps.

    .venv/bin/python ops/bench_reload.py [--tenants 5000] [--rounds 3]
"""

from __future__ import annotations

import argparse
import asyncio
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import httpx  # noqa: E402

from router.auth import hash_key  # noqa: E402
from tests.helpers import ADMIN, MODEL, RouterProcess, aiter_sse  # noqa: E402

KEY = "fs-reload-a"


def tenants_text(n: int, *, weight: int = 1, rpm: int = 600) -> str:
    """A tenants file of ``n`` generated tenants plus ``a`` (the streams'),
    each with a key, a weight and a ``limits`` entry: ~160 bytes a tenant."""
    lines = [f"admin_keys: [{hash_key(ADMIN)}]", "tenants:",
             f"  a: {{keys: [{hash_key(KEY)}], weight: 1}}"]
    for i in range(n):
        lines.append(f"  t{i:05d}:\n    keys: [{hash_key(f'fs-gen-{i}')}]\n    weight: {weight + i % 3}\n"
                     f"    limits: {{requests_per_minute: {rpm}, max_concurrent: 8}}")
    return "\n".join(lines) + "\n"


async def _stream(client: httpx.AsyncClient, stamps: list[float], tokens: int) -> None:
    async with client.stream("POST", "/v1/completions", headers={"Authorization": f"Bearer {KEY}"},
                             json={"model": MODEL, "prompt": "Le caf", "max_tokens": tokens, "stream": True,
                                   "ignore_eos": True}) as r:
        assert r.status_code == 200, await r.aread()
        async for ev in aiter_sse(r):
            stamps.append(time.perf_counter())


def longest_gap(streams: list[list[float]], start: float, end: float) -> float:
    """The longest gap between two events of one stream, of those that end in [start, end]."""
    gaps = [b - a for s in streams for a, b in zip(s, s[1:]) if start <= b <= end]
    return max(gaps, default=0.0)


async def reload_step(client: httpx.AsyncClient, path: Path, text: str, streams: int) -> tuple[float, float]:
    """Write ``text`` and reload it while ``streams`` streams run: (the
    reload's own time, the streams' longest gap during it)."""
    stamps: list[list[float]] = [[] for _ in range(streams)]
    tasks = [asyncio.create_task(_stream(client, s, 400)) for s in stamps]
    await asyncio.sleep(0.5)
    path.write_text(text)
    t0 = time.perf_counter()
    r = await client.post("/admin/reload", headers={"Authorization": f"Bearer {ADMIN}"}, timeout=120)
    took = time.perf_counter() - t0
    assert r.status_code == 200 and r.json()["changed"], r.text
    await asyncio.sleep(1.0)  # (what a reload leaves for the loop after its answer: metric series)
    end = time.perf_counter()
    for t in tasks:
        t.cancel()
    await asyncio.gather(*tasks, return_exceptions=True)
    return took, longest_gap(stamps, t0, end)


async def quiet(client: httpx.AsyncClient, streams: int) -> float:
    stamps: list[list[float]] = [[] for _ in range(streams)]
    tasks = [asyncio.create_task(_stream(client, s, 400)) for s in stamps]
    await asyncio.sleep(0.5)
    t0 = time.perf_counter()
    await asyncio.sleep(1.5)
    for t in tasks:
        t.cancel()
    await asyncio.gather(*tasks, return_exceptions=True)
    return longest_gap(stamps, t0, time.perf_counter())


async def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--tenants", type=int, default=5000)
    ap.add_argument("--streams", type=int, default=4)
    ap.add_argument("--rounds", type=int, default=3)
    args = ap.parse_args()
    with tempfile.TemporaryDirectory(prefix="fs-reload-") as tmp:
        path = Path(tmp) / "tenants.yaml"
        small = tenants_text(1)
        big = tenants_text(args.tenants)
        changed = tenants_text(args.tenants, weight=2, rpm=1200)
        path.write_text(small)
        print(f"{args.tenants} tenants: {len(big.encode()) / 1000:.0f} KB; {args.streams} streams at 10 ms a token")
        router = RouterProcess(Path(tmp) / "r", replicas=1, tenants=path,
                               sim={"step_base_ms": 10, "max_num_seqs": 64}).start()
        try:
            async with httpx.AsyncClient(base_url=router.base_url, timeout=60) as client:
                for rnd in range(args.rounds):
                    row = [f"none {await quiet(client, args.streams) * 1000:4.0f} ms"]
                    for step, text in (("add", big), ("change", changed), ("remove", small)):
                        took, gap = await reload_step(client, path, text, args.streams)
                        row.append(f"{step} {gap * 1000:4.0f} ms (reload {took:.2f} s)")
                    print(f"round {rnd + 1}: longest gap: " + ", ".join(row), flush=True)
        finally:
            router.stop()


if __name__ == "__main__":
    asyncio.run(main())
