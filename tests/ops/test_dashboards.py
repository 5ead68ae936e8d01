"""The Grafana dashboard and the Prometheus rules: valid, well-formed, and every
metric they name is one a real router exposes (with the right type for its
``_bucket``/``_sum``/``_count``/``_total`` suffix)."""

from __future__ import annotations

import json
import os
import re
import runpy
import shutil
import subprocess
from typing import Any

import httpx
import pytest
import yaml
from prometheus_client.parser import text_string_to_metric_families

from tests.helpers import GOLD, MODEL, ROOT, RouterProcess
from tests.ops.conftest import TINY_KEY

DASHBOARD = ROOT / "ops" / "grafana" / "fairstream.json"
BUILDER = ROOT / "ops" / "grafana" / "build_dashboard.py"
PROM_DIR = ROOT / "ops" / "prometheus"
ALERTS = PROM_DIR / "alerts.yml"
METRIC = re.compile(r"\bfairstream_[a-z_]+")
DURATION = re.compile(r"^(0|(\d+(ms|s|m|h|d|w|y))+)$")


# -- helpers --------------------------------------------------------------------


def dashboard() -> dict[str, Any]:
    return json.loads(DASHBOARD.read_text())


def alert_rules() -> list[dict[str, Any]]:
    doc = yaml.safe_load(ALERTS.read_text())
    return [r for g in doc["groups"] for r in g["rules"] if "alert" in r]


def dashboard_exprs(d: dict[str, Any]) -> list[str]:
    exprs = []
    for p in d["panels"]:
        exprs.extend(t["expr"] for t in p.get("targets", []))
    for v in d["templating"]["list"]:
        if v["type"] == "query":
            exprs.append(v["query"]["query"] if isinstance(v["query"], dict) else v["query"])
    return exprs


def names_in(exprs: list[str]) -> set[str]:
    return {m for e in exprs for m in METRIC.findall(e)}


def exposed_series(text: str) -> dict[str, tuple[str, str]]:
    """Series name -> (family, type) for every family in a /metrics text,
    declared or sampled: counters as ``_total``, histograms as ``_bucket``,
    ``_sum``, ``_count``, gauges by their own name."""
    suffixes = {"counter": ("_total",), "histogram": ("_bucket", "_sum", "_count"),
                "summary": ("_sum", "_count", ""), "gauge": ("",), "untyped": ("",)}
    out: dict[str, tuple[str, str]] = {}
    for fam in text_string_to_metric_families(text):
        for suffix in suffixes.get(fam.type, ("",)):
            out[fam.name + suffix] = (fam.name, fam.type)
        for s in fam.samples:  # e.g. _created
            out.setdefault(s.name, (fam.name, fam.type))
    return out


def promtool() -> str | None:
    return os.environ.get("PROMTOOL") or shutil.which("promtool")


# -- static checks ------------------------------------------------------------------


def test_dashboard_is_generated_from_builder() -> None:
    builder = runpy.run_path(str(BUILDER))
    assert builder["render"]() == DASHBOARD.read_text(), (
        "ops/grafana/fairstream.json is out of date: run python ops/grafana/build_dashboard.py")


def test_dashboard_structure() -> None:
    d = dashboard()
    assert d["uid"] and d["title"] and isinstance(d["schemaVersion"], int)
    variables = {v["name"]: v for v in d["templating"]["list"]}
    assert variables["datasource"]["type"] == "datasource"
    assert variables["datasource"]["query"] == "prometheus"
    ids = [p["id"] for p in d["panels"]]
    assert len(ids) == len(set(ids)), "panel ids must be unique"
    for p in d["panels"]:
        g = p["gridPos"]
        assert 0 <= g["x"] and g["x"] + g["w"] <= 24 and g["h"] > 0, p["title"]
        if p["type"] == "row":
            continue
        assert p["datasource"] == {"type": "prometheus", "uid": "${datasource}"}, p["title"]
        refs = [t["refId"] for t in p["targets"]]
        assert p["targets"] and len(refs) == len(set(refs)), p["title"]
        for t in p["targets"]:
            assert t["datasource"]["uid"] == "${datasource}"
            assert t["expr"].count("(") == t["expr"].count(")"), t["expr"]
    # Panels overlap nowhere.
    cells: set[tuple[int, int]] = set()
    for p in d["panels"]:
        g = p["gridPos"]
        for x in range(g["x"], g["x"] + g["w"]):
            for y in range(g["y"], g["y"] + g["h"]):
                assert (x, y) not in cells, f"panel {p['title']!r} overlaps another"
                cells.add((x, y))


