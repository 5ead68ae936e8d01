"""Replica life cycle under a real router: client disconnects, replica crashes
(idle and mid-stream, with token-exact failover), router crashes."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import time
from dataclasses import dataclass, field
from typing import Any

import httpx
import pytest

from tests.helpers import ADMIN, GOLD, MODEL, RouterProcess, aiter_sse, apoll, poll, proc_stat

AUTH = {"authorization": f"Bearer {GOLD}"}
SLOW = {"step_base_ms": 20}


@dataclass
class StreamResult:
    text: list[str] = field(default_factory=list)
    ids: list[int] = field(default_factory=list)
    finish: str | None = None
    usage: dict[str, int] | None = None
    errors: list[Any] = field(default_factory=list)
    done: bool = False
    events: int = 0
    request_id: str = ""


def _body(kind: str, prompt: str, max_tokens: int, **kw: Any) -> tuple[str, dict[str, Any]]:
    body: dict[str, Any] = {"model": MODEL, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True, **kw}
    if kind == "chat":
        return "/v1/chat/completions", {**body, "messages": [{"role": "user", "content": prompt}]}
    return "/v1/completions", {**body, "prompt": prompt}


def _text_of(kind: str, choice: dict[str, Any], *, stream: bool) -> str:
    if kind == "chat":
        return (choice["delta"] if stream else choice["message"]).get("content") or ""
    return choice["text"]


async def run_stream(http: httpx.AsyncClient, kind: str, prompt: str, max_tokens: int, out: StreamResult) -> None:
    """Stream one request into ``out`` (visible to the caller while it runs)."""
    path, body = _body(kind, prompt, max_tokens, stream=True, stream_options={"include_usage": True})
    async with http.stream("POST", path, json=body) as r:
        assert r.status_code == 200, await r.aread()
        out.request_id = r.headers["x-request-id"]
        async for ev in aiter_sse(r):
            out.events += 1
            if ev.data == "[DONE]":
                out.done = True
                break
            if kind == "chat" and ev.id is None and out.events == 1:  # (vLLM's role-only first chunk: no id)
                assert ev.json()["choices"][0]["delta"] == {"role": "assistant", "content": ""}, ev
                continue
            out.ids.append(ev.number if ev.number is not None else -1)  # (a failover sends no second role chunk)
            chunk = ev.json()
            if "error" in chunk:
                out.errors.append(chunk["error"])
                continue
            if chunk.get("usage"):
                out.usage = chunk["usage"]
            for choice in chunk["choices"]:
                out.text.append(_text_of(kind, choice, stream=True))
                out.finish = choice["finish_reason"] or out.finish


async def reference(http: httpx.AsyncClient, kind: str, prompt: str, max_tokens: int) -> str:
    path, body = _body(kind, prompt, max_tokens)
    r = await http.post(path, json=body)
    assert r.status_code == 200, r.text
    return _text_of(kind, r.json()["choices"][0], stream=False)


# -- (a) client disconnect ---------------------------------------------------------


async def test_client_disconnect_aborts_the_stream_on_its_replica(make_router) -> None:
    router: RouterProcess = make_router(replicas=1, sim=SLOW)
    path, body = _body("completions", "The ", 1000, stream=True)  # 20 s at 20 ms/step
    async with httpx.AsyncClient(base_url=router.base_url, headers=AUTH, timeout=30) as http:
        async with http.stream("POST", path, json=body) as r:
            assert r.status_code == 200
            # Pull events by hand: leaving an ``async for`` over the stream
            # early would close the connection already.
            events = aiter_sse(r)
            for _ in range(5):
                await events.__anext__()
            await apoll(
                lambda: _running_and_inflight(router, http, lambda run, inf: run >= 1 and inf >= 1),
                3, what="the stream to show as running on sim-0",
            )
            await events.aclose()
        # leaving the block closes the connection mid-stream
        await apoll(
            lambda: _running_and_inflight(router, http, lambda run, inf: run == 0 and inf == 0),
            # "at once": the load report interval (0.2 s) plus slack for a loaded CI machine
            2.5, what="sim-0 running and router inflight to drop to 0 after the disconnect",
        )
        m = await router.ametrics(http)
        assert m.value("fairstream_requests_total", tenant="gold", outcome="cancelled") == 1
        assert m.value("fairstream_requests_total", 0.0, tenant="gold", outcome="ok") == 0


async def test_client_disconnect_aborts_a_stream_with_a_pipelined_request_behind_it(make_router) -> None:
    # uvicorn marks only a connection's latest request as disconnected; the
    # router's own disconnect callback (router/fastpath.py) ends the stream
    # that a pipelined request follows too
    router: RouterProcess = make_router(replicas=1, sim=SLOW)
    path, body = _body("completions", "The ", 1000, stream=True)
    payload = json.dumps(body).encode()
    reader, writer = await asyncio.open_connection("127.0.0.1", router.port)
    async with httpx.AsyncClient(base_url=router.base_url, headers=AUTH, timeout=30) as http:
        try:
            writer.write(_raw_post(path, payload) + payload + b"GET /health HTTP/1.1\r\nhost: x\r\n\r\n")
            got = b""
            while got.count(b"data: ") < 5:
                got += await asyncio.wait_for(reader.read(65536), 10)
        except BaseException:
            writer.close()
            raise
        await _aborted_when_closed(router, http, writer)
        m = await router.ametrics(http)
        assert m.value("fairstream_requests_total", tenant="gold", outcome="cancelled") == 1


def _raw_post(path: str, payload: bytes) -> bytes:
    """The head of a POST of ``payload`` with the gold key, for a raw socket."""
    return (f"POST {path} HTTP/1.1\r\nhost: x\r\nauthorization: Bearer {GOLD}\r\n"
            f"content-type: application/json\r\ncontent-length: {len(payload)}\r\n\r\n").encode()


async def _aborted_when_closed(router: RouterProcess, http: httpx.AsyncClient, writer: asyncio.StreamWriter) -> None:
    """Once the request runs on sim-0, close its connection: it must be
    dropped from the replica and the router's count at once."""
    try:
        await apoll(
            lambda: _running_and_inflight(router, http, lambda run, inf: run >= 1 and inf >= 1),
            3, what="the request to show as running on sim-0",
        )
    finally:
        writer.close()
    await apoll(
        lambda: _running_and_inflight(router, http, lambda run, inf: run == 0 and inf == 0),
        2.5, what="sim-0 running and router inflight to drop to 0 after the disconnect",
    )


