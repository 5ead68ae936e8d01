"""A large tenants file reloaded while a stream runs: parsed in a child
process, not in the router's (where its parse paused every stream 0.3-0.8 s
on a loaded host), and its metric series added and removed a batch per loop
turn. The stream's pauses are measured by ops/bench_reload.py (README)."""

from __future__ import annotations

import asyncio
import time

import httpx

from ops.bench_reload import KEY, longest_gap, tenants_text
from tests.helpers import ADMIN, MODEL, RouterProcess, aiter_sse, apoll, children, cmdline

ADMIN_AUTH = {"Authorization": f"Bearer {ADMIN}"}


async def test_a_large_tenants_file_is_parsed_in_a_child_process_while_a_stream_runs(tmp_path):
    t = tmp_path / "tenants.yaml"
    small, big = tenants_text(1), tenants_text(3000)
    t.write_text(small)
    router = RouterProcess(tmp_path / "r", replicas=1, tenants=t, sim={"step_base_ms": 10}).start()
    try:
        async with httpx.AsyncClient(base_url=router.base_url, timeout=60) as client:
            stamps: list[float] = []

            async def stream() -> None:
                async with client.stream("POST", "/v1/completions", headers={"Authorization": f"Bearer {KEY}"},
                                         json={"model": MODEL, "prompt": "Le caf", "max_tokens": 1500,
                                               "stream": True, "ignore_eos": True}) as r:
                    assert r.status_code == 200
                    async for _ in aiter_sse(r):
                        stamps.append(time.perf_counter())

            running = asyncio.create_task(stream())
            await apoll(lambda: len(stamps) > 5, 20, what="the stream's first events")
            start = time.perf_counter()
            for text, tenants in ((big, 3001), (small, 2)):
                t.write_text(text)
                reload = asyncio.create_task(client.post("/admin/reload", headers=ADMIN_AUTH))
                parsers: set[int] = set()
                while not reload.done():  # (the parse of 3,000 tenants takes ~0.5 s or more)
                    parsers.update(pid for pid in children(router.pid)
                                   if "router.tenants_parse" in cmdline(pid))
                    await asyncio.sleep(0.01)
                r = await reload
                assert r.status_code == 200 and r.json()["changed"], r.text
                assert parsers, "the file was parsed in the router's own process"
                view = (await client.get("/admin/tenants", headers=ADMIN_AUTH)).json()
                assert len(view["tenants"]) == tenants
            await asyncio.sleep(1.0)  # (the metric series of the tenants removed go meanwhile, a batch a turn)
            assert not running.done()
            end = time.perf_counter()
            running.cancel()
            await asyncio.gather(running, return_exceptions=True)
            # (a loose bound for a loaded host: ops/bench_reload.py measures it)
            assert longest_gap([stamps], start, end) < 1.0
            # the removed tenants' series have left /metrics (scraped after: a
            # scrape of 3,000 tenants' series is itself long)
            gone = 'tenant="t00001"'
            await apoll(lambda: _scrape(client, gone), 30, what="the removed tenants' series to go")
    finally:
        router.stop()


async def _scrape(client: httpx.AsyncClient, gone: str) -> bool:
    return gone not in (await client.get("/metrics")).text
