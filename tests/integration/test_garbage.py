"""A request, answered or refused, and a closed connection leave nothing for the cycle collector.

Objects that refer to each other in a cycle outlive their request until the
collector runs, and a collection walks every young object: with the
router's young-generation threshold (50,000 allocations) each took 20-30 ms
of the event loop, a pause every stream on the router saw (S5's TTFT p99 was
90 ms with them, 34 ms without: docs/perf.md). So the request path keeps its
objects free of cycles, or cuts them when the request ends.

The router runs in this process (its own uvloop, in a thread, on the real
server) so that this process's collector sees its garbage. A refused
request once left a cycle (its error's traceback and a frame that held the
error) that kept its body until a collection: refused large bodies piled up
to gigabytes (tests/integration/test_refused_memory.py). Its upstreams are
real processes: a sim replica over the replica protocol and a sim OpenAI
server as a ``url:`` upstream, so both kinds of replica connection are on
the path.
"""

from __future__ import annotations

import collections
import contextlib
import gc
import hashlib
import json
import socket
import threading
import time
import types

import msgspec
import pytest
import yaml

from router.config import load_router_config
from router.generation import Generation
from router.job import Job
from router.openai_types import ChatRequest
from router.relay import EventStream
from tests.helpers import ADMIN, DEMO_TENANTS, GOLD, MODEL, free_port, poll, remote_replica_process
from tests.sim_openai import SimOpenAI

SECRET = "garbage-test-secret"
REQUESTS = 40
# a tenant whose requests outlast their total time limit mid-generation
BRIEF = "fs-garbage-brief"
# a tenant of one stream at a time, refused (429) past it
SINGLE = "fs-garbage-single"
# a key a reload revokes
REVOCABLE = "fs-garbage-revocable"


def _write_tenants(path, revocable: bool) -> None:
    """The demo tenants, and the tests' own; ``revocable``: whether
    REVOCABLE is a key (a reload of the file without it revokes it)."""
    tenants_yaml = yaml.safe_load(DEMO_TENANTS.read_text())
    tenants_yaml["tenants"]["brief"] = {"keys": [_hash(BRIEF)], "timeouts": {"total": 0.3}}
    tenants_yaml["tenants"]["single"] = {"keys": [_hash(SINGLE)], "on_limit": "reject",
                                         "limits": {"max_concurrent": 1, "max_tokens": 3000}}
    tenants_yaml["tenants"]["revocable"] = {"keys": [_hash(REVOCABLE if revocable else REVOCABLE + "-not")]}
    path.write_text(yaml.safe_dump(tenants_yaml))


