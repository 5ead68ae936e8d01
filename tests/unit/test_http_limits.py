"""router/connection.py ``HttpConnection``: the limits on a request's head and body
(408, 431), on a real uvicorn server in a thread with a small application:
keep-alive and pipelined requests, split packets, long streams and upgrades
must pass; idle, trickling and oversized heads must not."""

from __future__ import annotations

import asyncio
import contextlib
import json
import re
import socket
import threading
import time

import uvicorn

from router import connection as hc
from router import server as srv
from router.push import TransportWire
from tests.helpers import free_port

PORT = free_port()
HELD_LOST = threading.Event()


async def app(scope, receive, send):
    if scope["type"] != "http":
        return
    body = b""
    while True:
        m = await receive()
        if m["type"] == "http.disconnect":
            return
        body += m.get("body", b"")
        if not m.get("more_body"):
            break
    if scope["path"] == "/wire":  # the router's own head and body's end (router/push.py) on this server
        wire = TransportWire.open(send, {"x-wire": "own"}, [])
        if wire is None:
            await send({"type": "http.response.start", "status": 500, "headers": [(b"content-length", b"0")]})
            await send({"type": "http.response.body", "body": b""})
            return
        wire.write(b"one")
        wire.finish(b"two")
        return
    if scope["path"] == "/held":  # a handler that has not answered yet, told of a lost connection as the fast path is
        cycle = send.__self__
        task = asyncio.current_task()
        cycle.lost_callbacks.append(task.cancel)
        try:
            await asyncio.sleep(30)
        except asyncio.CancelledError:
            HELD_LOST.set()
        return
    if scope["path"] == "/slow":  # a stream that outlasts the limits
        await send({"type": "http.response.start", "status": 200, "headers": []})
        for i in range(10):
            await asyncio.sleep(0.2)
            await send({"type": "http.response.body", "body": b"piece%d\n" % i, "more_body": True})
        await send({"type": "http.response.body", "body": b"", "more_body": False})
        return
    out = b"got %d" % len(body)
    await send({"type": "http.response.start", "status": 200,
                "headers": [(b"content-length", str(len(out)).encode())]})
    await send({"type": "http.response.body", "body": out})


@contextlib.contextmanager
def serving(head=0.5, body=0.5, max_connections=0, metrics=None, body_total=60.0):
    c = hc.HttpConnection
    old = c.head_timeout, c.body_timeout, c.body_total_timeout, c.max_connections, c.metrics
    hc.HttpConnection.configure(head, body, body_total, max_connections, metrics)
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=PORT, http=hc.HttpConnection, ws=srv._WebSocket,
                                          loop="asyncio", lifespan="off", log_level="warning"))
    t = threading.Thread(target=server.run, daemon=True)
    t.start()
    for _ in range(100):
        if server.started:
            break
        time.sleep(0.05)
    try:
        yield server
    finally:
        server.should_exit = True
        t.join(10)
        hc.HttpConnection.configure(*old)


def conn() -> socket.socket:
    s = socket.create_connection(("127.0.0.1", PORT), timeout=10)
    s.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    return s


def read_all(s) -> bytes:
    out = b""
    with contextlib.suppress(OSError):
        while chunk := s.recv(65536):
            out += chunk
    return out


def read_response(s) -> bytes:
    """One content-length response."""
    out = b""
    while b"\r\n\r\n" not in out:
        out += s.recv(65536)
    head, _, rest = out.partition(b"\r\n\r\n")
    n = int([ln.split(b":")[1] for ln in head.split(b"\r\n") if ln.lower().startswith(b"content-length")][0])
    while len(rest) < n:
        rest += s.recv(65536)
    return head + b"\r\n\r\n" + rest


def test_pipelined_request_with_body_in_a_later_packet_does_not_cut_the_stream_before_it():
    # a pipelining client: a long stream, then a POST whose body comes in its own packet
    with serving(head=5, body=0.5):
        s = conn()
        s.sendall(b"GET /slow HTTP/1.1\r\nHost: x\r\n\r\n"
                  b"POST /echo HTTP/1.1\r\nHost: x\r\nContent-Length: 5\r\n\r\n")
        time.sleep(0.05)
        s.sendall(b"hello")
        s.settimeout(5)
        answer = read_all(s)
        s.close()
    assert b"piece9" in answer and b"got 5" in answer, answer


