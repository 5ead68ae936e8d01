"""``/v1/ws`` against a real router and a sim replica (message protocol in
router/websocket.py): auth, several concurrent chat completions per socket,
abort, protocol errors without closing, close aborts everything, tenant limits."""

from __future__ import annotations

import asyncio
import base64
import contextlib
import itertools
import json
import os
import socket
import struct
import time
from pathlib import Path
from typing import Any

import httpx
import pytest
import yaml
from websockets.asyncio.client import ClientConnection, connect
from websockets.exceptions import ConnectionClosed

from router.auth import hash_key
from tests.helpers import ADMIN, MODEL, RouterProcess, apoll, write_tenants

KEY_A, KEY_LIM = "ws-tenant-a", "ws-tenant-limited"
REPLICA = "sim-0"


@pytest.fixture(scope="module")
def router(tmp_path_factory) -> RouterProcess:
    d: Path = tmp_path_factory.mktemp("ws")
    tenants = d / "tenants.yaml"
    write_tenants(tenants, {
        "a": {"keys": [hash_key(KEY_A)]},
        "lim": {"keys": [hash_key(KEY_LIM)], "on_limit": "reject", "limits": {"max_concurrent": 1}},
    })
    # one replica (its running count is the whole story), 10 ms per token
    r = RouterProcess(d / "r", replicas=1, tenants=tenants, sim={"step_base_ms": 10})
    r.start()
    yield r
    r.stop()


@pytest.fixture
async def http(router: RouterProcess):
    async with httpx.AsyncClient(base_url=router.base_url, headers={"Authorization": f"Bearer {KEY_A}"},
                                 timeout=30) as c:
        yield c


def ws_url(router: RouterProcess) -> str:
    return router.base_url.replace("http://", "ws://") + "/v1/ws"


def open_ws(router: RouterProcess, key: str | None = KEY_A):
    headers = {"Authorization": f"Bearer {key}"} if key is not None else None
    return connect(ws_url(router), additional_headers=headers, proxy=None, open_timeout=10, close_timeout=5)


def chat_body(prompt: str, max_tokens: int, **kw: Any) -> dict[str, Any]:
    return {"model": MODEL, "messages": [{"role": "user", "content": prompt}], "max_tokens": max_tokens,
            "temperature": 0, "ignore_eos": True, **kw}


async def create(ws: ClientConnection, cid: str, body: dict[str, Any]) -> None:
    await ws.send(json.dumps({"type": "chat.completions.create", "id": cid, "body": body}))


async def recv(ws: ClientConnection, timeout: float = 10) -> dict[str, Any]:
    return json.loads(await asyncio.wait_for(ws.recv(), timeout))


async def reference(http: httpx.AsyncClient, prompt: str, max_tokens: int) -> str:
    r = await http.post("/v1/chat/completions", json=chat_body(prompt, max_tokens))
    assert r.status_code == 200, r.text
    return r.json()["choices"][0]["message"]["content"]


class Collector:
    """Reads a socket's messages in order, sorting them by request id."""

    def __init__(self, ws: ClientConnection) -> None:
        self.ws = ws
        self.log: list[dict[str, Any]] = []  # every message, in arrival order

    def of(self, cid: str) -> list[dict[str, Any]]:
        return [m for m in self.log if m.get("id") == cid]

    def text(self, cid: str) -> str:
        return "".join(c["delta"].get("content") or "" for m in self.of(cid) if "chunk" in m
                       for c in m["chunk"]["choices"])

    def finished(self, cid: str) -> bool:
        return any(m.get("done") or "error" in m or m.get("aborted") for m in self.of(cid))

    async def until(self, cond, timeout: float = 20, what: str = "messages") -> None:
        async def run() -> None:
            while not cond():
                self.log.append(await recv(self.ws, timeout))

        try:
            await asyncio.wait_for(run(), timeout)
        except TimeoutError:
            raise AssertionError(f"timed out after {timeout}s waiting for {what}; got {self.log[-5:]}") from None


def check_completed(col: Collector, cid: str, ref: str) -> None:
    msgs = col.of(cid)
    assert msgs[-1] == {"id": cid, "done": True}, msgs[-1]
    role, chunks = msgs[0], msgs[1:-1]
    # first vLLM's role-only chunk, which names the stream and has no SSE event id (router/sse.py)
    assert set(role) == {"id", "stream", "chunk"}, role
    assert role["chunk"]["choices"][0]["delta"] == {"role": "assistant", "content": ""}, role
    # then each chunk carries its SSE event id (what a resume takes)
    assert all(set(m) == {"id", "event", "event_id", "chunk"} for m in chunks), [m for m in chunks if "chunk" not in m]
    assert [m["event"] for m in chunks] == list(range(1, len(chunks) + 1))
    assert all(m["event_id"].startswith(f"{m['event']}-") for m in chunks), chunks
    assert all(m["chunk"]["object"] == "chat.completion.chunk" and m["chunk"]["model"] == MODEL for m in chunks)
    assert len({m["chunk"]["id"] for m in msgs[:-1]}) == 1
    assert col.text(cid) == ref
    finishes = [c["finish_reason"] for m in chunks for c in m["chunk"]["choices"] if c["finish_reason"]]
    assert finishes == ["length"]


