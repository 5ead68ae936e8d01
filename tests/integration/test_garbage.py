"""A request leaves nothing for the cycle collector.

Objects that refer to each other in a cycle outlive their request until the
collector runs, and a collection walks every young object: with the
router's young-generation threshold (50,000 allocations) each took 20-30 ms
of the event loop, a pause every stream on the router saw (S5's TTFT p99 was
90 ms with them, 34 ms without: docs/perf.md). So the request path keeps its
objects free of cycles, or cuts them when the request ends.

The router runs in this process (its own uvloop, in a thread, on the real
server) so that this process's collector sees its garbage. Its upstreams are
real processes: a sim replica over the replica protocol and a sim OpenAI
server as a ``url:`` upstream, so both kinds of replica connection are on
the path.
"""

from __future__ import annotations

import contextlib
import gc
import socket
import threading
import time

import msgspec
import pytest
import yaml

from router.config import load_router_config
from tests.helpers import DEMO_TENANTS, GOLD, MODEL, free_port, poll, remote_replica_process
from tests.sim_openai import SimOpenAI

SECRET = "garbage-test-secret"
REQUESTS = 40


@pytest.fixture
def in_process_router(tmp_path, monkeypatch):
    from router import connection as hc
    from router import server as srv
    from router.app import create_app

    monkeypatch.setenv("FS_GARBAGE_SECRET", SECRET)
    with contextlib.ExitStack() as stack:
        upstream = SimOpenAI(tmp_path, {"step_base_ms": 1}).start()
        stack.callback(upstream.stop)
        replica_port, _ = stack.enter_context(remote_replica_process(
            tmp_path / "replica.log", "FS_GARBAGE_SECRET", SECRET, {"model": MODEL, "seed": 0, "step_base_ms": 1}))
        (tmp_path / "router.yaml").write_text(yaml.safe_dump({
            "host": "127.0.0.1", "tenants": str(DEMO_TENANTS), "shutdown_grace": 1.0,
            "replicas": [{"name": "remote", "address": f"127.0.0.1:{replica_port}", "secret_env": "FS_GARBAGE_SECRET"},
                         {"name": "up", "url": upstream.url}],
        }))
        config, tenants = load_router_config(tmp_path / "router.yaml")
        # what the router sets for its whole process, put back afterwards
        stack.callback(hc.HttpConnection.configure, hc.HttpConnection.head_timeout, hc.HttpConnection.body_timeout,
                       hc.HttpConnection.body_total_timeout, hc.HttpConnection.max_connections,
                       hc.HttpConnection.metrics)
        stack.callback(gc.set_threshold, *gc.get_threshold())
        stack.callback(gc.unfreeze)  # (it froze what it had at start, this test process's objects with it)
        port = free_port()
        server = srv.Server(create_app(config, tenants), host="127.0.0.1", port=port)
        thread = threading.Thread(target=server.run, daemon=True)
        thread.start()

        def stop() -> None:
            server.should_exit = True
            thread.join(15)
            assert not thread.is_alive(), "the in-process router did not stop"

        stack.callback(stop)
        poll(lambda: server.started and _get(port, "/ready").startswith(b"HTTP/1.1 200"), 20,
             what="the in-process router ready with both replicas")
        yield port


def _get(port: int, path: str) -> bytes:
    try:
        with socket.create_connection(("127.0.0.1", port), timeout=5) as s:
            s.sendall(f"GET {path} HTTP/1.1\r\nhost: x\r\nconnection: close\r\n\r\n".encode())
            return s.recv(65536)
    except OSError:
        return b""


def _complete(sock: socket.socket, stream: bool) -> bytes:
    body = msgspec.json.encode({"model": MODEL, "stream": stream, "max_tokens": 8,
                                "messages": [{"role": "user", "content": "Tell me about Paris"}]})
    sock.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nhost: x\r\nauthorization: Bearer %s\r\n"
                 b"content-type: application/json\r\ncontent-length: %d\r\n\r\n%s" % (GOLD.encode(), len(body), body))
    out = b""
    end = b"0\r\n\r\n" if stream else b"}"
    deadline = time.monotonic() + 10
    while not out.endswith(end) or (not stream and b"\r\n\r\n" not in out):
        assert time.monotonic() < deadline, out
        out += sock.recv(65536)
    return out


def test_requests_streamed_or_not_leave_no_cyclic_garbage(in_process_router) -> None:
    port = in_process_router
    with socket.create_connection(("127.0.0.1", port), timeout=10) as sock:
        for stream in (True, False):  # warm up: what is made once stays
            assert b" 200 OK" in _complete(sock, stream)
        gc.collect()
        gc.disable()  # (only the collections below)
        try:
            gc.collect()
            for i in range(REQUESTS):
                out = _complete(sock, stream=i % 2 == 0)
                assert b" 200 OK" in out and (b"[DONE]" in out if i % 2 == 0 else b'"usage"' in out)
            time.sleep(0.3)  # (the requests' settling, in the router's thread)
            found = gc.collect()
        finally:
            gc.enable()
    # one cycle per request would be REQUESTS x its objects (~33 before)
    assert found < REQUESTS, f"{found} objects in reference cycles after {REQUESTS} requests"
