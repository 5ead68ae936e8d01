"""SIGTERM with requests in flight (a rolling deploy): the router takes no
new connections, lets what runs finish within ``shutdown_grace``, then ends
each request still running with an explicit ``router_shutdown`` error (a 503
before the response started, an SSE error event after), never a stream cut
without a word; and it exits with no replica left behind."""

from __future__ import annotations

import asyncio
import base64
import contextlib
import json
import os
import signal
import time

import httpx
import pytest
import redis.asyncio as aioredis
import yaml
from websockets.asyncio.client import connect
from websockets.exceptions import ConnectionClosed

from router.auth import hash_key
from tests.helpers import ADMIN, GOLD, MODEL, RouterProcess, aiter_sse, apoll
from tests.redis_server import RedisServer, require_redis_server

GRACE = 1.5
AUTH = {"authorization": f"Bearer {GOLD}"}
LIMITED = "shutdown-limited-key"  # one request a minute; the next one waits for it


def _body(max_tokens: int, *, stream: bool = True) -> dict:
    return {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": max_tokens,
            "ignore_eos": True, "stream": stream}


@pytest.fixture
def router(make_router, tmp_path) -> RouterProcess:
    tenants = tmp_path / "tenants.yaml"
    tenants.write_text(yaml.safe_dump({"admin_keys": [hash_key(ADMIN)], "tenants": {
        "gold": {"keys": [hash_key(GOLD)]},
        "limited": {"keys": [hash_key(LIMITED)], "on_limit": "queue", "limits": {"requests_per_minute": 1}},
    }}))
    # one replica, ~20 ms per token, one request in flight: a second waits in the router's queue
    return make_router(replicas=1, sim={"step_base_ms": 20}, tenants=tenants,
                       settings={"shutdown_grace": GRACE,
                                 "batching": {"enabled": False, "initial": 1, "min_inflight": 1, "max_inflight": 1}})


async def _stream(http: httpx.AsyncClient, max_tokens: int, started: asyncio.Event | None = None,
                  key: str = GOLD):
    """(status, SSE events or the error body, headers) of one streamed completion."""
    async with http.stream("POST", "/v1/chat/completions", json=_body(max_tokens),
                           headers={"authorization": f"Bearer {key}"}) as r:
        if r.status_code != 200:
            return r.status_code, json.loads(await r.aread()), dict(r.headers)
        events = []
        async for ev in aiter_sse(r):  # raises if the body is cut (chunked encoding not ended)
            events.append(ev)
            if started is not None:
                started.set()
        return r.status_code, events, dict(r.headers)


async def test_sigterm_ends_what_runs_past_the_grace_explicitly(router: RouterProcess) -> None:
    async with httpx.AsyncClient(base_url=router.base_url, headers=AUTH, timeout=30) as http:
        started = asyncio.Event()
        running = asyncio.create_task(_stream(http, 1000, started))  # ~20 s: outlives the grace
        await asyncio.wait_for(started.wait(), 10)
        queued = asyncio.create_task(_stream(http, 10, key=LIMITED))  # the one slot is taken: it waits in the queue
        await asyncio.sleep(0.3)
        limited = asyncio.create_task(_stream(http, 10, key=LIMITED))  # waits for its tenant's rate limit
        await asyncio.sleep(0.3)
        stopped_at = time.monotonic()
        router.proc.send_signal(signal.SIGTERM)
        await asyncio.sleep(0.3)
        async with httpx.AsyncClient(base_url=router.base_url, timeout=5) as fresh:
            with pytest.raises(httpx.ConnectError):  # no new connections while it drains
                await fresh.get("/health")
        (s_run, events, _), (s_q, q_body, q_headers), (s_l, l_body, _) = await asyncio.wait_for(
            asyncio.gather(running, queued, limited), GRACE + 10)
        ended_at = time.monotonic()

    # past the grace: an explicit error event ends the stream, and no [DONE] after it
    assert s_run == 200
    last = events[-1].json()
    assert last["error"]["code"] == "router_shutdown", last
    assert "shutting down" in last["error"]["message"]
    assert all(ev.data != "[DONE]" for ev in events)
    assert len(events) > 10, "the stream ran on until the grace was over"
    # queued, never started: a 503 the client (or the SDK's retry) can take elsewhere
    assert s_q == 503, q_body
    assert q_body["error"]["code"] == "router_shutdown"
    assert q_headers.get("retry-after") == "1"
    assert s_l == 503 and l_body["error"]["code"] == "router_shutdown", l_body
    assert GRACE - 0.5 <= ended_at - stopped_at <= GRACE + 5
    router.proc.wait(15)
    # (uvicorn raises the signal it caught again once it has shut down)
    assert router.proc.returncode in (0, -signal.SIGTERM), router.log()[-3000:]
    log = router.log()
    assert "shutdown grace of 1.5s is over: ended 1 running, 1 queued and 1 rate-limited requests" in log
    assert log.count('"outcome": "shutdown"') + log.count('"outcome":"shutdown"') == 3, log[-3000:]