def test_dashboard_has_the_required_panels() -> None:
    d = dashboard()
    by_title = {p["title"]: " ".join(t["expr"] for t in p.get("targets", [])) for p in d["panels"]}
    required = {
        "TTFT p99 per tenant": ["histogram_quantile(0.99", "fairstream_time_to_first_token_seconds_bucket"],
        "Tokens/s per tenant": ["rate(fairstream_tokens_total"],
        "Waiting per tenant": ["fairstream_queue_depth", "fairstream_admission_waiting"],
        "Wait p99 per tenant": ["fairstream_queue_wait_seconds_bucket", "fairstream_admission_wait_seconds_bucket"],
        "Replica in-flight vs adaptive cap": ["fairstream_replica_inflight_requests", "fairstream_replica_inflight_cap"],
        "Replica running / waiting": ["fairstream_replica_running_requests"],
        "KV-cache usage": ["fairstream_replica_kv_cache_usage_ratio"],
        "Failovers": ["rate(fairstream_failovers_total"],
        "Streams lost": ["fairstream_streams_lost_total"],
        "Rate-limited by limit": ["fairstream_rate_limited_total", "limit"],
        "Requests by outcome": ["fairstream_requests_total", "outcome"],
    }
    for title, needles in required.items():
        assert title in by_title, f"missing panel {title!r}"
        for n in needles:
            assert n in by_title[title], f"panel {title!r} does not use {n!r}"


def test_a_panel_plots_one_unit() -> None:
    # (the failover latency panel plotted resumed tokens/s on its seconds axis)
    for p in dashboard()["panels"]:
        if p["type"] == "row" or p["fieldConfig"]["overrides"]:
            continue
        if p["fieldConfig"]["defaults"]["unit"] == "s":
            for name in names_in([t["expr"] for t in p["targets"]]):
                assert "_seconds" in name, (p["title"], name)


def test_several_routers_show_each_replica_once_and_can_be_told_apart() -> None:
    # (with two routers each replica showed once per router, under one legend)
    d = dashboard()
    variables = {v["name"]: v for v in d["templating"]["list"]}
    assert "instance" in variables and variables["instance"]["multi"], sorted(variables)
    for p in d["panels"]:
        for t in p.get("targets", []):
            assert 'instance=~"$instance"' in t["expr"], (p["title"], t["expr"])
            if "$replica" in t["expr"]:
                assert "by (replica)" in t["expr"], (p["title"], t["expr"])


def test_alert_rules_structure() -> None:
    doc = yaml.safe_load(ALERTS.read_text())
    assert isinstance(doc["groups"], list) and doc["groups"]
    for g in doc["groups"]:
        assert g["name"] and isinstance(g["rules"], list) and g["rules"]
        for r in g["rules"]:
            assert ("alert" in r) != ("record" in r), r
            assert isinstance(r["expr"], str) and r["expr"].strip()
            if "alert" in r:
                assert {"alert", "expr", "for", "labels", "annotations"} <= set(r), r["alert"]
                assert DURATION.match(str(r["for"])), (r["alert"], r["for"])
                assert r["labels"]["severity"] in ("info", "warning", "critical"), r["alert"]
                assert r["annotations"]["summary"] and r["annotations"]["description"], r["alert"]
    rules = {r["alert"]: r for r in alert_rules()}
    expected = {
        "FairstreamTTFTOverSLO": ("fairstream_time_to_first_token_seconds_bucket", "5m"),
        "FairstreamReplicaDown": ("fairstream_replica_up == 0", "1m"),
        "FairstreamReplicaFlapping": ("changes(fairstream_replica_up[15m]) > 6", None),
        "FairstreamRefusedLogins": ('fairstream_requests_total{outcome="unauthorized"}', "5m"),
        "FairstreamStreamsLost": ("increase(fairstream_streams_lost_total[5m]) > 0", None),
        "FairstreamRequestsFailing": ('outcome=~"unavailable|timeout_first_token|timeout_total|lost|error"', "5m"),
        "FairstreamInternalErrors": ('fairstream_requests_total{outcome="error"}', None),
        "FairstreamConfigReloadFailed": ("fairstream_config_last_reload_successful == 0", None),
        "FairstreamStateStoreDown": ("fairstream_state_store_up == 0", None),
    }
    for name, (needle, for_) in expected.items():
        assert name in rules, f"missing alert {name}"
        assert needle in rules[name]["expr"], (name, rules[name]["expr"])
        if for_ is not None:
            assert rules[name]["for"] == for_, name
    assert "histogram_quantile(0.99" in rules["FairstreamTTFTOverSLO"]["expr"]
    assert "by (tenant" in rules["FairstreamTTFTOverSLO"]["expr"]


def test_metric_name_extraction() -> None:
    assert names_in(["sum(rate(fairstream_tokens_total{tenant=~\"$t\"}[5m])) / fairstream_x_bucket"]) == {
        "fairstream_tokens_total", "fairstream_x_bucket"}
    series = exposed_series(
        "# TYPE fairstream_a_total counter\nfairstream_a_total 1\n"
        "# TYPE fairstream_h histogram\nfairstream_h_bucket{le=\"+Inf\"} 1\nfairstream_h_count 1\nfairstream_h_sum 1\n"
        "# TYPE fairstream_g gauge\n"
    )
    assert series["fairstream_a_total"] == ("fairstream_a", "counter")
    assert series["fairstream_h_bucket"] == ("fairstream_h", "histogram")
    assert series["fairstream_g"] == ("fairstream_g", "gauge")  # declared, no sample yet
    assert "fairstream_a" not in series and "fairstream_h" not in series and "fairstream_g_total" not in series