async def load(router: RouterProcess, http: httpx.AsyncClient) -> tuple[float, float]:
    """(router in-flight, replica running + waiting) on the one replica."""
    m = await router.ametrics(http)
    return (m.value("fairstream_replica_inflight_requests", replica=REPLICA),
            m.value("fairstream_replica_running_requests", replica=REPLICA)
            + m.value("fairstream_replica_waiting_requests", replica=REPLICA))


async def wait_load(router: RouterProcess, http: httpx.AsyncClient, ok, timeout: float, what: str) -> None:
    async def check() -> bool:
        return ok(*await load(router, http))

    await apoll(check, timeout, what=what)


def requests_total(m, outcome: str) -> float:
    return m.value("fairstream_requests_total", 0.0, endpoint="websocket", outcome=outcome)


def assert_error(msg: dict[str, Any], cid: str | None, *, type_: str = "invalid_request_error",
                 code: str | None = None, param: str | None = None) -> dict[str, Any]:
    if cid is not None:
        assert msg.get("id") == cid, msg
    assert "error" in msg, msg
    err = msg["error"]
    assert set(err) == {"message", "type", "param", "code"}, err
    assert err["type"] == type_ and err["message"], err
    if code is not None:
        assert err["code"] == code, err
    if param is not None:
        assert err["param"] == param, err
    return err


# -- auth ------------------------------------------------------------------------------------------


async def test_auth_by_header(router: RouterProcess, http: httpx.AsyncClient) -> None:
    ref = await reference(http, "hello", 12)
    async with open_ws(router) as ws:
        col = Collector(ws)
        await create(ws, "r1", chat_body("hello", 12))
        await col.until(lambda: col.finished("r1"), what="r1 to finish")
        check_completed(col, "r1", ref)


async def test_auth_by_first_message(router: RouterProcess, http: httpx.AsyncClient) -> None:
    ref = await reference(http, "hello", 12)
    async with open_ws(router, key=None) as ws:
        # nothing runs before the socket is authenticated
        await create(ws, "early", chat_body("hello", 12))
        assert_error(await recv(ws), "early", code="missing_api_key")
        await ws.send(json.dumps({"type": "auth", "api_key": KEY_A}))
        assert await recv(ws) == {"type": "auth", "ok": True}
        col = Collector(ws)
        await create(ws, "r1", chat_body("hello", 12))
        await col.until(lambda: col.finished("r1"), what="r1 to finish")
        check_completed(col, "r1", ref)


@pytest.mark.parametrize("key, code, close_code", [("not-a-key", "invalid_api_key", 4401),
                                                   (ADMIN, "forbidden", 4403)], ids=["bad-key", "admin-key"])
@pytest.mark.parametrize("how", ["header", "message"])
async def test_bad_or_admin_key_gets_an_error_and_a_close_code(router: RouterProcess, key: str, code: str,
                                                               close_code: int, how: str) -> None:
    async with open_ws(router, key=key if how == "header" else None) as ws:
        if how == "message":
            await ws.send(json.dumps({"type": "auth", "api_key": key}))
        msg = await recv(ws)
        assert set(msg) == {"error"}, msg
        assert_error(msg, None, code=code)
        assert key not in msg["error"]["message"], "the key must not be echoed"
        with pytest.raises(ConnectionClosed) as info:
            await recv(ws)
        assert info.value.rcvd is not None and info.value.rcvd.code == close_code, info.value


# -- several requests on one socket -------------------------------------------------------------------


async def test_two_requests_run_concurrently_and_match_http(router: RouterProcess, http: httpx.AsyncClient) -> None:
    jobs = {"a": ("東京の", 120), "b": ("Tell me about Zürich", 100)}
    ref_tasks = {cid: asyncio.create_task(reference(http, p, n)) for cid, (p, n) in jobs.items()}
    async with open_ws(router) as ws:
        col = Collector(ws)
        await create(ws, "a", chat_body(*jobs["a"], stream_options={"include_usage": True}))
        await create(ws, "b", chat_body(*jobs["b"]))
        await col.until(lambda: col.finished("a") and col.finished("b"), what="both requests to finish")
    refs = {cid: await t for cid, t in ref_tasks.items()}
    usage = [m["chunk"]["usage"] for m in col.of("a") if "chunk" in m and m["chunk"].get("usage")]
    assert len(usage) == 1 and usage[0]["completion_tokens"] == 120, usage
    for cid in jobs:
        check_completed(col, cid, refs[cid])
    # interleaved: each one's chunks arrive while the other is still streaming
    order = [m["id"] for m in col.log]
    first = {cid: order.index(cid) for cid in jobs}
    last = {cid: len(order) - 1 - order[::-1].index(cid) for cid in jobs}
    assert first["b"] < last["a"] and first["a"] < last["b"], order
    switches = sum(1 for x, y in itertools.pairwise(order) if x != y)
    assert switches >= 4, f"the two streams were not interleaved: {order}"


