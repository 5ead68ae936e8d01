"""An OpenAI-compatible upstream's load, when it is vLLM: its ``/metrics``
page polled every ``METRICS_INTERVAL`` seconds for the scheduler gauges the
pool balances on (running, waiting, KV cache use). An upstream that serves
no such page, or not vLLM's, is counted by the router's own in-flight
count instead; the poller then stops."""

from __future__ import annotations

import asyncio
import logging
import re
from collections.abc import Callable

import aiohttp

from replicas.protocol import LoadReport

__all__ = ["METRICS_INTERVAL", "parse_vllm_metrics", "poll_vllm_load"]

log = logging.getLogger("fairstream.upstream")

METRICS_INTERVAL = 1.0
_METRIC_RE = re.compile(
    rb"^(vllm:num_requests_running|vllm:num_requests_waiting|vllm:kv_cache_usage_perc|vllm:generation_tokens_total)"
    rb"(?:\{[^}]*\})?\s+(\S+)",
    re.M,
)


def parse_vllm_metrics(text: bytes) -> LoadReport | None:
    """Scheduler load from a vLLM ``/metrics`` page (summed over engines;
    KV use is the fullest engine's); None when the page is not vLLM's."""
    found: dict[bytes, list[float]] = {}
    for name, value in _METRIC_RE.findall(text):
        try:
            found.setdefault(name, []).append(float(value))
        except ValueError:
            continue
    if b"vllm:num_requests_running" not in found:
        return None
    return LoadReport(
        running=int(sum(found[b"vllm:num_requests_running"])),
        waiting=int(sum(found.get(b"vllm:num_requests_waiting", [0.0]))),
        kv_usage=max(found.get(b"vllm:kv_cache_usage_perc", [0.0])),
        tokens_generated=int(sum(found.get(b"vllm:generation_tokens_total", [0.0]))),
    )


async def poll_vllm_load(session: aiohttp.ClientSession, root: str, name: str,
                                  loaded: Callable[[LoadReport | None], None]) -> None:
    """Poll ``root``/metrics and hand each report to ``loaded`` (None: the
    page has lost its gauges), until the upstream shows it never had vLLM's
    gauges (its load is then the router's count)."""
    url = root + "/metrics"
    seen = False
    while True:
        try:
            async with asyncio.timeout(max(1.0, METRICS_INTERVAL)):
                async with session.get(url) as r:
                    status, page = r.status, await r.read()
            if status == 200:
                report = parse_vllm_metrics(page)
                if report is None and not seen:
                    log.info("upstream %s serves no vllm:* gauges; its load is the router's count", name)
                    return
                seen = True
                loaded(report)
            elif status == 404:
                log.info("upstream %s has no /metrics; its load is the router's count", name)
                return
        except (aiohttp.ClientError, OSError, TimeoutError):
            pass  # the health check decides whether the upstream is down
        await asyncio.sleep(METRICS_INTERVAL)
