"""A streamed chat completion opens with a role-only chunk, as vLLM's OpenAI
server and OpenAI do: ``"delta":{"role":"assistant","content":""}``, no
finish; the text starts in the next chunk. (It carried the first text with
the role, and an app that reads ``if delta.role: ... elif delta.content:``
lost the first token.)

On the SSE wire that chunk is an event without an ``id:`` line, in the same
write as event 1, so the numbering of the events (and ``Last-Event-ID``) is
as before; on a WebSocket it is a ``chunk`` message without ``event``.
"""

from __future__ import annotations

import asyncio
import json

import httpx
import openai
import pytest
from websockets.asyncio.client import connect

from tests.helpers import GOLD, MODEL, RouterProcess, aiter_sse, parse_sse

GREEDY = dict(max_tokens=24, temperature=0, extra_body={"ignore_eos": True})
MESSAGES = [{"role": "user", "content": "Tell me"}]
ROLE_DELTA = {"role": "assistant", "content": ""}


@pytest.fixture(scope="module")
def client(shared_router: RouterProcess):
    with openai.OpenAI(base_url=shared_router.base_url + "/v1", api_key=GOLD, max_retries=0, timeout=30) as c:
        yield c


def _reference(client: openai.OpenAI) -> str:
    return client.chat.completions.create(model=MODEL, messages=MESSAGES, **GREEDY).choices[0].message.content


def test_the_sdk_sees_a_role_only_first_chunk_then_the_text(client: openai.OpenAI) -> None:
    ref = _reference(client)
    chunks = list(client.chat.completions.create(model=MODEL, messages=MESSAGES, stream=True, **GREEDY))
    first = chunks[0].choices[0]
    assert (first.delta.role, first.delta.content) == ("assistant", ""), first
    assert first.finish_reason is None and first.logprobs is None and chunks[0].usage is None
    second = chunks[1].choices[0]
    assert second.delta.role is None and second.delta.content, second
    assert ref.startswith(second.delta.content)
    assert all(c.choices[0].delta.role is None for c in chunks[1:]), "one role chunk"
    # an app that takes the role chunk apart from the text gets every token
    role, text = None, ""
    for c in chunks:
        delta = c.choices[0].delta
        if delta.role:
            role = delta.role
        elif delta.content:
            text += delta.content
    assert (role, text) == ("assistant", ref)


def test_the_role_chunk_is_an_event_without_an_id_before_event_1(shared_router: RouterProcess) -> None:
    body = {"model": MODEL, "messages": MESSAGES, "stream": True, **GREEDY, "ignore_eos": True}
    del body["extra_body"]
    r = httpx.post(shared_router.base_url + "/v1/chat/completions", json=body,
                   headers={"authorization": f"Bearer {GOLD}"}, timeout=30)
    assert r.status_code == 200, r.text
    events = parse_sse(r.text)
    role, rest = events[0], events[1:-1]
    assert role.id is None, "no id: Last-Event-ID and the event numbers stay as they were"
    d = role.json()
    # vLLM's first chunk (serving_chat.py, model_dump_json(exclude_unset=True))
    assert d["choices"] == [{"index": 0, "delta": ROLE_DELTA, "logprobs": None, "finish_reason": None}], d
    assert set(d) == {"id", "object", "created", "model", "choices"}, d
    assert d["object"] == "chat.completion.chunk" and d["model"] == MODEL
    assert {e.json()["id"] for e in rest} == {d["id"]}
    assert [e.number for e in rest] == list(range(1, len(rest) + 1))
    assert all("role" not in e.json()["choices"][0]["delta"] for e in rest)
    assert rest[0].json()["choices"][0]["delta"]["content"]


def test_legacy_completions_have_no_role_chunk(shared_router: RouterProcess) -> None:
    body = {"model": MODEL, "prompt": "The ", "stream": True, "max_tokens": 8, "ignore_eos": True}
    r = httpx.post(shared_router.base_url + "/v1/completions", json=body,
                   headers={"authorization": f"Bearer {GOLD}"}, timeout=30)
    events = parse_sse(r.text)
    assert events[0].number == 1 and events[0].json()["choices"][0]["text"], events[0]


def test_continuous_usage_puts_zero_completion_tokens_on_the_role_chunk(client: openai.OpenAI) -> None:
    # as vLLM: the role chunk carries the prompt's usage and no completion tokens yet
    chunks = list(client.chat.completions.create(
        model=MODEL, messages=MESSAGES, stream=True,
        stream_options={"include_usage": True, "continuous_usage_stats": True}, **GREEDY))
    first = chunks[0]
    assert first.choices[0].delta.content == "" and first.choices[0].delta.role == "assistant"
    u = first.usage
    assert u is not None and u.completion_tokens == 0 and u.total_tokens == u.prompt_tokens > 0, u
    assert chunks[1].usage.completion_tokens >= 1 and chunks[1].choices[0].delta.content
    # include_usage alone: no usage on it, as on the other chunks before the usage chunk
    chunks = list(client.chat.completions.create(model=MODEL, messages=MESSAGES, stream=True,
                                                 stream_options={"include_usage": True}, **GREEDY))
    assert chunks[0].usage is None and chunks[0].choices[0].delta.role == "assistant"


async def test_a_resume_from_the_start_has_the_role_chunk_and_one_after_event_1_has_none(
        shared_router: RouterProcess) -> None:
    body = {"model": MODEL, "messages": MESSAGES, "stream": True, "max_tokens": 24, "temperature": 0,
            "ignore_eos": True}
    async with httpx.AsyncClient(base_url=shared_router.base_url, headers={"authorization": f"Bearer {GOLD}"},
                                 timeout=30) as http:
        r = await http.post("/v1/chat/completions", json=body)
        sid = r.headers["x-request-id"]
        whole = parse_sse(r.text)
        for last, want in ((None, whole), (whole[1].id, whole[2:]), (whole[2].id, whole[3:])):
            headers = {"Last-Event-ID": last} if last else {}
            async with http.stream("GET", f"/v1/streams/{sid}", headers=headers) as resp:
                assert resp.status_code == 200, await resp.aread()
                got = [e async for e in aiter_sse(resp)]
            assert [(e.id, e.data) for e in got] == [(e.id, e.data) for e in want], last


async def test_a_websocket_stream_opens_with_a_role_message_without_an_event(shared_router: RouterProcess) -> None:
    url = shared_router.base_url.replace("http://", "ws://") + "/v1/ws"
    body = {"model": MODEL, "messages": MESSAGES, "max_tokens": 24, "temperature": 0, "ignore_eos": True}
    async with connect(url, additional_headers={"Authorization": f"Bearer {GOLD}"}, proxy=None) as ws:
        await ws.send(json.dumps({"type": "chat.completions.create", "id": "c", "body": body}))
        msgs = []
        while not msgs or not (msgs[-1].get("done") or "error" in msgs[-1]):
            msgs.append(json.loads(await asyncio.wait_for(ws.recv(), 20)))
    role, chunks = msgs[0], msgs[1:-1]
    assert set(role) == {"id", "stream", "chunk"}, role
    assert role["chunk"]["choices"][0]["delta"] == ROLE_DELTA and role["chunk"]["choices"][0]["finish_reason"] is None
    assert [m["event"] for m in chunks] == list(range(1, len(chunks) + 1)), chunks
    assert chunks[0]["event_id"].startswith("1-") and chunks[0]["chunk"]["choices"][0]["delta"]["content"]
    assert msgs[-1] == {"id": "c", "done": True}
