"""Tenant time limits through a real router with sim replicas.

* time to first token: an HTTP 504 before any header (OpenAI error shape,
  ``first_token_timeout``), and the request is aborted on its replica;
* total: mid-stream, an SSE error event (``total_timeout``) and no ``[DONE]``
  (the openai SDK raises ``APIError``), the request aborted on its replica and
  the tenant's concurrency lease released;
* stall: a replica that stops producing (SIGSTOP) is treated as failed and the
  stream continues on the other replica, text-exact, long before the
  supervisor's health check would act.

(The queue-wait limit is covered by tests/integration/test_scheduling.py.)
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
import socket
import time
from pathlib import Path
from typing import Any, Self

import httpx
import openai
import pytest
import yaml

from router.auth import hash_key
from tests.helpers import ADMIN, MODEL, RouterProcess, aiter_sse, apoll

KEY = "timeouts-tenant-key"
OTHER = "timeouts-other-key"
LONG = {"queue_wait": 30, "first_token": 30, "stall": 30, "total": 120}


def write_tenants(path: Path, timeouts: dict[str, float], limits: dict[str, int] | None = None,
                  **extra: Any) -> Path:
    """One tenant ``t`` (KEY) with ``timeouts`` over generous defaults (and
    ``extra`` fields), and an unlimited tenant ``other`` (OTHER)."""
    doc: dict[str, Any] = {
        "admin_keys": [hash_key(ADMIN)],
        "defaults": {"timeouts": LONG, "on_limit": "reject"},
        "tenants": {
            "t": {"keys": [hash_key(KEY)], "timeouts": {**LONG, **timeouts}, "limits": limits or {}, **extra},
            "other": {"keys": [hash_key(OTHER)]},
        },
    }
    path.write_text(yaml.safe_dump(doc, sort_keys=False))
    return path


async def request_line(router: RouterProcess, rid: str) -> dict[str, Any]:
    """The ``fairstream.request`` log line of request ``rid``."""
    def line() -> dict[str, Any] | None:
        for text in router.log().splitlines():
            if rid in text and text.startswith("{"):
                rec = json.loads(text)
                if rec.get("logger") == "fairstream.request" and rec.get("request_id") == rid:
                    return rec
        return None

    return await apoll(line, 10, what=f"the log line of {rid}")


def auth(key: str = KEY) -> dict[str, str]:
    return {"Authorization": f"Bearer {key}"}


def completion(max_tokens: int, *, stream: bool, prompt: str = "Le caf", **kw: Any) -> dict[str, Any]:
    return {"model": MODEL, "prompt": prompt, "max_tokens": max_tokens, "stream": stream,
            "temperature": 0, "ignore_eos": True, **kw}


def assert_openai_error(body: dict[str, Any], code: str) -> dict[str, Any]:
    assert set(body) == {"error"}, body
    err = body["error"]
    assert set(err) == {"message", "type", "param", "code"}, err
    assert isinstance(err["message"], str) and err["message"], err
    assert err["code"] == code, err
    return err


async def load_of(router: RouterProcess, http: httpx.AsyncClient, replica: str) -> tuple[float, float]:
    """(router in-flight, replica running + waiting) for ``replica``."""
    m = await router.ametrics(http)
    return (m.value("fairstream_replica_inflight_requests", replica=replica),
            m.value("fairstream_replica_running_requests", replica=replica)
            + m.value("fairstream_replica_waiting_requests", replica=replica))


class LoadWatch:
    """Samples a replica's load in the background; remembers the largest seen."""

    def __init__(self, router: RouterProcess, http: httpx.AsyncClient, replica: str = "sim-0") -> None:
        self.router, self.http, self.replica = router, http, replica
        self.max_inflight = self.max_engine = 0.0
        self._task: asyncio.Task[None] | None = None

    async def __aenter__(self) -> Self:
        async def run() -> None:
            while True:
                inflight, engine = await load_of(self.router, self.http, self.replica)
                self.max_inflight = max(self.max_inflight, inflight)
                self.max_engine = max(self.max_engine, engine)
                await asyncio.sleep(0.03)

        self._task = asyncio.create_task(run())
        return self

    async def __aexit__(self, *exc: object) -> None:
        assert self._task is not None
        self._task.cancel()
        try:
            await self._task
        except asyncio.CancelledError:
            pass