async def test_websockets_get_the_grace_then_close_with_1012(router: RouterProcess) -> None:
    url = router.base_url.replace("http://", "ws://") + "/v1/ws"
    opts = {"additional_headers": AUTH, "proxy": None, "open_timeout": 10, "close_timeout": 5}
    async with connect(url, **opts) as busy, connect(url, **opts) as idle:
        await busy.send(json.dumps({"type": "chat.completions.create", "id": "long", "body": _body(1000)}))
        first = json.loads(await asyncio.wait_for(busy.recv(), 10))
        assert first["id"] == "long" and "chunk" in first, first
        stopped_at = time.monotonic()
        router.proc.send_signal(signal.SIGTERM)
        # a socket with nothing running is closed at once, with "service restart"
        with pytest.raises(ConnectionClosed) as closed:
            await asyncio.wait_for(idle.recv(), 5)
        assert closed.value.rcvd is not None and closed.value.rcvd.code == 1012
        assert time.monotonic() - stopped_at < GRACE
        # the busy one takes no new request, but its running one goes on until the grace is over
        await busy.send(json.dumps({"type": "chat.completions.create", "id": "late", "body": _body(5)}))
        msgs = []
        with pytest.raises(ConnectionClosed) as closed:
            while True:
                msgs.append(json.loads(await asyncio.wait_for(busy.recv(), GRACE + 10)))
        ended_at = time.monotonic()
    assert closed.value.rcvd is not None and closed.value.rcvd.code == 1012, closed.value
    late = [m for m in msgs if m.get("id") == "late"]
    assert len(late) == 1 and late[0]["error"]["code"] == "router_shutdown", late
    long = [m for m in msgs if m.get("id") == "long"]
    assert len(long) > 10 and all("chunk" in m for m in long[:-1]), long[-3:]
    assert long[-1]["error"]["code"] == "router_shutdown", long[-1]
    assert GRACE - 0.5 <= ended_at - stopped_at <= GRACE + 5
    router.proc.wait(15)
    assert router.proc.returncode in (0, -signal.SIGTERM), router.log()[-3000:]


async def test_a_websocket_peer_that_never_answers_does_not_hold_the_shutdown(router: RouterProcess) -> None:
    host, port = router.base_url.removeprefix("http://").rsplit(":", 1)
    reader, writer = await asyncio.open_connection(host, int(port))
    key = base64.b64encode(os.urandom(16)).decode()
    writer.write(f"GET /v1/ws HTTP/1.1\r\nHost: {host}\r\nUpgrade: websocket\r\nConnection: Upgrade\r\n"
                 f"Sec-WebSocket-Key: {key}\r\nSec-WebSocket-Version: 13\r\n"
                 f"Authorization: Bearer {GOLD}\r\n\r\n".encode())
    head = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), 10)
    assert b" 101 " in head.split(b"\r\n")[0], head
    t = time.monotonic()
    router.proc.send_signal(signal.SIGTERM)  # the router sends its close frame; this peer never answers it
    await asyncio.to_thread(router.proc.wait, 15)
    assert time.monotonic() - t < 4, "a silent peer held the shutdown (websockets waits 10 s for a close reply)"
    writer.close()


async def _answer(reader: asyncio.StreamReader) -> tuple[str, dict[str, str], bytes]:
    """(status line, header fields, body) of a raw answer, read to the end."""
    answer = await asyncio.wait_for(reader.read(), 10)
    head, _, body = answer.partition(b"\r\n\r\n")
    lines = head.decode("latin-1").split("\r\n")
    return lines[0], {k.lower(): v.strip() for k, _, v in (ln.partition(":") for ln in lines[1:])}, body


