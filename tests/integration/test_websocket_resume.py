"""WebSocket streams resume as SSE streams do (router/websocket_stream.py).

A ``/v1/ws`` request's first message names its stream (``"stream"``: the
id ``GET /v1/streams/{id}`` takes) and each chunk carries its SSE event id
(``"event_id"``: the ``Last-Event-ID`` value). A client whose socket drops
resumes over HTTP, or on a new socket with ``{"type": "resume", ...}``, and
gets the missed events and then the rest, token-exact. Run on the memory
store (one router) and on Redis with two routers: the stream started on the
first is resumed on the second.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
import yaml
from websockets.asyncio.client import ClientConnection, connect

from router.auth import hash_key
from tests.helpers import ADMIN, MODEL, RouterProcess, SseEvent, aiter_sse, apoll
from tests.redis_server import RedisServer, require_redis_server

KEY_A, KEY_B = "wsr-tenant-a", "wsr-tenant-b"
REPLICA = "sim-0"


@pytest.fixture(scope="module", params=["memory", "redis"])
def routers(request, tmp_path_factory) -> Iterator[list[RouterProcess]]:
    """memory: one router; redis: two routers on one Redis (streams start on
    the first and are resumed on the last)."""
    d: Path = tmp_path_factory.mktemp(f"wsr-{request.param}")
    tenants = d / "tenants.yaml"
    tenants.write_text(yaml.safe_dump({
        "admin_keys": [hash_key(ADMIN)],
        "tenants": {"a": {"keys": [hash_key(KEY_A)]}, "b": {"keys": [hash_key(KEY_B)]}},
    }, sort_keys=False))
    # one replica each, 10 ms per token: a 200-token stream runs for >= 2 s
    kw: dict[str, Any] = {"replicas": 1, "tenants": tenants, "sim": {"step_base_ms": 10}}
    if request.param == "memory":
        r = RouterProcess(d / "r0", **kw).start()
        yield [r]
        r.stop()
        return
    require_redis_server()
    with RedisServer() as redis:
        made: list[RouterProcess] = []
        try:
            for i in range(2):
                made.append(RouterProcess(d / f"r{i}", settings={"state": {"backend": "redis", "url": redis.url}},
                                          **kw).start())
            yield made
        finally:
            for r in made:
                r.stop()


@pytest.fixture
async def http(routers: list[RouterProcess]):
    async with httpx.AsyncClient(headers={"Authorization": f"Bearer {KEY_A}"}, timeout=30) as c:
        yield c


def open_ws(router: RouterProcess, key: str = KEY_A):
    return connect(router.base_url.replace("http://", "ws://") + "/v1/ws",
                   additional_headers={"Authorization": f"Bearer {key}"}, proxy=None, open_timeout=10,
                   close_timeout=5)


def chat_body(prompt: str, max_tokens: int) -> dict[str, Any]:
    return {"model": MODEL, "messages": [{"role": "user", "content": prompt}], "max_tokens": max_tokens,
            "temperature": 0, "ignore_eos": True, "stream_options": {"include_usage": True}}


async def recv(ws: ClientConnection, timeout: float = 10) -> dict[str, Any]:
    return json.loads(await asyncio.wait_for(ws.recv(), timeout))


async def until_last(ws: ClientConnection, cid: str, timeout: float = 20) -> list[dict[str, Any]]:
    """``cid``'s messages up to its last one (done, an error, aborted)."""
    out: list[dict[str, Any]] = []
    async with asyncio.timeout(timeout):
        while not out or not (out[-1].get("done") or "error" in out[-1] or out[-1].get("aborted")):
            m = await recv(ws, timeout)
            if m.get("id") == cid:
                out.append(m)
    return out


async def reference(router: RouterProcess, http: httpx.AsyncClient, prompt: str, max_tokens: int) -> tuple[str, int]:
    """(text, prompt tokens) of the unbroken greedy completion."""
    body = {k: v for k, v in chat_body(prompt, max_tokens).items() if k != "stream_options"}
    r = await http.post(router.base_url + "/v1/chat/completions", json=body)
    assert r.status_code == 200, r.text
    d = r.json()
    return d["choices"][0]["message"]["content"], d["usage"]["prompt_tokens"]


