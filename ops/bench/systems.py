"""The systems under test, how each starts, and where the load goes.

Upstream systems (two mock OpenAI upstreams, ``ops/bench/mock_upstream.py``):

* ``direct``       the load client talks to the two mocks itself (users alternate).
* ``fairstream``   ``fairstream serve`` with ``url:`` replicas on the mocks.
* ``vllm-router``  vllm-router 0.1.17 (PyPI, its own venv), ``--policy round_robin``.
* ``litellm``      LiteLLM proxy (PyPI ``litellm[proxy]``, its own venv), two
                   openai-compatible deployments of one model name.
* ``py-floor``     ``ops/bench/floor_proxy.py``: the least per-token work a
                   Python router can do (a reference line, not a product);
                   ``py-floor-features`` adds fairstream's bookkeeping.

Sim systems (two ``fairstream replica --engine sim`` processes on Unix sockets):

* ``sim-direct``     the load client speaks the replica protocol to them
                     (``replicas.client.connect`` + ``generate``).
* ``fairstream-sim`` ``fairstream serve`` attached to them (``address: unix:...``).

Every fairstream here does its full job: API-key auth, a tenant policy with
(generous) rate limits and concurrency leases, fair queues, token
accounting, resume buffers, Prometheus metrics and one JSON log line per
request. Adaptive in-flight caps are off (``batching.enabled: false``) on the
upstream systems, as neither other router caps in flight; S4 sets a fixed cap.
"""

from __future__ import annotations

import json
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

from ops.bench.procs import Proc, free_port, wait_http

__all__ = ["Target", "Env", "UPSTREAM_SYSTEMS", "SIM_SYSTEMS", "DIRECT_OF", "start_system", "start_sims", "sim_target",
           "MockPair", "SimPair", "TENANT_KEYS", "ROOT", "VENVS"]

UPSTREAM_SYSTEMS = ["direct", "fairstream", "vllm-router", "litellm", "py-floor", "py-floor-features"]
SIM_SYSTEMS = ["sim-direct", "fairstream-sim"]
DIRECT_OF = {"fairstream": "direct", "vllm-router": "direct", "litellm": "direct", "py-floor": "direct",
             "py-floor-features": "direct", "fairstream-sim": "sim-direct"}

ROOT = Path(__file__).resolve().parents[2]
BENCH = Path(__file__).resolve().parent
VENVS = BENCH / ".venvs"
TENANT_KEYS = ["bench-t0", "bench-t1", "bench-t2", "bench-t3"]
LITELLM_KEY = "sk-" + "b3nch" * 12  # LiteLLM refuses to start without a strong master key


@dataclass
class Env:
    run_dir: Path  # logs and results
    cfg_dir: Path  # generated configs (apart from logs: fairstream watches its tenants dir)
    python: str = sys.executable
    fairstream_src: Path = ROOT  # tree whose router/ and replicas/ the fairstream systems run
    mock_ports: list[int] = field(default_factory=list)


@dataclass
class Target:
    """Where a scenario's load goes, and the router process to watch (if any)."""

    system: str
    kind: str  # "http" | "replica"
    ports: list[int] = field(default_factory=list)
    path: str = "/v1/chat/completions"
    model: str = "mock"
    keys: list[str] = field(default_factory=lambda: ["none"])
    addresses: list[str] = field(default_factory=list)
    token_chars: int = 4
    router: Proc | None = None
    extra_body: dict = field(default_factory=dict)

    def stop(self) -> None:
        if self.router is not None:
            self.router.stop()


class MockPair:
    """The two mock upstreams, started once per benchmark run."""

    def __init__(self, env: Env) -> None:
        self.procs: list[Proc] = []
        for i in range(2):
            port = free_port()
            p = Proc(f"mock-{i}", [env.python, "-m", "ops.bench.mock_upstream", "--port", str(port)],
                     env.run_dir / f"mock-{i}.log", cwd=str(ROOT))
            self.procs.append(p)
            env.mock_ports.append(port)
        self.ports = list(env.mock_ports)
        for p, port in zip(self.procs, self.ports):
            if not wait_http(f"http://127.0.0.1:{port}/v1/models", 20, p):
                self.stop()
                raise RuntimeError(f"mock upstream did not start:\n{p.tail()}")

    def configure(self, cfg: dict) -> None:
        from ops.bench.procs import http_json

        body = json.dumps({"delay_ms": 0.0, "hold_ms": 0.0, "first_ms": 0.0} | cfg).encode()
        for port in self.ports:
            http_json(f"http://127.0.0.1:{port}/_bench/config", body)

    def cpu(self) -> float:
        return sum(p.cpu() for p in self.procs)

    def stop(self) -> None:
        for p in self.procs:
            p.stop()