async def test_abort_stops_one_generation_and_the_other_completes(router: RouterProcess,
                                                                  http: httpx.AsyncClient) -> None:
    ref_b = await reference(http, "Le caf", 250)
    before = await router.ametrics(http)
    async with open_ws(router) as ws:
        col = Collector(ws)
        await create(ws, "long", chat_body("The ", 2000))  # >= 20 s unless aborted
        await create(ws, "b", chat_body("Le caf", 250))
        await col.until(lambda: len(col.of("long")) >= 5 and len(col.of("b")) >= 5, what="both to stream")
        await wait_load(router, http, lambda inf, eng: inf == 2, 3, "two requests in flight")
        await ws.send(json.dumps({"type": "abort", "id": "long"}))
        await col.until(lambda: any(m.get("aborted") for m in col.of("long")), what="the abort confirmation")
        assert col.of("long")[-1] == {"id": "long", "aborted": True}
        seen_long = len(col.of("long"))
        # aborted at once: the router has only b in flight
        await wait_load(router, http, lambda inf, eng: inf <= 1, 1.0, "the aborted request to leave the replica")
        await col.until(lambda: col.finished("b"), what="b to finish")
        check_completed(col, "b", ref_b)
        assert len(col.of("long")) == seen_long, "nothing of the aborted request after its confirmation"
        # nothing left on the replica (the aborted one had ~15 s to go)
        await wait_load(router, http, lambda inf, eng: inf == 0 and eng == 0, 2.5,
                        "router in-flight and replica running to drop to 0")
        after = await router.ametrics(http)
        assert requests_total(after, "cancelled") == requests_total(before, "cancelled") + 1
        assert requests_total(after, "ok") == requests_total(before, "ok") + 1
        # the socket still works
        await create(ws, "c", chat_body("Le caf", 8))
        await col.until(lambda: col.finished("c"), what="c to finish")
        assert col.of("c")[-1] == {"id": "c", "done": True}


async def test_an_id_aborted_and_sent_again_at_once_stays_abortable(router: RouterProcess,
                                                                     http: httpx.AsyncClient) -> None:
    """A "regenerate" button: abort and create with the same id, in one write."""
    async with open_ws(router) as ws:
        col = Collector(ws)
        await create(ws, "a", chat_body("The ", 2000))
        await col.until(lambda: len(col.of("a")) >= 3, what="a to stream")
        abort = json.dumps({"type": "abort", "id": "a"})
        again = json.dumps({"type": "chat.completions.create", "id": "a", "body": chat_body("The ", 2000)})
        ws.protocol.send_text(abort.encode())  # two messages in one TCP write
        ws.protocol.send_text(again.encode())
        ws.transport.write(b"".join(ws.protocol.data_to_send()))
        await col.until(lambda: sum(1 for m in col.of("a") if m.get("aborted")) == 1, what="the first abort")
        n = len(col.log)
        await col.until(lambda: sum(1 for m in col.log[n:] if m.get("id") == "a" and "chunk" in m) >= 3,
                        what="the new a to stream")
        await ws.send(abort)  # the new one is tracked: it can be aborted too
        await col.until(lambda: sum(1 for m in col.of("a") if m.get("aborted")) == 2, what="the second abort")
        await wait_load(router, http, lambda inf, eng: inf == 0, 2.5, "nothing left in flight")


# -- protocol errors keep the socket open ---------------------------------------------------------------


async def test_protocol_errors_are_messages_not_closes(router: RouterProcess, http: httpx.AsyncClient) -> None:
    ref = await reference(http, "hello", 10)
    async with open_ws(router) as ws:
        await create(ws, "n2", chat_body("hello", 10, n=2))
        err = assert_error(await recv(ws), "n2", param="n")
        assert "n" in err["message"]
        await ws.send(json.dumps({"type": "chat.completions.frobnicate", "id": "x"}))
        assert_error(await recv(ws), "x", param="type")
        await ws.send("{not json")
        assert_error(await recv(ws), "", code="invalid_json")
        await ws.send(b'{"type": "auth"}')  # a binary frame
        assert "text frame" in assert_error(await recv(ws), "", code="invalid_json")["message"]
        await ws.send(json.dumps({"type": "chat.completions.create", "body": chat_body("hello", 10)}))
        assert_error(await recv(ws), "", param="id")
        await ws.send(json.dumps({"type": "chat.completions.create", "id": "nobody"}))
        assert_error(await recv(ws), "nobody", param="body")
        await create(ws, "bad-field", {**chat_body("hello", 10), "frobnicate": 1})
        assert_error(await recv(ws), "bad-field", param="frobnicate")
        # an unpaired surrogate escape (JSON.stringify of text cut inside an emoji) is named, under the
        # request's id, as over HTTP (it was msgspec's "Input data was truncated", under the id "")
        cut = json.dumps({"type": "chat.completions.create", "id": "cut", "body": chat_body("\ud83d", 10)})
        assert "\\ud83d" in cut
        await ws.send(cut)
        err = assert_error(await recv(ws), "cut", code="invalid_json", param="body.messages[0].content")
        assert "unpaired UTF-16 surrogate escape \\ud83d" in err["message"] and "truncated" not in err["message"], err
        # (a message over 64 KiB too: the escape is set aside to read its id; two in the id's way)
        long = {"type": "chat.completions.create", "body": chat_body("\udc00" + "x" * 70_000 + "\ud83d", 10)}
        await ws.send(json.dumps({"stream": "\ud83d", **long, "id": "cut-long"}))
        assert "surrogate" in assert_error(await recv(ws), "cut-long", code="invalid_json")["message"]
        # after all that, the socket serves a request
        col = Collector(ws)
        await create(ws, "ok", chat_body("hello", 10))
        await col.until(lambda: col.finished("ok"), what="ok to finish")
        check_completed(col, "ok", ref)


