"""An upstream that takes a generation request and never answers it (its
front end still lists its models, so health checks pass) fails the request
over after the head timeout (the supervisor's health_timeout) instead of
holding it until the tenant's first-token limit answers 504."""

from __future__ import annotations

import asyncio
import time

import pytest

from replicas.client import ReplicaDead
from replicas.protocol import SamplingParams
from replicas.spec import ReplicaSpec
from replicas.upstream_open import open_upstream

MODELS = b'{"object":"list","data":[{"id":"m","object":"model","max_model_len":4096}]}'


async def _hanging_server():
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
                    writer.write(b"HTTP/1.1 200 OK\r\ncontent-type: application/json\r\ncontent-length: %d\r\n\r\n%s"
                                 % (len(MODELS), MODELS))
                else:
                    await asyncio.sleep(3600)  # takes the request, never answers
        except (asyncio.IncompleteReadError, ConnectionError, asyncio.CancelledError):
            pass
        finally:
            writer.close()

    return await asyncio.start_server(handle, "127.0.0.1", 0)


async def test_a_request_the_upstream_never_answers_fails_over_after_the_head_timeout() -> None:
    server = await _hanging_server()
    port = server.sockets[0].getsockname()[1]
    client = await open_upstream("hung", ReplicaSpec(name="hung", url=f"http://127.0.0.1:{port}/v1"),
                                 timeout=5, head_timeout=0.3)
    try:
        t0 = time.monotonic()
        col = client.generate(SamplingParams(max_tokens=4), prompt="hi")
        with pytest.raises(ReplicaDead, match="no response within 0.3s"):
            async with asyncio.timeout(5):
                await col.get()
        assert time.monotonic() - t0 < 2
        assert client.active == 0  # nothing left in flight there
    finally:
        await client.close()
        server.close()
