"""A chat's prompt on a ``vllm`` replica as vLLM 0.32's server renders it:
``developer`` turns, ``reasoning_effort``, a message's ``name`` and
``tool_call_id``, vLLM's own fields over ``chat_template_kwargs`` (checked
against vLLM's own renderer in tests/vllm/test_chat_rendering.py), and the
router-to-replica path of ``reasoning_effort``."""

from __future__ import annotations

import asyncio
import json
import shutil
import tempfile
from types import SimpleNamespace
from typing import Any

import msgspec
import pytest

from replicas.chat_template import conversation, template_variables
from replicas.client import connect
from replicas.protocol import (
    FEATURES,
    Feature,
    FinishReason,
    Generate,
    SamplingParams,
    encode_frame,
    required_features,
    router_decoder,
)
from replicas.server import ReplicaServer
from replicas.upstream import UpstreamClient
from replicas.vllm_engine import HfTokenizer
from router.errors import BadRequest
from router.job import Job
from router.openai_types import ChatRequest, chat_messages, decode_request

USER = {"role": "user", "content": "hi"}
OWN = {"add_generation_prompt": True, "continue_final_message": False}


def chat(**kw) -> ChatRequest:
    return decode_request(json.dumps({"model": "m", **kw}).encode(), ChatRequest)


def test_the_router_keeps_a_messages_name_and_a_tool_messages_call_id() -> None:
    req = chat(messages=[{"role": "user", "content": "hi", "name": "bob"},
                         {"role": "tool", "content": "42", "tool_call_id": "call_1", "name": "calc"},
                         {"role": "user", "content": "x", "tool_call_id": "not a tool's"}])
    assert chat_messages(req) == [{"role": "user", "content": "hi", "name": "bob"},
                                  {"role": "tool", "content": "42", "tool_call_id": "call_1", "name": "calc"},
                                  {"role": "user", "content": "x"}]


@pytest.mark.parametrize("effort", ["none", "minimal", "low", "medium", "high", "xhigh", "max"])
def test_the_reasoning_efforts_vllm_takes_are_taken(effort: str) -> None:
    assert chat(messages=[USER], reasoning_effort=effort).reasoning_effort == effort


def test_another_reasoning_effort_is_a_400_naming_it() -> None:
    with pytest.raises(BadRequest) as e:
        chat(messages=[USER], reasoning_effort="extreme")
    assert e.value.param == "reasoning_effort"
    # the values it takes, as vLLM's 400 lists them (it said only "Invalid enum value 'extreme'")
    assert str(e.value) == ("Invalid value for 'reasoning_effort': 'extreme'; expected one of none, minimal, low, "
                            "medium, high, xhigh, max.")
    with pytest.raises(BadRequest) as e:
        chat(messages=[USER], reasoning_effort=3)
    assert str(e.value).endswith("; expected one of none, minimal, low, medium, high, xhigh, max.")


def test_vllms_own_fields_go_over_the_kwargs() -> None:
    assert template_variables(None, None) == OWN
    assert template_variables({"add_generation_prompt": False, "continue_final_message": True, "x": 1}, None) == {
        "x": 1, **OWN}
    assert template_variables(None, "none") == {"enable_thinking": False, **OWN, "reasoning_effort": "none"}
    assert template_variables(None, "low") == {"enable_thinking": True, **OWN, "reasoning_effort": "low"}
    # the kwargs' enable_thinking is theirs to set; their reasoning_effort is not, where the request sets one
    both = template_variables({"enable_thinking": True, "reasoning_effort": "high"}, "none")
    assert both == {"enable_thinking": True, "reasoning_effort": "none", **OWN}
    assert template_variables({"reasoning_effort": "high", "documents": [1]}, None) == {
        "reasoning_effort": "high", "documents": [1], **OWN}