async def wait_idle(router: RouterProcess, http: httpx.AsyncClient, replica: str = "sim-0",
                    timeout: float = 3.0) -> None:
    """The router has nothing in flight on ``replica`` and the replica reports
    nothing running or waiting (its load reports come every 0.2 s)."""
    await apoll(lambda: _idle(router, http, replica), timeout,
                what=f"{replica}: router in-flight and replica running/waiting to drop to 0")


async def _idle(router: RouterProcess, http: httpx.AsyncClient, replica: str) -> bool:
    return await load_of(router, http, replica) == (0, 0)


# -- time to first token -----------------------------------------------------------------


@pytest.mark.parametrize("stream", [True, False], ids=["stream", "non-stream"])
async def test_first_token_timeout_is_504_before_headers_and_aborts_the_request(tmp_path, stream) -> None:
    # One engine step takes 3 s, so the first token comes after >= 3 s; the
    # tenant allows 1 s. Left running, the request would keep the replica busy
    # for 40 steps (2 minutes), so "running drops to 0" means it was aborted.
    tenants = write_tenants(tmp_path / "tenants.yaml", {"first_token": 1.0})
    with RouterProcess(tmp_path / "r", replicas=1, tenants=tenants, sim={"step_base_ms": 3000}) as router:
        async with httpx.AsyncClient(base_url=router.base_url, timeout=20) as http:
            async with (LoadWatch(router, http) as watch,
                        http.stream("POST", "/v1/completions", headers=auth(),
                                    json=completion(40, stream=stream)) as r):
                body = await r.aread()
                status, headers = r.status_code, r.headers
            assert status == 504, body
            assert headers["content-type"].startswith("application/json"), headers
            assert "x-request-id" in headers
            err = assert_openai_error(json.loads(body), "first_token_timeout")
            assert err["type"] == "timeout"
            # (it said "The request hit the tenant's first token timeout of 1s exceeded.")
            assert err["message"] == "The request exceeded the tenant's first token timeout of 1s.", err
            # the request did reach the replica ...
            assert watch.max_inflight >= 1 and watch.max_engine >= 1, (watch.max_inflight, watch.max_engine)
            # ... and was aborted there when the limit passed
            await wait_idle(router, http)
            m = await router.ametrics(http)
            assert m.value("fairstream_timeouts_total", tenant="t", timeout="first_token") == 1
            assert m.value("fairstream_requests_total", tenant="t", outcome="timeout_first_token") == 1
            assert m.value("fairstream_tokens_total", 0.0, tenant="t", direction="completion") == 0
            # its log line has the status the client got
            rec = await request_line(router, headers["x-request-id"])
            assert rec["status"] == 504 and rec["error_code"] == "first_token_timeout", rec
            assert rec["error"] == err["message"], rec


# -- total -------------------------------------------------------------------------------


TOTAL = 1.5


@pytest.fixture
def total_router(tmp_path):
    # 400 tokens at >= 20 ms per step: at least 8 s of generation against a 1.5 s limit
    tenants = write_tenants(tmp_path / "tenants.yaml", {"total": TOTAL}, {"max_concurrent": 1})
    with RouterProcess(tmp_path / "r", replicas=1, tenants=tenants, sim={"step_base_ms": 20}) as router:
        yield router


