"""An upstream that no longer serves the model the router sends it (it was
restarted with another, or a balancer in front now reaches another server):
its 404 "model does not exist" is not the client's error (the client asked
for a model the router serves), so the request moves to another replica,
and the health check takes the upstream down."""

from __future__ import annotations

import asyncio

import pytest

from replicas.client import ReplicaDead
from replicas.protocol import SamplingParams
from replicas.spec import ReplicaSpec
from replicas.upstream_open import open_upstream


async def _server(state: dict):
    async def handle(reader, writer):
        try:
            while True:
                head = await reader.readuntil(b"\r\n\r\n")
                n = 0
                for line in head.split(b"\r\n"):
                    if line.lower().startswith(b"content-length:"):
                        n = int(line.split(b":")[1])
                if n:
                    await reader.readexactly(n)
                if head.startswith(b"GET"):
                    body = b'{"object":"list","data":[{"id":"%s","object":"model"}]}' % state["model"].encode()
                    status = b"200 OK"
                else:
                    body = b'{"object":"error","message":"The model `m` does not exist.","type":"NotFoundError","code":404}'
                    status = b"404 Not Found"
                writer.write(b"HTTP/1.1 %s\r\ncontent-type: application/json\r\ncontent-length: %d\r\n\r\n%s"
                             % (status, len(body), body))
        except (asyncio.IncompleteReadError, ConnectionError, asyncio.CancelledError):
            pass
        finally:
            writer.close()

    return await asyncio.start_server(handle, "127.0.0.1", 0)


async def test_an_upstream_that_no_longer_serves_the_model_fails_the_request_over_and_its_health_check() -> None:
    state = {"model": "m"}
    server = await _server(state)
    port = server.sockets[0].getsockname()[1]
    client = await open_upstream("up", ReplicaSpec(name="up", url=f"http://127.0.0.1:{port}/v1"), timeout=5)
    try:
        state["model"] = "other"
        col = client.generate(SamplingParams(max_tokens=4), prompt="hi")
        with pytest.raises(ReplicaDead, match="does not exist"):  # was: a finish ERROR, the client's 400
            async with asyncio.timeout(5):
                await col.get()
        with pytest.raises(ReplicaDead, match="no longer lists 'm'"):
            await client.ping(5)
    finally:
        await client.close()
        server.close()