async def _running_and_inflight(router: RouterProcess, http: httpx.AsyncClient, ok) -> bool:
    m = await router.ametrics(http)
    return ok(
        m.value("fairstream_replica_running_requests", replica="sim-0"),
        m.value("fairstream_replica_inflight_requests", replica="sim-0"),
    )


async def test_client_disconnect_aborts_a_non_streamed_request(make_router) -> None:
    router: RouterProcess = make_router(replicas=1, sim=SLOW)
    path, body = _body("completions", "The ", 300)  # 6 s: still running at the deadline below
    async with httpx.AsyncClient(base_url=router.base_url, headers=AUTH) as http:
        with pytest.raises(httpx.ReadTimeout):
            await http.post(path, json=body, timeout=httpx.Timeout(30, read=0.6))
        await apoll(
            lambda: _running_and_inflight(router, http, lambda run, inf: inf == 0 and run == 0),
            2.0, what="the abandoned non-streamed request to be aborted",
        )


async def test_client_disconnect_aborts_a_request_whose_body_was_over_64_kib(make_router) -> None:
    # uvicorn stops reading a connection once a body passes its 64 KiB
    # high-water mark, and only receive() resumes it: without that, the
    # client's close went unread and the request ran on after it left
    router: RouterProcess = make_router(replicas=1, sim=SLOW)
    path, body = _body("completions", "The ", 300)  # 6 s, not streamed
    payload = json.dumps(body).encode()
    payload = payload[:-1] + b" " * 100_000 + b"}"  # (whitespace: the same request)
    reader, writer = await asyncio.open_connection("127.0.0.1", router.port)
    async with httpx.AsyncClient(base_url=router.base_url, headers=AUTH, timeout=30) as http:
        try:
            writer.write(_raw_post(path, payload))
            await writer.drain()
            await asyncio.sleep(0.3)  # the handler now waits in receive() for the body
            writer.write(payload)  # in one piece, over the mark
            await writer.drain()
        except BaseException:
            writer.close()
            raise
        await _aborted_when_closed(router, http, writer)