async def test_a_request_or_upgrade_that_comes_whole_after_shutdown_began_gets_a_503(router: RouterProcess) -> None:
    # Connections open when SIGTERM comes whose request had not come whole: a
    # WebSocket upgrade half sent, one not sent yet, an HTTP request half sent.
    # (uvicorn closed them at once: their clients saw the connection reset
    # under the request they were sending, and no word why.)
    host, port = router.base_url.removeprefix("http://").rsplit(":", 1)
    key = base64.b64encode(os.urandom(16)).decode()
    upgrade = (f"GET /v1/ws HTTP/1.1\r\nHost: {host}\r\nUpgrade: websocket\r\nConnection: Upgrade\r\n"
               f"Sec-WebSocket-Key: {key}\r\nSec-WebSocket-Version: 13\r\nAuthorization: Bearer {GOLD}\r\n\r\n")
    body = json.dumps(_body(5, stream=False))
    post = (f"POST /v1/chat/completions HTTP/1.1\r\nHost: {host}\r\nAuthorization: Bearer {GOLD}\r\n"
            f"Content-Type: application/json\r\nContent-Length: {len(body)}\r\n\r\n{body}")
    conns = {name: await asyncio.open_connection(host, int(port)) for name in ("half upgrade", "fresh", "half post")}
    conns["half upgrade"][1].write(upgrade[:40].encode())
    conns["half post"][1].write(post[:40].encode())
    await asyncio.sleep(0.3)  # (taken in and read)
    router.proc.send_signal(signal.SIGTERM)

    async def stopped_listening() -> bool:
        try:
            _, w = await asyncio.open_connection(host, int(port))
        except OSError:
            return True
        w.close()
        return False

    # shutdown has begun (the router closes its listener as it begins to drain)
    await apoll(stopped_listening, 5, what="the router to stop listening")
    conns["half upgrade"][1].write(upgrade[40:].encode())
    conns["fresh"][1].write(upgrade.encode())
    conns["half post"][1].write(post[40:].encode())
    for name, (reader, writer) in conns.items():
        line, fields, got = await _answer(reader)
        assert line.startswith("HTTP/1.1 503 "), (name, line, got[:300])
        assert fields["retry-after"] == "1" and fields["content-type"] == "application/json", (name, fields)
        err = json.loads(got)["error"]
        assert err["code"] == "router_shutdown" and err["type"] == "server_error", (name, err)
        writer.close()
    t = time.monotonic()
    await asyncio.to_thread(router.proc.wait, 15)
    # (they hold the exit no longer: a connection kept for its head would
    # wait out header_timeout, 30 s; the exit itself took 7 s once in a full
    # run on a busy 2-core box, 0.2-0.5 s alone)
    assert time.monotonic() - t < 10
    assert router.proc.returncode in (0, -signal.SIGTERM), router.log()[-3000:]


async def test_a_stream_that_ends_within_the_grace_finishes(router: RouterProcess) -> None:
    async with httpx.AsyncClient(base_url=router.base_url, headers=AUTH, timeout=30) as http:
        started = asyncio.Event()
        task = asyncio.create_task(_stream(http, 40, started))  # ~0.8 s
        await asyncio.wait_for(started.wait(), 10)
        router.proc.send_signal(signal.SIGTERM)
        status, events, _ = await asyncio.wait_for(task, GRACE + 10)
    assert status == 200 and events[-1].data == "[DONE]"
    assert not any("error" in ev.data for ev in events[:-1])
    t = time.monotonic()
    router.proc.wait(15)
    assert time.monotonic() - t < GRACE, "nothing ran any more: the grace is not waited out"


async def test_sigterm_with_nothing_in_flight_exits_at_once(router: RouterProcess) -> None:
    async with httpx.AsyncClient(base_url=router.base_url, headers=AUTH, timeout=30) as http:
        r = await http.post("/v1/chat/completions", json=_body(5, stream=False))
        assert r.status_code == 200
    t = time.monotonic()
    router.stop()
    assert time.monotonic() - t < GRACE, "no request ran: the grace is not waited out"
    # where it listened, and that it got to the end, are in its log
    log = router.log()
    assert f'"msg":"listening on {router.base_url}"' in log, log[-3000:]
    assert '"msg":"stopped"' in log, log[-3000:]