async def test_an_id_in_use_is_refused(router: RouterProcess) -> None:
    async with open_ws(router) as ws:
        col = Collector(ws)
        await create(ws, "dup", chat_body("hello", 150))
        await col.until(lambda: len(col.of("dup")) >= 2, what="dup to stream")
        await create(ws, "dup", chat_body("hello", 5))
        await col.until(lambda: any("error" in m for m in col.of("dup")), what="the error for the reused id")
        assert_error(next(m for m in col.of("dup") if "error" in m), "dup", param="id")
        await col.until(lambda: col.finished("dup") and col.of("dup")[-1].get("done"), what="dup to finish")


async def test_a_refused_message_is_marked_and_does_not_end_the_stream_running_under_its_id(
        router: RouterProcess) -> None:
    # A message refused under the id of a running stream was answered
    # {"id": "s0", "error": ...}: the shape of that stream's last message (one
    # that stays resumable), so a client routing by id closed s0 and then got
    # chunks for it. Every refusal of a message says "refused": true.
    async with open_ws(router) as ws:
        col = Collector(ws)
        await create(ws, "s0", chat_body("hello", 150))
        await col.until(lambda: len(col.of("s0")) >= 2, what="s0 to stream")
        await ws.send(json.dumps({"type": "bogus", "id": "s0"}))
        await create(ws, "s0", chat_body("hello", 5))
        await ws.send(json.dumps({"type": "chat.completions.create", "id": "s0", "body": chat_body("hi", 4),
                                  "extra": 1}))
        await ws.send(json.dumps({"type": "auth", "id": "s0", "api_key": KEY_A}))
        refused = lambda: [m for m in col.of("s0") if "error" in m]  # noqa: E731
        await col.until(lambda: len(refused()) == 4, what="the four refusals")
        codes = []
        for m in refused():
            assert m.get("refused") is True and "event" not in m and "request_id" not in m, m
            codes.append(assert_error(m, "s0")["code"])
        assert codes == ["unknown_message_type", "id_in_use", "invalid_json", "already_authenticated"], codes
        await col.until(lambda: col.of("s0")[-1].get("done"), what="s0 to finish")
        assert sum("chunk" in m for m in col.of("s0")) > 2
        # a refusal under an id not running has the same marker
        await ws.send(json.dumps({"type": "bogus", "id": "free"}))
        assert (await recv(ws)).get("refused") is True
        # the end of a request that ran (one its body's checks refused) is no message refusal
        await create(ws, "bad-field", {**chat_body("hello", 10), "frobnicate": 1})
        msg = await recv(ws)
        assert_error(msg, "bad-field", param="frobnicate")
        assert "refused" not in msg, msg


async def test_closing_the_socket_aborts_everything_running(router: RouterProcess, http: httpx.AsyncClient) -> None:
    before = await router.ametrics(http)
    async with open_ws(router) as ws:
        col = Collector(ws)
        await create(ws, "x", chat_body("The ", 2000))  # >= 20 s each unless aborted
        await create(ws, "y", chat_body("Über", 2000))
        await col.until(lambda: len(col.of("x")) >= 3 and len(col.of("y")) >= 3, what="both to stream")
        await wait_load(router, http, lambda inf, eng: inf == 2 and eng == 2, 3, "both running on the replica")
        # Close while still reading (a client that stops reading gets its
        # close handshake stuck behind the frames it did not read).
        drain = asyncio.create_task(col.until(lambda: False, timeout=30))
        closing = asyncio.create_task(ws.close())
        try:
            await wait_load(router, http, lambda inf, eng: inf == 0 and eng == 0, 2.5,
                            "router in-flight and replica running to drop to 0 after the close")
            await asyncio.wait_for(closing, 5)
        finally:
            drain.cancel()
        with pytest.raises((ConnectionClosed, asyncio.CancelledError)):
            await drain
    after = await router.ametrics(http)
    assert requests_total(after, "cancelled") == requests_total(before, "cancelled") + 2


# -- limits ----------------------------------------------------------------------------------------------


async def test_concurrency_limit_applies_per_request_on_the_socket(router: RouterProcess,
                                                                    http: httpx.AsyncClient) -> None:
    ref_task = asyncio.create_task(reference(http, "Le caf", 200))  # tenant a: not limited
    async with open_ws(router, key=KEY_LIM) as ws:
        col = Collector(ws)
        await create(ws, "first", chat_body("Le caf", 200))  # >= 2 s: holds the slot during the checks
        await col.until(lambda: len(col.of("first")) >= 2, what="first to stream")
        await create(ws, "second", chat_body("Le caf", 10))
        await col.until(lambda: col.finished("second"), what="the refusal of the second request")
        assert len(col.of("second")) == 1
        err = assert_error(col.of("second")[0], "second", type_="rate_limit_error", code="rate_limit_exceeded")
        assert "concurrent streams" in err["message"]
        assert col.of("second")[0]["retry_after"] >= 1  # (what HTTP's Retry-After says; it had none)
        # one limit across transports: the socket's stream holds the tenant's only slot for HTTP too
        r = await http.post("/v1/chat/completions", json=chat_body("Le caf", 4),
                            headers={"Authorization": f"Bearer {KEY_LIM}"})
        assert r.status_code == 429 and r.json()["error"]["code"] == "rate_limit_exceeded", r.text
        await col.until(lambda: col.finished("first"), what="first to finish")
        check_completed(col, "first", await ref_task)
        # the lease went with the first request: the next one is admitted
        await create(ws, "third", chat_body("Le caf", 10))
        await col.until(lambda: col.finished("third"), what="third to finish")
        assert col.of("third")[-1] == {"id": "third", "done": True}, col.of("third")


