"""PNG charts of a run (matplotlib, Agg backend: no display needed).

* ``ttft_cdf.png``, ``itl_cdf.png``, ``e2e_cdf.png``: latency CDFs per tenant
  (successful requests; ITL weighted per token).
* ``tokens_per_s.png``: completion tokens/s per tenant over time, as the client
  received them (solid) and from the router's ``fairstream_tokens_total``
  (dashed; counted when a request ends, so steppier).
* ``queue_depth.png``: ``fairstream_queue_depth`` per tenant, and below it each
  replica's in-flight requests and adaptive cap.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

import matplotlib

matplotlib.use("Agg")

import matplotlib.pyplot as plt  # noqa: E402
import numpy as np  # noqa: E402

from ops.loadgen.runner import RunData  # noqa: E402
from ops.loadgen.stats import router_token_rates, token_series  # noqa: E402

__all__ = ["write_plots"]

_DPI = 110


def _colors(tenants: Sequence[str]) -> dict[str, str]:
    cycle = plt.rcParams["axes.prop_cycle"].by_key()["color"]
    return {t: cycle[i % len(cycle)] for i, t in enumerate(tenants)}


def _cdf(ax, samples: list[tuple[float, float]], label: str, color: str) -> bool:
    if not samples:
        return False
    arr = np.array(sorted(samples))
    v, w = arr[:, 0] * 1000.0, arr[:, 1]
    cum = np.cumsum(w) / w.sum()
    ax.step(v, cum, where="post", label=f"{label} (n={len(samples)})", color=color)
    return True


def _latency_cdf(path: Path, title: str, per_tenant: dict[str, list[tuple[float, float]]],
                 colors: dict[str, str]) -> Path:
    fig, ax = plt.subplots(figsize=(8, 4.5))
    drawn = False
    for tenant, samples in per_tenant.items():
        drawn |= _cdf(ax, samples, tenant, colors[tenant])
    if drawn:
        ax.set_xscale("log")
        ax.legend(loc="lower right")
    else:
        ax.text(0.5, 0.5, "no samples", ha="center", va="center", transform=ax.transAxes)
    for q in (0.5, 0.9, 0.99):
        ax.axhline(q, color="0.8", lw=0.8, zorder=0)
    ax.set_xlabel("milliseconds (log)")
    ax.set_ylabel("fraction")
    ax.set_ylim(0, 1.01)
    ax.set_title(title)
    ax.grid(True, which="both", alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=_DPI)
    plt.close(fig)
    return path


def _tokens_per_s(path: Path, data: RunData, tenants: list[str], colors: dict[str, str]) -> Path:
    fig, ax = plt.subplots(figsize=(9, 4.5))
    starts, series = token_series(data.results, data.wall_s)
    x = np.array(starts) + 0.5
    total = np.zeros(len(starts))
    for t in tenants:
        if t in series:
            y = np.array(series[t])
            total += y
            ax.plot(x, y, label=f"{t} (client)", color=colors[t])
    if series:
        ax.plot(x, total, label="total (client)", color="black", lw=1.2)
    for t, pts in router_token_rates(data.snapshots).items():
        if pts:
            ax.plot([p[0] for p in pts], [p[1] for p in pts], ls="--", lw=1, alpha=0.8,
                    color=colors.get(t, "0.5"), label=f"{t} (router)")
    if data.send_s:
        ax.axvline(data.send_s, color="0.5", ls=":", lw=1, label="sending stops")
    ax.set_xlabel("seconds since start")
    ax.set_ylabel("completion tokens / s")
    ax.set_title(f"{data.scenario.name}: tokens/s per tenant")
    ax.grid(True, alpha=0.3)
    ax.legend(fontsize="small", ncol=2, loc="upper right")
    fig.tight_layout()
    fig.savefig(path, dpi=_DPI)
    plt.close(fig)
    return path


def _queue_depth(path: Path, data: RunData, tenants: list[str], colors: dict[str, str]) -> Path:
    fig, (top, bottom) = plt.subplots(2, 1, figsize=(9, 6), sharex=True)
    snaps = data.snapshots
    ts = [s.t for s in snaps]
    seen = list(dict.fromkeys([*tenants, *(k for s in snaps for k in s.queue_depth)]))
    extra = _colors(seen)
    for t in seen:
        top.plot(ts, [s.queue_depth.get(t, 0.0) for s in snaps], label=t, color=colors.get(t, extra[t]))
    top.set_ylabel("queued requests")
    top.set_title(f"{data.scenario.name}: fairstream_queue_depth per tenant")
    replicas = sorted({k for s in snaps for k in s.replica_inflight})
    rcolors = _colors(replicas)
    for rname in replicas:
        c = rcolors[rname]
        bottom.plot(ts, [s.replica_inflight.get(rname, 0.0) for s in snaps], label=f"{rname} in-flight", color=c)
        if any(rname in s.replica_cap for s in snaps):
            bottom.plot(ts, [s.replica_cap.get(rname, np.nan) for s in snaps], ls="--", color=c,
                        label=f"{rname} cap")
    bottom.set_ylabel("requests on replica")
    bottom.set_xlabel("seconds since start")
    for ax in (top, bottom):
        ax.grid(True, alpha=0.3)
        if ax.get_legend_handles_labels()[0]:
            ax.legend(fontsize="small", loc="upper right")
        if data.send_s:
            ax.axvline(data.send_s, color="0.5", ls=":", lw=1)
    if not snaps:
        top.text(0.5, 0.5, "no /metrics scrapes", ha="center", va="center", transform=top.transAxes)
    fig.tight_layout()
    fig.savefig(path, dpi=_DPI)
    plt.close(fig)
    return path


def write_plots(out: Path, data: RunData) -> list[Path]:
    out.mkdir(parents=True, exist_ok=True)
    tenants = list(dict.fromkeys([*data.scenario.tenants, *(r.tenant for r in data.results)]))
    colors = _colors(tenants)
    ok = [r for r in data.results if r.ok]
    ttft = {t: [(r.ttft, 1.0) for r in ok if r.tenant == t and r.ttft is not None] for t in tenants}
    itl = {t: [s for r in ok if r.tenant == t for s in r.itl] for t in tenants}
    e2e = {t: [(r.e2e, 1.0) for r in ok if r.tenant == t and r.e2e is not None] for t in tenants}
    name = data.scenario.name
    return [
        _latency_cdf(out / "ttft_cdf.png", f"{name}: time to first token", ttft, colors),
        _latency_cdf(out / "itl_cdf.png", f"{name}: inter-token latency (per token)", itl, colors),
        _latency_cdf(out / "e2e_cdf.png", f"{name}: end-to-end latency", e2e, colors),
        _tokens_per_s(out / "tokens_per_s.png", data, tenants, colors),
        _queue_depth(out / "queue_depth.png", data, tenants, colors),
    ]