async def start_and_drop(router: RouterProcess, prompt: str, max_tokens: int, n: int) -> tuple[str, list[dict]]:
    """Start a chat completion on a socket, read ``n`` chunk messages, then
    drop the connection (no close handshake). Returns (stream id, messages)."""
    async with open_ws(router) as ws:
        await ws.send(json.dumps({"type": "chat.completions.create", "id": "q", "body": chat_body(prompt, max_tokens)}))
        msgs = [await recv(ws) for _ in range(n)]
        ws.transport.abort()
    assert all("chunk" in m for m in msgs), msgs
    sid = msgs[0].get("stream")
    assert isinstance(sid, str) and sid, f"the first message names the stream: {msgs[0]}"
    assert all("stream" not in m for m in msgs[1:]), "only the first message names it"
    return sid, msgs


def positions(event_id: str) -> tuple[int, int, int, list[int]]:
    n, tokens, chars, *end = (int(x) for x in event_id.split("-"))
    return n, tokens, chars, end


def check_whole(chunks: list[dict[str, Any]], ref: str, prompt_tokens: int, max_tokens: int) -> None:
    """What the client holds after the dropped socket plus the resume
    (``chunk`` objects with their ``event`` and ``event_id``): first the
    role-only chunk, without an event (router/sse.py)."""
    role, chunks = chunks[0], chunks[1:]
    assert set(role) - {"stream"} == {"id", "chunk"}, role
    assert role["chunk"]["choices"][0]["delta"] == {"role": "assistant", "content": ""}, role
    assert [c["event"] for c in chunks] == list(range(1, len(chunks) + 1)), "numbered without a gap or a repeat"
    text = ""
    for c in chunks:
        choices = c["chunk"]["choices"]
        text += "".join(ch["delta"].get("content") or "" for ch in choices)
        n, tokens, chars, end = positions(c["event_id"])
        assert n == c["event"] and chars == len(text), c
        finish = bool(choices and choices[0]["finish_reason"])
        assert end == ([1] if finish else [2] if c["chunk"].get("usage") else []), c
    assert text == ref
    assert positions(chunks[-1]["event_id"])[1] == max_tokens
    usage = [c["chunk"]["usage"] for c in chunks if c["chunk"].get("usage")]
    assert usage == [{"prompt_tokens": prompt_tokens, "completion_tokens": max_tokens,
                      "total_tokens": prompt_tokens + max_tokens}], usage
    finishes = [ch["finish_reason"] for c in chunks for ch in c["chunk"]["choices"] if ch["finish_reason"]]
    assert finishes == ["length"]
    roles = [ch["delta"]["role"] for c in chunks for ch in c["chunk"]["choices"] if "role" in ch["delta"]]
    assert roles == [], "the role is sent once, not again after the resume"


async def resume_ws(router: RouterProcess, sid: str, last_event_id: str, key: str = KEY_A) -> list[dict[str, Any]]:
    async with open_ws(router, key) as ws:
        await ws.send(json.dumps({"type": "resume", "id": "again", "stream": sid, "last_event_id": last_event_id}))
        return await until_last(ws, "again")


async def counted(routers: list[RouterProcess], http: httpx.AsyncClient, name: str, **labels: str) -> float:
    return sum([(await r.ametrics(http)).value(name, 0.0, **labels) for r in routers])


async def idle(routers: list[RouterProcess], http: httpx.AsyncClient) -> None:
    async def check() -> bool:
        return await counted(routers, http, "fairstream_replica_inflight_requests") == 0
    await apoll(check, 3, what="no stream running on the replicas")


