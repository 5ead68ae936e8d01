"""A chat stream's role-only first chunk (vLLM's), an SSE event without an
id in the bytes of event 1, and the readers of stored events, which look
past it (router/sse.py)."""

from __future__ import annotations

import msgspec

from replicas.protocol import FinishReason
from router.resume_position import Mark, mark_of, rest_of
from router.resume_tail import _chunk
from router.sse import ChunkEncoder, Usage, lead, numbered
from tests.helpers import parse_sse

ROLE = {"index": 0, "delta": {"role": "assistant", "content": ""}, "logprobs": None, "finish_reason": None}


def _enc(chat: bool = True) -> ChunkEncoder:
    return ChunkEncoder(chat, "chatcmpl-x", "m", 7)


def test_the_first_chat_event_leads_with_an_id_less_role_chunk_and_the_others_do_not() -> None:
    enc = _enc()
    first = enc.delta("He", pos=b"-1-2")
    role, event = parse_sse(first.decode())
    assert role.id is None and role.json() == {"id": "chatcmpl-x", "object": "chat.completion.chunk", "created": 7,
                                               "model": "m", "choices": [ROLE]}
    assert event.id == "1-1-2" and event.json()["choices"][0]["delta"] == {"content": "He"}
    assert first[lead(first):] == numbered(first) and numbered(first).startswith(b"id: 1-1-2\n")
    second = enc.delta("llo", pos=b"-2-5")
    assert lead(second) == 0 and numbered(second) is second and second.startswith(b"id: 2-2-5\n")
    assert enc.plain_ready


def test_with_continuous_usage_the_role_chunk_has_the_prompt_and_no_completion_tokens() -> None:
    role, event = parse_sse(_enc().delta("He", pos=b"-1-2", usage=Usage(5, 1, 6)).decode())
    assert role.json()["usage"] == {"prompt_tokens": 5, "completion_tokens": 0, "total_tokens": 5}
    assert event.json()["usage"] == {"prompt_tokens": 5, "completion_tokens": 1, "total_tokens": 6}


def test_a_first_event_with_only_a_finish_still_comes_after_the_role_chunk() -> None:
    role, event = parse_sse(_enc().delta("", FinishReason.STOP, b"-1-0-1").decode())
    assert role.json()["choices"] == [ROLE]
    assert event.json()["choices"][0]["delta"] == {} and event.json()["choices"][0]["finish_reason"] == "stop"


def test_legacy_completions_and_a_stream_that_had_its_role_have_no_role_chunk() -> None:
    for enc in (_enc(chat=False), ChunkEncoder(True, "c", "m", 7, event_id=4, role_sent=True)):
        event = enc.delta("He", pos=b"-9-9")
        assert event.startswith(b"id: ") and lead(event) == 0 and b'"role"' not in event


def test_ends_and_notices_are_not_taken_for_a_role_chunk() -> None:
    enc = _enc()
    for event in (enc.done(), enc.notice(b'{"error":{}}')):
        assert lead(event) == 0 and numbered(event) is event


def test_stored_event_1_is_read_past_its_role_chunk() -> None:
    enc = _enc()
    first = enc.delta("Hello", pos=b"-2-5")
    assert mark_of(first) == Mark(2, 5)
    rest = rest_of(first, Mark(0, 0), Mark(1, 2))  # (a client inside event 1 had the role chunk)
    assert rest is not None and rest.startswith(b"id: 1-2-5\ndata: ") and b'"role"' not in rest
    assert msgspec.json.decode(rest[rest.index(b"data: ") + 6:])["choices"][0]["delta"] == {"content": "llo"}
    # a stream whose one event has its finish: the finish is found there (resume_tail)
    only = _enc().delta("Hi", FinishReason.LENGTH, b"-1-2-1")
    assert mark_of(only) == Mark(1, 2, 1)
    chunk = _chunk(only)
    assert chunk is not None and chunk.choices[0].finish_reason == "length"
