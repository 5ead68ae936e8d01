"""``python -m ops.loadgen``: run a scenario against a router, report, chart.

    python -m ops.loadgen --scenario ops/scenarios/demo.yaml --base-url http://127.0.0.1:8080

Exit status: 0 after a run in which at least one request succeeded (whatever
the others' outcomes), 1 when every request failed, 2 when the
scenario or the base URL is refused, 130 after a run cut short by Ctrl-C
(what was measured is reported and written all the same; a second Ctrl-C
ends the requests still open).
"""

from __future__ import annotations

import argparse
import asyncio
import sys
import time
from pathlib import Path

import msgspec
from rich.console import Console
from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn

from ops.loadgen.report import loop_lag, render_table, write_files
from ops.loadgen.runner import Run
from ops.loadgen.scenario import MAX_DURATION_S, ConfigError, load_scenario
from ops.loadgen.stats import summarize
from ops.loadgen.target import check_base_url

__all__ = ["main", "parser"]

_LAG_WARN_S = 0.1


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m ops.loadgen", description=__doc__.split("\n\n")[0])
    p.add_argument("--scenario", required=True, help="scenario YAML (see ops/loadgen/scenario.py)")
    p.add_argument("--base-url", default="http://127.0.0.1:8080", help="router URL (default %(default)s)")
    p.add_argument("--allow-remote", action="store_true",
                   help="allow a base URL that is not loopback (127.0.0.0/8, ::1, localhost)")
    p.add_argument("--out", type=Path, default=None,
                   help="output directory (default ops/out/<timestamp>/ under the current directory)")
    p.add_argument("--duration", type=float, default=None, help="override the scenario's duration_s")
    p.add_argument("--max-requests", type=int, default=None, help="override the scenario's max_requests")
    p.add_argument("--seed", type=int, default=None, help="override the scenario's seed")
    p.add_argument("--no-progress", action="store_true", help="no live progress bar")
    p.add_argument("--no-scrape", action="store_true", help="do not scrape the router's /metrics")
    p.add_argument("--no-plots", action="store_true", help="write no PNGs")
    return p


def _overrides(scenario, args):
    changes = {}
    if args.duration is not None:
        if not 0 < args.duration <= MAX_DURATION_S:
            raise ValueError(f"--duration must be in (0, {MAX_DURATION_S:g}]")
        changes["duration_s"] = args.duration
    if args.max_requests is not None:
        if args.max_requests < 1:
            raise ValueError("--max-requests must be at least 1")
        changes["max_requests"] = args.max_requests
    if args.seed is not None:
        changes["seed"] = args.seed
    return msgspec.structs.replace(scenario, **changes) if changes else scenario


def _progress_hook(progress: Progress, task_id):
    def tick(run: Run) -> None:
        p = run.progress
        progress.update(
            task_id, completed=run.fraction() * 1000,
            stats=(f"sent {p.sent}  done {p.completed}  errors {p.errors}  "
                   f"{p.tokens_per_s(run.elapsed()):,.0f} tok/s  tokens {p.tokens:,.0f}"),
        )
    return tick


def _run(run: Run):
    """Run on uvloop when it is installed (it is a router dependency): less client CPU per event."""
    try:
        import uvloop
    except ImportError:
        return asyncio.run(run.execute())
    return uvloop.run(run.execute())


def main(argv: list[str] | None = None) -> int:
    args = parser().parse_args(argv)
    err = Console(stderr=True)
    try:
        scenario = _overrides(load_scenario(args.scenario), args)
        base_url = check_base_url(args.base_url, args.allow_remote)
    except ConfigError as e:
        err.print("\n".join(e.errors), markup=False, highlight=False)
        return 2
    except ValueError as e:
        err.print(f"error: {e}", markup=False, highlight=False)
        return 2
    out = args.out if args.out is not None else Path("ops/out") / time.strftime("%Y%m%d-%H%M%S")
    console = Console(width=None if sys.stdout.isatty() else 160)
    bounds = []
    if scenario.duration_s is not None:
        bounds.append(f"{scenario.duration_s:g}s")
    if scenario.max_requests is not None:
        bounds.append(f"{scenario.max_requests} requests")
    load = f"{scenario.concurrency} workers" if scenario.mode == "concurrency" else f"{scenario.rate:g} req/s"
    console.print(f"[bold]{scenario.name}[/]: {load}, up to {' or '.join(bounds)}, against {base_url}",
                  highlight=False)

    try:
        if args.no_progress:
            run = Run(scenario, base_url, scrape=not args.no_scrape)
            data = _run(run)
        else:
            with Progress(TextColumn("[bold]{task.description}"), BarColumn(), TimeElapsedColumn(),
                          TextColumn("{task.fields[stats]}"), console=err, transient=False) as progress:
                task_id = progress.add_task(scenario.name, total=1000, stats="")
                run = Run(scenario, base_url, scrape=not args.no_scrape, on_tick=_progress_hook(progress, task_id))
                data = _run(run)
    except KeyboardInterrupt:  # (before the run's own Ctrl-C handling was up: nothing measured yet)
        err.print("interrupted before the run started: nothing measured", highlight=False)
        return 130
    # the report and its files are written whole: a Ctrl-C now would leave half of them
    import signal

    signal.signal(signal.SIGINT, signal.SIG_IGN)

    if data.interrupted:
        err.print(f"interrupted after {data.send_s:.1f}s of sending: reporting what was measured",
                  highlight=False)
    rows = summarize(data.results, data.wall_s, list(scenario.tenants))
    render_table(rows, f"{scenario.name}: {len(data.results)} requests in {data.wall_s:.1f}s "
                       f"(sending {data.send_s:.1f}s)", console)
    lag = loop_lag(data)
    if lag["p99"] is not None:
        console.print(f"client event-loop lag p50/p99/max: {lag['p50'] * 1000:.0f} / {lag['p99'] * 1000:.0f} / "
                      f"{lag['max'] * 1000:.0f} ms", highlight=False)
        if lag["p99"] > _LAG_WARN_S:
            console.print("[yellow]warning:[/] the load generator's own event loop lagged; latencies above include "
                          "client-side delay (lower the load, or run several load generators)", highlight=False)
    if data.scrape_errors:
        console.print(f"{data.scrape_errors} scrapes of {base_url}/metrics failed", highlight=False)
    paths = write_files(out, data, rows)
    if not args.no_plots:
        from ops.loadgen.plots import write_plots  # matplotlib import is slow; only when needed

        paths += write_plots(out, data)
    console.print(f"wrote {len(paths)} files to {out}/: " + ", ".join(p.name for p in paths), highlight=False)
    if data.interrupted:
        return 130
    if data.results and not any(r.ok for r in data.results):
        # (nothing was measured but failures: a router that is down, a wrong
        # key or model; a script must not take that for a run)
        err.print(f"no request succeeded ({len(data.results)} failed): see the errors above", highlight=False)
        return 1
    return 0