async def test_with_shared_state_a_stream_ended_by_shutdown_resumes_on_another_router(make_router) -> None:
    require_redis_server()
    with RedisServer() as redis:
        state = {"backend": "redis", "url": redis.url}
        sim = {"step_base_ms": 20}  # same seed everywhere: any replica continues a greedy stream exactly
        a = make_router(replicas=1, sim=sim, settings={"shutdown_grace": GRACE, "state": state})
        b = make_router(replicas=1, sim=sim, settings={"state": state})
        body = {**_body(120), "temperature": 0}
        async with httpx.AsyncClient(headers=AUTH, timeout=30) as http:
            ref = (await http.post(b.base_url + "/v1/chat/completions", json={**body, "stream": False})).json()
            text, last, stopped = "", None, False
            async with http.stream("POST", a.base_url + "/v1/chat/completions", json=body) as r:
                rid = r.headers["x-request-id"]
                async for ev in aiter_sse(r):
                    if ev.id is not None:  # as EventSource does: an event without an id keeps the last one
                        last = ev.id
                    d = ev.json()
                    if "error" in d:
                        break
                    text += d["choices"][0]["delta"].get("content") or ""
                    if len(text) >= 20 and not stopped:
                        a.proc.send_signal(signal.SIGTERM)
                        stopped = True
            assert d["error"]["code"] == "router_shutdown"
            assert "Last-Event-ID" in d["error"]["message"]
            assert ev.id is None, "the shutdown event takes no number: the resume starts after the last one"
            async with http.stream("GET", f"{b.base_url}/v1/streams/{rid}", headers={"Last-Event-ID": last}) as r:
                assert r.status_code == 200, await r.aread()
                async for ev in aiter_sse(r):
                    if ev.data == "[DONE]":
                        break
                    text += ev.json()["choices"][0]["delta"].get("content") or ""
        assert text == ref["choices"][0]["message"]["content"]
        a.proc.wait(15)
        # its request line names what its client was told (it said "retry the request")
        line = next(rec for rec in a.records("fairstream.request") if rec["request_id"] == rid)
        assert line["error_code"] == "router_shutdown" and "Last-Event-ID" in line["error"], line


@contextlib.contextmanager
def _two_routers_on_redis(make_router):
    """Routers ``a`` (a shutdown grace of 0.5 s) and ``b`` sharing a
    redis-server of their own (timeout 0.3 s), one slow sim replica each."""
    require_redis_server()
    with RedisServer() as redis:
        state = {"backend": "redis", "url": redis.url, "timeout": 0.3}
        sim = {"step_base_ms": 20}
        a = make_router(replicas=1, sim=sim, settings={"shutdown_grace": 0.5, "state": state})
        b = make_router(replicas=1, sim=sim, settings={"state": state})
        yield redis, a, b


async def _stream_until_shutdown(http, router, disturb, ready) -> tuple[str, str | None, bool, dict]:
    """Stream a 1,000-token chat from ``router``; at its 20th event
    ``disturb()`` (the state store), then SIGTERM the router once
    ``ready(n)``. (request id, last event id, whether it was stopped, the
    last event's data)."""
    body = {**_body(1000), "temperature": 0}
    n, last, stopped, d = 0, None, False, {}
    async with http.stream("POST", router.base_url + "/v1/chat/completions", json=body) as r:
        rid = r.headers["x-request-id"]
        async for ev in aiter_sse(r):
            if ev.id is not None:
                last = ev.id
            d = ev.json()
            if "error" in d:
                break
            n += 1
            if n == 20:
                await disturb()
            elif n > 20 and not stopped and ready(n):
                await asyncio.sleep(0.2)  # (a few more of its events appended)
                router.proc.send_signal(signal.SIGTERM)
                stopped = True
    return rid, last, stopped, d


def _told_to_retry(d: dict) -> None:
    err = d["error"]
    assert err["code"] == "router_shutdown", err
    assert "Last-Event-ID" not in err["message"] and "retry the request" in err["message"], err


