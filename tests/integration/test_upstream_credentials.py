"""A ``url:`` upstream that refuses the router's API key on its generation
endpoints while its ``/models`` needs none, so its health check alone passes
(docs/upstreams.md, "Health and load"): the operator's configuration error.
A request moves off it once (it used to be tried on every failover, up to 9
times, and logged at INFO), the upstream is not ready (``/ready``,
``/admin/replicas``, ``fairstream_replica_up``) and gets no more requests,
and with no other replica the client gets a 503 at once that says why."""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import AsyncIterator
import contextlib

import httpx
import yaml

from tests.helpers import ADMIN, GOLD, MODEL, loopback_http, poll
from tests.integration.test_upstream import PROMPT, UPSTREAM, cleanup, upstream_router

__all__ = ["cleanup"]  # (the fixture, from test_upstream)

_MODELS = json.dumps({"object": "list", "data": [{"id": MODEL, "object": "model"}]}).encode()
_UNAUTHORIZED = json.dumps({"error": {"message": "Incorrect API key provided", "type": "invalid_request_error",
                                      "code": "invalid_api_key"}}).encode()


@contextlib.asynccontextmanager
async def _key_refusing_upstream() -> AsyncIterator[tuple[str, list[bytes]]]:
    """A loopback upstream: ``GET /models`` 200, every POST 401. Yields its
    URL and the bodies of the generation requests it got (not the health
    check's probes, which carry no prompt)."""
    generations: list[bytes] = []

    async def answer(head: bytes, body: bytes, writer: asyncio.StreamWriter) -> None:
        if head.startswith(b"GET"):
            status, reply = b"200 OK", _MODELS
        else:
            if b'"prompt"' in body or b'"messages"' in body:
                generations.append(body)
            status, reply = b"401 Unauthorized", _UNAUTHORIZED
        writer.write(b"HTTP/1.1 %s\r\nContent-Type: application/json\r\nContent-Length: %d\r\n\r\n%s"
                     % (status, len(reply), reply))

    async with loopback_http(answer) as port:
        yield f"http://127.0.0.1:{port}/v1", generations