async def test_a_dropped_sockets_stream_resumes_on_a_new_socket_token_exact(
        routers: list[RouterProcess], http: httpx.AsyncClient) -> None:
    prompt, max_tokens = "Tell me about Zürich", 200
    ref, prompt_tokens = await reference(routers[0], http, prompt, max_tokens)
    sid, first = await start_and_drop(routers[0], prompt, max_tokens, 20)
    rest = await resume_ws(routers[-1], sid, first[-1]["event_id"])
    assert rest[-1] == {"id": "again", "done": True}, rest[-1]
    assert rest[0]["stream"] == sid and rest[0]["event"] == 20, rest[0]  # (the first message read: the role chunk)
    assert all(set(m) - {"stream"} == {"id", "event", "event_id", "chunk"} for m in rest[:-1]), rest[:-1]
    check_whole(first + rest[:-1], ref, prompt_tokens, max_tokens)


async def test_a_dropped_sockets_stream_resumes_over_http_token_exact(
        routers: list[RouterProcess], http: httpx.AsyncClient) -> None:
    prompt, max_tokens = "東京の", 200  # multi-byte text: event ids count characters
    ref, prompt_tokens = await reference(routers[0], http, prompt, max_tokens)
    sid, first = await start_and_drop(routers[0], prompt, max_tokens, 20)
    url = f"{routers[-1].base_url}/v1/streams/{sid}"
    async with http.stream("GET", url, headers={"Last-Event-ID": first[-1]["event_id"]}) as r:
        assert r.status_code == 200, await r.aread()
        assert r.headers["x-request-id"] == sid
        events: list[SseEvent] = [ev async for ev in aiter_sse(r)]
    assert events[-1].data == "[DONE]"
    as_messages = [{"event": ev.number, "event_id": ev.id, "chunk": ev.json()} for ev in events[:-1]]
    check_whole(first + as_messages, ref, prompt_tokens, max_tokens)


async def test_another_tenants_resume_is_refused_as_over_http(
        routers: list[RouterProcess], http: httpx.AsyncClient) -> None:
    prompt, max_tokens = "Le caf", 200
    sid, first = await start_and_drop(routers[0], prompt, max_tokens, 10)
    last = first[-1]["event_id"]
    over_http = await http.get(f"{routers[-1].base_url}/v1/streams/{sid}",
                               headers={"Authorization": f"Bearer {KEY_B}", "Last-Event-ID": last})
    assert over_http.status_code == 404, over_http.text
    refused = await resume_ws(routers[-1], sid, last, KEY_B)
    assert len(refused) == 1 and set(refused[0]) == {"id", "request_id", "error"}, refused
    assert refused[0]["error"]["code"] == over_http.json()["error"]["code"] == "stream_not_found", refused
    # and the stream is as it was for its own tenant
    ref, prompt_tokens = await reference(routers[0], http, prompt, max_tokens)
    rest = await resume_ws(routers[-1], sid, last)
    check_whole(first + rest[:-1], ref, prompt_tokens, max_tokens)


async def test_abort_still_ends_the_generation_and_the_stream_resumes_as_a_dropped_one(
        routers: list[RouterProcess], http: httpx.AsyncClient) -> None:
    prompt, max_tokens = "Über", 300  # 3 s unless aborted
    ref, prompt_tokens = await reference(routers[0], http, prompt, max_tokens)
    async with open_ws(routers[0]) as ws:
        await ws.send(json.dumps({"type": "chat.completions.create", "id": "q", "body": chat_body(prompt, max_tokens)}))
        first = [await recv(ws) for _ in range(10)]
        await ws.send(json.dumps({"type": "abort", "id": "q"}))
        msgs = await until_last(ws, "q")
        assert msgs[-1] == {"id": "q", "aborted": True}, msgs[-1]
        first += msgs[:-1]
        await idle(routers, http)  # aborted on the replica at once, as a disconnect is
        with pytest.raises(TimeoutError):
            await recv(ws, 0.5)  # nothing more for it
    # nothing runs for it until a resume asks; then it continues exactly
    rest = await resume_ws(routers[-1], first[0]["stream"], first[-1]["event_id"])
    assert rest[-1] == {"id": "again", "done": True}, rest[-1]
    check_whole(first + rest[:-1], ref, prompt_tokens, max_tokens)


