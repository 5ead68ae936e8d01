"""Markdown tables and target checks from the measurements of all rounds.

Each cell is the median over rounds with the spread ``[min-max]``; ``xN``
is the median over rounds of the ratio to ``direct`` (same round, same
scenario; ``sim-direct`` for ``fairstream-sim``).
"""

from __future__ import annotations

import statistics
from collections import defaultdict

from ops.bench.systems import DIRECT_OF

__all__ = ["render", "targets"]

KB = 1024
MB = 1024 * 1024
ORDER = ["direct", "fairstream", "vllm-router", "litellm", "py-floor", "py-floor-features", "sim-direct", "fairstream-sim"]


def _med(xs):
    xs = [x for x in xs if x is not None]
    return statistics.median(xs) if xs else None


def _fmt(v, digits: int = 1) -> str:
    if v is None:
        return "-"
    if abs(v) >= 1000:
        return f"{v:,.0f}"
    if abs(v) >= 100:
        return f"{v:.0f}"
    if abs(v) >= 10:
        return f"{v:.{max(0, digits - 0)}f}" if digits else f"{v:.0f}"
    if abs(v) >= 1:
        return f"{v:.{digits + 1}f}"
    return f"{v:.{digits + 2}f}" if v else "0"


class _Grid:
    def __init__(self, ms: list) -> None:
        self.by = defaultdict(list)  # (scenario, system) -> [Measurement]
        self.rounds = defaultdict(dict)  # (scenario, system) -> {round: m}
        for m in ms:
            self.by[(m.scenario, m.system)].append(m)
            self.rounds[(m.scenario, m.system)][m.round] = m

    def systems(self, scen: str) -> list[str]:
        present = {sy for (sc, sy) in self.by if sc == scen}
        return [s for s in ORDER if s in present] + sorted(present - set(ORDER))

    def values(self, scen, system, get):
        return [get(m) for m in self.by.get((scen, system), [])]

    def ratios(self, scen, system, get):
        base = DIRECT_OF.get(system)
        if base is None:
            return []
        out = []
        for rnd, m in self.rounds.get((scen, system), {}).items():
            b = self.rounds.get((scen, base), {}).get(rnd)
            if b is None:
                continue
            x, y = get(m), get(b)
            if x is not None and y:
                out.append(x / y)
        return out

    def cell(self, scen, system, get, scale: float = 1.0, ratio: bool = True, digits: int = 1) -> str:
        vals = [v * scale for v in self.values(scen, system, get) if v is not None]
        if not vals:
            return "-"
        s = _fmt(statistics.median(vals), digits)
        if len(vals) > 1:
            s += f" [{_fmt(min(vals), digits)}-{_fmt(max(vals), digits)}]"
        if ratio:
            r = self.ratios(scen, system, get)
            if r:
                s += f" x{statistics.median(r):.2f}"
        return s


def _kernel_share(m) -> float | None:
    """The kernel's part of the router's CPU (system calls, and on loopback
    the TCP work of delivering what they write), as a fraction."""
    if m.router_cpu_s and getattr(m, "router_sys_s", None) is not None:
        return m.router_sys_s / m.router_cpu_s
    return None


def _errors(ms) -> str:
    tot = defaultdict(int)
    n = 0
    for m in ms:
        n += m.requests
        for k, v in m.errors.items():
            tot[k] += v
    if not tot:
        return "0"
    return ", ".join(f"{k}:{v}" for k, v in sorted(tot.items())) + f" (of {n})"