# -- a reload, and sockets that never authenticate ----------------------------------------------------


async def test_a_reload_reaches_open_sockets_a_revoked_key_closes_them(tmp_path: Path) -> None:
    # The key is checked against the policy in force at each request. Before,
    # a socket kept the policy it authenticated with: a key revoked by a
    # reload went on working on it, with the old limits. Then the socket was
    # closed at the next request and its running ones were cancelled with no
    # message (logged as if the client had left); they now end as HTTP
    # streams of a revoked key do, and the socket closes after them.
    tenants = tmp_path / "tenants.yaml"

    def write(keys: list[str], max_tokens: int) -> None:
        write_tenants(tenants, {"a": {"keys": [hash_key(k) for k in keys], "limits": {"max_tokens": max_tokens}}})

    write([KEY_A, KEY_LIM], 1000)
    with RouterProcess(tmp_path / "r", replicas=1, tenants=tenants, sim={"step_base_ms": 1}) as r:
        async with httpx.AsyncClient(base_url=r.base_url, timeout=30) as admin:
            async def reload() -> None:
                resp = await admin.post("/admin/reload", headers={"Authorization": f"Bearer {ADMIN}"})
                assert resp.status_code == 200 and resp.json()["changed"], resp.text

            async with open_ws(r, KEY_A) as keeps, open_ws(r, key=None) as revoked:
                await revoked.send(json.dumps({"type": "auth", "api_key": KEY_LIM}))
                assert await recv(revoked) == {"type": "auth", "ok": True}
                for ws in (keeps, revoked):
                    col = Collector(ws)
                    await create(ws, "before", chat_body("hello", 50))
                    await col.until(lambda: col.finished("before"), what="a request before the reload")
                col = Collector(revoked)
                await create(revoked, "long", chat_body("hello", 900))  # (~1 s at 1 ms a token)
                await col.until(lambda: col.of("long"), what="the long request's first chunk")
                write([KEY_A], 20)  # KEY_LIM revoked; max_tokens 20
                await reload()
                await create(keeps, "after", chat_body("hello", 50))
                assert_error(await recv(keeps), "after", param="max_tokens")  # the new limit, on the open socket
                await create(revoked, "after", chat_body("hello", 5))
                await col.until(lambda: col.of("after"), what="the refusal")
                assert_error(col.of("after")[0], "after", code="invalid_api_key")
                await create(revoked, "again", chat_body("hello", 5))
                await col.until(lambda: col.finished("long") and col.of("again"), what="the long request's end")
                assert_error(col.of("again")[0], "again", code="invalid_api_key")
                assert col.of("long")[-1] == {"id": "long", "done": True}, col.of("long")[-1]
                assert sum("chunk" in m for m in col.of("long")) >= 2
                with pytest.raises(ConnectionClosed) as info:
                    await recv(revoked)
                assert info.value.rcvd is not None and info.value.rcvd.code == 4401, info.value


async def test_a_socket_whose_key_a_reload_revoked_closes_after_its_requests_without_another(tmp_path: Path) -> None:
    # A socket whose key a reload revoked, with requests running, that sends
    # nothing more: it closed only at its next request (or ws_idle_timeout,
    # 1000 "idle"), and meanwhile held its tenant's max_sockets slot, so the
    # rotated-in key was refused (4429). It closes with 4401 once they end.
    tenants = tmp_path / "tenants.yaml"

    def write(keys: list[str]) -> None:
        write_tenants(tenants, {"a": {"keys": [hash_key(k) for k in keys], "limits": {"max_sockets": 1}}})

    write([KEY_A, KEY_LIM])
    with RouterProcess(tmp_path / "r", replicas=1, tenants=tenants, sim={"step_base_ms": 1}) as r:
        async with httpx.AsyncClient(base_url=r.base_url, timeout=30) as admin:
            async with open_ws(r, KEY_LIM) as revoked:
                col = Collector(revoked)
                for cid in ("one", "two"):
                    await create(revoked, cid, chat_body("hello", 600))
                await col.until(lambda: col.of("one") and col.of("two"), what="the first chunks")
                write([KEY_A])
                resp = await admin.post("/admin/reload", headers={"Authorization": f"Bearer {ADMIN}"})
                assert resp.status_code == 200 and resp.json()["changed"], resp.text
                await col.until(lambda: col.finished("one") and col.finished("two"), what="the requests' ends")
                assert col.of("one")[-1] == {"id": "one", "done": True}, col.of("one")[-1]
                with pytest.raises(ConnectionClosed) as info:
                    await recv(revoked, timeout=5)
                assert info.value.rcvd is not None and info.value.rcvd.code == 4401, info.value
            async with open_ws(r, KEY_A) as fresh:  # (the tenant's one socket slot is free again)
                await create(fresh, "new", chat_body("hello", 5))
                assert "chunk" in await recv(fresh), "the new key's socket was refused"


