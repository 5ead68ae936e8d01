"""vLLM's ``chat_template_kwargs`` from the replica protocol to the chat
template: the replica renders a chat with them (the vllm engine's tokenizer
passes them to ``apply_chat_template`` as vLLM's server does; the sim's
template uses none), an OpenAI upstream is sent them as the client did, and
an older replica ignores them."""

from __future__ import annotations

import asyncio
import shutil
import tempfile
from types import SimpleNamespace
from typing import Any

import msgspec
import pytest

from replicas.client import connect
from replicas.engine import EngineError
from replicas.protocol import FinishReason, Generate, SamplingParams, encode_frame
from replicas.server import ReplicaServer
from replicas.sim import ByteTokenizer
from replicas.upstream import UpstreamClient
from replicas.vllm_engine import HfTokenizer

MESSAGES = [{"role": "user", "content": "hi"}]
KWARGS = {"enable_thinking": False, "documents": [{"title": "a", "text": "b"}]}


class _HfTemplate:
    """A Hugging Face tokenizer's chat side: records how it was called."""

    eos_token_id = 2
    chat_template = "{{ messages }}"

    def __init__(self, render=None) -> None:
        self.calls: list[tuple[list, dict[str, Any]]] = []
        self._render = render or (lambda messages, **kw: f"<{kw.get('enable_thinking', 'default')}>hi")

    def apply_chat_template(self, conversation, **kw):
        self.calls.append((conversation, kw))
        return self._render(conversation, **kw)

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return list(text.encode())


def test_the_vllm_tokenizer_passes_them_to_the_template_under_vllms_own_fields() -> None:
    hf = _HfTemplate()
    tok = HfTokenizer(hf)
    assert tok.chat(MESSAGES) == list(b"<default>hi")
    assert tok.chat(MESSAGES, KWARGS) == list(b"<False>hi")
    assert tok.chat(MESSAGES, {"add_generation_prompt": False}) == list(b"<default>hi")
    own = {"add_generation_prompt": True, "continue_final_message": False}
    assert [kw for _, kw in hf.calls] == [
        {"tokenize": False, **own},
        {"tokenize": False, **KWARGS, **own},
        {"tokenize": False, **own},  # (vLLM's server sets its own fields over them)
    ]
    assert all(conversation == MESSAGES for conversation, _ in hf.calls)


@pytest.mark.parametrize("kwargs, says", [
    ({"tokenize": True}, "unexpected chat template kwargs"),
    ({"chat_template": "{{ 'x' }}"}, "unexpected chat template kwargs"),
])
def test_the_vllm_tokenizer_refuses_what_vllm_refuses(kwargs, says) -> None:
    hf = _HfTemplate()
    with pytest.raises(EngineError, match=says):
        HfTokenizer(hf).chat(MESSAGES, kwargs)
    assert hf.calls == []


def test_a_template_that_cannot_render_the_request_is_an_engine_error() -> None:
    # (the replica answers it as the request's error, a 400 at the router,
    # as vLLM's server answers a template's exception)
    def fails(messages, **kw):
        raise ValueError("Conversation roles must alternate user/assistant")

    with pytest.raises(EngineError, match="roles must alternate"):
        HfTokenizer(_HfTemplate(fails)).chat(MESSAGES, KWARGS)
    with pytest.raises(EngineError, match="not text"):
        HfTokenizer(_HfTemplate(lambda messages, **kw: {"input_ids": [1]})).chat(MESSAGES, {"return_dict": True})


def test_the_sims_template_takes_them_and_uses_none() -> None:
    tok = ByteTokenizer()
    assert tok.chat(MESSAGES, KWARGS) == tok.chat(MESSAGES)


async def test_a_replica_renders_a_chat_with_them() -> None:
    run_dir = tempfile.mkdtemp(prefix="fst-")  # short: Unix socket paths are limited
    server = ReplicaServer("sim", {"model": "m", "step_base_ms": 0, "step_per_seq_ms": 0})
    seen: list[dict[str, Any] | None] = []
    chat = server.engine.tokenizer.chat

    def recording(messages, template_kwargs=None, reasoning_effort=None):
        seen.append(template_kwargs)
        return chat(messages, template_kwargs, reasoning_effort)

    server.engine.tokenizer.chat = recording  # type: ignore[method-assign]
    await server.start(socket_path=f"{run_dir}/r.sock")
    client = await connect("r", f"unix:{run_dir}/r.sock")
    try:
        prompts = []
        for kwargs in (KWARGS, None):
            col = client.generate(SamplingParams(max_tokens=3, temperature=0), messages=MESSAGES,
                                  chat_template_kwargs=kwargs)
            while (await asyncio.wait_for(col.get(), 5))[2] == FinishReason.NONE:
                pass
            prompts.append(col.prompt_token_ids)
        assert seen == [KWARGS, None]
        assert prompts[0] == prompts[1] == ByteTokenizer().chat(MESSAGES)
    finally:
        await client.close()
        await server.close()
        shutil.rmtree(run_dir, ignore_errors=True)


def test_an_older_replica_decodes_a_generate_with_them_and_ignores_them() -> None:
    class OldGenerate(msgspec.Struct, tag=2, array_like=True, omit_defaults=True, gc=False):
        rid: int
        params: SamplingParams
        prompt: str | None = None
        messages: list[dict[str, str]] | None = None
        prompt_token_ids: list[int] | None = None
        prefix_token_ids: list[int] = []
        prefix_text_len: int = 0

    frame = encode_frame(Generate(7, SamplingParams(), messages=MESSAGES, chat_template_kwargs=KWARGS))
    old = msgspec.msgpack.decode(frame[4:], type=OldGenerate)
    assert (old.rid, old.messages) == (7, MESSAGES)


def _upstream(token_ids: bool | None = True) -> SimpleNamespace:
    up = SimpleNamespace(upstream_model="m", token_ids=token_ids, _ask_usage=False)
    up._body = lambda *a: UpstreamClient._body(up, *a)  # type: ignore[arg-type]
    return up


def test_an_upstream_is_sent_them_as_the_client_did() -> None:
    up = _upstream()
    path, body, _ = UpstreamClient._request(up, SamplingParams(), None, MESSAGES, None, [], KWARGS)  # type: ignore[arg-type]
    sent = msgspec.json.decode(body)
    assert path == "/chat/completions" and sent["chat_template_kwargs"] == KWARGS and sent["messages"] == MESSAGES
    for none in (None, {}):
        _, body, _ = UpstreamClient._request(up, SamplingParams(), None, MESSAGES, None, [], none)  # type: ignore[arg-type]
        assert "chat_template_kwargs" not in msgspec.json.decode(body)


def test_an_upstream_is_sent_include_stop_str_in_output_only_when_set() -> None:
    up = _upstream()
    for include in (False, True):
        params = SamplingParams(stop=["x"], include_stop_str_in_output=include)
        _, body, _ = UpstreamClient._request(up, params, "p", None, None, [])  # type: ignore[arg-type]
        assert msgspec.json.decode(body).get("include_stop_str_in_output") is (True if include else None)
