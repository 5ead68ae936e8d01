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
    m.declare(["r0", "r1"], {f"tenant-{i}": "normal" for i in range(1500)})
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


async def test_scrapes_at_once_share_one_build_and_one_leaving_does_not_end_it(monkeypatch) -> None:
    # (each scrape built its own text in a thread: two Prometheus servers
    # scraping 1,000 tenants at once took twice the CPU)
    import threading

    monkeypatch.delenv("PROMETHEUS_MULTIPROC_DIR", raising=False)
    m = Metrics()
    built, release = [], threading.Event()

    def slow_text() -> bytes:
        built.append(1)
        release.wait(5)
        return b"text %d" % len(built)

    monkeypatch.setattr(m, "_text", slow_text)
    pool = SimpleNamespace(slots=[])
    first = asyncio.ensure_future(m.expose(pool))
    second = asyncio.ensure_future(m.expose(pool))
    leaving = asyncio.ensure_future(m.expose(pool))
    await asyncio.sleep(0.05)
    leaving.cancel()  # (its client left)
    await asyncio.sleep(0.01)
    release.set()
    assert await first == await second == b"text 1" and built == [1]
    assert leaving.cancelled()
    assert await m.expose(pool) == b"text 2"  # a scrape after it builds anew