async def test_total_timeout_mid_stream_is_an_error_event_without_done(total_router: RouterProcess) -> None:
    router = total_router
    async with httpx.AsyncClient(base_url=router.base_url, timeout=20) as http:
        events = []
        async with http.stream("POST", "/v1/completions", headers=auth(),
                               json=completion(400, stream=True)) as r:
            assert r.status_code == 200, await r.aread()
            rid = r.headers["x-request-id"]
            async for ev in aiter_sse(r):
                events.append(ev)
                if len(events) == 3:
                    # the lease is held while the stream runs: max_concurrent 1
                    second = await http.post("/v1/completions", headers=auth(), json=completion(4, stream=False))
                    assert second.status_code == 429, second.text
                    err = assert_openai_error(second.json(), "rate_limit_exceeded")
                    assert "concurrent streams" in err["message"]
        assert len(events) >= 3
        assert all(ev.data != "[DONE]" for ev in events), "a timed-out stream must not end with [DONE]"
        *chunks, last = events
        assert chunks and all("choices" in ev.json() for ev in chunks)
        text = "".join(ev.json()["choices"][0]["text"] for ev in chunks)
        assert text, "the stream was under way before the limit"
        err = assert_openai_error(last.json(), "total_timeout")
        assert err["type"] == "timeout"
        assert err["message"] == f"The stream exceeded the tenant's total timeout of {TOTAL:g}s.", err
        # the error event continues the stream's numbering
        assert [ev.number for ev in events] == list(range(1, len(events) + 1))
        # aborted on the replica at once (400 tokens would take >= 8 s)
        await wait_idle(router, http)
        m = await router.ametrics(http)
        assert m.value("fairstream_timeouts_total", tenant="t", timeout="total") == 1
        assert m.value("fairstream_requests_total", tenant="t", outcome="timeout_total") == 1
        completion_tokens = m.value("fairstream_tokens_total", tenant="t", direction="completion")
        assert 0 < completion_tokens < 400
        # the lease was released: a new request right away is admitted
        r = await http.post("/v1/completions", headers=auth(), json=completion(4, stream=False))
        assert r.status_code == 200, r.text
        # and the resume buffer ends with the same error event: a resume does not restart it
        r = await http.get(f"/v1/streams/{rid}", headers={**auth(), "Last-Event-ID": events[-2].id})
        assert r.status_code == 200, r.text
        assert r.text.strip() == f"id: {last.id}\ndata: {last.data}"
        # its log line has the status the client got: the 200 the stream began with
        rec = await request_line(router, rid)
        assert rec["outcome"] == "timeout_total" and rec["error_code"] == "total_timeout", rec
        assert rec["status"] == 200, rec
        assert rec["error"] == err["message"], rec  # (the same text, not a fragment of it)


async def test_total_timeout_raises_api_error_in_the_openai_sdk(total_router: RouterProcess) -> None:
    router = total_router
    texts: list[str] = []
    async with openai.AsyncOpenAI(base_url=router.base_url + "/v1", api_key=KEY, max_retries=0,
                                  timeout=20) as client:
        stream = await client.completions.create(model=MODEL, prompt="Le caf", max_tokens=400, stream=True,
                                                 temperature=0, extra_body={"ignore_eos": True})
        with pytest.raises(openai.APIError) as info:
            async for chunk in stream:
                texts.extend(c.text for c in chunk.choices)
        assert not isinstance(info.value, openai.APIStatusError), "the error comes after the headers"
        assert info.value.code == "total_timeout"
        assert info.value.type == "timeout"
        assert "total timeout" in info.value.message
        assert "".join(texts)
        # a new request right after the error is admitted (the lease of max_concurrent 1 is free)
        again = await client.completions.create(model=MODEL, prompt="x", max_tokens=4)
        assert again.usage is not None and again.usage.completion_tokens == 4
    async with httpx.AsyncClient(timeout=10) as http:
        await wait_idle(router, http)


# -- stall -------------------------------------------------------------------------------