async def test_a_resumed_socket_stream_counts_each_token_once(
        routers: list[RouterProcess], http: httpx.AsyncClient) -> None:
    prompt, max_tokens = "Le caf", 200
    await idle(routers, http)
    before = {d: await counted(routers, http, "fairstream_tokens_total", tenant="a", direction=d)
              for d in ("prompt", "completion")}
    sid, first = await start_and_drop(routers[0], prompt, max_tokens, 20)
    await idle(routers, http)
    rest = await resume_ws(routers[-1], sid, first[-1]["event_id"])
    assert rest[-1]["done"], rest[-1]
    usage = next(m["chunk"]["usage"] for m in rest if "chunk" in m and m["chunk"].get("usage"))
    after = {d: await counted(routers, http, "fairstream_tokens_total", tenant="a", direction=d)
             for d in ("prompt", "completion")}
    assert {d: after[d] - before[d] for d in after} == {"prompt": usage["prompt_tokens"], "completion": max_tokens}
    # the log lines: the socket's cancelled request, then the resume, as for an SSE stream
    lines = [rec for r in routers for rec in r.records("fairstream.request") if rec.get("request_id") == sid]
    assert sorted(rec["endpoint"] for rec in lines) == ["resume", "websocket"], lines
    assert sum(rec["completion_tokens"] for rec in lines) == max_tokens, lines
    assert [rec["outcome"] for rec in lines if rec["endpoint"] == "websocket"] == ["cancelled"], lines


async def test_a_resume_message_says_what_it_lacks(routers: list[RouterProcess]) -> None:
    async with open_ws(routers[0]) as ws:
        await ws.send(json.dumps({"type": "resume", "id": "r1", "last_event_id": "3-3-3"}))
        assert (await recv(ws))["error"]["param"] == "stream"
        await ws.send(json.dumps({"type": "resume", "id": "r2", "stream": "s", "body": {}}))
        assert (await recv(ws))["error"]["param"] == "body"
        await ws.send(json.dumps({"type": "chat.completions.create", "id": "r3", "stream": "s",
                                  "body": chat_body("hi", 3)}))
        assert (await recv(ws))["error"]["param"] == "stream"
        await ws.send(json.dumps({"type": "resume", "id": "r4", "stream": "x" * 129}))
        assert (await recv(ws))["error"]["param"] == "stream"
        # an unknown stream: the HTTP resume's 404, under a request id of its own
        await ws.send(json.dumps({"type": "resume", "id": "r5", "stream": "no-such-stream"}))
        msg = await recv(ws)
        assert msg["error"]["code"] == "stream_not_found" and msg["request_id"], msg


async def test_a_resume_messages_errors_name_its_last_event_id_not_a_header_it_never_sent(
        routers: list[RouterProcess], http: httpx.AsyncClient) -> None:
    # The socket runs the HTTP resume, whose errors named the Last-Event-ID
    # header: a socket client sent a resume message's "last_event_id".
    sid, first = await start_and_drop(routers[0], "Le caf", 200, 10)
    url = f"{routers[-1].base_url}/v1/streams/{sid}"
    for bad in ("abc", "-1", "1-2", "1" * 29, "١"):
        over_http = (await http.get(url, params={"last_event_id": bad})).json()["error"]
        assert over_http["param"] == "Last-Event-ID", over_http  # (HTTP unchanged)
        [refused] = await resume_ws(routers[-1], sid, bad)
        err = refused["error"]
        assert (err["param"], err["code"], err["type"]) == ("last_event_id", over_http["code"], "invalid_request_error"), err
        assert "Last-Event-ID" not in err["message"] and "last_event_id must be an event id" in err["message"], err
        assert refused["request_id"], refused
    # a well-formed id that is not one of this stream's: resume_mismatch, as over HTTP
    n = first[-1]["event"]
    [refused] = await resume_ws(routers[-1], sid, f"{n}-999-999")
    err = refused["error"]
    assert (err["param"], err["code"]) == ("last_event_id", "resume_mismatch"), err
    assert "Last-Event-ID" not in err["message"], err
    # and the stream is as it was
    rest = await resume_ws(routers[-1], sid, first[-1]["event_id"])
    assert rest[-1] == {"id": "again", "done": True}, rest[-1]