def _hash(key: str) -> str:
    return hashlib.sha256(key.encode()).hexdigest()


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
        _write_tenants(tmp_path / "tenants.yaml", revocable=True)
        (tmp_path / "router.yaml").write_text(yaml.safe_dump({
            "host": "127.0.0.1", "tenants": str(tmp_path / "tenants.yaml"), "shutdown_grace": 1.0,
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
        with _only_the_collections_below():
            for i in range(REQUESTS):
                out = _complete(sock, stream=i % 2 == 0)
                assert b" 200 OK" in out and (b"[DONE]" in out if i % 2 == 0 else b'"usage"' in out)
            time.sleep(0.3)  # (the requests' settling, in the router's thread)
            found = gc.collect()
    # one cycle per request would be REQUESTS x its objects (~33 before)
    assert found < REQUESTS, f"{found} objects in reference cycles after {REQUESTS} requests"


def _post(sock: socket.socket, body: dict, key: str = GOLD) -> tuple[int, bytes]:
    """A POST on the kept-alive ``sock``: its status and body (streamed or not)."""
    data = json.dumps(body).encode()
    sock.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nhost: x\r\nauthorization: Bearer %s\r\n"
                 b"content-type: application/json\r\ncontent-length: %d\r\n\r\n%s" % (key.encode(), len(data), data))
    return _response(sock)


def _response(sock: socket.socket) -> tuple[int, bytes]:
    """The next response on ``sock``: its status and body (streamed or not)."""
    out = b""
    deadline = time.monotonic() + 10
    while True:
        head, sep, rest = out.partition(b"\r\n\r\n")
        if sep:
            length = next((int(line.split(b":")[1]) for line in head.split(b"\r\n")
                           if line.lower().startswith(b"content-length:")), None)
            if (len(rest) >= length) if length is not None else rest.endswith(b"0\r\n\r\n"):
                return int(head.split(b" ", 2)[1]), rest
        assert time.monotonic() < deadline, out
        out += sock.recv(65536)


def _socket_request(port: int, body: dict, key: str = GOLD) -> bytes:
    """One request on a WebSocket: its last message (done or error)."""
    from websockets.sync.client import connect

    with connect(f"ws://127.0.0.1:{port}/v1/ws", open_timeout=5, close_timeout=5) as ws:
        ws.send(json.dumps({"type": "auth", "api_key": key}))
        assert b'"ok":true' in ws.recv(5, decode=False)
        ws.send(json.dumps({"type": "chat.completions.create", "id": "1", "body": body}))
        while True:
            msg = ws.recv(5, decode=False)
            if b'"done"' in msg or b'"error"' in msg:
                return msg


LONG = "hello " * 5_000  # (over the replicas' 4,096-token context)
MIDDLING = "hello " * 3_500  # (under it, over the gold tenant's max_prompt_tokens: the router refuses it)
# (body, status) of requests refused or ended by an error, each by another path
REFUSED = {
    "unsupported parameter": ({"model": MODEL, "logit_bias": {"1": 1}, "messages": [{"role": "user", "content": "a"}]},
                              400),
    "invalid value": ({"model": MODEL, "max_tokens": "x", "messages": [{"role": "user", "content": "a"}]}, 400),
    "unknown model": ({"model": "no-such-model", "messages": [{"role": "user", "content": "a"}]}, 404),
    "replica refusal": ({"model": MODEL, "max_tokens": 4, "messages": [{"role": "user", "content": LONG}]}, 400),
    "replica refusal, streamed": ({"model": MODEL, "max_tokens": 4, "stream": True,
                                   "messages": [{"role": "user", "content": LONG}]}, 400),
    "prompt over the tenant's limit": ({"model": MODEL, "max_tokens": 4,
                                        "messages": [{"role": "user", "content": MIDDLING}]}, 400),
}
# ended by the brief tenant's total time limit after some output
TIMED_OUT = {"model": MODEL, "max_tokens": 1000, "ignore_eos": True, "messages": [{"role": "user", "content": "Tell me about Paris"}]}


def test_refused_requests_leave_no_cyclic_garbage(in_process_router) -> None:
    port = in_process_router
    with socket.create_connection(("127.0.0.1", port), timeout=10) as sock:
        def each() -> int:
            n = 0
            for name, (body, status) in REFUSED.items():
                got, out = _post(sock, body)
                assert got == status, (name, out)
                n += 1
            got, out = _post(sock, TIMED_OUT, BRIEF)  # (the whole answer's path: a 504)
            assert got == 504, out
            got, out = _post(sock, {**TIMED_OUT, "stream": True}, BRIEF)  # (a 200, ended by an error event)
            assert got == 200 and b"total_timeout" in out, out
            for body, _ in REFUSED.values():  # (a WebSocket's refusals: error messages)
                assert b'"error"' in _socket_request(port, body)
            last = _socket_request(port, TIMED_OUT, BRIEF)
            assert b"total_timeout" in last, last
            return n + 2 + len(REFUSED) + 1

        # (the url: upstream's model is known once it has answered: a 503 until then)
        poll(lambda: _post(sock, REFUSED["unknown model"][0])[0] == 404, 10, what="a 404 for an unknown model")
        each()  # warm up: what is made once stays
        time.sleep(0.3)
        with _only_the_collections_below():
            requests = sum(each() for _ in range(3))
            time.sleep(0.3)  # (the requests' settling, in the router's thread)
            # An error in a cycle with its traceback's frames kept their
            # locals (the body, the decoded request) with it. (The
            # connections' own cycles, uvicorn's and websockets' protocol
            # objects, have neither and hold no request.)
            kept = _collect_router_garbage(REQUEST_KINDS)
    assert not kept, f"after {requests} refused requests, in reference cycles: {dict(kept)}"


def _stream_until_events(sock: socket.socket, events: int) -> None:
    """Start a long stream on ``sock`` and read until ``events`` events came."""
    body = msgspec.json.encode({**TIMED_OUT, "stream": True})
    sock.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nhost: x\r\nauthorization: Bearer %s\r\n"
                 b"content-type: application/json\r\ncontent-length: %d\r\n\r\n%s" % (GOLD.encode(), len(body), body))
    out = b""
    deadline = time.monotonic() + 10
    while out.count(b"data:") < events:
        assert time.monotonic() < deadline, out
        out += sock.recv(65536)


def _closed_keep_alive(port: int) -> None:
    with socket.create_connection(("127.0.0.1", port), timeout=10) as sock:
        assert b" 200 OK" in _complete(sock, stream=True)


def _closed_mid_stream(port: int) -> None:
    with socket.create_connection(("127.0.0.1", port), timeout=10) as sock:
        _stream_until_events(sock, 3)


def _closed_socket(port: int) -> None:
    from websockets.sync.client import connect

    with connect(f"ws://127.0.0.1:{port}/v1/ws", open_timeout=5, close_timeout=5) as ws:
        ws.send(json.dumps({"type": "auth", "api_key": GOLD}))
        assert b'"ok":true' in ws.recv(5, decode=False)


def _resume_not_found(port: int) -> None:
    """A resume of an unknown stream (Litestar's path, a 404 answered before
    its body is read: 64 KB of its 128 KB sent)."""
    with socket.create_connection(("127.0.0.1", port), timeout=10) as sock:
        sock.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nhost: x\r\nauthorization: Bearer %s\r\n"
                     b"last-event-id: 1-1-1\r\nx-resume-request-id: chatcmpl-none\r\n"
                     b"content-type: application/json\r\ncontent-length: %d\r\n\r\n%s"
                     % (GOLD.encode(), 128 * 1024, b" " * 64 * 1024))
        assert sock.recv(65536).startswith(b"HTTP/1.1 404 "), "no 404 for an unknown stream's resume"