def _hash(key: str) -> str:
    import hashlib

    return hashlib.sha256(key.encode()).hexdigest()


def _write_fairstream_config(env: Env, name: str, port: int, replicas: list[dict]) -> Path:
    d = env.cfg_dir / name
    d.mkdir(parents=True, exist_ok=True)
    tenants = {
        "priority_classes": ["high", "normal", "low"],
        "defaults": {
            "priority": "normal",
            "limits": {"requests_per_minute": 1_000_000, "tokens_per_minute": 1_000_000_000,
                       "max_concurrent": 100_000, "max_tokens": 4096},
            "timeouts": {"queue_wait": 120, "first_token": 120, "stall": 60, "total": 600},
            "queue_depth": 10_000,
            "on_limit": "queue",
        },
        "tenants": {
            f"t{i}": {"keys": [_hash(k)], "weight": [1, 2, 1, 3][i], "priority": ["normal", "normal", "high", "low"][i]}
            for i, k in enumerate(TENANT_KEYS)
        },
    }
    router = {
        "host": "127.0.0.1",
        "port": port,
        "tenants": "tenants.yaml",
        "default_max_tokens": 256,
        "batching": {"enabled": False, "max_inflight": 100_000},
        "replicas": replicas,
    }
    # JSON is YAML
    (d / "tenants.yaml").write_text(json.dumps(tenants, indent=1))
    (d / "router.yaml").write_text(json.dumps(router, indent=1))
    return d / "router.yaml"


def _fairstream(env: Env, name: str, replicas: list[dict], model: str, token_chars: int,
                extra_body: dict | None = None) -> Target:
    port = free_port()
    cfg = _write_fairstream_config(env, name, port, replicas)
    src = str(env.fairstream_src)
    proc = Proc(name, [env.python, "-c", "from router.cli import main; main()", "serve", "--config", str(cfg)],
                env.run_dir / f"{name}.log", cwd=src, env={"PYTHONPATH": src})
    if not wait_http(f"http://127.0.0.1:{port}/ready", 60, proc):
        proc.stop()
        raise RuntimeError(f"{name} did not become ready:\n{proc.tail()}")
    return Target(name, "http", [port], model=model, keys=list(TENANT_KEYS), token_chars=token_chars,
                  router=proc, extra_body=extra_body or {})