# -- (b) replica crash while idle -----------------------------------------------------


def test_killed_idle_replica_is_restarted(router: RouterProcess) -> None:
    old = router.replica_pids()
    assert set(old) == {"sim-0", "sim-1"}
    router.kill_replica("sim-0", signal.SIGKILL)
    ready_statuses: list[int] = []

    def restarted() -> int | None:
        # sim-1 keeps serving, so /ready must stay 200 through the restart
        ready_statuses.append(httpx.get(router.base_url + "/ready", timeout=5).status_code)
        pid = router.replica_pids().get("sim-0")
        return pid if pid not in (None, old["sim-0"]) else None

    poll(restarted, 15, what="a new sim-0 process")
    assert set(ready_statuses) == {200}, ready_statuses
    body = router.wait_ready(15, all_replicas=True)
    assert body["replicas"] == {"sim-0": "ready", "sim-1": "ready"}
    assert router.replica_pids()["sim-1"] == old["sim-1"], "the healthy replica must not be restarted"
    # the dead process was reaped, not left as a zombie
    poll(lambda: proc_stat(old["sim-0"]) is None, 5, what="the killed replica to be reaped")
    m = router.metrics()
    assert m.value("fairstream_replica_restarts_total", replica="sim-0") >= 1
    assert m.value("fairstream_replica_restarts_total", 0.0, replica="sim-1") == 0
    assert m.value("fairstream_replica_up", replica="sim-0") == 1
    # new requests succeed, on both replicas
    with httpx.Client(base_url=router.base_url, headers=AUTH, timeout=30) as http:
        for i in range(6):
            r = http.post("/v1/completions", json={"model": MODEL, "prompt": f"x{i}", "max_tokens": 4})
            assert r.status_code == 200, r.text
    m = router.metrics()
    assert m.value("fairstream_requests_total", tenant="gold", outcome="ok") == 6


def test_a_frozen_replica_is_down_and_restarted_as_soon_as_its_pings_time_out(make_router) -> None:
    # (before, the supervisor first gave the frozen process its 10 s SIGTERM
    # grace, which it could not use, and only then said it was down)
    router = make_router(settings={"health_interval": 0.2, "health_timeout": 1.0})
    old = router.replica_pids()
    os.kill(old["sim-0"], signal.SIGSTOP)
    frozen_at = time.monotonic()
    poll(lambda: httpx.get(router.base_url + "/ready", timeout=5).json()["replicas"]["sim-0"] != "ready", 10,
         what="sim-0 shown down")
    assert time.monotonic() - frozen_at < 6  # (it was health_timeout + 10 s)
    poll(lambda: router.replica_pids().get("sim-0") not in (None, old["sim-0"]), 10, what="a new sim-0 process")
    assert time.monotonic() - frozen_at < 9
    poll(lambda: proc_stat(old["sim-0"]) is None, 5, what="the frozen replica to be killed and reaped")


# -- (c) replica crash mid-stream --------------------------------------------------------