# -- against a real router --------------------------------------------------------------


def _drive(router: RouterProcess) -> None:
    """One streamed request and one 429, so the labelled families have samples."""
    body = {"model": MODEL, "messages": [{"role": "user", "content": "hello"}], "max_tokens": 8,
            "stream": True, "ignore_eos": True}
    with httpx.stream("POST", router.base_url + "/v1/chat/completions", json=body, timeout=30,
                      headers={"authorization": f"Bearer {GOLD}"}) as r:
        assert r.status_code == 200
        text = "".join(r.iter_text())
    assert "data: [DONE]" in text
    tiny = {"authorization": f"Bearer {TINY_KEY}"}
    unary = {**body, "stream": False}
    statuses = [httpx.post(router.base_url + "/v1/chat/completions", json=unary, headers=tiny, timeout=30).status_code
                for _ in range(2)]
    assert statuses == [200, 429], statuses


def test_every_metric_named_exists_on_a_router(ops_router: RouterProcess) -> None:
    _drive(ops_router)
    resp = httpx.get(ops_router.base_url + "/metrics", timeout=5)
    resp.raise_for_status()
    series = exposed_series(resp.text)
    used = names_in(dashboard_exprs(dashboard())) | names_in([r["expr"] for r in alert_rules()])
    assert len(used) >= 20, sorted(used)
    missing = sorted(n for n in used if n not in series)
    assert not missing, f"named in ops/grafana or ops/prometheus but not exposed by the router: {missing}"
    # The families the traffic above touched have samples, with the labels the panels group by.
    snap = ops_router.metrics()
    assert snap.value("fairstream_time_to_first_token_seconds_bucket", tenant="gold", le="+Inf") >= 1
    assert snap.value("fairstream_tokens_total", tenant="gold", direction="completion") >= 8
    assert snap.value("fairstream_rate_limited_total", tenant="tiny") >= 1
    assert snap.value("fairstream_requests_total", tenant="tiny", outcome="rate_limited") >= 1
    assert snap.value("fairstream_replica_up", replica="sim-0") == 1
    # event counters are exported at 0 before their first event, so increase() and rate() count it
    assert snap.value("fairstream_replica_restarts_total", -1.0, replica="sim-0") == 0
    assert snap.value("fairstream_failovers_total", -1.0, replica="sim-0") == 0
    assert snap.value("fairstream_timeouts_total", -1.0, tenant="gold", timeout="total") == 0
    assert snap.value("fairstream_rate_limited_total", -1.0, tenant="gold", limit="concurrency") == 0
    # latency histograms reach the built-in total timeout (900 s)
    assert snap.value("fairstream_request_duration_seconds_bucket", -1.0, tenant="gold", le="900.0") >= 1
    assert resp.headers["content-type"] == "text/plain; version=0.0.4; charset=utf-8"


@pytest.mark.skipif(promtool() is None, reason="promtool is not installed (set PROMTOOL or put it on PATH)")
@pytest.mark.parametrize("args", [
    ["check", "rules", "alerts.yml"],
    ["check", "config", "prometheus.yml"],
    ["test", "rules", "alerts_test.yml"],
], ids=["check-rules", "check-config", "test-rules"])
def test_promtool(args: list[str]) -> None:
    p = subprocess.run([promtool(), *args], cwd=PROM_DIR, capture_output=True, text=True, timeout=60)
    assert p.returncode == 0, p.stdout + p.stderr


def test_the_kubernetes_scrape_config_finds_the_router_pods_in_the_job_the_alerts_match() -> None:
    # (the manifests are scraped through prometheus.io annotations, whose job
    # is the discovery job: FairstreamRouterDown matched nothing there)
    import yaml

    config = yaml.safe_load((PROM_DIR / "prometheus-k8s.yml").read_text())
    [job] = config["scrape_configs"]
    assert job["job_name"] == "fairstream" and 'job="fairstream"' in (PROM_DIR / "alerts.yml").read_text()
    deploy = next(d for d in yaml.safe_load_all((PROM_DIR.parent / "deploy" / "k8s" / "router.yaml").read_text())
                  if d and d.get("kind") == "Deployment")
    labels = deploy["spec"]["template"]["metadata"]["labels"]
    ports = [str(p["containerPort"]) for c in deploy["spec"]["template"]["spec"]["containers"] for p in c["ports"]]
    meta = {"__meta_kubernetes_pod_label_" + re.sub(r"[^a-zA-Z0-9_]", "_", k): v for k, v in labels.items()}
    for rule in job["relabel_configs"]:
        if rule.get("action") != "keep":
            continue
        if rule["source_labels"] == ["__meta_kubernetes_pod_container_port_number"]:
            assert any(re.fullmatch(rule["regex"], p) for p in ports), (rule, ports)
        else:
            value = ";".join(meta.get(name, "") for name in rule["source_labels"])
            assert re.fullmatch(rule["regex"], value), (rule, value)
