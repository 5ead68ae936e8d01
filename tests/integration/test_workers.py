"""`fairstream serve --workers N`: several router processes on one port, one Redis."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import subprocess
import sys
import time

import httpx
import pytest
import yaml

from router.auth import hash_key
from tests.helpers import DEMO_TENANTS, MODEL, STARTUP_WAIT, MetricsSnapshot, alive, descendants, free_port, poll

KEY = "workers-test-key"


def _start(tmp_path, redis_url: str, workers: int):
    tenants = yaml.safe_load(DEMO_TENANTS.read_text())
    tenants["tenants"]["limited"] = {"keys": [hash_key(KEY)], "on_limit": "reject",
                                     "limits": {"requests_per_minute": 10}}
    (tmp_path / "tenants.yaml").write_text(yaml.safe_dump(tenants))
    port = free_port()
    (tmp_path / "router.yaml").write_text(yaml.safe_dump({
        "host": "127.0.0.1", "port": port, "tenants": str(tmp_path / "tenants.yaml"),
        "state": {"backend": "redis", "url": redis_url},
        "replicas": [{"name": f"sim-{i}", "engine": "sim", "config": {"model": MODEL}} for i in range(2)],
    }))
    log = open(tmp_path / "router.log", "wb")
    proc = subprocess.Popen(
        [sys.executable, "-c", "from router.cli import main; main()", "serve", "--config",
         str(tmp_path / "router.yaml"), "--workers", str(workers)],
        stdout=log, stderr=subprocess.STDOUT, env=dict(os.environ, PYTHONUNBUFFERED="1"),
    )
    base = f"http://127.0.0.1:{port}"

    def ready():
        try:
            return httpx.get(base + "/ready", timeout=2).status_code == 200
        except httpx.HTTPError:
            return False

    try:
        poll(ready, STARTUP_WAIT, what="workers ready")
    except BaseException:
        _kill_tree(proc)
        raise
    return proc, base


def _kill_tree(proc: subprocess.Popen) -> None:
    for pid in [*descendants(proc.pid), proc.pid]:
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    proc.wait(10)


def _stop(proc: subprocess.Popen) -> None:
    """SIGTERM ``serve`` and wait for it, its workers and its replicas to
    exit; whatever is left after that is killed, so a failing test leaks no
    process (under load a worker test's router once outlived it)."""
    kids = descendants(proc.pid)
    proc.send_signal(signal.SIGTERM)
    try:
        proc.wait(30)
        poll(lambda: not any(alive(p) for p in kids), 15, what="workers and replicas exit")
    finally:
        for pid in kids:
            if alive(pid):
                try:
                    os.kill(pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
        if proc.poll() is None:
            _kill_tree(proc)


def test_workers_need_redis(tmp_path):
    (tmp_path / "router.yaml").write_text(yaml.safe_dump({
        "tenants": str(DEMO_TENANTS), "replicas": [{"name": "sim-0"}]}))
    res = subprocess.run([sys.executable, "-c", "from router.cli import main; main()", "serve", "--config",
                          str(tmp_path / "router.yaml"), "--workers", "2"], capture_output=True, text=True,
                         timeout=30)
    assert res.returncode == 1 and "state: {backend: redis}" in res.stderr


async def test_two_workers_share_limits_and_metrics(tmp_path, redis_server):
    proc, base = _start(tmp_path, redis_server.url, 2)
    try:
        workers = [p for p in descendants(proc.pid) if "router.worker" in open(f"/proc/{p}/cmdline").read()]
        assert len(workers) == 2
        # many fresh connections: the kernel spreads them over both workers
        async def one(i: int) -> int:
            async with httpx.AsyncClient(timeout=30) as c:
                r = await c.post(base + "/v1/completions", headers={"Authorization": f"Bearer {KEY}"},
                                 json={"model": MODEL, "prompt": "x", "max_tokens": 2})
                return r.status_code

        codes = await asyncio.gather(*[one(i) for i in range(40)])
        assert codes.count(200) == 10 and codes.count(429) == 30, codes
        # every worker's /metrics shows the sum over all workers
        seen = set()
        for _ in range(12):
            with httpx.Client(timeout=5) as c:  # a fresh connection each time
                m = MetricsSnapshot(c.get(base + "/metrics").text)
            seen.add(m.value("fairstream_requests_total", tenant="limited", outcome="ok"))
            assert m.value("fairstream_rate_limited_total", tenant="limited", limit="requests") == 30
        assert seen == {10.0}
        # (series with no event yet are exported at 0 in multiprocess mode too)
        assert m.value("fairstream_queue_depth", tenant="limited", priority="normal") == 0
        assert m.value("fairstream_stream_resumes_total", tenant="gold") == 0
        assert m.value("fairstream_state_store_errors_total", op="admit") == 0
        # the workers' request lines are JSON with their fields, like a single router's
        lines = [json.loads(line) for line in (tmp_path / "router.log").read_text().splitlines()
                 if line.startswith("{") and '"fairstream.request"' in line]
        assert len(lines) == 40, (tmp_path / "router.log").read_text()[-3000:]
        assert {line["outcome"] for line in lines} == {"ok", "rate_limited"}
        assert all(line["tenant"] == "limited" and line["request_id"] for line in lines)
    finally:
        _stop(proc)


async def test_a_dead_worker_is_restarted(tmp_path, redis_server):
    proc, base = _start(tmp_path, redis_server.url, 2)
    try:
        def workers():
            out = []
            for p in descendants(proc.pid):
                try:
                    if "router.worker" in open(f"/proc/{p}/cmdline").read():
                        out.append(p)
                except FileNotFoundError:
                    pass
            return out

        first = workers()
        os.kill(first[0], signal.SIGKILL)
        poll(lambda: len(workers()) == 2 and first[0] not in workers(), 20, what="worker restarted")
        poll(lambda: httpx.get(base + "/ready", timeout=2).status_code == 200, 20, what="ready again")
        # a replica that dies is one restart, whichever worker answers /metrics (each worker reconnects)
        victims = [p for p in descendants(proc.pid) if "sim-0.sock" in open(f"/proc/{p}/cmdline").read()]
        assert len(victims) == 1, victims
        os.kill(victims[0], signal.SIGKILL)

        def restarts() -> float:
            with httpx.Client(timeout=5) as c:
                return MetricsSnapshot(c.get(base + "/metrics").text).value(
                    "fairstream_replica_restarts_total", 0.0, replica="sim-0")

        poll(lambda: restarts() >= 1, 20, what="the restart counted")
        poll(lambda: httpx.get(base + "/ready", timeout=2).status_code == 200, 20, what="ready again")
        time.sleep(2)  # (the workers have reconnected by now)
        assert restarts() == 1
        # Ctrl-C: 130, as a single router exits (it was 0)
        kids = descendants(proc.pid)
        proc.send_signal(signal.SIGINT)
        assert proc.wait(30) == 130
        poll(lambda: not any(alive(p) for p in kids), 15, what="workers and replicas exit")
    finally:
        _stop(proc)


def test_a_second_instance_on_the_same_port_is_refused_and_a_sighup_while_starting_is_harmless(
        tmp_path, redis_server):
    # The workers bind with SO_REUSEPORT, so a second `serve --workers` on
    # the same port bound it too and silently shared its clients; and a
    # SIGHUP (systemd's reload) in the first seconds killed the parent or
    # its starting workers.
    first = tmp_path / "first"
    first.mkdir()
    log = open(tmp_path / "first.log", "wb")
    tenants = tmp_path / "tenants.yaml"
    tenants.write_text(DEMO_TENANTS.read_text())
    port = free_port()
    config = {"host": "127.0.0.1", "port": port, "tenants": str(tenants),
              "state": {"backend": "redis", "url": redis_server.url},
              "replicas": [{"name": "sim-0", "engine": "sim", "config": {"model": MODEL}}]}
    (tmp_path / "router.yaml").write_text(yaml.safe_dump(config))
    cmd = [sys.executable, "-c", "from router.cli import main; main()", "serve", "--config",
           str(tmp_path / "router.yaml"), "--workers", "2"]
    proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=dict(os.environ, PYTHONUNBUFFERED="1"))
    base = f"http://127.0.0.1:{port}"
    try:
        def ready() -> bool:
            try:
                return httpx.get(base + "/ready", timeout=2).status_code == 200
            except httpx.HTTPError:
                return False

        def hup_handled(pid: int) -> bool:  # (ignored or caught: from `serve`'s first lines, not the interpreter's)
            status = open(f"/proc/{pid}/status").read()
            masks = [int(line.split()[1], 16) for line in status.splitlines() if line.startswith(("SigIgn", "SigCgt"))]
            return any(m & 1 for m in masks)

        poll(lambda: hup_handled(proc.pid), STARTUP_WAIT, what="serve to start")
        deadline = time.monotonic() + STARTUP_WAIT
        while not ready() and time.monotonic() < deadline:  # all the time the replica and the workers start
            assert proc.poll() is None, (tmp_path / "first.log").read_text()[-3000:]
            time.sleep(0.1)
            os.kill(proc.pid, signal.SIGHUP)
            for p in descendants(proc.pid):
                try:
                    with open(f"/proc/{p}/cmdline", "rb") as f:
                        if b"router.worker" in f.read():
                            os.kill(p, signal.SIGHUP)
                except (FileNotFoundError, ProcessLookupError):
                    pass  # (a short-lived child, gone meanwhile)
        poll(lambda: httpx.get(base + "/ready", timeout=2).status_code == 200
             if proc.poll() is None else pytest.fail((tmp_path / "first.log").read_text()[-3000:]),
             STARTUP_WAIT, what="workers ready")
        assert "exited with" not in (tmp_path / "first.log").read_text()  # (no worker died of it)
        second = subprocess.run(cmd, capture_output=True, text=True, timeout=30)
        assert second.returncode == 3, second.stderr
        assert f"cannot listen on 127.0.0.1:{port}" in second.stderr and "in use" in second.stderr, second.stderr
        assert httpx.get(base + "/ready", timeout=2).status_code == 200
    finally:
        _stop(proc)