async def test_an_idle_socket_is_closed_and_a_tenant_has_at_most_max_sockets(tmp_path: Path) -> None:
    # (uvicorn's pings kept a silent authenticated socket open for good: 20
    # of them held every connection slot of a router with max_connections 20)
    tenants = tmp_path / "tenants.yaml"
    tenants.write_text(yaml.safe_dump({"admin_keys": [hash_key(ADMIN)], "tenants": {
        "a": {"keys": [hash_key(KEY_A)], "limits": {"max_sockets": 2}}}}))
    with RouterProcess(tmp_path / "r", replicas=1, tenants=tenants, sim={"step_base_ms": 5},
                       settings={"ws_idle_timeout": 1.0}) as r:
        loop = asyncio.get_running_loop()
        async with open_ws(r, KEY_A) as busy, open_ws(r, key=None) as silent:
            await silent.send(json.dumps({"type": "auth", "api_key": KEY_A}))
            assert await recv(silent) == {"type": "auth", "ok": True}
            async with open_ws(r, KEY_A) as third:  # (a third of the tenant's: refused)
                msg = await recv(third)
                assert_error(msg, None, type_="rate_limit_error", code="too_many_sockets")
                with pytest.raises(ConnectionClosed) as info:
                    await recv(third)
                assert info.value.rcvd is not None and info.value.rcvd.code == 4429, info.value
            col = Collector(busy)
            started = loop.time()
            cpu = _cpu_seconds(r.pid)
            await create(busy, "long", chat_body("hello", 600))  # (~3 s at 5 ms a token: past the idle time)
            with pytest.raises(ConnectionClosed) as info:
                await recv(silent, timeout=5)
            assert info.value.rcvd is not None and (info.value.rcvd.code, info.value.rcvd.reason) == (1000, "idle")
            await col.until(lambda: col.finished("long"), what="the long request")
            assert col.of("long")[-1] == {"id": "long", "done": True}
            assert loop.time() - started > 2.5  # (it ran past the idle time, and its socket stayed)
            # (and the router waited meanwhile: past the idle time its read loop spun, a whole core)
            assert _cpu_seconds(r.pid) - cpu < 1.0, _cpu_seconds(r.pid) - cpu
            ended = loop.time()
            with pytest.raises(ConnectionClosed) as info:
                await recv(busy, timeout=5)
            assert info.value.rcvd is not None and info.value.rcvd.code == 1000
            assert 0.5 < loop.time() - ended < 3, loop.time() - ended  # (idle from its request's end)
        async with open_ws(r, KEY_A) as again:  # (the closed ones made room)
            await create(again, "x", chat_body("hello", 3))
            col = Collector(again)
            await col.until(lambda: col.finished("x"), what="a request on a new socket")


def _cpu_seconds(pid: int) -> float:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")  # (utime, stime)


async def test_a_socket_that_sends_no_auth_within_header_timeout_is_closed(tmp_path: Path) -> None:
    # As an HTTP connection that sends no request head: without a key it
    # would hold a connection (one of max_connections) for good.
    tenants = tmp_path / "tenants.yaml"
    tenants.write_text(yaml.safe_dump({"admin_keys": [hash_key(ADMIN)], "tenants": {"a": {"keys": [hash_key(KEY_A)]}}}))
    with RouterProcess(tmp_path / "r", replicas=1, tenants=tenants, settings={"header_timeout": 1.0}) as r:
        async with open_ws(r, key=None) as silent, open_ws(r, key=None) as chatty, open_ws(r, KEY_A) as keyed:
            sent = 0  # junk that gets an error reply each time buys no more time
            while sent < 10:
                try:
                    await chatty.send("{}")
                except ConnectionClosed:
                    break
                sent += 1
                await asyncio.sleep(0.45)
            assert sent < 6, "junk messages kept an unauthenticated socket open"
            for ws in (silent, chatty):
                with pytest.raises(ConnectionClosed) as info:
                    while True:
                        await recv(ws, timeout=10)
                assert info.value.rcvd is not None and info.value.rcvd.code == 1008, info.value
                assert "no auth message within 1s" in info.value.rcvd.reason
            await asyncio.sleep(0.5)
            col = Collector(keyed)  # a socket with a key waits for its messages as long as it likes
            await create(keyed, "late", chat_body("hello", 3))
            await col.until(lambda: col.finished("late"), what="a request after header_timeout")
        async with httpx.AsyncClient(base_url=r.base_url, timeout=30) as http:
            m = await r.ametrics(http)
        assert m.value("fairstream_http_connections_refused_total", reason="header_timeout") == 2


async def test_a_body_over_max_body_bytes_is_refused_as_over_http(router: RouterProcess) -> None:
    # (before, only uvicorn's 16 MiB frame limit applied: a 6 MB body was
    # decoded and admitted, refused at most by a token limit)
    async with open_ws(router) as ws:
        big = chat_body("x" * (5 * 1024 * 1024), 3)  # over the default 4 MiB
        await create(ws, "big", big)
        assert_error(await recv(ws, timeout=30), "big", code="request_too_large", param="body")
        col = Collector(ws)  # the socket goes on
        await create(ws, "small", chat_body("hello", 3))
        await col.until(lambda: col.finished("small"), what="a request after the refused one")


