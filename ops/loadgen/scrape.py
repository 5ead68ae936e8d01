"""Scrapes the router's ``/metrics`` at a fixed interval during a run.

Each scrape keeps only what the charts need: ``fairstream_queue_depth`` per
tenant (summed over priorities), ``fairstream_tokens_total`` per tenant and
direction, and the replica gauges (in-flight, running, adaptive cap). A
failed scrape is counted, never fatal: the load still runs.
"""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass, field

import httpx
from prometheus_client.parser import text_string_to_metric_families

__all__ = ["Snapshot", "Scraper", "parse_snapshot"]


@dataclass
class Snapshot:
    t: float  # seconds since the run began
    queue_depth: dict[str, float] = field(default_factory=dict)  # tenant -> waiting requests
    completion_tokens: dict[str, float] = field(default_factory=dict)  # tenant -> counter value
    prompt_tokens: dict[str, float] = field(default_factory=dict)
    replica_inflight: dict[str, float] = field(default_factory=dict)
    replica_running: dict[str, float] = field(default_factory=dict)
    replica_cap: dict[str, float] = field(default_factory=dict)


def _add(d: dict[str, float], key: str, v: float) -> None:
    d[key] = d.get(key, 0.0) + v


_WANTED = ("fairstream_queue_depth", "fairstream_tokens_total", "fairstream_replica_inflight_requests",
           "fairstream_replica_running_requests", "fairstream_replica_inflight_cap")


def parse_snapshot(text: str, t: float) -> Snapshot:
    snap = Snapshot(t)
    # Only the samples we chart: parsing every histogram bucket once a second
    # would cost the load generator CPU that the load needs.
    text = "\n".join(line for line in text.splitlines() if line.startswith(_WANTED)) + "\n"
    for family in text_string_to_metric_families(text):
        if not family.name.startswith("fairstream_"):
            continue
        for s in family.samples:
            lab = s.labels
            if s.name == "fairstream_queue_depth":
                _add(snap.queue_depth, lab.get("tenant", "?"), s.value)
            elif s.name == "fairstream_tokens_total":
                d = snap.completion_tokens if lab.get("direction") == "completion" else snap.prompt_tokens
                _add(d, lab.get("tenant", "?"), s.value)
            elif s.name == "fairstream_replica_inflight_requests":
                snap.replica_inflight[lab.get("replica", "?")] = s.value
            elif s.name == "fairstream_replica_running_requests":
                snap.replica_running[lab.get("replica", "?")] = s.value
            elif s.name == "fairstream_replica_inflight_cap":
                snap.replica_cap[lab.get("replica", "?")] = s.value
    return snap


class Scraper:
    """One background task; ``close()`` takes a last scrape and ends it."""

    def __init__(self, url: str, interval: float, t0: float) -> None:
        self.url = url
        self.interval = interval
        self.t0 = t0
        self.snapshots: list[Snapshot] = []
        self.errors = 0
        self._task: asyncio.Task | None = None
        self._client: httpx.AsyncClient | None = None

    def start(self, client: httpx.AsyncClient) -> None:
        self._client = client
        self._task = asyncio.get_running_loop().create_task(self._loop(), name="metrics-scraper")

    async def scrape_once(self) -> None:
        assert self._client is not None
        try:
            resp = await self._client.get(self.url, timeout=min(5.0, max(1.0, self.interval)))
            resp.raise_for_status()
            self.snapshots.append(parse_snapshot(resp.text, time.perf_counter() - self.t0))
        except (httpx.HTTPError, ValueError):
            self.errors += 1

    async def _loop(self) -> None:
        next_at = time.perf_counter()
        while True:
            await self.scrape_once()
            now = time.perf_counter()
            next_at += self.interval
            if next_at < now:  # a slow scrape: skip the missed ticks, no burst to catch up
                next_at += (now - next_at) // self.interval * self.interval + self.interval
            await asyncio.sleep(next_at - now)

    async def close(self) -> None:
        if self._task is not None:
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)
            self._task = None
            await self.scrape_once()