async def test_stalled_replica_fails_over_text_exact(tmp_path) -> None:
    # stall 1 s: well above a loaded machine's token gaps at 10 ms a step
    tenants = write_tenants(tmp_path / "tenants.yaml", {"stall": 1.0})
    # health_timeout 30: the supervisor's ping does not kill the frozen
    # replica first; only the stall limit can move the stream.
    router = RouterProcess(tmp_path / "r", replicas=2, tenants=tenants, sim={"step_base_ms": 10},
                           settings={"health_timeout": 30}).start()
    stopped: list[int] = []
    try:
        max_tokens = 200
        body = completion(max_tokens, stream=False, prompt="東京の")
        async with httpx.AsyncClient(base_url=router.base_url, headers=auth(), timeout=30) as http:
            ref = await http.post("/v1/completions", json=body)
            assert ref.status_code == 200, ref.text
            reference = ref.json()["choices"][0]["text"]
            parts: list[str] = []
            finish = None
            done = False
            errors = []
            ids = []
            async with http.stream("POST", "/v1/completions", json={**body, "stream": True}) as r:
                assert r.status_code == 200
                events = aiter_sse(r)
                while len("".join(parts)) < 20:
                    ev = await events.__anext__()
                    parts.append(ev.json()["choices"][0]["text"])
                    ids.append(ev.number)
                m = await router.ametrics(http)
                inflight = {n: m.value("fairstream_replica_inflight_requests", replica=n)
                            for n in router.replica_names}
                victim = max(inflight, key=inflight.get)
                assert inflight[victim] == 1, inflight
                pid = router.replica_pids()[victim]
                os.kill(pid, signal.SIGSTOP)
                stopped.append(pid)
                frozen_at = time.monotonic()
                async for ev in events:
                    if ev.data == "[DONE]":
                        done = True
                        break
                    ids.append(ev.number)
                    d = ev.json()
                    if "error" in d:
                        errors.append(d["error"])
                        continue
                    parts.append(d["choices"][0]["text"])
                    finish = d["choices"][0]["finish_reason"] or finish
            finished_in = time.monotonic() - frozen_at
            assert errors == [], (errors, router.log()[-3000:])
            assert done, "the stream must end with [DONE]"
            assert finish == "length"
            assert "".join(parts) == reference
            assert ids == list(range(1, len(ids) + 1)), "event ids continue across the failover"
            m = await router.ametrics(http)
            assert m.value("fairstream_failovers_total", replica=victim) >= 1
            assert m.value("fairstream_failovers_total") >= 1
            assert m.value("fairstream_streams_lost_total") == 0
            # the stall limit moved it, not the supervisor (health_timeout 30 s):
            # the frozen replica was neither restarted nor replaced
            assert finished_in < 10, finished_in
            assert m.value("fairstream_replica_restarts_total", 0.0, replica=victim) == 0
            assert router.replica_pids()[victim] == pid
    finally:
        for pid in stopped:
            try:
                os.kill(pid, signal.SIGCONT)
            except ProcessLookupError:
                pass
        router.stop()


# -- a client that stopped reading ----------------------------------------------------------------


