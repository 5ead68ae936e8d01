"""The deployment examples parse, name what exists and carry valid fairstream configs."""

from __future__ import annotations

import configparser
import re
import shlex
import shutil
import subprocess
from pathlib import Path

import msgspec
import pytest
import yaml

from router.config import SHUTDOWN_MARGIN, RouterConfig
from router.configfile import load_yaml
from router.tenants import TenantsFile

DEPLOY = Path(__file__).resolve().parents[2] / "ops" / "deploy"
K8S_REQUIRED = {"apiVersion", "kind", "metadata"}
ROUTER_PATHS = {"/ready", "/health", "/metrics"}


def _k8s_docs() -> list[dict]:
    docs = []
    for path in sorted((DEPLOY / "k8s").glob("*.yaml")):
        for doc in yaml.safe_load_all(path.read_text()):
            if doc is not None:
                docs.append(doc)
    return docs


def test_k8s_manifests_have_the_expected_objects():
    docs = _k8s_docs()
    for d in docs:
        assert K8S_REQUIRED <= d.keys(), d
        assert d["metadata"].get("name"), d
    kinds = {(d["kind"], d["metadata"]["name"]) for d in docs}
    assert ("Deployment", "fairstream-router") in kinds
    assert ("Service", "fairstream") in kinds
    assert ("StatefulSet", "fairstream-replica") in kinds
    assert ("Service", "fairstream-replica") in kinds
    assert ("ConfigMap", "fairstream-config") in kinds
    assert ("Deployment", "fairstream-redis") in kinds


def test_k8s_selectors_match_pod_labels_and_probes_hit_real_paths():
    for d in _k8s_docs():
        if d["kind"] in ("Deployment", "StatefulSet"):
            labels = d["spec"]["template"]["metadata"]["labels"]
            assert d["spec"]["selector"]["matchLabels"].items() <= labels.items()
            for c in d["spec"]["template"]["spec"]["containers"]:
                for probe in ("readinessProbe", "livenessProbe"):
                    get = c.get(probe, {}).get("httpGet")
                    if get:
                        assert get["path"] in ROUTER_PATHS
    services = [d for d in _k8s_docs() if d["kind"] == "Service"]
    pods = [d["spec"]["template"]["metadata"]["labels"] for d in _k8s_docs() if d["kind"] in ("Deployment", "StatefulSet")]
    for svc in services:
        assert any(svc["spec"]["selector"].items() <= labels.items() for labels in pods), svc["metadata"]


def test_k8s_router_pods_are_scraped_and_replicas_get_one_gpu():
    docs = {(d["kind"], d["metadata"]["name"]): d for d in _k8s_docs()}
    ann = docs[("Deployment", "fairstream-router")]["spec"]["template"]["metadata"]["annotations"]
    assert ann["prometheus.io/scrape"] == "true" and ann["prometheus.io/path"] == "/metrics"
    rep = docs[("StatefulSet", "fairstream-replica")]["spec"]["template"]["spec"]["containers"][0]
    assert rep["resources"]["limits"]["nvidia.com/gpu"] == 1


def test_k8s_pods_that_run_fairstream_have_an_init_that_reaps_orphans():
    # (fairstream as PID 1 reaps only its own children: a replica's engine
    # processes orphaned by a crashed engine core would stay zombies)
    docs = {(d["kind"], d["metadata"]["name"]): d for d in _k8s_docs()}
    for key in (("Deployment", "fairstream-router"), ("StatefulSet", "fairstream-replica")):
        assert docs[key]["spec"]["template"]["spec"].get("shareProcessNamespace") is True, key


def test_k8s_configmap_configs_validate(tmp_path):
    cm = next(d for d in _k8s_docs() if d["kind"] == "ConfigMap")
    for name, text in cm["data"].items():
        (tmp_path / name).write_text(text)
    cfg, _ = load_yaml(tmp_path / "router.yaml", RouterConfig)
    load_yaml(tmp_path / "tenants.yaml", TenantsFile)
    assert cfg.state.backend == "redis"
    sts = next(d for d in _k8s_docs() if d["kind"] == "StatefulSet")
    # the router lists exactly the StatefulSet's pods, by their stable DNS names
    want = {f"{sts['metadata']['name']}-{i}.{sts['spec']['serviceName']}:7000" for i in range(sts["spec"]["replicas"])}
    assert {r.address for r in cfg.replicas} == want


