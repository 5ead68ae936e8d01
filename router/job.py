"""What a client asked for: ``Job``, the model, the prompt in one of its
three forms (text, chat messages, token ids) and the sampling parameters,
and the prefix-affinity key the scheduler routes it by."""

from __future__ import annotations

from typing import Any

from replicas.protocol import SamplingParams, required_features

__all__ = ["Job", "AFFINITY_PREFIX"]


AFFINITY_PREFIX = 512  # characters (or tokens) of the prompt that key prefix affinity


class Job:
    """What was asked: the model, the prompt in one of three forms, the params.

    A chat keeps its ``template_kwargs`` (``chat_template_kwargs``) and
    ``reasoning_effort`` with its messages: a replica lost before the
    prompt's token ids came back renders them again on the next one."""

    __slots__ = ("model", "params", "prompt", "messages", "prompt_token_ids", "template_kwargs", "reasoning_effort",
                 "needs")

    def affinity_key(self) -> int | None:
        """Hash of the prompt's first AFFINITY_PREFIX characters (or token
        ids): requests sharing it prefer the replica that served it last,
        whose prefix cache may still hold it. None for short prompts."""
        if self.messages is not None:
            # (the first messages that make up the prefix: this runs on the
            # event loop, and a chat may have 100,000 messages)
            parts: list[str] = []
            size = -1
            for m in self.messages:
                parts.append(f"{m.get('role')}:{m.get('content')}")
                size += len(parts[-1]) + 1
                if size >= AFFINITY_PREFIX:
                    return hash("\x00".join(parts)[:AFFINITY_PREFIX])
            return None
        if self.prompt is not None:
            return hash(self.prompt[:AFFINITY_PREFIX]) if len(self.prompt) >= AFFINITY_PREFIX else None
        ids = self.prompt_token_ids or []
        return hash(tuple(ids[:AFFINITY_PREFIX])) if len(ids) >= AFFINITY_PREFIX else None

    def __init__(
        self,
        model: str,
        params: SamplingParams,
        *,
        prompt: str | None = None,
        messages: list[dict[str, str]] | None = None,
        prompt_token_ids: list[int] | None = None,
        template_kwargs: dict[str, Any] | None = None,
        reasoning_effort: str | None = None,
    ) -> None:
        self.model = model
        self.params = params
        self.prompt = prompt
        self.messages = messages
        self.prompt_token_ids = prompt_token_ids
        self.template_kwargs = template_kwargs
        self.reasoning_effort = reasoning_effort
        # the replica features its fields need (replicas.protocol.Feature: an
        # older replica would drop them); 0 for most requests
        self.needs = required_features(params, template_kwargs, reasoning_effort)