async def test_a_client_that_stops_reading_is_dropped_after_send_timeout_and_frees_its_slot(tmp_path) -> None:
    # Tenant t may run one stream at a time. Its client asks for a long stream
    # and stops reading: once every buffer between them is full, the router
    # waits send_timeout (1.5 s), drops the connection and ends the request,
    # so the tenant's slot is free again. Before, the request, its lease and
    # its queued output stayed as long as TCP kept the connection.
    # (one token per event: 30,000 of them outgrow every buffer on the way;
    # the tokens of a read merged into events of 16 would all fit in them)
    tenants = write_tenants(tmp_path / "tenants.yaml", {}, {"max_concurrent": 1}, chunk_tokens=1)
    sim = {"step_base_ms": 0.0, "step_per_seq_ms": 0.0, "max_model_len": 40000}
    with RouterProcess(tmp_path / "r", replicas=1, tenants=tenants, sim=sim,
                       settings={"send_timeout": 1.5}) as router:
        body = json.dumps(completion(30000, stream=True)).encode()
        sock = socket.socket()
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)  # (before connect: a small window)
        sock.connect(("127.0.0.1", router.port))
        sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer " + KEY.encode()
                     + b"\r\nContent-Type: application/json\r\nContent-Length: " + str(len(body)).encode()
                     + b"\r\n\r\n" + body)
        assert sock.recv(64).startswith(b"HTTP/1.1 200")  # then it reads nothing more
        try:
            async with httpx.AsyncClient(base_url=router.base_url, headers=auth(), timeout=30) as http:
                started = time.monotonic()

                async def slot_free() -> bool:
                    r = await http.post("/v1/completions", json=completion(2, stream=False))
                    assert r.status_code in (200, 429), r.text
                    return r.status_code == 200

                await apoll(slot_free, 30, interval=0.5, what="the tenant's slot to be free again")
                assert time.monotonic() - started >= 1.5
                m = await router.ametrics(http)
                assert m.value("fairstream_requests_total", tenant="t", endpoint="completions",
                               outcome="cancelled") == 1
            assert "took none of its stream for 1.5s; closing its connection" in router.log()
        finally:
            sock.close()


async def test_a_resume_whose_client_stops_reading_is_dropped_after_send_timeout(tmp_path) -> None:
    # A stream of 30,000 tokens is read to its end. A resume of it from the
    # start (GET /v1/streams/{id}) by a client that reads nothing after the
    # response head: once every buffer between them is full, the router
    # waits send_timeout (1.5 s) and closes the connection, as it does for a
    # completion's stream. Before, the replay waited as long as TCP kept the
    # connection.
    tenants = write_tenants(tmp_path / "tenants.yaml", {}, chunk_tokens=1)  # (as above: 30,000 events)
    sim = {"step_base_ms": 0.0, "step_per_seq_ms": 0.0, "max_model_len": 40000}
    with RouterProcess(tmp_path / "r", replicas=1, tenants=tenants, sim=sim,
                       settings={"send_timeout": 1.5}) as router:
        async with httpx.AsyncClient(base_url=router.base_url, headers=auth(), timeout=60) as http:
            async with http.stream("POST", "/v1/completions", json=completion(30000, stream=True)) as r:
                assert r.status_code == 200
                sid = r.headers["x-request-id"]
                async for _ in r.aiter_bytes():
                    pass
        sock = socket.socket()
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)  # (before connect: a small window)
        sock.connect(("127.0.0.1", router.port))
        try:
            sock.sendall(f"GET /v1/streams/{sid} HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer {KEY}\r\n"
                         "Last-Event-ID: 0\r\n\r\n".encode())
            assert sock.recv(64).startswith(b"HTTP/1.1 200")  # then it reads nothing more
            started = time.monotonic()
            said = "took none of its stream for 1.5s; closing its connection"
            await apoll(lambda: said in router.log(), 30, interval=0.2, what="the resume to be given up on")
            assert time.monotonic() - started >= 1.5
            assert f"GET /v1/streams/{sid}: the client {said}" in router.log()
            # the router closed it: reading what is left ends, it does not wait
            sock.settimeout(10)
            try:
                while sock.recv(1 << 16):
                    pass
            except ConnectionResetError:
                pass
        finally:
            sock.close()



