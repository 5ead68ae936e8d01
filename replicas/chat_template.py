"""What vLLM 0.32's OpenAI server hands a model's chat template, besides the
template itself: the conversation (``developer`` turns as ``system`` ones
where the template does not know that role) and the variables (a request's
``chat_template_kwargs`` under vLLM's own fields). Pure: the ``vllm``
engine's tokenizer (``replicas.vllm_engine.HfTokenizer``) renders with them.
"""

from __future__ import annotations

from typing import Any

__all__ = ["conversation", "template_variables"]


def template_variables(kwargs: dict[str, Any] | None, reasoning_effort: str | None) -> dict[str, Any]:
    """A chat's ``chat_template_kwargs`` with vLLM's own request fields over
    them (``ChatCompletionRequest.build_chat_params``, ``merge_kwargs``):
    ``add_generation_prompt`` and ``continue_final_message`` at the values
    a request that cannot set them has (True, False), ``reasoning_effort``
    when set, and with it ``enable_thinking`` (off for ``"none"``) unless the
    kwargs set that one. (vLLM's ``documents``, None here, leaves theirs.)"""
    variables = dict(kwargs or {})
    if reasoning_effort is not None and "enable_thinking" not in variables:
        variables["enable_thinking"] = reasoning_effort != "none"
    variables["add_generation_prompt"] = True
    variables["continue_final_message"] = False
    if reasoning_effort is not None:
        variables["reasoning_effort"] = reasoning_effort
    return variables


def conversation(messages: list[dict[str, Any]], template: str) -> list[dict[str, Any]]:
    """``messages`` as vLLM's server gives them to ``template``
    (``parse_chat_messages``, ``safe_apply_chat_template``): a ``developer``
    turn carries ``tools`` (None: no request sets a message's tools here),
    and where the template names no ``developer`` role, those turns become
    ``system`` ones, all of which are then merged into one, first, when one
    is not first or there are several (Qwen's templates take one system
    turn, first; ``_consolidate_system_messages``)."""
    if not any(m.get("role") == "developer" for m in messages):
        return messages
    if '"developer"' in template or "'developer'" in template:
        return [{**m, "tools": None} if m.get("role") == "developer" else m for m in messages]
    converted = [{**m, "role": "system"} if m.get("role") == "developer" else m for m in messages]
    systems = [i for i, m in enumerate(converted) if m["role"] == "system"]
    if systems == [0]:
        return converted
    texts = [text for m in converted if m["role"] == "system" and (text := m.get("content"))]
    return [{"role": "system", "content": "\n\n".join(texts)}, *(m for m in converted if m["role"] != "system")]