def _raw_ws(router: RouterProcess, key: str | None) -> socket.socket:
    """A WebSocket client that reads nothing after the handshake (a small
    receive window, so the router's writes back up soon)."""
    sock = socket.socket()
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)  # (before connect)
    sock.connect(("127.0.0.1", router.port))
    auth = f"Authorization: Bearer {key}\r\n" if key else ""
    sock.sendall(f"GET /v1/ws HTTP/1.1\r\nHost: x\r\nUpgrade: websocket\r\nConnection: Upgrade\r\n"
                 f"Sec-WebSocket-Key: {base64.b64encode(os.urandom(16)).decode()}\r\n"
                 f"Sec-WebSocket-Version: 13\r\n{auth}\r\n".encode())
    head = b""
    while b"\r\n\r\n" not in head:
        head += sock.recv(1)
    assert head.startswith(b"HTTP/1.1 101"), head
    return sock


def _frame(text: str) -> bytes:
    """A masked text frame, as a client sends it."""
    data, mask = text.encode(), os.urandom(4)
    n = len(data)
    size = bytes([0x80 | n]) if n < 126 else bytes([0x80 | 126]) + struct.pack("!H", n) if n < 65536 \
        else bytes([0x80 | 127]) + struct.pack("!Q", n)
    return b"\x81" + size + mask + bytes(b ^ mask[i % 4] for i, b in enumerate(data))


async def test_a_socket_whose_client_stops_reading_is_dropped(tmp_path: Path) -> None:
    # Its requests ended after send_timeout, but the connection stayed open
    # for good: a close waits for buffers the client never drains. Before
    # authenticating, junk messages whose error replies it never read held
    # it open past header_timeout too: six such sockets locked every client
    # out (max_connections). The router now drops such connections.
    tenants = tmp_path / "tenants.yaml"
    # (one token per message: a stream of them outgrows every buffer between them)
    tenants.write_text(yaml.safe_dump({"admin_keys": [hash_key(ADMIN)],
                                       "tenants": {"a": {"keys": [hash_key(KEY_A)], "chunk_tokens": 1}}}))
    sim = {"step_base_ms": 0.0, "step_per_seq_ms": 0.0, "max_model_len": 40000}
    with RouterProcess(tmp_path / "r", replicas=1, tenants=tenants, sim=sim,
                       settings={"send_timeout": 1.5, "header_timeout": 1.0}) as r:
        async with httpx.AsyncClient(base_url=r.base_url, timeout=30) as http:
            async def open_connections() -> float:
                return (await r.ametrics(http)).value("fairstream_http_connections")  # (this client's own too)

            base = await open_connections()
            keyed = _raw_ws(r, KEY_A)
            body = chat_body("hello", 30000)
            keyed.sendall(_frame(json.dumps({"type": "chat.completions.create", "id": "x", "body": body})))
            junk = _raw_ws(r, None)
            junk.settimeout(0.5)
            with contextlib.suppress(OSError):  # (until the router stops reading it, or drops it)
                for _ in range(20):
                    junk.sendall(_frame("{}") * 2000)
            await apoll(lambda: _equal(open_connections(), base), 30, interval=0.5,
                        what="both stuck sockets to be dropped")
            assert "ending its requests and dropping the connection" in r.log()
            m = await r.ametrics(http)
            assert m.value("fairstream_requests_total", tenant="a", endpoint="websocket", outcome="cancelled") == 1
            assert m.value("fairstream_http_connections_refused_total", reason="header_timeout") == 1
            keyed.close()
            junk.close()


async def _equal(value, expected: float) -> bool:
    return await value == expected


async def test_a_large_message_before_authentication_closes_the_socket(router: RouterProcess) -> None:
    # (uvicorn's 16 MiB frame limit applied before the key was known: two
    # dozen sockets sending one such message each took ~900 MB of memory)
    async with open_ws(router, key=None) as ws:
        await ws.send(json.dumps({"type": "auth", "api_key": "k" * 100_000}))
        with pytest.raises(ConnectionClosed) as info:
            await recv(ws)
        assert info.value.rcvd is not None and info.value.rcvd.code == 1009, info.value
    async with open_ws(router, key=None) as ws:  # an auth message as it should be: then large ones are fine
        await ws.send(json.dumps({"type": "auth", "api_key": KEY_A}))
        assert await recv(ws) == {"type": "auth", "ok": True}
        await create(ws, "big", chat_body("x" * 100_000, 3))
        msg = await recv(ws, timeout=30)
        assert msg["id"] == "big" and ("chunk" in msg or "error" in msg), msg


_GOOD_KEY = "Sec-WebSocket-Key: dGhlIHNhbXBsZSBub25jZQ==\r\n"


def raw_answer(router: RouterProcess, head: str) -> tuple[str, dict[str, str], bytes]:
    """(status line, header fields, body) of the router's answer to a raw
    request ``head``, read to the end (a refusal closes the connection)."""
    with socket.create_connection(("127.0.0.1", router.port), timeout=10) as s:
        s.sendall(head.encode())
        answer = b""
        while chunk := s.recv(65536):
            answer += chunk
    head_bytes, _, body = answer.partition(b"\r\n\r\n")
    lines = head_bytes.decode("latin-1").split("\r\n")
    fields = {k.lower(): v.strip() for k, _, v in (line.partition(":") for line in lines[1:])}
    return lines[0], fields, body


def refused(router: RouterProcess, reason: str) -> float:
    return router.metrics().value("fairstream_http_connections_refused_total", 0.0, reason=reason)


