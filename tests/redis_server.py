"""A real ``redis-server`` for tests: started on a free loopback port, stopped for sure.

``RedisServer`` runs ``redis-server --port N --bind 127.0.0.1 --save ''
--appendonly no`` in a private temporary directory, waits until it answers
PING, and on ``stop()`` sends SIGTERM, then SIGKILL if it lingers (both
bounded). ``kill()`` and ``restart()`` (same port) make outages for the
resilience tests.

When there is no redis-server binary, ``require_redis_server()`` skips the
test with a hint how to install it, unless the environment variable ``CI`` is
set: CI must have Redis, so there a missing binary fails the test instead of
hiding the whole Redis half of the contract suite behind a skip.
"""

from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import tempfile
import time
from pathlib import Path

import pytest

__all__ = ["RedisServer", "redis_server_binary", "require_redis_server", "MISSING_REASON"]

MISSING_REASON = "redis-server not installed (apt-get install redis-server)"


def redis_server_binary() -> str | None:
    """Path of the redis-server binary (``$REDIS_SERVER`` overrides the PATH lookup)."""
    explicit = os.environ.get("REDIS_SERVER")
    if explicit:
        return explicit if os.access(explicit, os.X_OK) else None
    return shutil.which("redis-server") or (
        "/usr/bin/redis-server" if os.access("/usr/bin/redis-server", os.X_OK) else None
    )


def require_redis_server() -> str:
    """The binary's path; skip the test without one (fail under ``CI``)."""
    binary = redis_server_binary()
    if binary is None:
        if os.environ.get("CI"):
            pytest.fail(f"{MISSING_REASON}; CI must provide it", pytrace=False)
        pytest.skip(MISSING_REASON)
    return binary


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _ping(port: int, timeout: float = 0.5) -> bool:
    """True if a Redis server answers PING on ``port`` (raw RESP, no client library)."""
    try:
        with socket.create_connection(("127.0.0.1", port), timeout=timeout) as s:
            s.sendall(b"*1\r\n$4\r\nPING\r\n")
            return s.recv(64).startswith(b"+PONG")
    except OSError:
        return False


class RedisServer:
    """One ``redis-server`` child process. Use as a context manager or call start()/stop()."""

    def __init__(self, binary: str | None = None, *, start_timeout: float = 30.0, stop_timeout: float = 5.0,
                 persist: bool = False) -> None:
        self.binary = binary or require_redis_server()
        self.persist = persist  # an append-only file, synced at every write: a restart keeps the data
        self.start_timeout = start_timeout
        self.stop_timeout = stop_timeout
        self.port = 0
        self.proc: subprocess.Popen[bytes] | None = None
        self.dir = Path(tempfile.mkdtemp(prefix="fs-redis-"))
        self.log_path = self.dir / "redis.log"

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    def start(self) -> RedisServer:
        """Start on a free port (or on ``self.port`` again after ``kill()``); wait for PING."""
        fixed = bool(self.port)
        for attempt in range(3):
            if not fixed:
                self.port = _free_port()
            self._spawn()
            try:
                self._wait_ready()
                return self
            except AssertionError:
                log = self.log()
                self._terminate()
                if "Address already in use" in log and attempt < 2:
                    if fixed:  # the old socket may linger a moment; try the same port again
                        time.sleep(0.2)
                    continue
                raise
        raise AssertionError("unreachable")

    def _spawn(self) -> None:
        with open(self.log_path, "ab") as log:
            self.proc = subprocess.Popen(
                [self.binary, "--port", str(self.port), "--bind", "127.0.0.1",
                 "--save", "", "--appendonly", "yes" if self.persist else "no", "--appendfsync", "always",
                 "--dir", str(self.dir)],
                cwd=self.dir, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
            )

    def _wait_ready(self) -> None:
        end = time.monotonic() + self.start_timeout
        while True:
            assert self.proc is not None
            if self.proc.poll() is not None:
                raise AssertionError(
                    f"redis-server exited with {self.proc.returncode} on port {self.port}:\n{self.log()[-2000:]}"
                )
            if _ping(self.port):
                return
            if time.monotonic() >= end:
                raise AssertionError(
                    f"redis-server on port {self.port} did not answer PING within {self.start_timeout}s:\n"
                    f"{self.log()[-2000:]}"
                )
            time.sleep(0.02)

    def _terminate(self, sig: int = signal.SIGTERM) -> None:
        """Send ``sig``; SIGKILL after ``stop_timeout``; reap. Bounded in time."""
        proc, self.proc = self.proc, None
        if proc is None:
            return
        if proc.poll() is None:
            proc.send_signal(sig)
            try:
                proc.wait(self.stop_timeout if sig != signal.SIGKILL else 5.0)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait(5.0)

    def kill(self) -> None:
        """An outage: SIGKILL the server (no shutdown). The port is kept for ``restart()``."""
        self._terminate(signal.SIGKILL)

    def pause(self) -> None:
        """A partition or a hang: SIGSTOP (its clients' commands time out); ``resume()`` ends it."""
        assert self.proc is not None
        self.proc.send_signal(signal.SIGSTOP)

    def resume(self) -> None:
        assert self.proc is not None
        self.proc.send_signal(signal.SIGCONT)

    def restart(self) -> RedisServer:
        """Start again on the same port (after ``kill()``), empty."""
        self._terminate()
        return self.start()

    def stop(self) -> None:
        """SIGTERM, SIGKILL if it has not exited within ``stop_timeout``; remove the directory."""
        self._terminate()
        shutil.rmtree(self.dir, ignore_errors=True)

    @property
    def running(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def log(self) -> str:
        try:
            return self.log_path.read_text(errors="replace")
        except FileNotFoundError:
            return ""

    def __enter__(self) -> RedisServer:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()