CLOSED = {"keep-alive connection": _closed_keep_alive, "connection closed mid-stream": _closed_mid_stream,
          "WebSocket": _closed_socket, "resume answered before its body": _resume_not_found}
CONNECTIONS = 10


@pytest.mark.parametrize("kind", list(CLOSED))
def test_closed_connections_leave_no_cyclic_garbage(in_process_router, kind) -> None:
    """A closed connection's protocol objects (uvicorn's, websockets' and
    Litestar's, and the router's hooks into them) go when it closes. In a
    cycle, ~26 objects an HTTP connection, ~120 a WebSocket, waited for a
    collection, the unread part of a refused body with them, and the
    router's collections are rare (router/service.py), so closed
    connections piled up until one came (README, Known limitations, for
    what a connection flood costs)."""
    port, connect = in_process_router, CLOSED[kind]
    connect(port)  # warm up: what is made once stays
    time.sleep(0.3)
    with _only_the_collections_below():
        for _ in range(CONNECTIONS):
            connect(port)
        time.sleep(0.5)  # (the connections' close, in the router's thread)
        gc.set_debug(gc.DEBUG_SAVEALL)
        try:
            found = gc.collect()
        finally:
            gc.set_debug(0)
        try:
            kept = collections.Counter(type(o).__qualname__ for o in gc.garbage)
        finally:
            gc.garbage.clear()
    assert found < CONNECTIONS, f"{found} objects in reference cycles after {CONNECTIONS} connections: " \
                                f"{dict(kept.most_common(12))}"


# what a request left in a reference cycle would hold it with: an error and
# its traceback's frames, the decoded request, its job and generation, its stream
REQUEST_KINDS = (BaseException, types.TracebackType, types.FrameType, ChatRequest, Job, Generation, EventStream)


@contextlib.contextmanager
def _only_the_collections_below():
    """The cycle collector off but for the test's own collections, from a
    collected heap (what the warm-up made and freed is gone)."""
    gc.collect()
    gc.disable()
    try:
        gc.collect()
        yield
    finally:
        gc.enable()


def _collect_router_garbage(kinds: tuple[type, ...] | None = None) -> collections.Counter:
    """The collection of what was made since the last one (gc disabled):
    the objects of ``kinds`` (``REQUEST_KINDS`` and a socket's connection
    unless given) it finds in reference cycles, by type."""
    if kinds is None:
        from router.websocket import _Conn

        kinds = (*REQUEST_KINDS, _Conn)
    gc.set_debug(gc.DEBUG_SAVEALL)  # (what it finds goes to gc.garbage)
    try:
        gc.collect()
    finally:
        gc.set_debug(0)
    try:
        return collections.Counter(type(o).__name__ for o in gc.garbage if isinstance(o, kinds))
    finally:
        gc.garbage.clear()


def _start_single(sock: socket.socket, max_tokens: int) -> bytes:
    """Start a stream of SINGLE's on ``sock``: its response's first bytes."""
    body = msgspec.json.encode({**TIMED_OUT, "max_tokens": max_tokens, "stream": True})
    sock.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nhost: x\r\nauthorization: Bearer %s\r\n"
                 b"content-type: application/json\r\ncontent-length: %d\r\n\r\n%s" % (SINGLE.encode(), len(body), body))
    return sock.recv(65536)


