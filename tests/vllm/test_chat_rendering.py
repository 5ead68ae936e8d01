"""A chat request's prompt on a ``vllm`` replica is the one vLLM 0.32's own
OpenAI server renders: the same token ids, checked against vLLM's renderer
run in this process (``ChatCompletionRequest.build_chat_params``,
``parse_chat_messages``, ``safe_apply_chat_template``: what
``vllm.entrypoints.openai.api_server`` does with a chat) for the ``developer``
role, ``reasoning_effort``, a message's ``name`` and ``tool_call_id``, and
``chat_template_kwargs`` beside vLLM's own fields. fairstream's side is the
router's decode of the body, the ``Generate`` frame it sends, and the
replica's tokenizer (``HfTokenizer`` over vLLM's tokenizer, as
``VllmEngine`` has it). No engine starts."""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

import pytest

from replicas.protocol import Generate, SamplingParams, encode_frame, router_decoder
from router.openai_types import ChatRequest, chat_messages, chat_template_kwargs, decode_request
from tests.vllm.support import require_vllm

pytestmark = pytest.mark.vllm

# A Qwen3-like template: it shows each message's name, tool_call_id and
# whether it has a tools key, and the variables vLLM sets from its own fields.
_VARIABLES = (
    "{{ bos_token }}{% for m in messages %}<|{{ m['role'] }}"
    "{% if m.name is defined %} name={{ m.name }}{% endif %}"
    "{% if m.tool_call_id is defined %} id={{ m.tool_call_id }}{% endif %}"
    "{% if m.tools is defined %} tools{% endif %}|>\n{{ m['content'] }}\n{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>\n"
    "{% if enable_thinking is defined and not enable_thinking %}<think>\n\n</think>\n{% endif %}"
    "{% if reasoning_effort is defined and reasoning_effort %}effort={{ reasoning_effort }}\n{% endif %}"
    "{% endif %}"
    "{% if documents is defined and documents %}docs={{ documents | length }}\n{% endif %}"
)
# ... and one that knows the developer role (vLLM then leaves it as it is)
_DEVELOPER = "{% if false %}{{ 'developer' }}{% endif %}" + _VARIABLES

_USER = {"role": "user", "content": "hi"}
CASES: dict[str, tuple[str, dict[str, Any]]] = {
    "developer": ("tiny", {"messages": [{"role": "developer", "content": "be brief"}, _USER]}),
    "developer after system": ("tiny", {"messages": [
        {"role": "system", "content": "a"}, _USER, {"role": "developer", "content": "b"},
        {"role": "assistant", "content": "ok"}, {"role": "user", "content": "again"}]}),
    "developer, known": ("developer", {"messages": [{"role": "developer", "content": "be brief"}, _USER]}),
    "name and tool_call_id": ("variables", {"messages": [
        {"role": "system", "content": "s", "name": "sys"}, {"role": "user", "content": "hi", "name": "bob"},
        {"role": "assistant", "content": "calling"},
        {"role": "tool", "content": [{"type": "text", "text": "42"}], "tool_call_id": "call_1"}]}),
    "an assistant turn without content, a named developer": ("tiny", {"messages": [
        {"role": "developer", "content": "d", "name": "dev"}, _USER, {"role": "assistant", "content": None},
        {"role": "user", "content": "go on"}]}),
    "reasoning_effort none": ("variables", {"messages": [_USER], "reasoning_effort": "none"}),
    "reasoning_effort high": ("variables", {"messages": [_USER], "reasoning_effort": "high"}),
    "enable_thinking of the kwargs wins": ("variables", {
        "messages": [_USER], "reasoning_effort": "none", "chat_template_kwargs": {"enable_thinking": True}}),
    "vLLM's own fields win over the kwargs": ("variables", {
        "messages": [_USER], "reasoning_effort": "low",
        "chat_template_kwargs": {"add_generation_prompt": False, "continue_final_message": True,
                                 "reasoning_effort": "high", "documents": [{"title": "t", "text": "x"}]}}),
    "kwargs alone": ("variables", {"messages": [_USER], "chat_template_kwargs": {
        "enable_thinking": False, "reasoning_effort": "medium"}}),
}


