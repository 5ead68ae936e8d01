"""The prompt-token estimate admission reserves before a replica has counted
the prompt (the router never tokenizes).

A prompt's UTF-8 bytes bound its token count under byte-level BPE
tokenizers. A chat template adds a header per message (``<|user|>``, a
role and separators: at most ``PER_MESSAGE`` tokens in the templates
tried) and a fixed part per request: a begin-of-text token, the
generation prompt, a default system prompt (Llama 3.1's is ~25 tokens).
The fixed part is learned per model and prompt form from the real counts
the replicas return for short prompts (at most ``SHORT`` bytes of content)
that render nothing beyond the base (no ``chat_template_kwargs``,
``reasoning_effort``, message ``name`` or ``tool_call_id``): the most such
a request needed beyond its bytes and message headers. Only short ones,
since bytes overstate a long text's tokens several times over (a long
prompt would teach 0); only plain ones, since what a template renders of
those fields may count many times their bytes, and would raise every
tenant's estimate for the router's life; at most ``MAX_FIXED``. Until a
model's first short prompt, ``FIRST_GUESS`` tokens. Settlement always
charges the real count, so the estimate decides only how much a burst can
take before the first requests settle."""

from __future__ import annotations

import msgspec

from router.job import Job

__all__ = ["PromptEstimates", "base_estimate", "messages_estimate", "PER_MESSAGE", "FIRST_GUESS"]

PER_MESSAGE = 16  # tokens of a chat template's header around one message
FIRST_GUESS = {"chat": 32, "text": 1, "ids": 0}  # a model's fixed part before its first real count
SHORT = 64  # bytes of content at most in a prompt that teaches the fixed part
MAX_FIXED = 1024  # tokens: the most the fixed part is taken to be


def _kind(job: Job) -> str:
    return "chat" if job.messages is not None else "text" if job.prompt is not None else "ids"


def messages_estimate(messages: list[dict[str, str]]) -> int:
    """What ``messages`` take at most, their template's headers included,
    and a message's ``name`` and ``tool_call_id`` (templates render them)."""
    return sum(len(str(m.get("content", "")).encode()) + len((m.get("name") or "").encode())
               + len((m.get("tool_call_id") or "").encode()) + PER_MESSAGE for m in messages)


def base_estimate(job: Job, messages: int | None = None) -> int:
    """What ``job``'s prompt takes at most, but for its model's fixed part;
    ``messages``: ``messages_estimate(job.messages)``, if already counted."""
    if job.messages is not None:
        n = messages_estimate(job.messages) if messages is None else messages
        if job.template_kwargs:  # (a template may render them into the prompt: documents, tools)
            n += len(msgspec.json.encode(job.template_kwargs))
        return n
    if job.prompt is not None:
        return len(job.prompt.encode())
    return len(job.prompt_token_ids or ())


class PromptEstimates:
    """Each served model's fixed prompt part, learned (see the module)."""

    __slots__ = ("_fixed",)

    def __init__(self) -> None:
        self._fixed: dict[tuple[str, str], int] = {}

    def estimate(self, job: Job, base: int | None = None) -> tuple[int, int]:
        """(the estimate, its base: ``learn``'s argument once counted);
        ``base``: ``base_estimate(job)``, if already computed."""
        if base is None:
            base = base_estimate(job)
        kind = _kind(job)
        return base + self._fixed.get((job.model, kind), FIRST_GUESS[kind]), base

    def learn(self, job: Job, base: int, counted: int) -> None:
        """The replica counted ``counted`` prompt tokens for ``job`` (``base``
        from ``estimate``); only a short, plain prompt teaches (see the module)."""
        if job.template_kwargs or job.reasoning_effort is not None:
            return
        kind = _kind(job)
        content = base - PER_MESSAGE * len(job.messages) if job.messages is not None else base
        if kind != "ids" and content > SHORT:
            return
        if job.messages is not None and any("name" in m or "tool_call_id" in m for m in job.messages):
            return
        key = (job.model, kind)
        extra = min(MAX_FIXED, max(0, counted - base))
        known = self._fixed.get(key)
        if known is None or extra > known:
            self._fixed[key] = extra