def _drop_mid_stream(port: int) -> tuple[str, str]:
    """A stream of SINGLE's closed after its first events: its id and the
    last event's id (it stays resumable, its generation aborted)."""
    with socket.create_connection(("127.0.0.1", port), timeout=10) as sock:
        out = _start_single(sock, 200)
        deadline = time.monotonic() + 10
        while out.count(b"\nid: ") < 3:
            assert time.monotonic() < deadline, out
            out += sock.recv(65536)
    rid = next(line.split(b":", 1)[1].strip() for line in out.split(b"\r\n")
               if line.lower().startswith(b"x-request-id:"))
    last = [line[4:].strip() for line in out.split(b"\n") if line.startswith(b"id: ")][-1]
    return rid.decode(), last.decode()


def _refused_continuation(sock: socket.socket, rid: str, last: str) -> bytes:
    """A resume of ``rid`` after ``last``: the 200's events (with the
    tenant at its limit, its continuation's refusal: an error event)."""
    sock.sendall(b"GET /v1/streams/%s HTTP/1.1\r\nhost: x\r\nauthorization: Bearer %s\r\n"
                 b"last-event-id: %s\r\n\r\n" % (rid.encode(), SINGLE.encode(), last.encode()))
    status, out = _response(sock)
    assert status == 200, out
    return out


CONTINUATIONS = 10


def test_refused_continuations_leave_no_cyclic_garbage(in_process_router) -> None:
    """A resume's continuation refused before its first piece (the tenant
    at its one stream, on_limit: reject): its error stayed in a cycle with
    its traceback's frames (the continuation's frame held it, and the
    resume's, the task it was raised from), the Job and the Generation
    with them."""
    port = in_process_router
    rid, last = _drop_mid_stream(port)
    with contextlib.ExitStack() as stack:
        def blocking() -> bool:
            # the tenant's one stream (~3,000 tokens, running until the
            # resumes are done): admitted once the dropped one's has ended
            sock = stack.enter_context(socket.create_connection(("127.0.0.1", port), timeout=10))
            return _start_single(sock, 3000).startswith(b"HTTP/1.1 200 ")

        poll(blocking, 10, what="the tenant's one stream admitted")
        sock = stack.enter_context(socket.create_connection(("127.0.0.1", port), timeout=10))
        # warm up (what is made once stays), once the dropped stream is
        # detached (its resume then continues it, not follows it)
        poll(lambda: b"rate_limit_exceeded" in _refused_continuation(sock, rid, last), 5,
             what="a refused continuation")
        time.sleep(0.3)
        with _only_the_collections_below():
            for _ in range(CONTINUATIONS):
                out = _refused_continuation(sock, rid, last)
                assert b"rate_limit_exceeded" in out, out
            time.sleep(0.3)  # (the requests' settling, in the router's thread)
            kept = _collect_router_garbage()
    assert not kept, f"after {CONTINUATIONS} refused continuations, in reference cycles: {dict(kept)}"


def _reload(port: int, tenants, revocable: bool) -> None:
    """Write ``tenants`` (with REVOCABLE a key or not) and reload it."""
    _write_tenants(tenants, revocable)
    with socket.create_connection(("127.0.0.1", port), timeout=10) as sock:
        sock.sendall(b"POST /admin/reload HTTP/1.1\r\nhost: x\r\nauthorization: Bearer %s\r\n"
                     b"content-length: 0\r\n\r\n" % ADMIN.encode())
        status, out = _response(sock)
    assert status == 200, out


def test_sockets_of_a_revoked_key_leave_no_cyclic_garbage(in_process_router, tmp_path) -> None:
    """A reload that revokes the key of connected WebSockets: each keeps the
    refusal for its next requests, and closes (4401). The refusal kept its
    traceback, whose frames held the connection: a cycle of each socket's
    objects until a collection."""
    from websockets.sync.client import connect

    port, tenants = in_process_router, tmp_path / "tenants.yaml"

    def revoked(n: int) -> None:
        _reload(port, tenants, revocable=True)
        with contextlib.ExitStack() as stack:
            sockets = [stack.enter_context(connect(f"ws://127.0.0.1:{port}/v1/ws", open_timeout=5, close_timeout=5))
                       for _ in range(n)]
            for ws in sockets:
                ws.send(json.dumps({"type": "auth", "api_key": REVOCABLE}))
                assert b'"ok":true' in ws.recv(5, decode=False)
            _reload(port, tenants, revocable=False)
            poll(lambda: all(ws.close_code is not None for ws in sockets), 10, what="the revoked sockets closed")
            assert {ws.close_code for ws in sockets} == {4401}

    revoked(1)  # warm up: what is made once stays
    time.sleep(0.3)
    with _only_the_collections_below():
        revoked(CONNECTIONS)
        time.sleep(0.5)  # (the connections' close, in the router's thread)
        kept = _collect_router_garbage()
    assert not kept, f"after {CONNECTIONS} sockets' key revoked, in reference cycles: {dict(kept)}"
