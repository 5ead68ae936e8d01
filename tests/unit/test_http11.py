"""replicas.http11 against a real HTTP/1.1 server on loopback (asyncio streams)."""

from __future__ import annotations

import asyncio

import pytest

from replicas.http11 import HttpError, HttpPool


class Server:
    """Answers each request by ``script(path, writer, reader)``; counts connections."""

    def __init__(self, script) -> None:
        self.script = script
        self.connections = 0
        self.open = 0
        self.closed = asyncio.Event()
        self.requests: list[bytes] = []

    async def __aenter__(self) -> Server:
        self.server = await asyncio.start_server(self._serve, "127.0.0.1", 0)
        self.url = f"http://127.0.0.1:{self.server.sockets[0].getsockname()[1]}/v1"
        return self

    async def __aexit__(self, *exc) -> None:
        self.server.close()
        await self.server.wait_closed()

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.connections += 1
        self.open += 1
        try:
            while True:
                head = await reader.readuntil(b"\r\n\r\n")
                length = int(next(h.split(b":")[1] for h in head.split(b"\r\n") if h.lower().startswith(b"content-length")))
                body = await reader.readexactly(length)
                self.requests.append(head + body)
                path = head.split(b" ")[1].decode()
                if await self.script(path, writer, reader) == "close":
                    break
        except (asyncio.IncompleteReadError, ConnectionError):
            pass
        finally:
            self.open -= 1
            self.closed.set()
            writer.close()


def chunked(*pieces: bytes) -> bytes:
    return b"".join(b"%x\r\n%s\r\n" % (len(p), p) for p in pieces) + b"0\r\n\r\n"


HEAD = b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\nTransfer-Encoding: chunked\r\n\r\n"


async def hello_then_wait(path, w, r):
    """One body chunk, then nothing until the client closes the connection."""
    w.write(HEAD + b"5\r\nhello\r\n")
    await w.drain()
    assert await r.read() == b""
    return "close"


async def test_streams_the_body_to_the_sink_and_reuses_the_connection() -> None:
    async def script(path, w, r):
        w.write(HEAD)
        await w.drain()
        for p in (b"data: 1\n\n", b"data: 2\n\n"):
            w.write(b"%x\r\n%s\r\n" % (len(p), p))
            await w.drain()
            await asyncio.sleep(0.01)
        w.write(b"0\r\n\r\n")

    async with Server(script) as srv:
        pool = HttpPool(srv.url, {"authorization": "Bearer k"})
        for _ in range(3):
            r = await pool.request("POST", "/completions", b'{"a":1}')
            got: list[bytes] = []
            r.stream_to(got.append)
            await r.finished()
            assert r.status == 200 and b"".join(got) == b"data: 1\n\ndata: 2\n\n"
            assert len(got) == 2  # piece by piece, as they came
        assert srv.connections == 1  # kept alive
        assert srv.requests[0].startswith(b"POST /v1/completions HTTP/1.1\r\n")
        assert b"authorization: Bearer k\r\n" in srv.requests[0] and srv.requests[0].endswith(b'{"a":1}')
        await pool.close()


async def test_the_chunks_of_one_read_reach_the_sink_as_one_piece() -> None:
    # (an upstream writes every SSE event as a chunk of its own: a read that
    # holds many went to the SSE reader one chunk at a time, a pass of the
    # reader and a delta per token when the upstream outpaced the router)
    events = [b"data: %d\n\n" % i for i in range(50)]

    async def script(path, w, r):
        w.write(HEAD + chunked(*events[:25]))  # (the body's end in the same read)
        await w.drain()

    async def split(path, w, r):
        w.write(HEAD + chunked(*events[:25])[:-5])
        await w.drain()
        await asyncio.sleep(0.05)
        w.write(b"0\r\n\r\n")

    for s in (script, split):
        async with Server(s) as srv:
            pool = HttpPool(srv.url)
            r = await pool.request("POST", "/completions", b"{}")
            got: list[bytes] = []
            r.stream_to(got.append)
            await r.finished()
            assert b"".join(got) == b"".join(events[:25])
            assert len(got) <= 2, len(got)  # the read with the head, and the one after it at most
            await pool.close()


async def test_error_bodies_are_read_whole() -> None:
    async def script(path, w, r):
        body = b'{"error": {"message": "bad"}}'
        w.write(b"HTTP/1.1 400 Bad Request\r\nContent-Length: %d\r\n\r\n%s" % (len(body), body))

    async with Server(script) as srv:
        pool = HttpPool(srv.url)
        r = await pool.request("POST", "/completions", b"{}")
        assert r.status == 400 and await r.read() == b'{"error": {"message": "bad"}}'
        await pool.close()