def second_request(request: bytes, head: float = 5, body: float = 5) -> bytes:
    """What a keep-alive connection gets for ``request`` after a first one."""
    with serving(head=head, body=body):
        s = conn()
        s.sendall(b"GET /a HTTP/1.1\r\nHost: x\r\n\r\n")
        assert read_response(s).startswith(b"HTTP/1.1 200")
        s.sendall(request)
        s.settimeout(5)
        answer = read_all_until(s, b"got ")
        s.close()
    return answer


def test_second_keepalive_request_with_oversized_head_is_431():
    # (the limit missed the first packet of a keep-alive connection's next request)
    answer = second_request(b"GET /b HTTP/1.1\r\nHost: x\r\nX-Big: " + b"a" * 100_000 + b"\r\n\r\n")
    assert answer.startswith(b"HTTP/1.1 431"), answer[:200]


def test_second_keepalive_request_whose_head_times_out_gets_a_408():
    answer = second_request(b"GET /b HTTP/1.1\r\nHost: x\r\n", head=0.5)  # and nothing more
    assert answer.startswith(b"HTTP/1.1 408"), answer


def test_head_terminator_in_tiny_packets_does_not_count_the_body_as_head():
    with serving(head=5, body=5):
        s = conn()
        body = b"b" * 40_000
        s.sendall(b"POST /echo HTTP/1.1\r\nHost: x\r\nX-Pad: " + b"p" * 30_000
                  + b"\r\nContent-Length: %d\r" % len(body))
        for piece in (b"\n", b"\r"):
            time.sleep(0.05)
            s.sendall(piece)
        time.sleep(0.05)
        s.sendall(b"\n" + body)
        answer = read_all_until(s, b"got ")
        s.close()
    assert answer.startswith(b"HTTP/1.1 200") and b"got 40000" in answer, answer[:200]


def read_all_until(s, marker: bytes) -> bytes:
    out = b""
    s.settimeout(5)
    with contextlib.suppress(OSError):
        while chunk := s.recv(65536):
            out += chunk
            if marker in out:
                break
    return out


def test_unsupported_upgrade_stream_outlasting_the_limits_is_not_cut():
    with serving(head=0.5, body=0.5):
        s = conn()
        s.sendall(b"GET /slow HTTP/1.1\r\nHost: x\r\nConnection: Upgrade\r\nUpgrade: h2c\r\n\r\n")
        s.settimeout(5)
        answer = read_all_until(s, b"piece9")
        s.close()
    assert b"piece9" in answer, answer


def test_a_body_that_keeps_arriving_is_not_cut_by_body_timeout():
    # body_timeout is between two reads, as nginx's client_body_timeout
    with serving(head=5, body=1.5):
        s = conn()
        s.sendall(b"POST /echo HTTP/1.1\r\nHost: x\r\nContent-Length: 25\r\n\r\n")
        for _ in range(25):
            time.sleep(0.1)
            s.sendall(b"b")  # steady progress: a byte every 0.1 s, 2.5 s in all
        answer = read_all_until(s, b"got ")
        s.close()
    assert answer.startswith(b"HTTP/1.1 200"), answer


def trickle(s: socket.socket, every: float, limit: float) -> tuple[bytes, float]:
    """Send a body byte every ``every`` seconds until the server answers (or
    ``limit`` seconds pass): what it answered, and when."""
    t0 = time.monotonic()
    out = b""
    while time.monotonic() - t0 < limit:
        with contextlib.suppress(OSError):
            s.sendall(b"b")
        s.settimeout(every)
        with contextlib.suppress(TimeoutError):
            out = s.recv(65536)
        if out:
            break
    return out + read_all_until(s, b"}"), time.monotonic() - t0


def test_a_trickled_body_gets_a_408_when_body_total_timeout_is_up():
    # body_timeout is between two reads: a byte every 0.2 s, far under it,
    # held the connection for as long as the body's announced length lasted
    # (1 byte/s: 500 such connections were open 35 s on, none answered)
    with serving(head=5, body=1.0, body_total=2.0):
        s = conn()
        s.sendall(b"POST /echo HTTP/1.1\r\nHost: x\r\nContent-Length: 100000\r\n\r\n")
        answer, took = trickle(s, 0.2, 6)
        s.close()
    assert answer.startswith(b"HTTP/1.1 408"), answer
    assert b'"code":"body_timeout"' in answer and b"application/json" in answer, answer
    assert 1.8 <= took < 3.0, took  # (the total, counted from the head's end: not a read's gap)


