"""Percentiles, per-tenant summaries and time series of a run. Pure.

Percentiles are nearest-rank on weighted samples: the smallest value whose
cumulative weight reaches q% of the total (TTFT and E2E weigh 1 per request,
inter-token latency weighs each event by its tokens). Tokens/s is completion
tokens over the run's wall time (first send to last response).
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence

import msgspec

from ops.loadgen.client import Result
from ops.loadgen.scrape import Snapshot

__all__ = ["QUANTILES", "TenantSummary", "wpercentile", "summarize", "token_series", "router_token_rates",
           "TOTAL"]

QUANTILES = (50, 90, 99)
TOTAL = "total"


def wpercentile(samples: Iterable[tuple[float, float]], q: float) -> float | None:
    """q-th percentile (0-100) of ``(value, weight)`` samples; None when empty."""
    pts = sorted((v, w) for v, w in samples if w > 0)
    if not pts:
        return None
    total = sum(w for _, w in pts)
    need = total * q / 100.0
    acc = 0.0
    for v, w in pts:
        acc += w
        if acc >= need - 1e-12 * total:
            return v
    return pts[-1][0]


class TenantSummary(msgspec.Struct, kw_only=True):
    """One row of the summary table (``tenant`` is ``total`` for the last row). Seconds."""

    tenant: str
    requests: int
    ok: int
    errors: dict[str, int]
    ttft_p50: float | None
    ttft_p90: float | None
    ttft_p99: float | None
    itl_p50: float | None
    itl_p90: float | None
    itl_p99: float | None
    e2e_p50: float | None
    e2e_p90: float | None
    e2e_p99: float | None
    prompt_tokens: int
    completion_tokens: int
    tokens_per_s: float
    requests_per_s: float


def _row(name: str, rs: Sequence[Result], wall_s: float) -> TenantSummary:
    errors: dict[str, int] = {}
    for r in rs:
        if r.error is not None:
            errors[r.error] = errors.get(r.error, 0) + 1
    ok = [r for r in rs if r.ok]
    # Latencies of successful requests only: a 429 answered in 2 ms is not a fast request.
    ttft = [(r.ttft, 1.0) for r in ok if r.ttft is not None]
    e2e = [(r.e2e, 1.0) for r in ok if r.e2e is not None]
    itl = [s for r in ok for s in r.itl]
    p = {}
    for label, samples in (("ttft", ttft), ("itl", itl), ("e2e", e2e)):
        for q in QUANTILES:
            p[f"{label}_p{q}"] = wpercentile(samples, q)
    completion = sum(r.completion_tokens for r in rs)
    wall = wall_s if wall_s > 0 else math.inf
    return TenantSummary(
        tenant=name, requests=len(rs), ok=len(ok), errors=dict(sorted(errors.items())),
        prompt_tokens=sum(r.prompt_tokens for r in rs), completion_tokens=completion,
        tokens_per_s=completion / wall, requests_per_s=len(rs) / wall, **p,
    )


def summarize(results: Sequence[Result], wall_s: float, tenants: Sequence[str] = ()) -> list[TenantSummary]:
    """One row per tenant (scenario order first, then any other), then ``total``."""
    names = list(dict.fromkeys([*tenants, *(r.tenant for r in results)]))
    rows = [_row(t, [r for r in results if r.tenant == t], wall_s) for t in names]
    rows.append(_row(TOTAL, results, wall_s))
    return rows


def token_series(results: Sequence[Result], wall_s: float, bin_s: float = 1.0) -> tuple[list[float], dict[str, list[float]]]:
    """Completion tokens/s received by the client per tenant, in ``bin_s`` bins: (bin starts, series)."""
    n = max(1, math.ceil(wall_s / bin_s))
    out: dict[str, list[float]] = {}
    for r in results:
        series = out.setdefault(r.tenant, [0.0] * n)
        for t, k in r.token_times:
            series[min(n - 1, max(0, int(t / bin_s)))] += k / bin_s
    return [i * bin_s for i in range(n)], out


def router_token_rates(snaps: Sequence[Snapshot]) -> dict[str, list[tuple[float, float]]]:
    """Completion tokens/s per tenant from consecutive scrapes of ``fairstream_tokens_total``.

    The router counts a request's tokens when it ends, so this is steppier than
    the client's view."""
    out: dict[str, list[tuple[float, float]]] = {}
    for a, b in zip(snaps, snaps[1:]):
        dt = b.t - a.t
        if dt <= 0:
            continue
        for tenant in b.completion_tokens:
            d = b.completion_tokens[tenant] - a.completion_tokens.get(tenant, 0.0)
            out.setdefault(tenant, []).append((b.t, max(0.0, d) / dt))
    return out
