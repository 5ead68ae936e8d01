"""A /metrics scrape does not hold the event loop (``Metrics.expose``)."""

from __future__ import annotations

import asyncio
import inspect
from types import SimpleNamespace

from router.metrics import Metrics


async def test_streams_go_on_while_a_large_scrape_is_built(monkeypatch) -> None:
    # (with 1,000 tenants the text took ~0.2 s on the event loop, every
    # stream of every tenant paused for it at every scrape)
    monkeypatch.delenv("PROMETHEUS_MULTIPROC_DIR", raising=False)
    m = Metrics()
    m.declare(["r0", "r1"], [f"tenant-{i}" for i in range(1500)])
    ticks = 0
    done = False

    async def ticker() -> None:  # (a stream's token: one loop turn)
        nonlocal ticks
        while not done:
            await asyncio.sleep(0.001)
            ticks += 1

    task = asyncio.create_task(ticker())
    await asyncio.sleep(0.01)
    ticks = 0
    text = m.expose(SimpleNamespace(slots=[]))
    if inspect.isawaitable(text):
        text = await text
    during, done = ticks, True
    await task
    assert b'tenant="tenant-1499"' in text
    assert during >= 5, during  # (0 while it was built on the loop)
