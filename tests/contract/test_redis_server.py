"""The redis-server test helper itself: skip vs fail without a binary, life cycle."""

from __future__ import annotations

import os

import pytest

from tests.redis_server import MISSING_REASON, RedisServer, _ping, require_redis_server


def test_missing_binary_skips_outside_ci(monkeypatch) -> None:
    monkeypatch.setenv("REDIS_SERVER", "/nonexistent/redis-server")
    monkeypatch.delenv("CI", raising=False)
    with pytest.raises(pytest.skip.Exception, match=r"redis-server not installed \(apt-get install redis-server\)"):
        require_redis_server()
    assert MISSING_REASON == "redis-server not installed (apt-get install redis-server)"


def test_missing_binary_fails_in_ci(monkeypatch) -> None:
    monkeypatch.setenv("REDIS_SERVER", "/nonexistent/redis-server")
    monkeypatch.setenv("CI", "1")
    with pytest.raises(pytest.fail.Exception, match="redis-server not installed"):
        require_redis_server()
    with pytest.raises(pytest.fail.Exception):
        RedisServer()


@pytest.mark.redis
def test_start_kill_restart_stop() -> None:
    server = RedisServer(require_redis_server())
    try:
        server.start()
        port, pid = server.port, server.proc.pid
        assert _ping(port) and server.running
        server.kill()
        assert not server.running and not _ping(port)
        assert not os.path.exists(f"/proc/{pid}") or open(f"/proc/{pid}/stat").read().split()[2] in "ZX"
        server.restart()
        assert server.port == port and _ping(port)
        assert server.proc.pid != pid
    finally:
        server.stop()
    assert server.proc is None and not _ping(port)
    assert not server.dir.exists()