def test_a_slow_steady_large_body_that_arrives_within_body_total_timeout_is_served():
    with serving(head=5, body=1.0, body_total=4.0):
        s = conn()
        piece = b"b" * 16384
        s.sendall(b"POST /echo HTTP/1.1\r\nHost: x\r\nContent-Length: %d\r\n\r\n" % (20 * len(piece)))
        for _ in range(20):  # 320 KiB over 2 s: longer than body_timeout, within the total
            time.sleep(0.1)
            s.sendall(piece)
        answer = read_all_until(s, b"got ")
        s.close()
    assert answer.startswith(b"HTTP/1.1 200") and answer.endswith(b"got %d" % (20 * len(piece))), answer


def test_a_pipelined_body_s_total_starts_when_its_request_does():
    # behind a response under way uvicorn stops reading: the queued body's
    # total is not spent while the stream ahead of it runs (2 s, past the total)
    with serving(head=5, body=5, body_total=1.5):
        s = conn()
        s.sendall(b"GET /slow HTTP/1.1\r\nHost: x\r\n\r\n"
                  b"POST /echo HTTP/1.1\r\nHost: x\r\nContent-Length: 5\r\n\r\nhe")
        time.sleep(2.2)  # (the stream's last piece is out at 2 s)
        s.sendall(b"llo")
        answer = read_all_until(s, b"got ")
        s.close()
    assert b"piece9" in answer and b"got 5" in answer, answer


def test_a_connection_past_max_connections_gets_a_503_and_the_open_ones_go_on():
    with serving(head=5, body=5, max_connections=2):
        streaming, idle = conn(), conn()
        streaming.sendall(b"GET /slow HTTP/1.1\r\nHost: x\r\n\r\n")  # a long response under way
        time.sleep(0.2)
        over = conn()
        over.sendall(b"POST /echo HTTP/1.1\r\nHost: x\r\nContent-Length: 5\r\n\r\nhello")
        over.settimeout(5)
        answer = read_all(over)  # (to the end: the router closes it)
        over.close()
        head, _, body = answer.partition(b"\r\n\r\n")
        assert head.startswith(b"HTTP/1.1 503"), answer
        assert b"retry-after: 1" in head and b"connection: close" in head and b"application/json" in head
        assert re.search(rb"\r\nx-request-id: [0-9a-f]{24}\r\n", head), head  # (as every other answer)
        error = json.loads(body)["error"]
        assert error["code"] == "too_many_connections" and error["type"] == "server_error", error
        assert "(2)" in error["message"]

        upgrade = conn()  # a WebSocket upgrade past the cap too
        upgrade.sendall(b"GET /ws HTTP/1.1\r\nHost: x\r\nConnection: Upgrade\r\nUpgrade: websocket\r\n"
                        b"Sec-WebSocket-Version: 13\r\nSec-WebSocket-Key: dGhlIHNhbXBsZSBub25jZQ==\r\n\r\n")
        upgrade.settimeout(5)
        assert read_all(upgrade).startswith(b"HTTP/1.1 503")
        upgrade.close()

        # the open connections were not touched: the stream runs to its end,
        # and the idle one is served
        idle.sendall(b"POST /echo HTTP/1.1\r\nHost: x\r\nContent-Length: 2\r\n\r\nhi")
        assert read_all_until(idle, b"got 2").startswith(b"HTTP/1.1 200")
        assert b"piece9" in read_all_until(streaming, b"piece9")
        idle.close()
        time.sleep(0.2)
        again = conn()  # one closed: room for one more
        again.sendall(b"POST /echo HTTP/1.1\r\nHost: x\r\nContent-Length: 2\r\n\r\nhi")
        assert read_all_until(again, b"got 2").startswith(b"HTTP/1.1 200")
        again.close()
        streaming.close()