def test_developer_turns_are_system_ones_where_the_template_knows_no_developer() -> None:
    dev = {"role": "developer", "content": "d", "name": "n"}
    assert conversation([USER], "{{ messages }}") == [USER]
    assert conversation([dev, USER], "{{ messages }}") == [{"role": "system", "content": "d", "name": "n"}, USER]
    # several system turns, or one not first: one, first (its name goes)
    assert conversation([{"role": "system", "content": "s"}, USER, dev, {"role": "system", "content": ""}],
                        "{{ messages }}") == [{"role": "system", "content": "s\n\nd"}, USER]
    for template in ("{% if m.role == 'developer' %}{% endif %}", '{{ "developer" }}'):
        assert conversation([USER, dev], template) == [USER, {**dev, "tools": None}]


class _Hf:
    eos_token_id = 2
    chat_template = "{{ messages }}"

    def __init__(self) -> None:
        self.calls: list[tuple[list, dict[str, Any]]] = []

    def apply_chat_template(self, conversation, **kw):
        self.calls.append((conversation, kw))
        return "x"

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return list(text.encode())


def test_the_vllm_tokenizer_renders_with_them() -> None:
    hf = _Hf()
    HfTokenizer(hf).chat([{"role": "developer", "content": "d"}, USER], {"add_generation_prompt": False}, "none")
    assert hf.calls == [([{"role": "system", "content": "d"}, USER],
                         {"tokenize": False, "enable_thinking": False, **OWN, "reasoning_effort": "none"})]


def test_reasoning_effort_crosses_the_protocol_to_replicas_that_announce_it() -> None:
    frame = encode_frame(Generate(3, SamplingParams(), messages=[USER], reasoning_effort="low"))
    assert router_decoder().decode(frame[4:]).reasoning_effort == "low"
    assert Feature.REASONING_EFFORT in FEATURES
    assert required_features(SamplingParams(), None, "none") == Feature.REASONING_EFFORT
    assert required_features(SamplingParams(), None) == 0
    job = Job("m", SamplingParams(), messages=[USER], reasoning_effort="high")
    assert (job.reasoning_effort, job.needs) == ("high", Feature.REASONING_EFFORT)


async def test_a_replica_renders_a_chat_with_its_reasoning_effort() -> None:
    run_dir = tempfile.mkdtemp(prefix="fst-")  # short: Unix socket paths are limited
    server = ReplicaServer("sim", {"model": "m", "step_base_ms": 0, "step_per_seq_ms": 0})
    seen: list[tuple[Any, ...]] = []
    render = server.engine.tokenizer.chat

    def recording(messages, template_kwargs=None, reasoning_effort=None):
        seen.append((messages, template_kwargs, reasoning_effort))
        return render(messages, template_kwargs, reasoning_effort)

    server.engine.tokenizer.chat = recording  # type: ignore[method-assign]
    await server.start(socket_path=f"{run_dir}/r.sock")
    client = await connect("r", f"unix:{run_dir}/r.sock")
    try:
        named = [{"role": "user", "content": "hi", "name": "bob"}]
        for effort in ("none", None):
            col = client.generate(SamplingParams(max_tokens=2, temperature=0), messages=named,
                                  reasoning_effort=effort)
            while (await asyncio.wait_for(col.get(), 5))[2] == FinishReason.NONE:
                pass
        assert seen == [(named, None, "none"), (named, None, None)]
    finally:
        await client.close()
        await server.close()
        shutil.rmtree(run_dir, ignore_errors=True)


def test_an_upstream_is_sent_reasoning_effort_as_the_client_did() -> None:
    up = SimpleNamespace(upstream_model="m", token_ids=True, _ask_usage=False)
    up._body = lambda *a: UpstreamClient._body(up, *a)  # type: ignore[arg-type]
    request: Any = UpstreamClient._request
    for effort in ("none", None):
        _, body, _ = request(up, SamplingParams(), None, [USER], None, [], None, effort)
        assert msgspec.json.decode(body).get("reasoning_effort") == effort
