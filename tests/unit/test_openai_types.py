"""Request decoding: what is refused as unsupported, and what asks for nothing."""

import json

import pytest

from router.errors import BadRequest
from router.openai_types import ChatRequest, CompletionRequest, chat_messages, decode_request

MSG = [{"role": "user", "content": "hi"}]


def chat(**kw):
    return decode_request(json.dumps({"model": "m", "messages": MSG, **kw}).encode(), ChatRequest)


def completion(**kw):
    return decode_request(json.dumps({"model": "m", "prompt": "hi", **kw}).encode(), CompletionRequest)


@pytest.mark.parametrize("kw", [
    {"stream": None}, {"logit_bias": {}}, {"parallel_tool_calls": False}, {"parallel_tool_calls": True},
    {"logprobs": False}, {"top_logprobs": 0}, {"n": 1}, {"tools": None}, {"tool_choice": "none"},
    {"response_format": {"type": "text"}},
], ids=lambda kw: json.dumps(kw))
def test_values_that_ask_for_nothing_are_accepted(kw):
    # (OpenAI takes them; SDKs and frameworks send some of them by default)
    assert isinstance(chat(**kw), ChatRequest)


def test_a_null_stream_does_not_stream():
    assert chat(stream=None).stream is False
    assert completion(stream=None).stream is False


@pytest.mark.parametrize("make, kw, name", [
    (chat, {"n": 2}, "n"),
    (chat, {"logprobs": True}, "logprobs"),
    (chat, {"logit_bias": {"50256": -100}}, "logit_bias"),
    (chat, {"tools": [{"type": "function", "function": {"name": "f"}}]}, "tools"),
    (chat, {"tools": [{"type": "function", "function": {"name": "f"}}], "parallel_tool_calls": False}, "tools"),
    (completion, {"logprobs": 0}, "logprobs"),  # the sampled token's logprob: not a silent ignore
    (completion, {"logprobs": 3}, "logprobs"),
    (completion, {"echo": True}, "echo"),
    (completion, {"best_of": 2}, "best_of"),
], ids=lambda v: json.dumps(v) if isinstance(v, dict) else getattr(v, "__name__", str(v)))
def test_options_this_server_cannot_honour_are_a_400_naming_them(make, kw, name):
    with pytest.raises(BadRequest) as info:
        make(**kw)
    assert info.value.param == name and info.value.code == "unsupported_parameter", info.value


def test_an_assistant_message_with_no_tool_calls_is_a_message():
    req = chat(messages=[*MSG, {"role": "assistant", "content": "hello", "tool_calls": []},
                         {"role": "user", "content": "again"}])
    assert [m["content"] for m in chat_messages(req)] == ["hi", "hello", "again"]
    req = chat(messages=[*MSG, {"role": "assistant", "content": None,
                                "tool_calls": [{"id": "c", "type": "function",
                                                "function": {"name": "f", "arguments": "{}"}}]}])
    with pytest.raises(BadRequest) as info:
        chat_messages(req)
    assert info.value.param == "messages[1].tool_calls"