async def test_an_upstream_refusing_the_key_is_tried_once_and_goes_not_ready(tmp_path, cleanup):
    async with _key_refusing_upstream() as (url, generations):
        router = upstream_router(tmp_path / "router", url, local=1, api_key_env="FS_TEST_NO_SUCH_KEY")
        cleanup(router)
        await asyncio.to_thread(router.start)  # its readiness check needs this loop's server
        async with httpx.AsyncClient(base_url=router.base_url, headers={"Authorization": f"Bearer {GOLD}"},
                                     timeout=30) as http:
            # (equal loads: the first ready replica, the upstream, is chosen)
            r = await http.post("/v1/completions", json={"model": MODEL, "prompt": PROMPT, "max_tokens": 8})
            assert r.status_code == 200, r.text
            assert r.json()["choices"][0]["text"]
            assert len(generations) == 1  # tried once, then on the sim replica

            ready = (await http.get("/ready")).json()
            assert ready["replicas"][UPSTREAM] == "down" and ready["ready"], ready
            assert router.metrics().value("fairstream_replica_up", replica=UPSTREAM) == 0

            def admin_says() -> dict | None:
                rows = httpx.get(router.base_url + "/admin/replicas", headers={"Authorization": f"Bearer {ADMIN}"},
                                 timeout=5).json()["replicas"]
                row = next(x for x in rows if x["name"] == UPSTREAM)
                return row if "refused the router's credentials" in (row["last_error"] or "") else None

            row = await asyncio.to_thread(poll, admin_says, 10, what="/admin/replicas naming the refusal")
            assert not row["ready"] and "HTTP 401" in row["last_error"], row

            for _ in range(3):  # the scheduler sends nothing more there
                r = await http.post("/v1/chat/completions", json={
                    "model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4})
                assert r.status_code == 200, r.text
            assert len(generations) == 1
        m = router.metrics()
        assert m.value("fairstream_failovers_total", replica=UPSTREAM, default=0) <= 1
        assert m.value("fairstream_requests_total", tenant="gold", outcome="ok") == 4
    lines = [json.loads(line) for line in router.log().splitlines() if line.startswith("{")]
    errors = [x["msg"] for x in lines if x["level"] == "error" and "refused the router's credentials" in x["msg"]]
    assert len(errors) == 1 and UPSTREAM in errors[0] and "HTTP 401" in errors[0], errors


async def test_a_request_whose_only_upstream_refuses_the_key_gets_a_503_at_once(tmp_path, cleanup):
    async with _key_refusing_upstream() as (url, generations):
        router = upstream_router(tmp_path / "router", url, local=0, api_key_env="FS_TEST_NO_SUCH_KEY")
        cleanup(router)
        await asyncio.to_thread(router.start)
        async with httpx.AsyncClient(base_url=router.base_url, headers={"Authorization": f"Bearer {GOLD}"},
                                     timeout=30) as http:
            for i in range(2):  # the first one tried there, the second refused before
                t0 = time.monotonic()
                r = await http.post("/v1/completions", json={"model": MODEL, "prompt": PROMPT, "max_tokens": 8,
                                                             "stream": True})
                assert time.monotonic() - t0 < 5  # not after failover_wait (30 s)
                assert r.status_code == 503, r.text
                err = r.json()["error"]
                assert err["code"] == "no_replica_available", err
                assert "refused the router's credentials" in err["message"], err
                assert "FS_TEST_NO_SUCH_KEY" in err["message"] and "HTTP 401" in err["message"], err
            assert len(generations) == 1


async def test_a_per_request_403_with_the_right_key_leaves_the_upstream_ready(tmp_path, cleanup):
    """An upstream that takes the key but refuses one request's content with
    403 (OpenRouter's moderation): other requests there are not refused."""
    from aiohttp import web
    from replicas.openai_server import OpenAIServer

    class Moderated(OpenAIServer):
        async def _completions(self, request):
            if "FLAGGED" in json.dumps(await request.json()):
                return web.json_response({"error": {"message": "your input was flagged"}}, status=403)
            return await super()._completions(request)

    srv = Moderated("sim", {"model": MODEL, "seed": 0, "step_base_ms": 0, "step_per_seq_ms": 0})
    port = await srv.start("127.0.0.1", 0)
    cleanup(srv)  # (stopped last)
    srv.stop = lambda: None  # (closed below, in this loop)
    try:
        router = upstream_router(tmp_path / "router", f"http://127.0.0.1:{port}/v1", local=0)
        cleanup(router)
        await asyncio.to_thread(router.start)
        async with httpx.AsyncClient(base_url=router.base_url, headers={"Authorization": f"Bearer {GOLD}"},
                                     timeout=30) as http:
            async def flagged():
                return await http.post("/v1/completions", json={"model": MODEL, "prompt": "FLAGGED", "max_tokens": 4})

            async def ordinary():
                await asyncio.sleep(0.005)
                return await http.post("/v1/completions", json={"model": MODEL, "prompt": PROMPT, "max_tokens": 4})

            for _ in range(10):
                rs = await asyncio.gather(flagged(), *(ordinary() for _ in range(4)))
                assert all(r.status_code == 200 for r in rs[1:]), [r.text for r in rs[1:] if r.status_code != 200]
            assert (await http.get("/ready")).json()["replicas"][UPSTREAM] == "ready"
        assert "refused the router's credentials" not in router.log()
    finally:
        await srv.close()


async def test_a_chat_only_upstream_comes_back_once_its_key_is_taken(tmp_path, cleanup):
    """A chat-only upstream behind a gateway that answers 403 to a route it
    does not define (AWS API Gateway's 'Missing Authentication Token'): its
    key refused on /chat/completions, then fixed, it is ready again (the
    probe asks the endpoint that refused, not /completions)."""
    from aiohttp import web
    from replicas.openai_server import OpenAIServer

    key_ok = False

    class Gateway(OpenAIServer):
        async def _completions(self, request):
            return web.json_response({"message": "Missing Authentication Token"}, status=403)

        async def _chat(self, request):
            if not key_ok:
                return web.json_response({"error": {"message": "Incorrect API key provided"}}, status=401)
            return await super()._chat(request)

    srv = Gateway("sim", {"model": MODEL, "seed": 0, "step_base_ms": 0, "step_per_seq_ms": 0})
    port = await srv.start("127.0.0.1", 0)
    try:
        router = upstream_router(tmp_path / "router", f"http://127.0.0.1:{port}/v1", local=0)
        cleanup(router)
        await asyncio.to_thread(router.start)
        chat = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}
        async with httpx.AsyncClient(base_url=router.base_url, headers={"Authorization": f"Bearer {GOLD}"},
                                     timeout=30) as http:
            r = await http.post("/v1/chat/completions", json=chat)
            assert r.status_code == 503, r.text
            key_ok = True
            deadline = time.monotonic() + 10
            while (await http.get("/ready")).json()["replicas"][UPSTREAM] != "ready":
                assert time.monotonic() < deadline, "still not ready 10 s after its key was taken"
                await asyncio.sleep(0.2)
            r = await http.post("/v1/chat/completions", json=chat)
            assert r.status_code == 200, r.text
    finally:
        await srv.close()


async def test_an_upstream_refusing_the_key_at_connect_is_logged_once_naming_api_key_env(tmp_path, cleanup,
                                                                                           monkeypatch):
    """An upstream whose ``/models`` needs the key (``vllm serve --api-key``)
    refuses a wrong one at connect. That refusal was a plain one: its message
    did not name ``api_key_env``, it was logged again at every attempt
    (0.5, 1, 2, 4 s... up to ``restart_backoff_max``), and a client's 503
    did not say why. Now it is the generation path's refusal: logged once
    (until the key is taken), named in the 503 and in ``last_error``; and
    the upstream is used once it takes the key."""
    from tests.sim_openai import SimOpenAI

    monkeypatch.setenv("FS_TEST_UP_KEY", "wrong")
    server = SimOpenAI(tmp_path, {"step_base_ms": 1}, api_key="s3cret").start()
    cleanup(server)
    # a sim replica keeps the router ready; the upstream's model is its own, so its requests go nowhere else
    # (up-1's model is known from its config; up-2's only once it connects)
    router = upstream_router(tmp_path / "router", server.url, local=1, api_key_env="FS_TEST_UP_KEY")
    router.config["replicas"][0]["config"] = {"model": "up-model"}
    router.config["replicas"].insert(1, {"name": "up-2", "url": server.url, "api_key_env": "FS_TEST_UP_KEY"})
    router.config_path.write_text(yaml.safe_dump(router.config, sort_keys=False))
    router.replica_names = ["sim-0"]
    cleanup(router)
    await asyncio.to_thread(router.start)
    async with httpx.AsyncClient(base_url=router.base_url, headers={"Authorization": f"Bearer {GOLD}"},
                                 timeout=30) as http:
        # attempts at 0, 0.5, 1.5, 3.5 s: waited for, not slept (a loaded host is later)
        deadline = asyncio.get_running_loop().time() + 30
        while asyncio.get_running_loop().time() < deadline:
            rows = (await http.get("/admin/replicas", headers={"Authorization": f"Bearer {ADMIN}"})).json()["replicas"]
            if all(row["reconnects"] >= 3 for row in rows[:2]):
                break
            await asyncio.sleep(0.2)
        for model in ("up-model", "a-model-up-2-may-serve"):
            r = await http.post("/v1/completions", json={"model": model, "prompt": PROMPT, "max_tokens": 4})
            assert r.status_code == 503, r.text
            message = r.json()["error"]["message"]
            assert "refused the router's credentials" in message and "FS_TEST_UP_KEY" in message, message
        rows = (await http.get("/admin/replicas", headers={"Authorization": f"Bearer {ADMIN}"})).json()["replicas"]
        for row in rows[:2]:
            assert not row["ready"] and "FS_TEST_UP_KEY" in row["last_error"], row
            assert row["restarts"] == 0 and row["reconnects"] >= 3, row  # (the router restarts no upstream)
    lines = [json.loads(line) for line in router.log().splitlines() if line.startswith("{")]
    errors = [x["msg"] for x in lines if x["level"] == "error" and "refused" in x["msg"]]
    for name in (UPSTREAM, "up-2"):
        mine = [e for e in errors if f"upstream {name} " in e]
        assert len(mine) == 1, errors  # once, not at every attempt
        assert "FS_TEST_UP_KEY" in mine[0] and "HTTP 401" in mine[0], mine

    # the upstream's key is changed to the router's: both are used again, and say so
    server.stop()
    server.api_key = "wrong"
    server.start(port=server.port)
    router.replica_names = [UPSTREAM, "up-2", "sim-0"]
    await asyncio.to_thread(router.wait_ready, 10)
    # (a log line is written at the end of the loop's turn: on a loaded host
    # it can land after /ready says ready)
    deadline = time.monotonic() + 5
    while True:
        lines = [json.loads(line) for line in router.log().splitlines() if line.startswith("{")]
        again = sum("takes the router's credentials again" in x["msg"] for x in lines)
        if again >= 2 or time.monotonic() > deadline:
            break
        await asyncio.sleep(0.1)
    assert again == 2, [x["msg"] for x in lines]