def _stream_table(g: _Grid, scen: str) -> list[str]:
    out = [
        "| system | TTFT p50 ms | TTFT p99 ms | ITL p50 ms | ITL p99 ms | tokens/s | tokens/event "
        "| router CPU s/1k tok | of it kernel % | router RSS peak MB | errors | client CPU s/1k tok |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for sy in g.systems(scen):
        ms = g.by[(scen, sy)]
        out.append("| " + " | ".join([
            sy,
            g.cell(scen, sy, lambda m: m.ttft_p50, 1000),
            g.cell(scen, sy, lambda m: m.ttft_p99, 1000),
            g.cell(scen, sy, lambda m: m.itl_p50, 1000),
            g.cell(scen, sy, lambda m: m.itl_p99, 1000),
            g.cell(scen, sy, lambda m: m.tok_s, digits=0),
            g.cell(scen, sy, lambda m: m.tokens / m.events if m.events else None, ratio=False),
            g.cell(scen, sy, lambda m: m.cpu_per_1k, ratio=False, digits=2),
            g.cell(scen, sy, _kernel_share, 100, ratio=False, digits=0),
            g.cell(scen, sy, lambda m: m.rss_peak, 1 / MB, ratio=False),
            _errors(ms),
            g.cell(scen, sy, lambda m: m.client_cpu_per_1k, ratio=False, digits=2),
        ]) + " |")
    return out


def _idle_table(g: _Grid, scen: str) -> list[str]:
    out = [
        "| system | open streams (peak) | RSS before MB | RSS peak MB | KB per open stream | TTFT p50 ms "
        "| TTFT p99 ms | router CPU s | errors |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for sy in g.systems(scen):
        ms = g.by[(scen, sy)]
        out.append("| " + " | ".join([
            sy,
            g.cell(scen, sy, lambda m: m.open_peak, ratio=False, digits=0),
            g.cell(scen, sy, lambda m: m.rss_before, 1 / MB, ratio=False),
            g.cell(scen, sy, lambda m: m.rss_peak, 1 / MB, ratio=False),
            g.cell(scen, sy, lambda m: m.rss_per_stream, 1 / KB, ratio=False),
            g.cell(scen, sy, lambda m: m.ttft_p50, 1000),
            g.cell(scen, sy, lambda m: m.ttft_p99, 1000),
            g.cell(scen, sy, lambda m: m.router_cpu_s, ratio=False, digits=2),
            _errors(ms),
        ]) + " |")
    return out


def _micro_table(micro: list[list[dict]]) -> list[str]:
    out = [
        "| queued | tenants | `_dispatch` p50 us | p99 us | mean us | `HeadIndex.pick` p50 us | p99 us "
        "| reference `pick` (scan) p50 us | p99 us |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    by = defaultdict(list)
    for rnd in micro:
        for r in rnd:
            by[(r["waiters"], r["tenants"])].append(r)
    for (w, t), rs in sorted(by.items()):
        def c(path):
            vals = [r[path[0]][path[1]] for r in rs]
            s = _fmt(statistics.median(vals))
            if len(vals) > 1:
                s += f" [{_fmt(min(vals))}-{_fmt(max(vals))}]"
            return s
        out.append(f"| {w} | {t} | {c(('dispatch_us', 'p50'))} | {c(('dispatch_us', 'p99'))} | "
                   f"{c(('dispatch_us', 'mean'))} | {c(('index_pick_us', 'p50'))} | {c(('index_pick_us', 'p99'))} | "
                   f"{c(('pick_us', 'p50'))} | {c(('pick_us', 'p99'))} |")
    return out


def render(ms: list, micro: list[list[dict]], titles: dict[str, str]) -> str:
    g = _Grid(ms)
    scens = sorted({m.scenario for m in ms})
    lines: list[str] = []
    for sc in scens:
        lines += ["", f"### {sc}: {titles.get(sc, '')}", ""]
        if sc == "S3":
            lines += _idle_table(g, sc)
        else:
            lines += _stream_table(g, sc)
    if micro:
        lines += ["", "### S4 micro-benchmark: one scheduling decision (fairstream `Scheduler._dispatch`, "
                  "in-process)", ""]
        lines += _micro_table(micro)
    return "\n".join(lines)


def _verdict(ok: bool | None) -> str:
    return "n/a " if ok is None else ("PASS" if ok else "MISS")


def targets(ms: list, micro: list[list[dict]]) -> tuple[str, list[tuple[str, bool | None]]]:
    g = _Grid(ms)
    lines: list[str] = []
    results: list[tuple[str, bool | None]] = []

    def add(name: str, ok: bool | None, detail: str) -> None:
        results.append((name, ok))
        lines.append(f"- **{_verdict(ok)}** {name}: {detail}")

    for sc in ("S1", "S2"):
        fs = _med(g.values(sc, "fairstream", lambda m: m.cpu_per_1k))
        vr = _med(g.values(sc, "vllm-router", lambda m: m.cpu_per_1k))
        ok = None if fs is None or vr is None else fs <= vr
        add(f"{sc} router CPU per 1000 tokens, fairstream <= vllm-router", ok,
            f"fairstream {_fmt(fs, 3)} s vs vllm-router {_fmt(vr, 3)} s"
            + (f" (x{fs / vr:.1f})" if fs and vr else ""))
        fss = _med(g.values(sc, "fairstream-sim", lambda m: m.cpu_per_1k))
        if fss is not None:
            lines.append(f"  - for reference, fairstream over its own sim replicas: {_fmt(fss, 3)} s per 1000 tokens")
        for ref in ("py-floor", "py-floor-features"):
            v = _med(g.values(sc, ref, lambda m: m.cpu_per_1k))
            if v is not None:
                lines.append(f"  - for reference, the Python floor ({ref}, ops/bench/floor_proxy.py): "
                             f"{_fmt(v, 3)} s per 1000 tokens")

    for sc in ("S2", "S1"):
        def added(system):
            out = []
            for rnd, m in g.rounds.get((sc, system), {}).items():
                d = g.rounds.get((sc, "direct"), {}).get(rnd)
                if d is not None and m.ttft_p50 is not None and d.ttft_p50 is not None:
                    out.append(m.ttft_p50 - d.ttft_p50)
            return _med(out)
        fs, vr = added("fairstream"), added("vllm-router")
        ok = None if fs is None or vr is None else fs <= max(vr, 0.0) / 3
        add(f"{sc} added TTFT p50, fairstream <= 1/3 of vllm-router's", ok,
            f"fairstream +{_fmt(fs * 1000 if fs is not None else None)} ms vs vllm-router "
            f"+{_fmt(vr * 1000 if vr is not None else None)} ms (limit {_fmt(max(vr or 0, 0) / 3 * 1000)} ms)")

    for system in ("fairstream", "fairstream-sim"):
        r = _med(g.ratios("S2", system, lambda m: m.itl_p99))
        if r is None:
            continue
        add(f"S2 inter-token p99 within 10% of direct at 256 streams ({system})", r <= 1.10,
            f"x{r:.2f} of {DIRECT_OF[system]}")

    for system in ("fairstream", "fairstream-sim"):
        v = _med(g.values("S3", system, lambda m: m.rss_per_stream))
        if v is None:
            continue
        add(f"S3 router memory per idle open stream <= 20 KB ({system})", v <= 20 * KB, f"{v / KB:.1f} KB")

    by = defaultdict(list)
    for rnd in micro:
        for r in rnd:
            by[(r["waiters"], r["tenants"])].append(r["dispatch_us"]["p50"])
    for (w, t), vals in sorted(by.items()):
        v = statistics.median(vals)
        add(f"S4 scheduling decision < 50 us with {w} queued over {t} tenants", v < 50, f"p50 {v:.1f} us")

    # S5 has no target of its own: the per-request cost behind S1/S2's CPU and added TTFT
    def ms_per_request(m):
        return m.router_cpu_s / m.ok * 1000 if m.ok and m.router_cpu_s is not None else None

    per_req = {sys_: _med(g.values("S5", sys_, ms_per_request)) for sys_ in ("fairstream", "vllm-router", "fairstream-sim")}
    if per_req["fairstream"] is not None:
        lines.append("- (no target) S5 router CPU per completed request (1-token streams): "
                     + ", ".join(f"{k} {v:.3f} ms" for k, v in per_req.items() if v is not None))
    return "\n".join(lines), results