def test_k8s_and_systemd_wait_out_the_routers_shutdown_grace():
    # SIGKILL before the grace and its margin are over would cut streams without a word
    cm = next(d for d in _k8s_docs() if d["kind"] == "ConfigMap")
    k8s_grace = msgspec.yaml.decode(cm["data"]["router.yaml"], type=RouterConfig).shutdown_grace
    router = next(d for d in _k8s_docs() if d["metadata"]["name"] == "fairstream-router")
    pre_stop = float(router["spec"]["template"]["spec"]["containers"][0]["lifecycle"]["preStop"]["exec"]["command"][1])
    assert router["spec"]["template"]["spec"]["terminationGracePeriodSeconds"] > pre_stop + k8s_grace + SHUTDOWN_MARGIN
    cfg, _ = load_yaml(DEPLOY / "systemd" / "router.yaml", RouterConfig)
    stop = float(_unit(DEPLOY / "systemd" / "fairstream-router.service")["Service"]["TimeoutStopSec"])
    assert stop > cfg.shutdown_grace + SHUTDOWN_MARGIN


def _unit(path: Path) -> configparser.ConfigParser:
    cp = configparser.ConfigParser(strict=False, interpolation=None)
    cp.optionxform = str
    cp.read_string(path.read_text())
    return cp


@pytest.mark.parametrize("name", ["fairstream-router.service", "fairstream-replica@.service"])
def test_systemd_units_parse_and_run_fairstream(name):
    unit = _unit(DEPLOY / "systemd" / name)
    assert {"Unit", "Service", "Install"} <= set(unit.sections())
    argv = shlex.split(unit["Service"]["ExecStart"])
    assert argv[0].endswith("/fairstream")
    assert argv[1] in ("serve", "replica")
    if argv[1] == "replica":
        # the CLI accepts every flag the unit passes
        from replicas.cli import add_arguments
        import argparse

        p = argparse.ArgumentParser()
        add_arguments(p)
        args = p.parse_args([a.replace("%i", "0") for a in argv[2:]])
        _check_gpu_engine_config(args.config_json)
    if shutil.which("systemd-analyze"):
        res = subprocess.run(["systemd-analyze", "verify", str(DEPLOY / "systemd" / name)],
                             capture_output=True, text=True)
        # verify complains about the missing binary on this host; syntax errors are what matter
        assert "Unknown section" not in res.stderr and "Unknown key" not in res.stderr, res.stderr


def test_systemd_router_config_matches_replica_units():
    cfg, _ = load_yaml(DEPLOY / "systemd" / "router.yaml", RouterConfig)
    unit = (DEPLOY / "systemd" / "fairstream-replica@.service").read_text()
    port_pattern = re.search(r"--listen 127\.0\.0\.1:(\d+)%i", unit).group(1)
    assert {r.address for r in cfg.replicas} == {f"127.0.0.1:{port_pattern}{i}" for i in range(len(cfg.replicas))}
    assert all(r.secret_env for r in cfg.replicas)


def _check_gpu_engine_config(config_json: str) -> None:
    """A GPU replica's settings, not the CPU test model's defaults (they
    capped Llama-3-8B at 2,048 tokens of context and turned CUDA graphs off,
    and clients had to name the model by its path)."""
    from replicas.vllm_engine import VllmEngineConfig

    cfg = msgspec.convert(msgspec.json.decode(config_json), VllmEngineConfig)
    assert cfg.max_model_len >= 8192 and not cfg.enforce_eager and cfg.served_name, cfg


def test_the_k8s_replicas_run_a_gpu_engine_config():
    docs = list(yaml.safe_load_all((DEPLOY / "k8s" / "replicas.yaml").read_text()))
    (sts,) = [d for d in docs if d and d.get("kind") == "StatefulSet"]
    command = sts["spec"]["template"]["spec"]["containers"][0]["command"]
    _check_gpu_engine_config(command[command.index("--config-json") + 1])


def test_the_router_unit_restarts_it_after_a_death_by_sighup():
    # (serve ignores SIGHUP from its first lines, not while the interpreter
    # starts: a reload then kills it, and systemd counts that death as clean)
    service = _unit(DEPLOY / "systemd" / "fairstream-router.service")["Service"]
    assert "-HUP" in service["ExecReload"] and service["Restart"] == "on-failure"
    assert "SIGHUP" in service["RestartForceExitStatus"].split()