def test_a_refused_client_that_sends_its_whole_request_first_reads_the_answer_not_a_reset():
    # Most clients write the whole request before they read. Closed at once
    # with bytes still arriving, the socket was reset: their write failed
    # (EPIPE, ECONNRESET) and the 431 or 503 was never read. The router now
    # half-closes and drops what comes until the client closes (LINGER).
    big_head = b"GET /b HTTP/1.1\r\nHost: x\r\nX-Big: " + b"a" * 4_000_000 + b"\r\n\r\n"
    pipelined = (b"POST /echo HTTP/1.1\r\nHost: x\r\nContent-Length: 5\r\n\r\nhello"
                 b"POST /echo HTTP/1.1\r\nHost: x\r\nContent-Length: 4000000\r\n\r\n" + b"a" * 4_000_000)
    for cap, request, status in ((0, big_head, b"431"), (1, pipelined, b"503")):
        with serving(head=5, body=5, max_connections=cap):
            held = conn()  # (the one connection the cap allows, if there is a cap)
            for _ in range(3):
                s = conn()
                s.sendall(request)  # (raised BrokenPipeError or ConnectionResetError before)
                s.settimeout(5)
                answer = read_all(s)
                s.close()
                assert answer.startswith(b"HTTP/1.1 " + status) and answer.endswith(b"}"), answer[:200]
            held.close()


def _closed_after_the_linger(s: socket.socket, start: float) -> None:
    time.sleep(hc.LINGER + 0.5)
    with contextlib.suppress(OSError):  # LINGER seconds on, the connection is gone: a reset now
        s.sendall(b"more")
        time.sleep(0.1)
        s.sendall(b"more")
        raise AssertionError("the connection is still open")
    assert time.monotonic() - start < hc.LINGER + 2


def test_a_refused_connection_whose_client_stays_is_closed_after_the_linger():
    with serving(head=0.3, body=5):
        s = conn()
        s.settimeout(5)
        start = time.monotonic()
        assert s.recv(65536).startswith(b"HTTP/1.1 408")  # (no head within 0.3 s)
        assert s.recv(65536) == b""  # the router's side is closed with the answer...
        s.sendall(b"GET / HTTP/1.1\r\n")  # (dropped)
        _closed_after_the_linger(s, start)  # ...and the connection soon after
        s.close()


def test_a_refusal_that_lingers_stops_the_handler_of_the_request_before_it_at_once(monkeypatch):
    # A request's handler has not answered yet (a completion before its first
    # token) when the next request's head grows too large: the 431 is sent and
    # the connection lingers. The handler went on generating, its writes
    # dropped, until the close LINGER seconds later; it is now told at once.
    monkeypatch.setattr(hc, "LINGER", 30.0)
    HELD_LOST.clear()
    with serving(head=5, body=5):
        s = conn()
        s.settimeout(10)
        s.sendall(b"GET /held HTTP/1.1\r\nHost: x\r\n\r\n")
        time.sleep(0.3)  # (its handler is waiting)
        s.sendall(b"GET /b HTTP/1.1\r\nHost: x\r\nX-Big: " + b"a" * 70_000 + b"\r\n\r\n")
        assert read_all_until(s, b"}").startswith(b"HTTP/1.1 431")
        assert HELD_LOST.wait(5), "the held request's handler was not told while the connection lingered"
        s.close()


def test_a_request_pipelined_behind_a_refused_one_does_not_keep_the_connection():
    # (its head timer replaced the linger's close, and the refusal's timer then
    # found the connection refused already: it stayed open until the client left)
    with serving(head=0.5, body=5):
        s = conn()
        s.settimeout(5)
        start = time.monotonic()
        s.sendall(b"GET /a HTTP/1.1\r\nHost: x\r\nX-Big: " + b"a" * 70_000 + b"\r\n\r\n"
                  b"GET /b HTTP/1.1\r\nHost: x\r\n\r\n")
        assert read_all_until(s, b"}").startswith(b"HTTP/1.1 431")
        _closed_after_the_linger(s, start)
        s.close()


