"""Upstreams whose state, not the client's request, makes them fail: each
request moves to another replica (``ReplicaDead`` on its collector) instead
of reaching the client as an error.

* One that takes a generation request and never answers it (its front end
  still lists its models, so health checks pass) fails the request over
  after the head timeout (the supervisor's ``health_timeout``), not at the
  tenant's first-token limit with a 504.
* One that no longer serves the model the router sends it (restarted with
  another, or a balancer in front now reaching another server): its 404
  "model does not exist" is not the client's error, and its health check
  takes it down.
* One that refuses the router's API key on its generation endpoints while
  its ``/models`` needs none (so health checks alone pass): the request
  moves on as ``CredentialsRefused``, and the upstream is not chosen until a
  health check's probe of a generation endpoint shows the key taken."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable

import pytest

from replicas.client import CredentialsRefused, ReplicaDead
from replicas.protocol import SamplingParams
from replicas.spec import ReplicaSpec
from replicas.upstream_open import open_upstream
from tests.helpers import read_request

_JSON = b"HTTP/1.1 %s\r\ncontent-type: application/json\r\ncontent-length: %d\r\n\r\n%s"


async def _server(models: Callable[[], bytes], post: Callable[[asyncio.StreamWriter], Awaitable[None]]):
    """A loopback upstream: ``GET /models`` answers ``models()``; a POST, ``post``."""
    async def handle(reader, writer):
        try:
            while True:
                head = await read_request(reader)
                if head.startswith(b"GET"):
                    body = models()
                    writer.write(_JSON % (b"200 OK", len(body), body))
                else:
                    await post(writer)
        except (asyncio.IncompleteReadError, ConnectionError, asyncio.CancelledError):
            pass
        finally:
            writer.close()

    server = await asyncio.start_server(handle, "127.0.0.1", 0)
    return server, server.sockets[0].getsockname()[1]


def _listing(model: str) -> bytes:
    return b'{"object":"list","data":[{"id":"%s","object":"model","max_model_len":4096}]}' % model.encode()


async def test_a_request_the_upstream_never_answers_fails_over_after_the_head_timeout() -> None:
    async def never(writer) -> None:
        await asyncio.sleep(3600)  # takes the request, never answers

    server, port = await _server(lambda: _listing("m"), never)
    client = await open_upstream("hung", ReplicaSpec(name="hung", url=f"http://127.0.0.1:{port}/v1"),
                                 timeout=5, head_timeout=0.3)
    try:
        t0 = time.monotonic()
        col = client.generate(SamplingParams(max_tokens=4), prompt="hi")
        with pytest.raises(ReplicaDead, match="no response head within 0.3s"):
            async with asyncio.timeout(5):
                await col.get()
        assert time.monotonic() - t0 < 2
        assert client.active == 0  # nothing left in flight there
    finally:
        await client.close()
        server.close()


async def test_an_upstream_that_no_longer_serves_the_model_fails_the_request_over_and_its_health_check() -> None:
    served = {"model": "m"}

    async def not_found(writer) -> None:
        body = b'{"object":"error","message":"The model `m` does not exist.","type":"NotFoundError","code":404}'
        writer.write(_JSON % (b"404 Not Found", len(body), body))

    server, port = await _server(lambda: _listing(served["model"]), not_found)
    client = await open_upstream("up", ReplicaSpec(name="up", url=f"http://127.0.0.1:{port}/v1"), timeout=5)
    try:
        served["model"] = "other"
        col = client.generate(SamplingParams(max_tokens=4), prompt="hi")
        with pytest.raises(ReplicaDead, match="does not exist"):  # was: a finish ERROR, the client's 400
            async with asyncio.timeout(5):
                await col.get()
        with pytest.raises(ReplicaDead, match="no longer lists 'm'"):
            await client.ping(5)
    finally:
        await client.close()
        server.close()


async def test_an_upstream_that_refuses_the_key_for_generation_is_refused_until_a_probe_passes(caplog) -> None:
    key = {"taken": False}

    async def post(writer) -> None:  # (a request, or the health check's probe: no prompt)
        if key["taken"]:
            body = b'{"error":{"message":"prompt is required","type":"BadRequestError","code":400}}'
            writer.write(_JSON % (b"400 Bad Request", len(body), body))
        else:
            body = b'{"error":{"message":"Unauthorized","type":"invalid_request_error","code":401}}'
            writer.write(_JSON % (b"401 Unauthorized", len(body), body))

    server, port = await _server(lambda: _listing("m"), post)
    client = await open_upstream("up", ReplicaSpec(name="up", url=f"http://127.0.0.1:{port}/v1",
                                                   api_key_env="FS_TEST_WRONG_KEY"), timeout=5)
    try:
        assert client.credentials_refused is None
        col = client.generate(SamplingParams(max_tokens=4), prompt="hi")
        with pytest.raises(CredentialsRefused, match=r"refused the router's credentials .*HTTP 401: Unauthorized"):
            async with asyncio.timeout(5):
                await col.get()
        assert "FS_TEST_WRONG_KEY" in (client.credentials_refused or "")
        assert client.check_now.is_set()  # (the supervisor shows it down at once)
        errors = [r for r in caplog.records if r.levelname == "ERROR" and "credentials" in r.getMessage()]
        assert len(errors) == 1 and "HTTP 401" in errors[0].getMessage()
        await client.ping(5)  # /models answers, the probe is refused: alive, still refused
        assert client.credentials_refused is not None and client.closed is None
        key["taken"] = True
        await client.ping(5)
        assert client.credentials_refused is None
    finally:
        await client.close()
        server.close()
