"""vLLM request fields the router does not implement, taken at vLLM's default.

vLLM's OpenAI server takes request fields beyond OpenAI's, and clients
written for it (agent frameworks, vLLM's examples) send some of them with
their default value spelled out: ``skip_special_tokens: true``,
``add_generation_prompt: true``, ``priority: 0``. Such a value asks for
nothing the replicas do not do already (they behave as vLLM does by
default), so it is taken and dropped; any other value is a 400 naming the
field (``unsupported_parameter``): never a silent ignore. ``null`` is unset,
as for the other fields. The defaults are vLLM 0.32's (its
``ChatCompletionRequest`` and ``CompletionRequest``); a field not listed
here is unknown, a 400 ``unknown_parameter`` (router.openai_types).
"""

from __future__ import annotations

from operator import attrgetter
from typing import Any

import msgspec

__all__ = ["VllmFields", "CHAT_DEFAULTS", "COMPLETION_DEFAULTS", "not_default", "not_default_message"]

# both endpoints'
_BOTH: dict[str, Any] = {
    "skip_special_tokens": True,
    "spaces_between_special_tokens": True,
    "priority": 0,
    "truncate_prompt_tokens": None,
    "use_beam_search": False,
    "length_penalty": 1.0,
    "prompt_logprobs": None,
    "allowed_token_ids": None,
    "return_tokens_as_token_ids": False,  # (vLLM: null; false asks for the same)
    "cache_salt": None,
    "structured_outputs": None,
    "vllm_xargs": None,
    "kv_transfer_params": None,
    "logits_processors": None,
}
CHAT_DEFAULTS: dict[str, Any] = {
    **_BOTH,
    "add_special_tokens": False,  # (the chat template adds them)
    "echo": False,
    "add_generation_prompt": True,
    "bad_words": [],  # (chat's alone: vLLM's CompletionRequest has no such field)
    "continue_final_message": False,
    "documents": None,
    "chat_template": None,
    "mm_processor_kwargs": None,
    "include_reasoning": True,
}
COMPLETION_DEFAULTS: dict[str, Any] = {**_BOTH, "add_special_tokens": True, "echo": False}


class VllmFields(msgspec.Struct, forbid_unknown_fields=True, kw_only=True):
    """The fields of ``_BOTH`` and ``add_special_tokens`` (its default differs
    between the endpoints), any JSON value: ``not_default`` checks them. The
    chat's own are ``ChatRequest``'s (a completion's ``echo`` is its own)."""

    skip_special_tokens: Any = None
    spaces_between_special_tokens: Any = None
    priority: Any = None
    truncate_prompt_tokens: Any = None
    use_beam_search: Any = None
    length_penalty: Any = None
    prompt_logprobs: Any = None
    allowed_token_ids: Any = None
    return_tokens_as_token_ids: Any = None
    cache_salt: Any = None
    structured_outputs: Any = None
    vllm_xargs: Any = None
    kv_transfer_params: Any = None
    logits_processors: Any = None
    add_special_tokens: Any = None


def _is(value: Any, default: Any) -> bool:
    # (a bool is no number here, nor a number a bool: 1 is no true; but 1
    # is length_penalty's 1.0, as vLLM's pydantic takes it)
    if type(value) is bool or type(default) is bool:
        return type(value) is type(default) and value == default
    return value == default


# each endpoint's fields read in one call: a getattr each was 23 Python calls in every request
_READ = {id(CHAT_DEFAULTS): attrgetter(*CHAT_DEFAULTS), id(COMPLETION_DEFAULTS): attrgetter(*COMPLETION_DEFAULTS)}


def not_default(req: VllmFields, defaults: dict[str, Any]) -> str | None:
    """The first field of ``defaults`` (its endpoint's: ``CHAT_DEFAULTS`` or
    ``COMPLETION_DEFAULTS``) that ``req`` sets to other than vLLM's default."""
    read = _READ.get(id(defaults))
    values = read(req) if read is not None else tuple(getattr(req, name) for name in defaults)
    if values.count(None) == len(values):  # (the usual request: it sends none of them)
        return None
    for (name, default), value in zip(defaults.items(), values):
        if value is not None and not _is(value, default):
            return name
    return None


def not_default_message(name: str, defaults: dict[str, Any]) -> str:
    default = msgspec.json.encode(defaults[name]).decode()
    return f"'{name}' is not supported by this server; only vLLM's default ({default}) is taken."
