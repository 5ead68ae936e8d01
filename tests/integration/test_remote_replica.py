"""Remote replicas: `fairstream replica --listen` over TCP, guarded by a shared secret."""

from __future__ import annotations

import os
import subprocess
import sys

import httpx
import pytest

from tests.helpers import GOLD, MODEL, STARTUP_WAIT, RouterProcess, poll, remote_replica_process

SECRET = "s3cret-for-tests"


@pytest.fixture
def remote_replica(tmp_path):
    with remote_replica_process(tmp_path / "replica.log", "FS_TEST_SECRET", SECRET,
                                {"model": MODEL, "seed": 0}) as (port, proc):
        yield port, proc


def _router(tmp_path, port: int, secret_env: str | None) -> RouterProcess:
    r = RouterProcess(tmp_path / "router", replicas=0, settings={
        "replicas": [{"name": "far-0", "address": f"127.0.0.1:{port}", "secret_env": secret_env}],
        "health_interval": 0.2,
        "restart_backoff_max": 0.5,
    })
    r.replica_names = ["far-0"]
    return r


def test_router_streams_from_a_remote_replica_with_the_secret(tmp_path, remote_replica, monkeypatch):
    port, _ = remote_replica
    monkeypatch.setenv("FS_ROUTER_SECRET", SECRET)
    with _router(tmp_path, port, "FS_ROUTER_SECRET") as router:
        r = httpx.post(router.base_url + "/v1/completions", headers={"Authorization": f"Bearer {GOLD}"},
                       json={"model": MODEL, "prompt": "Le caf", "max_tokens": 12}, timeout=20)
        assert r.status_code == 200, r.text
        assert r.json()["usage"]["completion_tokens"] == 12


def test_a_router_without_the_secret_is_refused(tmp_path, remote_replica, monkeypatch):
    port, _ = remote_replica
    monkeypatch.setenv("FS_ROUTER_SECRET", "wrong")
    router = _router(tmp_path, port, "FS_ROUTER_SECRET")
    router.start(serving=True)  # (its replica never becomes ready)
    try:
        poll(lambda: "bad replica secret" in router.log(), STARTUP_WAIT, what="the replica's refusal logged")
        r = httpx.get(router.base_url + "/ready", timeout=5)
        assert r.status_code == 503 and r.json()["replicas"]["far-0"] != "ready", r.text
    finally:
        router.stop()


def test_remote_replica_loss_is_retried_with_backoff(tmp_path, remote_replica, monkeypatch):
    port, proc = remote_replica
    monkeypatch.setenv("FS_ROUTER_SECRET", SECRET)
    with _router(tmp_path, port, "FS_ROUTER_SECRET") as router:
        proc.kill()
        proc.wait()
        poll(lambda: httpx.get(router.base_url + "/ready", timeout=2).status_code == 503, 10,
             what="router notices the lost remote replica")
        # a new replica on the same address is picked up again by the reconnect loop
        env = dict(os.environ, FS_TEST_SECRET=SECRET)
        again = subprocess.Popen(
            [sys.executable, "-m", "replicas", "--engine", "sim", "--listen", f"127.0.0.1:{port}",
             "--secret-env", "FS_TEST_SECRET", "--config-json", '{"model": "%s"}' % MODEL],
            env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
        )
        try:
            poll(lambda: httpx.get(router.base_url + "/ready", timeout=2).status_code == 200, 15,
                 what="router reconnects to the restarted remote replica")
        finally:
            again.terminate()
            again.wait(10)