@pytest.mark.parametrize("routers", ["redis"], indirect=True)  # (the buffer is written straight into Redis)
async def test_a_resume_of_a_stream_that_ended_without_its_end_is_not_told_done(
        routers: list[RouterProcess], http: httpx.AsyncClient) -> None:
    # A stream whose relay failed (a bug) leaves a finished buffer with
    # neither [DONE] nor an error event last: its SSE resume ends without
    # [DONE]; a socket's said {"done": true}, a clean finish.
    url = routers[-1].config["state"]["url"]
    from replicas.protocol import SamplingParams
    from router.ids import new_id
    from router.resume import ResumeMeta, encode_meta
    from router.sse import ChunkEncoder
    from router.state.redis_store import RedisStore

    sid = new_id()
    enc = ChunkEncoder(True, "chatcmpl-cut", MODEL, 0)
    events = [enc.delta("Hello", pos=b"-1-5"), enc.delta(" there", pos=b"-2-11")]
    store = RedisStore(url)
    try:
        meta = ResumeMeta("a", True, MODEL, "chatcmpl-cut", 0, False, SamplingParams(max_tokens=8), [1, 2])
        await store.stream_open(sid, encode_meta(meta), "", 60)
        assert await store.stream_append(sid, events, [10, 11], 11, True, "", 60)
    finally:
        await store.close()
    async with http.stream("GET", f"{routers[-1].base_url}/v1/streams/{sid}", headers={"Last-Event-ID": "1-1-5"}) as r:
        assert r.status_code == 200, await r.aread()
        sse = [ev.data async for ev in aiter_sse(r)]
    assert len(sse) == 1 and sse[0] != "[DONE]", sse  # (SSE: the stream ends without its end)
    for after, chunks in (("1-1-5", 1), ("2-2-11", 0)):
        msgs = await resume_ws(routers[-1], sid, after)
        assert [m["event_id"] for m in msgs[:-1]] == ["2-2-11"][:chunks], msgs
        last = msgs[-1]
        assert "done" not in last and set(last) == {"id", "request_id", "error"}, last
        assert last["request_id"] == sid, last
        assert (last["error"]["type"], last["error"]["code"]) == ("server_error", "stream_lost"), last


@pytest.mark.parametrize("routers", ["redis"], indirect=True)  # (the buffer is written straight into Redis)
async def test_a_take_over_from_a_buffer_with_tokens_but_no_events_opens_with_the_role_chunk(
        routers: list[RouterProcess], http: httpx.AsyncClient) -> None:
    # A stream whose first token had no text yet (a held-back stop prefix, a
    # split character) when its client left stores that token and no event.
    # A resume from the start takes it over: its client has no event, so the
    # continuation's first event opens with the role chunk (it was left out,
    # the buffer having tokens).
    url = routers[-1].config["state"]["url"]
    from replicas.protocol import SamplingParams
    from router.ids import new_id
    from router.resume import ResumeMeta, encode_meta
    from router.state.redis_store import RedisStore

    sid = new_id()
    store = RedisStore(url)
    try:
        meta = ResumeMeta("a", True, MODEL, "chatcmpl-held", 0, False, SamplingParams(max_tokens=6), [1, 2])
        await store.stream_open(sid, encode_meta(meta), "", 60)
        assert await store.stream_append(sid, [], [10], 0, False, "", 60)
    finally:
        await store.close()
    async with http.stream("GET", f"{routers[-1].base_url}/v1/streams/{sid}") as r:
        assert r.status_code == 200, await r.aread()
        sse = [ev.data async for ev in aiter_sse(r)]
    assert sse[-1] == "[DONE]", sse
    first = json.loads(sse[0])["choices"][0]
    assert first["delta"] == {"role": "assistant", "content": ""} and first["finish_reason"] is None, sse[:2]
    assert all("role" not in json.loads(d)["choices"][0]["delta"] for d in sse[1:-1] if d.startswith("{")), sse