@pytest.mark.parametrize("request_line, headers, status, code, says, reason", [
    ("GET /v1/ws HTTP/1.1", "Sec-WebSocket-Version: 13\r\n", 400, "invalid_websocket_handshake",
     "missing Sec-WebSocket-Key header", "invalid_websocket_handshake"),
    ("GET /v1/ws HTTP/1.1", "Sec-WebSocket-Key: abc\r\nSec-WebSocket-Version: 13\r\n", 400,
     "invalid_websocket_handshake", "invalid Sec-WebSocket-Key header: abc", "invalid_websocket_handshake"),
    ("GET /v1/ws HTTP/1.1", _GOOD_KEY + "Sec-WebSocket-Version: 8\r\n", 400, "invalid_websocket_handshake",
     "invalid Sec-WebSocket-Version header: 8", "invalid_websocket_handshake"),
    ("POST /v1/ws HTTP/1.1", _GOOD_KEY + "Sec-WebSocket-Version: 13\r\nContent-Length: 0\r\n", 405,
     "invalid_websocket_handshake", "unsupported HTTP method: POST", "invalid_websocket_handshake"),
    ("GET /v1/nowhere HTTP/1.1", _GOOD_KEY + "Sec-WebSocket-Version: 13\r\n", 404, None,
     "Unknown path /v1/nowhere.", "websocket_not_found"),
    ("GET /v1/ws HTTP/1.0", _GOOD_KEY + "Sec-WebSocket-Version: 13\r\n", 400, "invalid_websocket_handshake",
     "HTTP/1.1 or later", "invalid_websocket_handshake"),
], ids=["no key", "malformed key", "version 8", "POST", "no WebSocket route", "HTTP/1.0"])
def test_a_refused_handshake_gets_an_openai_error_and_is_counted(router: RouterProcess, request_line: str,
                                                                 headers: str, status: int, code: str | None,
                                                                 says: str, reason: str) -> None:
    # (the websockets library answered them in plain text, uvicorn an upgrade
    # to a path with no WebSocket route with an empty 403, and upgraded an
    # HTTP/1.0 connection; none of them was counted)
    before = refused(router, reason)
    line, fields, body = raw_answer(router, f"{request_line}\r\nHost: x\r\nUpgrade: websocket\r\n"
                                            f"Connection: Upgrade\r\n{headers}\r\n")
    assert line.startswith(f"HTTP/1.1 {status} "), (line, body[:300])
    assert fields["content-type"] == "application/json" and int(fields["content-length"]) == len(body), fields
    assert fields["connection"] == "close"
    assert len(fields["x-request-id"]) == 24  # (as every other answer of the API)
    if status == 405:
        assert fields["allow"] == "GET"
    err = json.loads(body)["error"]
    assert set(err) == {"message", "type", "param", "code"} and err["param"] is None, err
    assert err["type"] == "invalid_request_error" and err["code"] == code, err
    assert says in err["message"], err
    assert refused(router, reason) == before + 1


def test_an_upgrade_to_a_path_with_no_websocket_endpoint_gets_what_an_http_request_to_an_unknown_path_gets(
        router: RouterProcess) -> None:
    http = httpx.get(router.base_url + "/v1/nowhere", timeout=10)
    assert http.status_code == 404 and http.headers["content-type"] == "application/json"
    # (the last two: an HTTP route there, and a path under the WebSocket endpoint's)
    for path in ["/v1/nowhere", "/health", "/v1/ws/more"]:
        line, _, body = raw_answer(router, f"GET {path} HTTP/1.1\r\nHost: x\r\nUpgrade: websocket\r\n"
                                           f"Connection: Upgrade\r\n{_GOOD_KEY}Sec-WebSocket-Version: 13\r\n\r\n")
        assert line.startswith("HTTP/1.1 404 "), (path, line, body[:300])
        assert body == http.content.replace(b"/v1/nowhere", path.encode()), (body, http.content)
    # a refusal is no error of the router's: uvicorn logged one for each
    # ("returned without completing handshake"; time for its line to come)
    time.sleep(1.0)
    assert "without completing handshake" not in router.log()


@pytest.mark.parametrize("path", ["/v1/ws/", "//v1//ws"])
async def test_an_upgrade_to_the_endpoint_spelled_as_litestar_routes_it_is_accepted(router: RouterProcess,
                                                                                    path: str) -> None:
    url = router.base_url.replace("http://", "ws://") + path
    async with connect(url, additional_headers={"Authorization": f"Bearer {KEY_A}"}, proxy=None,
                       open_timeout=10, close_timeout=5) as ws:
        await create(ws, "x", chat_body("hi", 2))
        assert "chunk" in await recv(ws)


async def test_a_message_the_envelope_refuses_is_answered_under_its_id(router: RouterProcess) -> None:
    # A request whose envelope is wrong (a field beside type/id/body, such as
    # "stream" put at the top level; a body of the wrong kind) was answered
    # with id "": a client that matches answers to its requests by id waited
    # for "s1" for good.
    async with open_ws(router) as ws:
        await ws.send(json.dumps({"type": "chat.completions.create", "id": "s1", "body": chat_body("hi", 4),
                                  "stream": True}))
        assert "stream" in assert_error(await recv(ws), "s1", code="invalid_json")["message"]
        await ws.send(json.dumps({"type": 5, "id": "s2"}))
        assert_error(await recv(ws), "s2", code="invalid_json")
        await ws.send(json.dumps({"type": "chat.completions.create", "id": 7, "body": chat_body("hi", 4)}))
        assert_error(await recv(ws), "", code="invalid_json")  # (no id it could be answered under)