async def test_replica_killed_mid_stream_fails_over_token_exact(make_router) -> None:
    router: RouterProcess = make_router(replicas=2, sim={"step_base_ms": 10})
    max_tokens = 200
    jobs = [("chat", "東京の"), ("chat", "Tell me"), ("completions", "Le caf"), ("completions", "Über")]
    async with httpx.AsyncClient(base_url=router.base_url, headers=AUTH, timeout=60) as http:
        refs = await asyncio.gather(*(reference(http, k, p, max_tokens) for k, p in jobs))
        results = [StreamResult() for _ in jobs]
        tasks = [asyncio.create_task(run_stream(http, k, p, max_tokens, out)) for (k, p), out in zip(jobs, results)]
        try:
            await apoll(
                lambda: all(len("".join(r.text)) >= 40 for r in results) or any(t.done() for t in tasks),
                20, what="every stream to be well under way",
            )
            assert not any(t.done() for t in tasks), "a stream ended before the replica was killed"
            m = await router.ametrics(http)
            inflight = {n: m.value("fairstream_replica_inflight_requests", replica=n) for n in ("sim-0", "sim-1")}
            victim = max(inflight, key=inflight.get)
            assert inflight[victim] >= 1
            router.kill_replica(victim, signal.SIGKILL)
            await asyncio.wait_for(asyncio.gather(*tasks), 30)
        finally:
            for t in tasks:
                t.cancel()
        m = await router.ametrics(http)
    for (kind, prompt), ref, res in zip(jobs, refs, results):
        assert res.errors == [], (kind, prompt, res.errors)
        assert res.done, "stream ended without [DONE]"
        assert res.finish == "length"
        assert "".join(res.text) == ref, (kind, prompt)
        assert res.usage is not None and res.usage["completion_tokens"] == max_tokens
        assert res.ids == list(range(1, len(res.ids) + 1)), "event ids must continue without a gap"
    assert m.value("fairstream_failovers_total", replica=victim) >= inflight[victim]
    assert m.value("fairstream_streams_lost_total") == 0
    assert m.value("fairstream_resumed_tokens_total") > 0
    # each move is logged under its request's id, with where it went
    moved = [rec for rec in router.records("fairstream.generation") if "continuing on" in rec["msg"]]
    assert len(moved) == m.value("fairstream_failovers_total", replica=victim), moved
    other = "sim-1" if victim == "sim-0" else "sim-0"
    assert all(rec["replica"] == victim and rec["msg"].endswith(f"continuing on {other} (failover 1)")
               for rec in moved), moved
    assert {rec["request_id"] for rec in moved} <= {res.request_id for res in results}, moved


async def test_a_resumed_streams_failover_is_logged_under_its_id(make_router) -> None:
    """A stream's client leaves; its resume continues it, and the replica
    the continuation runs on is killed: the continuation fails over, and
    that move is logged under the stream's id (the resume's
    ``x-request-id``), as a first request's is (it had none)."""
    router: RouterProcess = make_router(replicas=2, sim={"step_base_ms": 10})
    max_tokens = 300
    async with httpx.AsyncClient(base_url=router.base_url, headers=AUTH, timeout=60) as http:
        ref = await reference(http, "completions", "Le caf", max_tokens)
        path, body = _body("completions", "Le caf", max_tokens, stream=True)
        text, last = "", None
        async with http.stream("POST", path, json=body) as r:
            rid = r.headers["x-request-id"]
            async for ev in aiter_sse(r):
                text, last = text + ev.json()["choices"][0]["text"], ev.id
                if len(text) >= 20:
                    break  # the client leaves
        await apoll(lambda: _idle(router, http), 10, what="the first generation aborted")
        victim = None
        async with http.stream("GET", f"/v1/streams/{rid}", headers={"Last-Event-ID": last}) as r:
            assert r.status_code == 200, await r.aread()
            assert r.headers["x-request-id"] == rid
            async for ev in aiter_sse(r):
                if ev.data == "[DONE]":
                    break
                d = ev.json()
                assert "error" not in d, d
                text += d["choices"][0]["text"] if d["choices"] else ""
                if victim is None and len(text) >= 60:
                    m = await router.ametrics(http)
                    victim = next(n for n in ("sim-0", "sim-1")
                                  if m.value("fairstream_replica_inflight_requests", replica=n))
                    router.kill_replica(victim, signal.SIGKILL)
    assert victim is not None and text == ref
    moved = [rec for rec in router.records("fairstream.generation") if "continuing on" in rec["msg"]]
    assert len(moved) == 1 and moved[0]["replica"] == victim, moved
    assert moved[0].get("request_id") == rid, moved


async def _idle(router: RouterProcess, http: httpx.AsyncClient) -> bool:
    m = await router.ametrics(http)
    return not any(m.value("fairstream_replica_inflight_requests", replica=n) for n in ("sim-0", "sim-1"))


