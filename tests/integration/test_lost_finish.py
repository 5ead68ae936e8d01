"""A stream with stop strings whose every ``max_tokens`` token was delivered
and whose finish was lost (its replica died after the last token, before
the finish: an OpenAI server sends the finish in a chunk of its own). Its
replica may have held back the last characters (they could have started a
stop string), so the router cannot just end it with ``length``: a 0-token
continuation on another replica sends that text, then ``length``
(``replicas.prepare.finish_prefix``; ``UpstreamClient`` through its splice).
It used to end in ``stream_lost`` after the text less those characters."""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator
import contextlib

import httpx

from replicas.protocol import FinishReason, SamplingParams
from replicas.stops import StopMatcher
from tests.helpers import GOLD, MODEL, aiter_sse, loopback_http
from tests.integration.test_upstream import TOK, _drain, _sim_upstream, cleanup, upstream_router

__all__ = ["cleanup"]  # (the fixture, from test_upstream)

PROMPT = "Once upon a time"
STOP = ["wolves!"]  # (never in TEXT: the replica holds back its last 6 characters)
TEXT = "the fox ran over the hill to the wo"  # (ends in the start of the stop string, held back too)


@contextlib.asynccontextmanager
async def _dies_before_the_finish() -> AsyncIterator[str]:
    """A loopback vLLM-like upstream: ``/models``; a streamed completion of
    ``TEXT``, one byte token per chunk with token ids, the text held back
    for ``STOP`` as vLLM holds it; then its connection breaks, before the
    finish chunk (and the held-back text it would carry). Yields its URL."""
    models = json.dumps({"data": [{"id": MODEL}]}).encode()

    async def answer(head: bytes, body: bytes, writer: asyncio.StreamWriter) -> bool:
        if head.startswith(b"GET"):
            writer.write(b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\n"
                         b"Content-Length: %d\r\n\r\n%s" % (len(models), models))
            return True
        req = json.loads(body)
        assert req["stop"] == STOP and req["max_tokens"] == len(TEXT), req
        writer.write(b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\n"
                     b"Transfer-Encoding: chunked\r\n\r\n")
        stops = StopMatcher(STOP)
        for i, t in enumerate(TOK.encode(TEXT)):
            text, stopped = stops.feed(chr(t))
            assert not stopped
            choice = {"index": 0, "text": text, "token_ids": [t], "finish_reason": None}
            chunk = {"choices": [choice]}
            if i == 0:
                chunk["prompt_token_ids"] = TOK.encode(PROMPT)
            event = b"data: %s\n\n" % json.dumps(chunk).encode()
            writer.write(b"%x\r\n%s\r\n" % (len(event), event))
            await writer.drain()
        await asyncio.sleep(0.05)
        writer.transport.abort()  # dies after the last token, before the finish
        return False

    async with loopback_http(answer) as port:
        yield f"http://127.0.0.1:{port}/v1"


async def test_a_lost_finish_with_stop_strings_gets_the_held_back_text_then_length(tmp_path, cleanup):
    async with _dies_before_the_finish() as url:
        router = upstream_router(tmp_path / "router", url, local=1)
        cleanup(router)
        await asyncio.to_thread(router.start)  # its readiness check needs this loop's server
        async with httpx.AsyncClient(base_url=router.base_url, headers={"Authorization": f"Bearer {GOLD}"},
                                     timeout=30) as http:
            # (equal loads: the first ready replica, the upstream, is chosen)
            async with http.stream("POST", "/v1/completions", json={
                "model": MODEL, "prompt": PROMPT, "stream": True, "max_tokens": len(TEXT), "stop": STOP,
                "temperature": 0,
            }) as r:
                assert r.status_code == 200, await r.aread()
                text, finish, errors = [], None, []
                async for ev in aiter_sse(r):
                    if ev.data == "[DONE]":
                        break
                    body = ev.json()
                    if "error" in body:
                        errors.append(body["error"])
                        continue
                    for c in body["choices"]:
                        text.append(c["text"])
                        finish = c["finish_reason"] or finish
    assert not errors, errors  # (was: stream_lost, after the text less its last 6 characters)
    assert ("".join(text), finish) == (TEXT, "length")
    m = router.metrics()
    assert m.value("fairstream_failovers_total", replica="up-0") == 1
    assert m.value("fairstream_requests_total", tenant="gold", outcome="ok") == 1


async def test_an_upstream_asked_for_no_more_tokens_sends_the_held_back_text_then_length():
    """The same end when the continuation goes to a ``url:`` upstream: its
    splice gets the prefix's text from ``/detokenize`` and sends what the
    client lacks of it, asking nothing to be generated."""
    ids = TOK.encode(TEXT)
    emitted = len(TEXT) - (len(STOP[0]) - 1)  # what a replica that held back sent
    async with _sim_upstream() as (_, client):
        col = client.generate(SamplingParams(max_tokens=len(ids), stop=STOP), prompt_token_ids=TOK.encode(PROMPT),
                              prefix_token_ids=ids, prefix_text_len=emitted)
        async with asyncio.timeout(10):
            got = await _drain(col)
    assert got == ([], TEXT[emitted:], FinishReason.LENGTH), got