def start_system(system: str, env: Env) -> Target:
    """Start ``system`` in front of the mocks (``env.mock_ports``); return its target."""
    p1, p2 = env.mock_ports
    if system == "direct":
        return Target(system, "http", [p1, p2])
    if system == "fairstream":
        reps = [{"name": f"up-{i}", "url": f"http://127.0.0.1:{p}/v1"} for i, p in enumerate((p1, p2))]
        return _fairstream(env, "fairstream", reps, "mock", 4)
    if system == "vllm-router":
        exe = VENVS / "vllm-router" / "bin" / "vllm-router"
        if not exe.exists():
            raise FileNotFoundError(f"{exe} missing: python -m ops.bench --install")
        port, prom = free_port(), free_port()
        proc = Proc(system, [str(exe), "--worker-urls", f"http://127.0.0.1:{p1}", f"http://127.0.0.1:{p2}",
                             "--policy", "round_robin", "--host", "127.0.0.1", "--port", str(port),
                             "--prometheus-host", "127.0.0.1", "--prometheus-port", str(prom)],
                    env.run_dir / f"{system}.log", cwd=str(env.run_dir))
        if not wait_http(f"http://127.0.0.1:{port}/health", 60, proc):
            proc.stop()
            raise RuntimeError(f"vllm-router did not start:\n{proc.tail()}")
        return Target(system, "http", [port], router=proc)
    if system in ("py-floor", "py-floor-features"):
        port = free_port()
        args = [env.python, "-m", "ops.bench.floor_proxy", "--port", str(port),
                "--upstream", f"127.0.0.1:{p1}", "--upstream", f"127.0.0.1:{p2}"]
        for k in TENANT_KEYS:
            args += ["--key", k]
        if system == "py-floor-features":
            args.append("--features")
        proc = Proc(system, args, env.run_dir / f"{system}.log", cwd=str(ROOT))
        if not wait_http(f"http://127.0.0.1:{port}/health", 30, proc):
            proc.stop()
            raise RuntimeError(f"{system} did not start:\n{proc.tail()}")
        return Target(system, "http", [port], keys=list(TENANT_KEYS), router=proc)
    if system == "litellm":
        exe = VENVS / "litellm" / "bin" / "litellm"
        if not exe.exists():
            raise FileNotFoundError(f"{exe} missing: python -m ops.bench --install")
        port = free_port()
        d = env.cfg_dir / "litellm"
        d.mkdir(parents=True, exist_ok=True)
        cfg = {
            "model_list": [
                {"model_name": "mock", "litellm_params": {
                    "model": "openai/mock", "api_base": f"http://127.0.0.1:{p}/v1", "api_key": "sk-bench"}}
                for p in (p1, p2)
            ],
            "router_settings": {"routing_strategy": "simple-shuffle"},
            "litellm_settings": {"drop_params": True, "request_timeout": 600},
        }
        (d / "config.yaml").write_text(json.dumps(cfg, indent=1))
        proc = Proc(system, [str(exe), "--config", str(d / "config.yaml"), "--host", "127.0.0.1", "--port", str(port)],
                    env.run_dir / f"{system}.log", cwd=str(env.run_dir),
                    env={"LITELLM_LOCAL_MODEL_COST_MAP": "True", "LITELLM_TELEMETRY": "False",
                         "DISABLE_SCHEMA_UPDATE": "True", "LITELLM_MASTER_KEY": LITELLM_KEY})
        if not wait_http(f"http://127.0.0.1:{port}/health/liveliness", 120, proc):
            proc.stop()
            raise RuntimeError(f"litellm did not start:\n{proc.tail()}")
        return Target(system, "http", [port], keys=[LITELLM_KEY], router=proc)
    raise ValueError(f"unknown upstream system {system!r}")


class SimPair:
    """Two sim replica processes on Unix sockets, with one scenario's config."""

    def __init__(self, env: Env, config: dict, tag: str) -> None:
        self.procs: list[Proc] = []
        self.addresses: list[str] = []
        for i in range(2):
            sock = env.cfg_dir / f"sim-{tag}-{i}.sock"
            if sock.exists():
                sock.unlink()
            p = Proc(f"sim-{i}", [env.python, "-m", "replicas", "--engine", "sim", "--socket", str(sock),
                                  "--config-json", json.dumps(config | {"seed": 0})],
                     env.run_dir / f"sim-{tag}-{i}.log", cwd=str(ROOT))
            self.procs.append(p)
            self.addresses.append(f"unix:{sock}")
        end = time.monotonic() + 30
        for p, a in zip(self.procs, self.addresses):
            while not Path(a[5:]).exists() or "ready" not in p.tail(5):
                if time.monotonic() > end or not p.alive():
                    self.stop()
                    raise RuntimeError(f"sim replica did not start:\n{p.tail()}")
                time.sleep(0.1)

    def cpu(self) -> float:
        return sum(p.cpu() for p in self.procs)

    def stop(self) -> None:
        for p in self.procs:
            p.stop()


def start_sims(env: Env, config: dict, tag: str) -> SimPair:
    return SimPair(env, config, tag)


def sim_target(system: str, env: Env, sims: SimPair, cap: int | None) -> Target:
    extra = {"ignore_eos": True, "temperature": 0.0}
    if system == "sim-direct":
        return Target(system, "replica", addresses=list(sims.addresses), model="fairstream-sim", token_chars=0)
    reps = []
    for i, a in enumerate(sims.addresses):
        r = {"name": f"sim-{i}", "address": a}
        if cap:
            r["max_concurrency"] = cap
        reps.append(r)
    return _fairstream(env, "fairstream-sim", reps, "fairstream-sim", 0, extra)