async def test_a_stream_whose_only_replica_is_killed_continues_token_exact_after_its_restart(make_router) -> None:
    """One replica, killed mid-stream: the stream waits for the replica's
    restart (``failover_wait``) and continues there, token-exact."""
    router: RouterProcess = make_router(replicas=1, sim={"step_base_ms": 10})
    max_tokens = 150
    async with httpx.AsyncClient(base_url=router.base_url, headers=AUTH, timeout=60) as http:
        ref = await reference(http, "chat", "Tell me", max_tokens)
        res = StreamResult()
        task = asyncio.create_task(run_stream(http, "chat", "Tell me", max_tokens, res))
        await apoll(lambda: len("".join(res.text)) >= 40 or task.done(), 20, what="the stream to be under way")
        assert not task.done(), "the stream ended before the replica was killed"
        router.kill_replica("sim-0", signal.SIGKILL)
        await asyncio.wait_for(task, 30)
        m = await router.ametrics(http)
    assert res.errors == [] and res.done and res.finish == "length"
    assert "".join(res.text) == ref
    assert res.ids == list(range(1, len(res.ids) + 1)), "event ids must continue without a gap"
    assert m.value("fairstream_failovers_total", replica="sim-0") == 1
    assert m.value("fairstream_streams_lost_total") == 0
    # the wait and the move are logged under the request's id
    lines = [rec["msg"] for rec in router.records("fairstream.generation") if rec.get("request_id") == res.request_id]
    assert len(lines) == 2 and "no replica is ready to continue it" in lines[0], lines
    # (what failed, and after how many tokens, as every failover's line says; it said only that it waited)
    assert lines[0].startswith("stream on sim-0 failed after ") and " tokens (" in lines[0], lines
    assert lines[1] == "stream on sim-0 continues on sim-0, which became ready", lines


async def test_streams_that_waited_for_both_replicas_do_not_pile_past_the_cap_of_the_first_back(
        make_router) -> None:
    """4 streams on 2 replicas capped at 2 (``max_concurrency``), both killed:
    the streams wait, and the first replica back takes 2 of them, not all 4;
    the other 2 wait for room (the second replica back, or a stream that
    ends). All 4 continue token-exact."""
    replicas = [{"name": f"sim-{i}", "engine": "sim", "max_concurrency": 2,
                 "config": {"model": MODEL, "seed": 0, "step_base_ms": 10}} for i in range(2)]
    router: RouterProcess = make_router(replicas=2, settings={"replicas": replicas, "failover_wait": 30.0})
    max_tokens = 400
    jobs = [("chat", "Tell me"), ("chat", "東京の"), ("completions", "Le caf"), ("completions", "Über")]
    peak = {"sim-0": 0.0, "sim-1": 0.0}
    async with httpx.AsyncClient(base_url=router.base_url, headers=AUTH, timeout=60) as http:
        refs = await asyncio.gather(*(reference(http, k, p, max_tokens) for k, p in jobs))
        results = [StreamResult() for _ in jobs]
        tasks = [asyncio.create_task(run_stream(http, k, p, max_tokens, out)) for (k, p), out in zip(jobs, results)]
        try:
            await apoll(lambda: all(len("".join(r.text)) >= 40 for r in results) or any(t.done() for t in tasks),
                        20, what="every stream to be under way")
            assert not any(t.done() for t in tasks), "a stream ended before the replicas were killed"
            m = await router.ametrics(http)
            assert [m.value("fairstream_replica_inflight_requests", replica=n) for n in peak] == [2, 2]
            for name in peak:
                router.kill_replica(name, signal.SIGKILL)
            # (the streams of the one seen dead first may go at once to the other, not yet seen dead, past
            # its cap, as a failover does when a replica is ready: counted from when both are down)

            async def all_waiting() -> bool:
                m = await router.ametrics(http)
                return not any(m.value("fairstream_replica_inflight_requests", replica=n) for n in peak)

            await apoll(all_waiting, 10, interval=0.01, what="both replicas seen down, their streams waiting")
            deadline = time.monotonic() + 40
            while not all(t.done() for t in tasks):
                assert time.monotonic() < deadline, "the streams did not end"
                m = await router.ametrics(http)
                for name in peak:
                    peak[name] = max(peak[name], m.value("fairstream_replica_inflight_requests", replica=name))
                await asyncio.sleep(0.03)
            await asyncio.gather(*tasks)
        finally:
            for t in tasks:
                t.cancel()
        m = await router.ametrics(http)
    for (kind, prompt), ref, res in zip(jobs, refs, results):
        assert res.errors == [] and res.done and res.finish == "length", (prompt, res.errors)
        assert "".join(res.text) == ref, (kind, prompt)
    assert max(peak.values()) <= 2, f"past max_concurrency: {peak}"
    assert m.value("fairstream_streams_lost_total") == 0
    # each stream waited (both were down), then went on where there was room
    records = router.records("fairstream.generation")
    for res in results:
        lines = [r["msg"] for r in records if r.get("request_id") == res.request_id]
        assert any("no replica is ready to continue it" in line for line in lines), lines
        assert " continues on sim-" in lines[-1] and "past its in-flight cap" not in lines[-1], lines