async def test_a_stream_whose_buffer_broke_is_told_to_retry_at_shutdown_not_to_resume(make_router) -> None:
    # Redis stops answering for 1 s mid-stream (timeout 0.3 s): the router's
    # appends go to its local fallback meanwhile, and once Redis is back it
    # finds the stream's buffer short of them (broken: it says so in its
    # log). SIGTERM then told the client to resume from its Last-Event-ID,
    # and that resume, on the router sharing the store, was a 400
    # ``not_resumable`` (a chaos run with two routers). It is to be told to
    # retry the request, as a stream with no buffer is.
    with _two_routers_on_redis(make_router) as (redis, a, b):

        async def freeze_a_second() -> None:
            redis.proc.send_signal(signal.SIGSTOP)
            await asyncio.sleep(1.0)
            redis.proc.send_signal(signal.SIGCONT)

        async with httpx.AsyncClient(headers=AUTH, timeout=30) as http:
            rid, last, stopped, d = await _stream_until_shutdown(http, a, freeze_a_second,
                                                                 lambda n: "not appended to" in a.log())
            assert stopped, "the router never found the buffer broken"
            _told_to_retry(d)
            # (what a resume of it gets: the promise it was given before would have been false)
            r = await http.get(f"{b.base_url}/v1/streams/{rid}", headers={"Last-Event-ID": last})
            assert r.status_code == 400 and r.json()["error"]["code"] == "not_resumable", r.text
        a.proc.wait(15)
        line = next(rec for rec in a.records("fairstream.request") if rec["request_id"] == rid)
        assert line["error_code"] == "router_shutdown" and "Last-Event-ID" not in line["error"], line


async def test_a_stream_whose_buffer_redis_holds_is_told_to_retry_at_shutdown_during_the_outage(make_router) -> None:
    # Redis stops answering mid-stream and stays down: the router's appends
    # went to its local fallback, which holds no buffer of the stream and
    # kept nothing of them, yet said nothing, so a SIGTERM during the outage
    # told the client to resume from its Last-Event-ID (a resume that misses
    # those events). The fallback refuses them, and the stream is told to
    # retry the request.
    require_redis_server()
    with RedisServer() as redis:
        state = {"backend": "redis", "url": redis.url, "timeout": 0.3}
        a = make_router(replicas=1, sim={"step_base_ms": 20}, settings={"shutdown_grace": 0.5, "state": state})

        async def freeze() -> None:
            redis.proc.send_signal(signal.SIGSTOP)

        try:
            async with httpx.AsyncClient(headers=AUTH, timeout=30) as http:
                _, _, stopped, d = await _stream_until_shutdown(
                    http, a, freeze, lambda n: "not appended to" in a.log() or n == 400)
                assert stopped and "serving with local limits" in a.log()
                _told_to_retry(d)
        finally:
            redis.proc.send_signal(signal.SIGCONT)
        a.proc.wait(15)


async def test_a_stream_whose_buffer_the_store_lost_is_told_to_retry_at_shutdown(make_router) -> None:
    # Redis loses its data mid-stream without the router meeting an outage
    # (flushed here; as well a restart without persistence between two of
    # its calls, or one while the stream was quiet): the router sees the
    # store's generation change ("lost the leases") and goes on appending
    # the stream's events, which the store answered "no such buffer" to,
    # taken for a success. SIGTERM then told the client to resume from its
    # Last-Event-ID, and that resume, on the router sharing the store, was
    # a 404 ``stream_not_found`` (a chaos run: 17 streams at once). It is
    # to be told to retry the request, as a stream with a broken buffer is.
    with _two_routers_on_redis(make_router) as (redis, a, b):

        async def flush() -> None:
            client = aioredis.from_url(redis.url)
            await client.flushall()
            await client.aclose()

        async with httpx.AsyncClient(headers=AUTH, timeout=30) as http:
            rid, last, stopped, d = await _stream_until_shutdown(
                http, a, flush, lambda n: "lost the leases" in a.log() or n == 400)
            assert stopped and "lost the leases" in a.log() and "unavailable" not in a.log()
            _told_to_retry(d)
            # (what a resume of it gets: the promise it was given before would have been false)
            r = await http.get(f"{b.base_url}/v1/streams/{rid}", headers={"Last-Event-ID": last})
            assert r.status_code == 404 and r.json()["error"]["code"] == "stream_not_found", r.text
        a.proc.wait(15)