def test_the_open_file_limit_is_raised_to_the_hard_limit():
    import resource

    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if hard != resource.RLIM_INFINITY:
        resource.setrlimit(resource.RLIMIT_NOFILE, (max(1024, hard // 2), hard))  # (any process may lower it)
    limit = hc.open_file_limit()
    assert resource.getrlimit(resource.RLIMIT_NOFILE)[0] == (soft if hard == resource.RLIM_INFINITY else hard)
    assert limit == (0 if hard == resource.RLIM_INFINITY else hard)


class _Limits:
    """A ``resource`` module whose open-file limits are (soft, hard), and
    whose system takes no soft limit above ``ceiling``."""

    RLIMIT_NOFILE = 7
    RLIM_INFINITY = -1

    def __init__(self, soft: int, hard: int, ceiling: int) -> None:
        self.limits, self.ceiling, self.tried = (soft, hard), ceiling, []

    def getrlimit(self, which):
        assert which == self.RLIMIT_NOFILE
        return self.limits

    def setrlimit(self, which, limits):
        soft, hard = limits
        self.tried.append(soft)
        if hard != self.limits[1] or soft > self.ceiling:
            raise ValueError("not allowed")
        self.limits = limits


def test_an_unlimited_hard_open_file_limit_raises_the_soft_one_as_far_as_the_system_allows():
    # macOS: hard limit unlimited, soft 256; setrlimit past OPEN_MAX fails
    mac = _Limits(256, _Limits.RLIM_INFINITY, ceiling=10240)
    assert hc.open_file_limit(mac) == 10240
    assert mac.limits == (10240, _Limits.RLIM_INFINITY) and mac.tried == [1 << 20, 10240]
    linux = _Limits(1024, _Limits.RLIM_INFINITY, ceiling=1 << 20)  # (root may set an unlimited hard limit)
    assert hc.open_file_limit(linux) == 1 << 20


def test_an_open_file_limit_that_cannot_be_raised_stays_as_it_is(caplog):
    tight = _Limits(256, _Limits.RLIM_INFINITY, ceiling=512)
    with caplog.at_level("WARNING", logger="fairstream.router"):
        assert hc.open_file_limit(tight) == 256
    assert tight.limits == (256, _Limits.RLIM_INFINITY)
    assert "could not raise the open-file limit from 256" in caplog.text
    assert hc.open_file_limit(_Limits(4096, 4096, ceiling=0)) == 4096  # (soft = hard: nothing to do)
    assert hc.open_file_limit(_Limits(_Limits.RLIM_INFINITY, _Limits.RLIM_INFINITY, ceiling=0)) == 0


def test_the_router_writes_its_own_head_and_end_on_this_server():
    # (router/push.py's fast path is on under router/server.py's protocol:
    # were TransportWire.open to decline, the route answers 500)
    with serving(head=5, body=5):
        s = conn()
        for _ in range(2):  # kept alive: the second request is served after the first's end
            s.sendall(b"POST /wire HTTP/1.1\r\nHost: x\r\nContent-Length: 0\r\n\r\n")
            answer = read_all_until(s, b"0\r\n\r\n")
            head, _, body = answer.partition(b"\r\n\r\n")
            assert head.startswith(b"HTTP/1.1 200") and b"x-wire: own" in head, answer
            assert b"transfer-encoding: chunked" in head and b"date: " in head
            assert body == b"3\r\none\r\n3\r\ntwo\r\n0\r\n\r\n", body
        s.close()


def test_past_max_connections_a_silent_or_expect_100_connection_is_answered_at_once(monkeypatch):
    monkeypatch.setattr(hc, "OVER_CAP_READ", 0.5)
    with serving(head=30, body=60, max_connections=1):
        held = conn()
        held.sendall(b"GET /slow HTTP/1.1\r\nHost: x\r\n\r\n")
        time.sleep(0.2)
        silent = conn()  # sends nothing: answered after OVER_CAP_READ, not the 30 s head timeout
        t0 = time.monotonic()
        silent.settimeout(5)
        assert read_all(silent).startswith(b"HTTP/1.1 503")
        assert time.monotonic() - t0 < 3
        silent.close()
        monkeypatch.setattr(hc, "OVER_CAP_READ", 30.0)  # (read as a connection opens)
        waiting = conn()  # holds its body back for a 100 Continue: answered now, not after body_timeout
        waiting.sendall(b"POST /echo HTTP/1.1\r\nHost: x\r\nContent-Length: 5\r\nExpect: 100-continue\r\n\r\n")
        t0 = time.monotonic()
        waiting.settimeout(10)
        answer = read_all(waiting)
        assert answer.startswith(b"HTTP/1.1 503") and b"100 Continue" not in answer, answer
        assert time.monotonic() - t0 < 5  # (not OVER_CAP_READ, 30 s, nor body_timeout, 60 s)
        waiting.close()
        held.close()


def test_connections_past_max_connections_hold_at_most_over_cap_held_descriptors(monkeypatch):
    # A client that connects again as soon as a connection closes (the
    # tester's 985 idle connections against a cap of 372) kept every
    # connection past the cap for OVER_CAP_READ and then LINGER seconds:
    # ~4 s of a descriptor each, with no bound on how many at once, until the
    # router (its replicas' restarts too) ran out of descriptors. Past
    # OVER_CAP_HELD of them, one more is answered 503 at once and closed.
    monkeypatch.setattr(hc, "OVER_CAP_READ", 30.0)
    monkeypatch.setattr(hc, "OVER_CAP_HELD", 3)
    with serving(head=30, body=60, max_connections=1) as server:
        held = conn()
        time.sleep(0.1)
        waiting = [conn() for _ in range(3)]  # silent: answered after OVER_CAP_READ
        time.sleep(0.2)
        t0 = time.monotonic()
        flood = [conn() for _ in range(20)]
        for s in flood:  # answered and closed now, not after OVER_CAP_READ
            s.settimeout(5)
            answer = read_all(s)
            head, _, body = answer.partition(b"\r\n\r\n")
            assert head.startswith(b"HTTP/1.1 503") and b"retry-after: 1" in head, answer
            assert json.loads(body)["error"]["code"] == "too_many_connections"
        assert time.monotonic() - t0 < 5
        time.sleep(0.2)
        assert len(server.server_state.connections) <= 1 + 3  # (the cap's one, and OVER_CAP_HELD past it)
        sent = conn()  # one that sends its request at once is told too
        sent.sendall(b"GET /echo HTTP/1.1\r\nHost: x\r\n\r\n")
        sent.settimeout(5)
        assert read_all(sent).startswith(b"HTTP/1.1 503")
        for s in [*flood, *waiting, sent]:
            s.close()
        time.sleep(0.3)
        again = conn()  # the held ones gone: past the cap, read again before its answer
        again.sendall(b"POST /echo HTTP/1.1\r\nHost: x\r\nContent-Length: 5\r\n\r\nhello")
        again.settimeout(5)
        assert read_all(again).startswith(b"HTTP/1.1 503")
        again.close()
        held.sendall(b"GET /echo HTTP/1.1\r\nHost: x\r\n\r\n")  # the open connection was not touched
        assert read_all_until(held, b"got 0").startswith(b"HTTP/1.1 200")
        held.close()


def test_a_pipelined_request_whose_body_stops_gets_its_408_after_the_stream_before_it():
    # Its body could not come while it waited (uvicorn pauses reading behind
    # a response under way): body_timeout cut the stream before it, and its
    # 408 went out in the middle of that stream's chunked body. Now its time
    # starts when it does, and the 408 follows the stream's end.
    with serving(head=5, body=0.5):
        s = conn()
        s.sendall(b"GET /slow HTTP/1.1\r\nHost: x\r\n\r\n"
                  b"POST /echo HTTP/1.1\r\nHost: x\r\nContent-Length: 10\r\n\r\nab")  # 8 bytes never come
        s.settimeout(5)
        answer = read_all(s)
        s.close()
    first, sep, second = answer.partition(b"0\r\n\r\n")  # (the stream's end)
    assert first.startswith(b"HTTP/1.1 200") and b"piece9" in first and sep, answer
    assert second.startswith(b"HTTP/1.1 408"), answer


def test_a_pipelined_request_whose_body_comes_later_does_not_cut_the_stream_before_it():
    with serving(head=5, body=0.5):
        s = conn()
        s.sendall(b"GET /slow HTTP/1.1\r\nHost: x\r\n\r\n")
        time.sleep(0.3)
        s.sendall(b"POST /echo HTTP/1.1\r\nHost: x\r\nContent-Length: 5\r\n\r\n")
        time.sleep(0.05)
        s.sendall(b"hello")  # read only once the stream before it has ended
        answer = read_all_until(s, b"got 5")
        s.close()
    assert b"piece9" in answer and b"got 5" in answer, answer


def test_a_half_sent_head_behind_a_queued_request_does_not_cut_the_stream_before_it():
    # the head timer too started while reading was paused behind the stream
    with serving(head=0.5, body=5):
        s = conn()
        s.sendall(b"GET /slow HTTP/1.1\r\nHost: x\r\n\r\n")
        time.sleep(0.3)
        s.sendall(b"POST /echo HTTP/1.1\r\nHost: x\r\nContent-Length: 2\r\n\r\nhi"
                  b"POST /echo HTTP/1.1\r\nHo")  # a queued request, then half of another's head
        time.sleep(0.1)
        s.sendall(b"st: x\r\nContent-Length: 3\r\n\r\nabc")
        answer = read_all_until(s, b"got 3")
        s.close()
    assert b"piece9" in answer and b"got 2" in answer and b"got 3" in answer, answer


def test_open_and_refused_connections_are_counted() -> None:
    from router.metrics import Metrics

    m = Metrics()

    def value(name: str, **labels) -> float:
        return m.registry.get_sample_value(name, labels) or 0.0

    with serving(head=2.0, body=5, max_connections=2, metrics=m):  # (b's head must beat it on a loaded box)
        a, b = conn(), conn()
        time.sleep(0.1)
        assert value("fairstream_http_connections") == 2
        over = conn()
        over.sendall(b"GET /echo HTTP/1.1\r\nHost: x\r\n\r\n")
        over.settimeout(5)
        assert read_all(over).startswith(b"HTTP/1.1 503")
        over.close()
        b.sendall(b"GET /echo HTTP/1.1\r\nHost: x\r\nX-Big: " + b"a" * 70_000 + b"\r\n\r\n")
        b.settimeout(5)
        assert read_all(b).startswith(b"HTTP/1.1 431")
        b.close()
        a.settimeout(5)
        assert read_all(a).startswith(b"HTTP/1.1 408")  # sent nothing: the head timeout
        a.close()
        ws = conn()  # an upgrade: counted by the WebSocket protocol from then on, once
        ws.sendall(b"GET /ws HTTP/1.1\r\nHost: x\r\nConnection: Upgrade\r\nUpgrade: websocket\r\n"
                   b"Sec-WebSocket-Version: 13\r\nSec-WebSocket-Key: dGhlIHNhbXBsZSBub25jZQ==\r\n\r\n")
        ws.settimeout(5)
        read_all(ws)  # (the small app takes no WebSocket: refused, closed)
        ws.close()
        time.sleep(0.3)
        assert value("fairstream_http_connections") == 0
    assert value("fairstream_http_connections_refused_total", reason="max_connections") == 1
    assert value("fairstream_http_connections_refused_total", reason="header_timeout") == 1
    assert value("fairstream_http_connections_refused_total", reason="header_too_large") == 1
    assert value("fairstream_http_connections_refused_total", reason="body_timeout") == 0


def test_a_request_that_comes_whole_after_shutdown_began_gets_a_503_and_an_idle_connection_is_closed() -> None:
    from router.metrics import Metrics

    m = Metrics()
    with serving(head=5, body=5, metrics=m) as server:
        half, fresh, silent, idle = conn(), conn(), conn(), conn()
        half.sendall(b"POST /echo HTTP/1.1\r\nHo")
        idle.sendall(b"GET /echo HTTP/1.1\r\nHost: x\r\n\r\n")
        assert read_response(idle).endswith(b"got 0")  # (kept alive, and idle from now on)
        time.sleep(0.2)
        server.should_exit = True
        for _ in range(100):  # (shutdown begins with the listener's close)
            try:
                conn().close()
            except OSError:
                break
            time.sleep(0.05)
        else:
            raise AssertionError("the server did not stop listening")
        t = time.monotonic()
        idle.settimeout(5)
        assert read_all(idle) == b""  # closed at once, as uvicorn does
        assert time.monotonic() - t < 0.5
        half.sendall(b"st: x\r\nContent-Length: 2\r\n\r\nhi")
        fresh.sendall(b"GET /echo HTTP/1.1\r\nHost: x\r\n\r\n")
        for s in (half, fresh):
            s.settimeout(5)
            answer = read_all(s)
            assert answer.startswith(b"HTTP/1.1 503 "), answer
            assert b"\r\nretry-after: 1\r\n" in answer and b'"code":"router_shutdown"' in answer, answer
            s.close()
        silent.settimeout(5)
        assert read_all(silent) == b""  # sent nothing within SHUTDOWN_READ: closed, no answer
        assert time.monotonic() - t < hc.SHUTDOWN_READ + 1
        for s in (silent, idle):
            s.close()
    assert m.registry.get_sample_value("fairstream_http_connections_refused_total", {"reason": "shutdown"}) == 2


async def test_a_connection_costs_uvicorn_its_own_state_and_little_more() -> None:
    # (2,000 idle streams hold 2,000 connections: S3's memory per stream.
    # The router's per-connection state is in slots, so uvicorn's instance
    # dict keeps its keys shared; uvicorn's empty deques, 624 bytes each,
    # are lists: its pipeline queue and its two events' waiters)
    import sys

    from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol
    from uvicorn.server import ServerState

    class Transport:
        def get_extra_info(self, name):
            return None

        def is_closing(self):
            return False

        def set_write_buffer_limits(self, **kw):
            pass

        def close(self):
            pass

    config = uvicorn.Config(app=app, log_level="warning")
    config.load()
    theirs, ours = (cls(config, ServerState(), app_state={}) for cls in (HttpToolsProtocol, hc.HttpConnection))
    for proto in (theirs, ours):
        proto.connection_made(Transport())
    # (no key of the router's own in the instance dict: the same keys as
    # uvicorn's. Their sizes are not compared: a dict shares its keys with
    # the class's other instances only while those add attributes in the
    # same order, so they depend on what ran before in the process)
    assert list(vars(ours)) == list(vars(theirs))
    assert sys.getsizeof(ours.pipeline) < 100 and sys.getsizeof(ours.flow._is_writable_event._waiters) < 100
    ours.pipeline.appendleft("first")
    ours.pipeline.appendleft("second")
    assert ours.pipeline.pop() == "first" and ours.pipeline  # (uvicorn's order: appendleft, pop)
    ours.connection_lost(None)


def flood(head: bytes, byte: bytes = b"a", most: int = 16 << 20, over_cap: bool = False) -> tuple[bytes, int]:
    """Send ``head``, then ``byte`` in 64 KiB pieces (never a CRLF) until the
    server answers or ``most`` bytes are out: its answer, and the bytes sent
    by then (``over_cap``: on a connection past ``max_connections``)."""
    with serving(head=5, body=30, body_total=60, max_connections=1 if over_cap else 0):
        holder = conn() if over_cap else None  # (the one connection under the cap)
        s = conn()
        s.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, 65536)  # (what "sent" counts is what the server could read)
        s.sendall(head)
        piece, sent, out = byte * 65536, 0, b""
        s.setblocking(False)
        while sent < most and not out:
            with contextlib.suppress(BlockingIOError):
                out = s.recv(65536)
            with contextlib.suppress(BlockingIOError, InterruptedError):
                sent += s.send(piece)
        s.settimeout(5)
        out += read_all_until(s, b"}")
        s.close()
        if holder is not None:
            holder.close()
    return out, sent


CHUNKED = b"POST /echo HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: chunked\r\n\r\n"


def test_a_chunked_body_s_endless_trailer_gets_a_431_within_a_few_megabytes():
    # trailers are header fields, but the head's limit ended with the head:
    # httptools buffered an unfinished trailer value until body_timeout
    # (128 MB sent grew the router by ~290 MB, on one connection)
    answer, sent = flood(CHUNKED + b"1\r\nx\r\n0\r\nX-T: ")
    assert answer.startswith(b"HTTP/1.1 431") and b'"code":"header_too_large"' in answer, answer[:300]
    assert sent < 4 << 20, sent
    name, sent = flood(CHUNKED + b"1\r\nx\r\n0\r\n")  # (an endless trailer name, as well)
    assert name.startswith(b"HTTP/1.1 431") and sent < 4 << 20, (name[:300], sent)


def test_past_max_connections_an_endless_trailer_gets_a_431_within_a_few_megabytes():
    # (such a connection has no request cycle: its trailers went uncounted until its 503, OVER_CAP_READ later)
    answer, sent = flood(CHUNKED + b"1\r\nx\r\n0\r\nX-T: ", over_cap=True)
    assert answer.startswith(b"HTTP/1.1 431") and sent < 4 << 20, (answer[:300], sent)


def test_a_chunk_s_endless_extension_gets_a_431_within_a_few_megabytes():
    answer, sent = flood(CHUNKED + b"1\r\nx\r\n1;", byte=b"e")
    assert answer.startswith(b"HTTP/1.1 431") and sent < 4 << 20, (answer[:300], sent)


def test_a_chunked_body_in_tiny_chunks_and_its_small_trailers_are_served():
    with serving(head=5, body=5):
        s = conn()
        s.sendall(CHUNKED)
        body = b"".join(b"1;ext=%d\r\n%c\r\n" % (i, 97 + i % 26) for i in range(200_000))
        for i in range(0, len(body), 8192):  # (most reads hold no body byte's worth of data past a few)
            s.sendall(body[i:i + 8192])
        s.sendall(b"0\r\nX-Checksum: " + b"c" * 30_000 + b"\r\nX-Other: 1\r\n\r\n")
        answer = read_all_until(s, b"got ")
        s.close()
    assert answer.startswith(b"HTTP/1.1 200") and answer.endswith(b"got 200000"), answer[:300]