async def test_stream_lost_without_a_spare_replica_ends_with_an_error_event(make_router) -> None:
    """One replica, killed mid-stream, and no wait for its restart
    (``failover_wait: 0``): nothing can resume the stream, so it ends with an
    explicit error event (no [DONE]), never a silent truncation."""
    router: RouterProcess = make_router(replicas=1, sim=SLOW, settings={"failover_wait": 0})
    async with httpx.AsyncClient(base_url=router.base_url, headers=AUTH, timeout=30) as http:
        res = StreamResult()
        task = asyncio.create_task(run_stream(http, "completions", "The ", 1000, res))
        await apoll(lambda: len("".join(res.text)) >= 5 or task.done(), 10, what="the stream to start")
        router.kill_replica("sim-0", signal.SIGKILL)
        await asyncio.wait_for(task, 10)
        m = await router.ametrics(http)
    assert not res.done, "a lost stream must not end with [DONE]"
    assert res.finish is None
    assert len(res.errors) == 1 and res.errors[0]["code"] == "stream_lost", res.errors
    assert m.value("fairstream_streams_lost_total") == 1
    assert m.value("fairstream_requests_total", tenant="gold", outcome="lost") == 1
    # nothing moved: no failover counted, no token resumed (both were, where the replica failed)
    assert m.value("fairstream_failovers_total", 0.0, replica="sim-0") == 0
    assert m.value("fairstream_resumed_tokens_total") == 0
    line = next(r for r in router.records("fairstream.request") if r["outcome"] == "lost")
    assert line.get("failovers", 0) == 0, line
    router.wait_ready(15)  # and the replica comes back
    # why it failed stays in /admin/replicas once it is back (it was only in the log)
    listed = httpx.get(router.base_url + "/admin/replicas", headers={"Authorization": f"Bearer {ADMIN}"},
                       timeout=10).json()["replicas"]
    (sim0,) = [r for r in listed if r["name"] == "sim-0"]
    assert sim0["state"] == "ready" and "-9" in sim0["last_error"] and sim0["last_error_at"] <= time.time(), sim0


async def test_replica_lost_before_the_first_token_without_a_spare_is_a_503(make_router) -> None:
    """One replica, killed during a long prefill, and no wait for its restart
    (``failover_wait: 0``): nothing was sent, so the client gets a 503 in
    OpenAI's error shape (retryable), not a 500."""
    router: RouterProcess = make_router(replicas=1, sim={"step_base_ms": 5, "step_per_prefill_token_ms": 50},
                                        settings={"failover_wait": 0})
    async with httpx.AsyncClient(base_url=router.base_url, headers=AUTH, timeout=30) as http:
        async def request() -> httpx.Response:
            return await http.post("/v1/completions", json={
                "model": MODEL, "prompt": "x" * 400, "max_tokens": 8, "stream": True})

        task = asyncio.create_task(request())
        await apoll(lambda: router.inflight("sim-0") == 1, 10, what="the request on the replica")
        router.kill_replica("sim-0", signal.SIGKILL)
        r = await asyncio.wait_for(task, 10)
        # while it restarts, a new request is told to come back too
        again = await http.post("/v1/completions", json={"model": MODEL, "prompt": "x", "max_tokens": 2})
        m = await router.ametrics(http)
    assert r.status_code == 503, r.text
    err = r.json()["error"]
    assert err["code"] == "no_replica_available" and "before its first token" in err["message"], err
    assert r.headers["retry-after"] and r.headers["x-request-id"]
    assert again.status_code == 503 and again.json()["error"]["code"] == "no_replica_available", again.text
    assert again.headers["retry-after"] == "1"
    # nothing was produced, so no stream was lost: the request was unavailable
    assert m.value("fairstream_streams_lost_total") == 0
    assert m.value("fairstream_requests_total", tenant="gold", outcome="unavailable") == 2  # (both)
    router.wait_ready(15)


