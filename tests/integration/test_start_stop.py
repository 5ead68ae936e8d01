"""A router stops promptly whatever is still starting: the first contact
with Redis, a replica's connect.

(A router started on a port in use sometimes never exited, SIGTERM and
SIGINT ignored: its stop waited on a start-up task. A Redis that accepts
connections and never answers makes the wait certain: the stop waited for
the first contact's ``connect_timeout``.)
"""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import yaml

from tests.helpers import DEMO_TENANTS, MODEL, ROOT, STARTUP_WAIT, poll, remote_replica_process, wait_or_dump

SECRET = "s3cret-for-tests"
CONNECT_TIMEOUT = 60.0  # the router's first contact with the deaf Redis (far past every wait below)
PROMPT = 8.0  # seconds a stop may take here (on a loaded test machine)


@contextlib.contextmanager
def _deaf() -> Iterator[int]:
    """A listener on a free loopback port that accepts connections and never
    answers (a Redis that hangs, or is SIGSTOPped): its port."""
    server = socket.create_server(("127.0.0.1", 0), backlog=128)
    held: list[socket.socket] = []
    stop = threading.Event()

    def accept() -> None:
        server.settimeout(0.1)
        while not stop.is_set():
            with contextlib.suppress(TimeoutError, OSError):
                held.append(server.accept()[0])

    thread = threading.Thread(target=accept, daemon=True)
    thread.start()
    try:
        yield server.getsockname()[1]
    finally:
        stop.set()
        thread.join(5)
        for conn in held:
            conn.close()
        server.close()


@pytest.fixture
def replica(tmp_path) -> Iterator[int]:
    with remote_replica_process(tmp_path / "replica.log", "FS_TEST_SECRET", SECRET,
                                {"model": MODEL, "seed": 0}) as (port, _):
        yield port


def _serve(tmp_path: Path, redis_port: int, replica_port: int, port: int) -> tuple[subprocess.Popen[bytes], Path]:
    config = {
        "host": "127.0.0.1",
        "port": port,
        "tenants": str(DEMO_TENANTS),
        "shutdown_grace": 1.0,
        "state": {"backend": "redis", "url": f"redis://127.0.0.1:{redis_port}/0", "connect_timeout": CONNECT_TIMEOUT},
        "replicas": [{"name": f"gpu-{i}", "address": f"127.0.0.1:{replica_port}", "secret_env": "FS_ROUTER_SECRET"}
                     for i in range(2)],
    }
    (tmp_path / "router.yaml").write_text(yaml.safe_dump(config, sort_keys=False))
    log_path = tmp_path / "router.log"
    with open(log_path, "wb") as log:
        proc = subprocess.Popen(
            [sys.executable, "-c", "from router.cli import main; main()", "serve", "--config",
             str(tmp_path / "router.yaml"), "--log-format", "text"],
            cwd=ROOT, env=dict(os.environ, FS_ROUTER_SECRET=SECRET, PYTHONFAULTHANDLER="1"),
            stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
        )
    return proc, log_path


def _exit_code(proc: subprocess.Popen[bytes], log_path: Path, within: float, what: str) -> int:
    """The router's exit code within ``within`` seconds; else its stacks
    (SIGABRT, faulthandler) go to its log, it is killed and the test fails."""
    code = wait_or_dump(proc, within)
    if code is None:
        raise AssertionError(f"the router did not exit within {within}s {what}; log:\n"
                             f"{log_path.read_text(errors='replace')[-6000:]}")
    return code


def test_router_on_a_port_in_use_exits_3_at_once_while_redis_never_answers(tmp_path, replica) -> None:
    with _deaf() as redis_port, socket.create_server(("127.0.0.1", 0)) as taken:
        port = taken.getsockname()[1]
        started = time.monotonic()
        proc, log_path = _serve(tmp_path, redis_port, replica, port)
        code = _exit_code(proc, log_path, STARTUP_WAIT / 4 + PROMPT, "of its start on a port in use")
    log = log_path.read_text(errors="replace")
    assert code == 3, log
    # (its start-up takes a few seconds on a loaded machine; the stop itself, none of connect_timeout's 60)
    assert time.monotonic() - started < CONNECT_TIMEOUT / 2, log
    # the line names the address and the reason, whatever came between uvicorn's line and it
    assert f"cannot listen on 127.0.0.1:{port}: [Errno 98]" in log and "address already in use" in log, log
    assert "the line before says why" not in log, log


def test_sigterm_stops_a_router_whose_redis_never_answered(tmp_path, replica) -> None:
    with _deaf() as redis_port:
        from tests.helpers import free_port

        port = free_port()
        proc, log_path = _serve(tmp_path, redis_port, replica, port)
        try:
            poll(lambda: f"listening on http://127.0.0.1:{port}" in log_path.read_text(errors="replace")
                 or proc.poll() is not None, STARTUP_WAIT, what="router listening")
            assert proc.poll() is None, log_path.read_text(errors="replace")
            proc.send_signal(signal.SIGTERM)
            code = _exit_code(proc, log_path, PROMPT, "of SIGTERM (it waited for Redis's first answer)")
        finally:
            if proc.poll() is None:
                proc.kill()
                proc.wait(5)
    log = log_path.read_text(errors="replace")
    assert code == -signal.SIGTERM, log  # (uvicorn raises the signal again once the router stopped)
    assert "stopped" in log, log