@pytest.fixture(scope="module")
def models(tiny_model: str, tmp_path_factory: pytest.TempPathFactory) -> dict[str, str]:
    """The tiny model, and copies of it with the templates above."""
    out = {"tiny": tiny_model}
    for name, template in (("variables", _VARIABLES), ("developer", _DEVELOPER)):
        d = tmp_path_factory.mktemp(f"tiny-{name}")
        shutil.copytree(tiny_model, d, dirs_exist_ok=True)
        (d / "chat_template.jinja").write_text(template)
        cfg = json.loads((d / "tokenizer_config.json").read_text())
        cfg["chat_template"] = template
        (d / "tokenizer_config.json").write_text(json.dumps(cfg))
        out[name] = str(d)
    return out


def _vllm_prompt(model_dir: str, body: dict[str, Any]) -> list[int]:
    """The prompt's token ids vLLM's server renders for ``body``."""
    from vllm.config import ModelConfig
    from vllm.entrypoints.openai.chat_completion.protocol import ChatCompletionRequest
    from vllm.renderers.chat_utils import parse_chat_messages
    from vllm.renderers.hf import resolve_chat_template_content_format, safe_apply_chat_template
    from vllm.tokenizers import get_tokenizer

    config = ModelConfig(model=model_dir, tokenizer=model_dir, max_model_len=2048)
    tok = get_tokenizer(model_dir)
    req = ChatCompletionRequest(model="m", **body)
    params = req.build_chat_params(None, "auto")
    fmt = resolve_chat_template_content_format(params.chat_template, None, "auto", tok, model_config=config)
    conversation, _, _ = parse_chat_messages(req.messages, config, content_format=fmt)
    return list(safe_apply_chat_template(config, tok, conversation, **params.get_apply_chat_template_kwargs()))


def _fairstream_prompt(model_dir: str, body: dict[str, Any]) -> list[int]:
    """The prompt's token ids a ``vllm`` replica renders for ``body``: the
    router's messages and fields, through a ``Generate`` frame, to the
    replica's tokenizer (``VllmEngine.tokenizer``)."""
    from vllm.tokenizers import get_tokenizer

    from replicas.vllm_engine import HfTokenizer

    req = decode_request(json.dumps({"model": "m", **body}).encode(), ChatRequest)
    frame = encode_frame(Generate(1, SamplingParams(), messages=chat_messages(req),
                                  chat_template_kwargs=chat_template_kwargs(req),
                                  reasoning_effort=req.reasoning_effort))
    msg = router_decoder().decode(frame[4:])
    return HfTokenizer(get_tokenizer(model_dir)).chat(msg.messages, msg.chat_template_kwargs, msg.reasoning_effort)


@pytest.mark.parametrize("case", list(CASES))
def test_a_chat_renders_as_vllms_server_renders_it(models: dict[str, str], case: str) -> None:
    require_vllm()
    model, body = CASES[case]
    want = _vllm_prompt(models[model], body)
    got = _fairstream_prompt(models[model], body)
    from vllm.tokenizers import get_tokenizer

    tok = get_tokenizer(models[model])
    assert tok.decode(got) == tok.decode(want)
    assert got == want


def test_the_cases_change_the_prompt(models: dict[str, str]) -> None:
    # (each case renders something the plain request does not: it tests what it names)
    require_vllm()
    plain = {m: _vllm_prompt(models[m], {"messages": [_USER]}) for m in models}
    for case, (model, body) in CASES.items():
        assert _vllm_prompt(models[model], body) != plain[model], case
    assert Path(models["variables"], "chat_template.jinja").read_text() == _VARIABLES
