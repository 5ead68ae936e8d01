"""The summary table (rich) and the raw files of a run.

Files written into the output directory:

* ``summary.json``: ``{"scenario", "base_url", "started_at", "wall_s", "send_s",
  "client_loop_lag_s", "tenants": {name: row}, "total": row}``; a row is
  ``TenantSummary`` (seconds).
* ``results.json``: the same header, every request (``Result.row()``) and every
  ``/metrics`` scrape.
* ``results.csv``: one line per request.
"""

from __future__ import annotations

import csv
import dataclasses
from pathlib import Path

import msgspec
from rich.console import Console
from rich.table import Table

from ops.loadgen.runner import RunData
from ops.loadgen.stats import TOTAL, TenantSummary, wpercentile

__all__ = ["render_table", "write_files", "loop_lag", "CSV_FIELDS"]

CSV_FIELDS = ["tenant", "class", "stream", "start", "status", "error", "ttft", "e2e", "itl_mean",
              "prompt_tokens", "completion_tokens", "events", "tokens_exact"]


def _ms(v: float | None) -> str:
    if v is None:
        return "-"
    return f"{v * 1000:.0f}" if v >= 0.01 else f"{v * 1000:.1f}"


def _s(v: float | None) -> str:
    return "-" if v is None else f"{v:.2f}"


def _triple(row: TenantSummary, what: str, fmt) -> str:
    return " / ".join(fmt(getattr(row, f"{what}_p{q}")) for q in (50, 90, 99))


def render_table(rows: list[TenantSummary], title: str, console: Console) -> None:
    table = Table(title=title, show_lines=False, header_style="bold")
    table.add_column("tenant")
    table.add_column("requests", justify="right")
    table.add_column("ok", justify="right")
    table.add_column("errors by kind")
    table.add_column("TTFT ms p50/p90/p99", justify="right")
    table.add_column("ITL ms p50/p90/p99", justify="right")
    table.add_column("E2E s p50/p90/p99", justify="right")
    table.add_column("tokens", justify="right")
    table.add_column("tok/s", justify="right")
    for row in rows:
        errors = "\n".join(f"{kind} x{n}" for kind, n in row.errors.items()) or "-"
        style = "bold" if row.tenant == TOTAL else None
        if row.tenant == TOTAL:
            table.add_section()
        table.add_row(
            row.tenant, str(row.requests), str(row.ok), errors,
            _triple(row, "ttft", _ms), _triple(row, "itl", _ms), _triple(row, "e2e", _s),
            str(row.completion_tokens), f"{row.tokens_per_s:.0f}", style=style,
        )
    console.print(table)


def loop_lag(data: RunData) -> dict[str, float | None]:
    """Percentiles of the client's event-loop lag (seconds)."""
    samples = [(v, 1.0) for v in data.loop_lag]
    return {"p50": wpercentile(samples, 50), "p99": wpercentile(samples, 99),
            "max": max(data.loop_lag) if data.loop_lag else None}


def _header(data: RunData) -> dict:
    return {
        "scenario": data.scenario.name, "base_url": data.base_url, "started_at": data.started_at,
        "wall_s": data.wall_s, "send_s": data.send_s, "client_loop_lag_s": loop_lag(data),
    }


def write_files(out: Path, data: RunData, rows: list[TenantSummary]) -> list[Path]:
    out.mkdir(parents=True, exist_ok=True)
    enc = msgspec.json.Encoder()
    rows_by = {r.tenant: r for r in rows if r.tenant != TOTAL}
    total = next(r for r in rows if r.tenant == TOTAL)
    summary = {**_header(data), "tenants": rows_by, "total": total}
    paths = []
    p = out / "summary.json"
    p.write_bytes(msgspec.json.format(enc.encode(summary), indent=2))
    paths.append(p)
    p = out / "results.json"
    full = {
        **_header(data), "tenants": rows_by, "total": total,
        "requests": [r.row() for r in data.results],
        "scrapes": [dataclasses.asdict(s) for s in data.snapshots], "scrape_errors": data.scrape_errors,
    }
    p.write_bytes(enc.encode(full))
    paths.append(p)
    p = out / "results.csv"
    with p.open("w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=CSV_FIELDS)
        w.writeheader()
        for r in sorted(data.results, key=lambda r: r.start):
            w.writerow(r.row())
    paths.append(p)
    return paths