async def test_a_model_whose_replicas_are_all_restarting_gets_a_503_not_a_404(make_router) -> None:
    """Two models, one replica each: while the second model's replica
    restarts, the first still answers, and a request for the second is a 503
    to retry (it was a 404, model_not_found, which clients do not retry, and
    the model left /v1/models for the restart)."""
    other = "other-model"
    router: RouterProcess = make_router(settings={"replicas": [
        {"name": "sim-0", "engine": "sim", "config": {"model": MODEL, "seed": 0}},
        {"name": "sim-1", "engine": "sim", "config": {"model": other, "seed": 0}},
    ]})
    chat = {"max_tokens": 2, "messages": [{"role": "user", "content": "hi"}]}
    async with httpx.AsyncClient(base_url=router.base_url, headers=AUTH, timeout=30) as http:
        router.kill_replica("sim-1", signal.SIGKILL)
        await apoll(lambda: httpx.get(router.base_url + "/ready").json()["replicas"]["sim-1"] != "ready", 10,
                    what="the router to see sim-1 gone")
        r = await http.post("/v1/chat/completions", json={"model": other, **chat})
        models = [m["id"] for m in (await http.get("/v1/models")).json()["data"]]
        served = await http.post("/v1/chat/completions", json={"model": MODEL, **chat})
        router.wait_ready(15)
        back = await http.post("/v1/chat/completions", json={"model": other, **chat})
    assert r.status_code == 503, r.text
    assert r.json()["error"]["code"] == "no_replica_available" and r.headers["retry-after"] == "1"
    assert sorted(models) == sorted([other, MODEL]), models
    assert served.status_code == 200 and back.status_code == 200, (served.text, back.text)


# -- (d) router crash -------------------------------------------------------------------


def test_replicas_exit_when_the_router_is_killed(router: RouterProcess) -> None:
    pids = router.replica_pids()
    assert len(pids) == 2
    assert router.proc is not None
    os.kill(router.pid, signal.SIGKILL)
    router.proc.wait(5)
    left = router.wait_replicas_gone(5.0)
    assert left == [], f"orphaned replicas after the router was SIGKILLed: {left}"


def test_a_router_removes_the_run_dir_a_killed_router_left(tmp_path) -> None:
    """A SIGKILLed router cannot remove its run dir (replica sockets); the
    next router on the same temp dir does, and keeps its own."""
    first = RouterProcess(tmp_path / "first", replicas=1)
    second = RouterProcess(tmp_path / "second", replicas=1)
    try:
        first.start()
        assert first.tmpdir is not None
        [left] = first.tmpdir.glob("fairstream-*")
        replicas = list(first.replica_pids().values())
        os.kill(first.pid, signal.SIGKILL)
        for pid in replicas:
            os.kill(pid, signal.SIGKILL)
        assert first.proc is not None
        first.proc.wait(5)
        assert first.wait_replicas_gone(5.0) == []
        assert left.is_dir(), "the killed router's run dir is gone already"

        second.tmpdir = first.tmpdir  # (the same TMPDIR)
        second.start()
        assert not left.exists(), "the second router left the killed router's run dir"
        [now] = first.tmpdir.glob("fairstream-*")
        assert (now / "sim-0.sock").exists()
    finally:
        second.stop()  # (first: it removes the shared TMPDIR)
        first.stop()


# -- shutdown -----------------------------------------------------------------------------


def test_router_removes_its_run_dir_on_exit(router: RouterProcess) -> None:
    router.stop()
    assert router.leftovers == []