async def test_first_token_timeout_ends_a_request_waiting_for_a_busy_replica_at_its_limit(tmp_path) -> None:
    # first_token counts "its waits for limits and a replica included"; a
    # request queued behind a full replica was checked only once dispatched:
    # with first_token 1 and queue_wait 30 it waited the 7 s the replica was
    # busy, was dispatched, and only then got its 504.
    tenants = tmp_path / "tenants.yaml"
    tenants.write_text(yaml.safe_dump({"admin_keys": [hash_key(ADMIN)], "tenants": {
        "t": {"keys": [hash_key(KEY)], "timeouts": {"first_token": 1.0, "queue_wait": 30}},
        "b": {"keys": [hash_key("busy-key")]}}}))
    settings = {"replicas": [{"name": "sim-0", "engine": "sim", "max_concurrency": 1,
                              "config": {"model": MODEL, "seed": 0, "step_base_ms": 2}}]}
    with RouterProcess(tmp_path / "r", replicas=1, tenants=tenants, settings=settings) as r:
        busy = openai.AsyncOpenAI(base_url=r.base_url + "/v1", api_key="busy-key", max_retries=0)
        cli = openai.AsyncOpenAI(base_url=r.base_url + "/v1", api_key=KEY, max_retries=0)
        body = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "extra_body": {"ignore_eos": True}}
        hold = await busy.chat.completions.create(**body, max_tokens=3000, stream=True)  # (~6 s)
        await hold.__anext__()
        t0 = time.monotonic()
        with pytest.raises(openai.APIStatusError) as info:
            await cli.chat.completions.create(**body, max_tokens=5, stream=True)
        assert info.value.status_code == 504 and info.value.body["code"] == "first_token_timeout", info.value.body
        assert time.monotonic() - t0 < 2.5, time.monotonic() - t0
        await hold.close()


@pytest.mark.parametrize("limit,store", [("requests_per_minute", "memory"), ("max_concurrent", "redis")])
async def test_first_token_timeout_ends_a_request_waiting_for_its_tenant_s_limit_at_its_limit(
        tmp_path, request, limit, store) -> None:
    # a request waiting in its tenant's admission line (on_limit: queue) waited
    # its whole queue_wait, 30 s here, and then got its 504 first_token_timeout
    tenants = tmp_path / "tenants.yaml"
    tenants.write_text(yaml.safe_dump({"admin_keys": [hash_key(ADMIN)], "tenants": {
        "t": {"keys": [hash_key(KEY)], "on_limit": "queue", "limits": {limit: 1},
              "timeouts": {"first_token": 1.0, "queue_wait": 30}}}}))
    settings: dict[str, Any] = {}
    if store == "redis":
        settings["state"] = {"backend": "redis", "url": request.getfixturevalue("redis_server").url}
    with RouterProcess(tmp_path / "r", replicas=1, tenants=tenants, settings=settings) as r:
        cli = openai.AsyncOpenAI(base_url=r.base_url + "/v1", api_key=KEY, max_retries=0)
        body = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "extra_body": {"ignore_eos": True}}
        hold = await cli.chat.completions.create(**body, max_tokens=3000, stream=True)  # (its one request or slot)
        await hold.__anext__()
        t0 = time.monotonic()
        with pytest.raises(openai.APIStatusError) as info:
            await cli.chat.completions.create(**body, max_tokens=5, stream=True)
        waited = time.monotonic() - t0
        assert info.value.status_code == 504, info.value.body
        assert_openai_error({"error": info.value.body}, "first_token_timeout")
        assert 0.9 <= waited < 2.5, waited
        async with httpx.AsyncClient(base_url=r.base_url, timeout=10) as http:
            m = await r.ametrics(http)
            assert m.value("fairstream_admission_waiting", tenant="t") == 0
            assert m.value("fairstream_timeouts_total", tenant="t", timeout="first_token") == 1
            assert m.value("fairstream_requests_total", tenant="t", outcome="timeout_first_token") == 1
            assert m.value("fairstream_rate_limited_total", 0.0, tenant="t", limit="queue_wait") == 0
            rec = await request_line(r, info.value.response.headers["x-request-id"])
            assert rec["status"] == 504 and rec["error_code"] == "first_token_timeout", rec
        await hold.close()
        if limit == "max_concurrent":
            # the slot is free again, and no place the 504 left in the store's line
            # holds the next request back (it would, for its retry_after plus 2 s)
            t0 = time.monotonic()
            await cli.chat.completions.create(**body, max_tokens=2)
            assert time.monotonic() - t0 < 1.0, time.monotonic() - t0
