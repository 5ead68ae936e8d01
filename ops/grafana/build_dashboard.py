"""Builds ops/grafana/fairstream.json, the Grafana dashboard of the router.

    python ops/grafana/build_dashboard.py            # rewrite fairstream.json
    python ops/grafana/build_dashboard.py --check    # exit 1 if it is out of date

The JSON is generated so that panels stay uniform (datasource variable,
tenant/replica filters, units, legends) and a test can keep the file and this
script in sync. Import it in Grafana (Dashboards -> New -> Import) and pick a
Prometheus datasource for ``datasource``; ``instance`` (the routers), ``tenant``
and ``replica`` filter every panel that has that label.

With several routers (``instance``) every panel sums over them: per tenant by
``tenant``, per replica by ``replica`` (in-flight requests and caps summed: each
router holds a replica to its own cap; what a replica reports, running,
waiting and KV-cache use, is the same to every router: the largest; up: the
smallest, so a replica any router cannot reach shows DOWN). Routers that each
start their own local replicas under the same names (sim-0, ...) run
different processes under one name: pick one ``instance`` to see each apart.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

__all__ = ["dashboard", "render", "PATH"]

PATH = Path(__file__).with_name("fairstream.json")
DS = {"type": "prometheus", "uid": "${datasource}"}
I = 'instance=~"$instance"'
T = f'tenant=~"$tenant",{I}'
R = f'replica=~"$replica",{I}'
RI = "[$__rate_interval]"


def _q(expr: str, legend: str, ref: str = "A", **extra: Any) -> dict[str, Any]:
    return {"refId": ref, "datasource": DS, "expr": expr, "legendFormat": legend, "range": True, **extra}


def _quantile(q: float, metric: str, by: str, sel: str) -> str:
    return f"histogram_quantile({q}, sum by ({by}, le) (rate({metric}_bucket{{{sel}}}{RI})))"


class _Layout:
    """Places panels left to right in rows of 24 grid units."""

    def __init__(self) -> None:
        self.panels: list[dict[str, Any]] = []
        self.x = 0
        self.y = 0
        self.row_h = 0
        self.next_id = 1

    def _id(self) -> int:
        self.next_id += 1
        return self.next_id - 1

    def row(self, title: str) -> None:
        self._newline()
        self.panels.append({"type": "row", "id": self._id(), "title": title, "collapsed": False,
                            "gridPos": {"h": 1, "w": 24, "x": 0, "y": self.y}, "panels": []})
        self.y += 1

    def _newline(self) -> None:
        if self.x:
            self.y += self.row_h
            self.x = 0
            self.row_h = 0

    def add(self, panel: dict[str, Any], w: int, h: int) -> None:
        if self.x + w > 24:
            self._newline()
        panel = {"id": self._id(), **panel, "gridPos": {"h": h, "w": w, "x": self.x, "y": self.y}}
        self.panels.append(panel)
        self.x += w
        self.row_h = max(self.row_h, h)


def _timeseries(title: str, description: str, targets: list[dict], unit: str, *, stack: bool = False,
                min_: float | None = 0, max_: float | None = None, draw: str = "line") -> dict[str, Any]:
    custom: dict[str, Any] = {"drawStyle": draw, "lineWidth": 1, "fillOpacity": 10 if not stack else 40,
                              "showPoints": "never", "spanNulls": True,
                              "stacking": {"mode": "normal" if stack else "none", "group": "A"}}
    defaults: dict[str, Any] = {"unit": unit, "custom": custom}
    if min_ is not None:
        defaults["min"] = min_
    if max_ is not None:
        defaults["max"] = max_
    return {
        "type": "timeseries", "title": title, "description": description, "datasource": DS,
        "targets": targets,
        "fieldConfig": {"defaults": defaults, "overrides": []},
        "options": {"legend": {"displayMode": "table", "placement": "bottom", "calcs": ["lastNotNull", "max"]},
                    "tooltip": {"mode": "multi", "sort": "desc"}},
    }


def _stat(title: str, description: str, targets: list[dict], *, unit: str = "none",
          mappings: list | None = None, thresholds: list | None = None) -> dict[str, Any]:
    steps = thresholds or [{"color": "green", "value": None}]
    return {
        "type": "stat", "title": title, "description": description, "datasource": DS, "targets": targets,
        "fieldConfig": {"defaults": {"unit": unit, "mappings": mappings or [],
                                     "thresholds": {"mode": "absolute", "steps": steps}},
                        "overrides": []},
        "options": {"reduceOptions": {"calcs": ["lastNotNull"], "fields": "", "values": False},
                    "colorMode": "background", "graphMode": "none", "textMode": "value_and_name",
                    "orientation": "auto", "justifyMode": "auto"},
    }


_UP_DOWN = [{"type": "value", "options": {"0": {"text": "DOWN", "color": "red", "index": 0},
                                          "1": {"text": "UP", "color": "green", "index": 1}}}]
_OK_FAILED = [{"type": "value", "options": {"0": {"text": "FAILED", "color": "red", "index": 0},
                                            "1": {"text": "OK", "color": "green", "index": 1}}}]
_RED_BELOW_1 = [{"color": "red", "value": None}, {"color": "green", "value": 1}]


def _panels() -> list[dict[str, Any]]:
    L = _Layout()
    L.row("Tenants")
    L.add(_timeseries(
        "TTFT p99 per tenant", "99th percentile time to first token (request arrival -> first token), per tenant.",
        [_q(_quantile(0.99, "fairstream_time_to_first_token_seconds", "tenant", T), "{{tenant}} p99"),
         _q(_quantile(0.5, "fairstream_time_to_first_token_seconds", "tenant", T), "{{tenant}} p50", "B")],
        "s"), 8, 8)
    L.add(_timeseries(
        "Inter-token latency p99 per tenant", "99th percentile gap between delivered tokens, per tenant.",
        [_q(_quantile(0.99, "fairstream_inter_token_latency_seconds", "tenant", T), "{{tenant}} p99")],
        "s"), 8, 8)
    L.add(_timeseries(
        "Request duration p99 per tenant", "99th percentile time from arrival to the last byte.",
        [_q(_quantile(0.99, "fairstream_request_duration_seconds", "tenant", T), "{{tenant}} p99")],
        "s"), 8, 8)
    L.add(_timeseries(
        "Tokens/s per tenant", "Completion (and prompt) tokens per second, counted when a request ends.",
        [_q(f'sum by (tenant) (rate(fairstream_tokens_total{{direction="completion",{T}}}{RI}))',
            "{{tenant}} completion"),
         _q(f'sum by (tenant) (rate(fairstream_tokens_total{{direction="prompt",{T}}}{RI}))',
            "{{tenant}} prompt", "B")],
        "short"), 8, 8)
    L.add(_timeseries(
        "Waiting per tenant", "Admitted requests waiting in the scheduler's queue for replica capacity, and "
        "requests waiting for their tenant's rate or concurrency limit (on_limit: queue).",
        [_q(f"sum by (tenant) (fairstream_queue_depth{{{T}}})", "{{tenant}} for a replica"),
         _q(f"sum by (tenant) (fairstream_admission_waiting{{{T}}})", "{{tenant}} for a limit", "B")],
        "short"), 8, 8)
    L.add(_timeseries(
        "Wait p99 per tenant", "99th percentile time a request waited for a replica, and for its tenant's limit.",
        [_q(_quantile(0.99, "fairstream_queue_wait_seconds", "tenant", T), "{{tenant}} for a replica"),
         _q(_quantile(0.99, "fairstream_admission_wait_seconds", "tenant", T), "{{tenant}} for a limit", "B")],
        "s"), 8, 8)
    L.add(_timeseries(
        "Requests by outcome", "Finished requests per second by outcome (ok, rate_limited, lost, timeout_*, ...).",
        [_q(f"sum by (outcome) (rate(fairstream_requests_total{{{T}}}{RI}))", "{{outcome}}")],
        "reqps", stack=True), 8, 8)
    L.add(_timeseries(
        "Rate-limited by limit", "Requests refused or delayed by a tenant limit, per tenant and limit.",
        [_q(f"sum by (tenant, limit) (rate(fairstream_rate_limited_total{{{T}}}{RI}))", "{{tenant}} {{limit}}")],
        "reqps"), 8, 8)
    L.add(_timeseries(
        "Timeouts by kind", "Requests ended by a tenant time limit (first_token, total; a queue_wait is under Rate-limited by limit, a stall is a failover).",
        [_q(f"sum by (tenant, timeout) (rate(fairstream_timeouts_total{{{T}}}{RI}))", "{{tenant}} {{timeout}}")],
        "reqps"), 8, 8)

    L.row("Replicas")
    L.add(_stat(
        "Replica up", "1 when the replica is connected and ready.",
        [_q(f"min by (replica) (fairstream_replica_up{{{R}}})", "{{replica}}")], mappings=_UP_DOWN,
        thresholds=_RED_BELOW_1), 6, 8)
    L.add(_timeseries(
        "Replica in-flight vs adaptive cap", "Requests the router has on each replica, and the cap the router holds it to (adaptive, never above max_concurrency).",
        [_q(f"sum by (replica) (fairstream_replica_inflight_requests{{{R}}})", "{{replica}} in-flight"),
         _q(f"sum by (replica) (fairstream_replica_inflight_cap{{{R}}})", "{{replica}} cap", "B")],
        "short"), 9, 8)
    L.add(_timeseries(
        "Replica running / waiting", "Running and waiting requests each replica reports.",
        [_q(f"max by (replica) (fairstream_replica_running_requests{{{R}}})", "{{replica}} running"),
         _q(f"max by (replica) (fairstream_replica_waiting_requests{{{R}}})", "{{replica}} waiting", "B")],
        "short"), 9, 8)
    L.add(_timeseries(
        "KV-cache usage", "KV-cache use each replica reports.",
        [_q(f"max by (replica) (fairstream_replica_kv_cache_usage_ratio{{{R}}})", "{{replica}}")],
        "percentunit", max_=1), 12, 8)
    L.add(_timeseries(
        "Replica restarts", "Restarts of local replicas by the supervisor.",
        [_q(f"sum by (replica) (increase(fairstream_replica_restarts_total{{{R}}}{RI}))", "{{replica}}")],
        "short", draw="bars"), 12, 8)

    L.row("Failover and health")
    L.add(_timeseries(
        "Failovers", "Streams moved to another replica mid-generation, by the replica they left.",
        [_q(f"sum by (replica) (rate(fairstream_failovers_total{{{R}}}{RI}))", "{{replica}}")],
        "ops"), 6, 8)
    L.add(_timeseries(
        "Failover latency p99", "From a replica's death to the stream's next token.",
        [_q(f"histogram_quantile(0.99, sum by (le) (rate(fairstream_failover_latency_seconds_bucket{{{I}}}{RI})))",
            "p99")],
        "s"), 6, 8)
    L.add(_timeseries(
        "Resumed tokens/s", "Completion tokens streams had when they moved to another replica (counted as "
        "they move: the output a failover carried over, not generated again).",
        [_q(f"sum(rate(fairstream_resumed_tokens_total{{{I}}}{RI}))", "resumed")],
        "suffix: tokens/s"), 6, 8)
    L.add(_timeseries(
        "Streams lost", "Streams ended with an error event because no replica could continue them.",
        [_q(f"sum(increase(fairstream_streams_lost_total{{{I}}}{RI}))", "lost")],
        "short", draw="bars"), 6, 8)
    L.add(_stat(
        "Streams lost (time range)", "Lost streams over the dashboard's time range.",
        [_q(f"sum(increase(fairstream_streams_lost_total{{{I}}}[$__range]))", "lost", instant=True, range=False)],
        thresholds=[{"color": "green", "value": None}, {"color": "red", "value": 1}]), 4, 8)
    L.add(_stat(
        "Last config reload", "Whether the last tenant policy reload succeeded (a failed one keeps the old policy).",
        [_q(f"min(fairstream_config_last_reload_successful{{{I}}})", "reload")], mappings=_OK_FAILED,
        thresholds=_RED_BELOW_1), 4, 8)
    L.add(_stat(
        "State store", "1 while the shared state store (memory or Redis) answers.",
        [_q(f"min(fairstream_state_store_up{{{I}}})", "state store")], mappings=_UP_DOWN,
        thresholds=_RED_BELOW_1), 4, 8)
    L.add(_timeseries(
        "Config reloads and store errors", "Tenant policy reloads by result; failed state store operations by op.",
        [_q(f"sum by (result) (increase(fairstream_config_reloads_total{{{I}}}{RI}))", "reload {{result}}"),
         _q(f"sum by (op) (rate(fairstream_state_store_errors_total{{{I}}}{RI}))", "store error {{op}}", "B")],
        "short"), 12, 8)
    L.add(_timeseries(
        "Client stream resumes", "Streams resumed by clients with Last-Event-ID, per tenant.",
        [_q(f"sum by (tenant) (rate(fairstream_stream_resumes_total{{{T}}}{RI}))", "{{tenant}}")],
        "ops"), 24, 6)
    return L.panels


def _variable(name: str, label: str, query: str) -> dict[str, Any]:
    return {
        "type": "query", "name": name, "label": label, "datasource": DS,
        "query": {"query": query, "refId": f"{name}-var"}, "definition": query,
        "refresh": 2, "multi": True, "includeAll": True, "allValue": ".*",
        "current": {"selected": True, "text": ["All"], "value": ["$__all"]}, "sort": 1, "hide": 0,
    }


def dashboard() -> dict[str, Any]:
    return {
        "annotations": {"list": [{
            "builtIn": 1, "datasource": {"type": "grafana", "uid": "-- Grafana --"}, "enable": True,
            "hide": True, "iconColor": "rgba(0, 211, 255, 1)", "name": "Annotations & Alerts", "type": "dashboard",
        }]},
        "description": "fairstream: multi-tenant streaming router for vLLM (tenants, replicas, failover).",
        "editable": True,
        "graphTooltip": 1,
        "links": [],
        "panels": _panels(),
        "refresh": "10s",
        "schemaVersion": 39,
        "tags": ["fairstream", "vllm"],
        "templating": {"list": [
            {"type": "datasource", "name": "datasource", "label": "Prometheus", "query": "prometheus",
             "current": {}, "hide": 0, "refresh": 1, "regex": ""},
            _variable("instance", "Router", "label_values(fairstream_config_last_reload_successful, instance)"),
            _variable("tenant", "Tenant", f"label_values(fairstream_requests_total{{{I}}}, tenant)"),
            _variable("replica", "Replica", f"label_values(fairstream_replica_up{{{I}}}, replica)"),
        ]},
        "time": {"from": "now-1h", "to": "now"},
        "timepicker": {},
        "timezone": "",
        "title": "fairstream router",
        "uid": "fairstream-router",
        "version": 1,
    }


def render() -> str:
    return json.dumps(dashboard(), indent=2) + "\n"


def main(argv: list[str]) -> int:
    text = render()
    if "--check" in argv:
        if PATH.read_text() != text:
            print(f"{PATH} is out of date: run python {Path(__file__).as_posix()}", file=sys.stderr)
            return 1
        return 0
    PATH.write_text(text)
    print(f"wrote {PATH}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