async def test_a_kept_alive_connection_the_server_closed_is_replaced() -> None:
    async def script(path, w, r):
        w.write(b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\n\r\nok")
        await w.drain()
        return "close"  # without telling the client (no Connection: close)

    async with Server(script) as srv:
        pool = HttpPool(srv.url)
        for _ in range(3):
            r = await pool.request("POST", "/x", b"{}")
            assert await r.read() == b"ok"
            await asyncio.sleep(0.05)  # the server's close reaches the idle connection
        assert srv.connections == 3
        await pool.close()


async def test_a_sink_error_ends_the_response_with_it_and_drops_the_connection() -> None:
    async with Server(hello_then_wait) as srv:
        pool = HttpPool(srv.url)
        r = await pool.request("POST", "/x", b"{}")

        def sink(piece: bytes) -> None:
            raise ValueError(f"cannot parse {piece!r}")

        r.stream_to(sink)
        with pytest.raises(ValueError, match="hello"):
            await r.finished()
        await asyncio.wait_for(srv.closed.wait(), 2)  # the server saw the connection go
        await pool.close()


async def test_close_mid_body_closes_the_connection() -> None:
    async with Server(hello_then_wait) as srv:
        pool = HttpPool(srv.url)
        r = await pool.request("POST", "/x", b"{}")
        r.stream_to(lambda piece: None)
        r.close()
        await r.finished()  # closed by us: a normal end
        await asyncio.wait_for(srv.closed.wait(), 2)
        assert srv.open == 0
        await pool.close()


async def test_a_connection_cut_mid_body_is_an_http_error() -> None:
    async def script(path, w, r):
        w.write(HEAD + b"5\r\nhello\r\n")
        await w.drain()
        return "close"

    async with Server(script) as srv:
        pool = HttpPool(srv.url)
        r = await pool.request("POST", "/x", b"{}")
        r.stream_to(lambda piece: None)
        with pytest.raises(HttpError, match="closed"):
            await r.finished()
        await pool.close()


def held_until(release: asyncio.Event):
    """A script: the head at once and the body's one chunk once ``release`` is
    set; a request to ``/hang`` gets nothing until then."""
    async def script(path, w, r):
        if path.endswith("/hang"):
            await release.wait()  # has the request, answers nothing
            return "close"
        w.write(HEAD)
        await w.drain()
        await release.wait()
        w.write(chunked(b"x"))

    return script


async def test_limit_bounds_concurrent_requests() -> None:
    release = asyncio.Event()
    async with Server(held_until(release)) as srv:
        pool = HttpPool(srv.url, limit=2)
        first = [await pool.request("POST", "/x", b"{}") for _ in range(2)]
        third = asyncio.ensure_future(pool.request("POST", "/x", b"{}"))
        await asyncio.sleep(0.1)
        assert not third.done() and srv.connections == 2
        release.set()
        for r in first:
            await r.read()
        r3 = await asyncio.wait_for(third, 2)
        assert await r3.read() == b"x"
        await pool.close()


async def test_the_head_timeout_times_the_head_not_the_wait_for_a_slot() -> None:
    # (it once covered the wait for the pool's slot and the connect too, so a
    # request queued behind a slow body failed over as if its server hung)
    release = asyncio.Event()
    async with Server(held_until(release)) as srv:
        pool = HttpPool(srv.url, limit=1)
        first = await pool.request("POST", "/x", b"{}", head_timeout=0.2)
        second = asyncio.ensure_future(pool.request("POST", "/x", b"{}", head_timeout=0.2))
        await asyncio.sleep(0.4)  # (past the head timeout, waiting for the slot)
        release.set()
        assert await first.read() == b"x"
        r2 = await asyncio.wait_for(second, 2)
        assert await r2.read() == b"x"
        release.clear()
        with pytest.raises(HttpError, match="no response head within 0.2s"):
            await pool.request("POST", "/hang", b"{}", head_timeout=0.2)
        release.set()
        await pool.close()


async def test_connection_refused_is_an_http_error() -> None:
    srv = await asyncio.start_server(lambda r, w: None, "127.0.0.1", 0)
    port = srv.sockets[0].getsockname()[1]
    srv.close()
    await srv.wait_closed()
    pool = HttpPool(f"http://127.0.0.1:{port}")
    with pytest.raises(HttpError, match="connect"):
        await pool.request("POST", "/x", b"{}")
    await pool.close()


async def test_a_body_that_came_with_the_head_reaches_the_sink() -> None:
    """The whole response in one network read: the body arrived (and ended)
    before the caller set its sink; the sink still gets all of it."""
    async def script(path, w, r):
        w.write(HEAD + chunked(b"data: 1\n\n", b"data: 2\n\n"))

    async with Server(script) as srv:
        pool = HttpPool(srv.url)
        r = await pool.request("POST", "/x", b"{}")
        await asyncio.sleep(0.05)  # let it all arrive before the sink is set
        got: list[bytes] = []
        r.stream_to(got.append)
        await r.finished()
        assert b"".join(got) == b"data: 1\n\ndata: 2\n\n"
        await pool.close()


async def test_send_now_writes_at_once_and_the_head_hook_streams_from_the_callback() -> None:
    async def script(path, w, r):
        w.write(HEAD + chunked(b"data: 1\n\n", b"data: 2\n\n"))

    async with Server(script) as srv:
        pool = HttpPool(srv.url)
        assert pool.send_now("POST", "/x", b"{}") is None  # no kept-alive connection yet
        first = await pool.request("POST", "/x", b"{}")
        await first.read()
        sent = pool.send_now("POST", "/x", b'{"b":2}')
        assert sent is not None
        got: list[bytes] = []
        heads: list[int] = []

        def on_head(resp) -> None:
            heads.append(resp.status)
            resp.stream_to(got.append)

        sent.response.on_head = on_head
        # out with no await of ours: the server answers before request() is called
        await asyncio.wait_for(sent.response.finished(), 2)
        assert heads == [200] and b"".join(got) == b"data: 1\n\ndata: 2\n\n"
        r = await pool.response_to(sent)
        assert r is sent.response and r.status == 200
        assert srv.connections == 1 and srv.requests[1].endswith(b'{"b":2}')
        await pool.close()


async def test_send_now_is_off_under_a_concurrency_limit() -> None:
    async def script(path, w, r):
        w.write(b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\n\r\nok")

    async with Server(script) as srv:
        pool = HttpPool(srv.url, limit=4)
        await (await pool.request("POST", "/x", b"{}")).read()
        assert pool.send_now("POST", "/x", b"{}") is None  # the limit needs request()'s wait
        await pool.close()


async def test_a_request_sent_at_once_on_a_closed_connection_goes_again_on_a_new_one() -> None:
    seen = 0

    async def script(path, w, r):
        nonlocal seen
        seen += 1
        if seen == 2:
            return "close"  # the kept-alive connection dies under the request, no byte back
        w.write(HEAD + chunked(b"data: %d\n\n" % seen))

    async with Server(script) as srv:
        pool = HttpPool(srv.url)
        await (await pool.request("POST", "/x", b"{}")).read()
        got: list[bytes] = []
        sent = pool.send_now("POST", "/x", b"{}", lambda resp: resp.stream_to(got.append))
        assert sent is not None
        r = await pool.response_to(sent)
        await r.finished()
        assert r is not sent.response and got == [b"data: 3\n\n"]  # the hook came along
        assert srv.connections == 2
        await pool.close()


async def test_a_head_hook_that_fails_ends_the_response_and_its_head_with_an_error() -> None:
    async def script(path, w, r):
        w.write(HEAD + chunked(b"data: 1\n\n"))

    async with Server(script) as srv:
        pool = HttpPool(srv.url)
        await (await pool.request("POST", "/x", b"{}")).read()

        def hook(resp) -> None:
            raise RuntimeError("hook failed")

        sent = pool.send_now("POST", "/x", b"{}", hook)
        assert sent is not None
        with pytest.raises(HttpError):
            await pool.response_to(sent)  # not a cancellation: the caller reports it
        with pytest.raises(RuntimeError, match="hook failed"):
            await sent.response.finished()
        await pool.close()



@pytest.mark.parametrize("body_later", [False, True])
async def test_a_response_and_a_closed_connection_leave_nothing_for_the_cycle_collector(body_later: bool) -> None:
    # (a sink that refers back to its response, as the upstream SSE reader
    # does, and a connection's parser, which holds the connection's
    # callbacks, are cut when they end: reference counting frees them;
    # tests/integration/test_garbage.py checks the whole request path.
    # This test server's asyncio streams make cycles of their own: only
    # the client's objects are counted)
    import gc

    import httptools

    from replicas.http11 import Response, _Conn

    class Reader:
        def __init__(self, response) -> None:
            self.response = response
            self.got: list[bytes] = []

        def feed(self, data: bytes) -> None:
            self.got.append(data)

    async def script(path, w, r):
        if body_later:  # (the sink is set before the body comes)
            w.write(HEAD)
            await w.drain()
            await asyncio.sleep(0.02)
            w.write(chunked(b"data: 1\n\n"))
        else:  # (the whole body comes with the head: it has ended when the sink is set)
            w.write(HEAD + chunked(b"data: 1\n\n"))
        return "close"  # (and the connection is closed after it)

    async with Server(script) as srv:
        pool = HttpPool(srv.url)
        gc.collect()
        gc.disable()
        try:
            for _ in range(5):
                r = await pool.request("POST", "/completions", b"{}")
                reader = Reader(r)
                r.stream_to(reader.feed)
                await r.finished()
                assert b"".join(reader.got) == b"data: 1\n\n"
                del r, reader
                await asyncio.wait_for(srv.closed.wait(), 2)
                srv.closed.clear()
                await asyncio.sleep(0.05)  # (the client side's connection_lost)
            gc.set_debug(gc.DEBUG_SAVEALL)
            gc.collect()
            ours = [type(o).__name__ for o in gc.garbage
                    if isinstance(o, (Response, _Conn, httptools.HttpResponseParser))]
        finally:
            gc.set_debug(0)
            gc.garbage.clear()
            gc.enable()
        await pool.close()
    assert ours == [], f"in reference cycles after 5 responses: {ours}"
