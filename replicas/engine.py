"""The engine interface a replica process drives.

An engine owns the model and continuous batching. It takes requests as token
ids and pushes new token ids through a callback; detokenization, stop strings
and framing live in ``replicas.output`` and ``replicas.server`` so that every
engine (``sim``, ``vllm``) gets identical text semantics, including across a
failover splice.
"""

from __future__ import annotations

import abc
import asyncio
from typing import Any, Protocol

from replicas.protocol import FinishReason, LoadReport, SamplingParams

__all__ = ["Tokenizer", "Engine", "OutputSink", "EngineError", "EngineDead"]


class EngineError(RuntimeError):
    """The engine cannot serve a request (bad prompt, too long)."""


class EngineDead(EngineError):
    """The engine has died: no request gets an answer from this process any
    more; it exits so that it is restarted, and the router moves its
    requests to other replicas."""


class Tokenizer(Protocol):
    """What the replica needs from a tokenizer."""

    eos_token_id: int | None

    def encode(self, text: str) -> list[int]: ...

    def decode(self, token_ids: list[int]) -> str:
        """Text of ``token_ids``; an unfinished UTF-8 sequence decodes to U+FFFD."""
        ...

    def chat(self, messages: list[dict[str, str]], template_kwargs: dict[str, Any] | None = None,
             reasoning_effort: str | None = None) -> list[int]:
        """Token ids of ``messages`` rendered by the chat template, with the
        generation prompt appended; ``template_kwargs`` (a request's
        ``chat_template_kwargs``) are the template's extra variables, and
        ``reasoning_effort`` (OpenAI's) one more where the template takes it.
        Raises ``EngineError`` when they cannot render."""
        ...


class OutputSink(Protocol):
    """Where an engine's output goes: rid, new token ids, finish reason
    (NONE while running), error text; ``stop_id``, with a ``STOP``: the stop
    token id the engine says ended it, where it knows one the replica's
    params do not (vLLM's ``stop_reason``: the EOS ids it adds from the
    model's generation config, as Gemma's ``<end_of_turn>``)."""

    def __call__(self, rid: int, new_ids: list[int], finish: FinishReason, error: str,
                 stop_id: int | None = None) -> None: ...


class Engine(abc.ABC):
    """A continuous-batching engine serving one model."""

    name: str  # "sim" or "vllm"
    model: str
    max_model_len: int
    tokenizer: Tokenizer
    # the model's own max_tokens for a request that sets none (vLLM: its
    # generation config's max_new_tokens; replicas.prepare applies it)
    default_max_tokens: int | None = None

    def __init__(self, sink: OutputSink) -> None:
        self.sink = sink
        self.died = asyncio.Event()  # set once, by ``die``
        self.death = ""  # why

    @property
    def dead(self) -> bool:
        """The engine can serve nothing any more (an engine that finds out
        by itself, as vLLM's does, says so here; checked every second)."""
        return self.died.is_set()

    def die(self, reason: str) -> None:
        """The engine has died: ``serve`` drops every connection (no request
        is answered with an error: the router fails them over) and exits."""
        if not self.died.is_set():
            self.death = reason
            self.died.set()

    @abc.abstractmethod
    async def start(self) -> None:
        """Load the model; return when requests can be served."""

    @abc.abstractmethod
    def add(self, rid: int, token_ids: list[int], params: SamplingParams, generated: int = 0) -> None:
        """Start generating after ``token_ids``. ``params.max_tokens`` counts
        new tokens only. The last ``generated`` of ``token_ids`` are the
        request's own output from before a splice (a failover or a resume):
        penalties over a request's output count them too. Output goes to
        ``sink``; the last call for ``rid`` has a finish reason other than
        NONE (unless ``abort`` was called)."""

    @abc.abstractmethod
    def abort(self, rid: int) -> None:
        """Stop ``rid`` at once and free its resources; no further output."""

    @abc.abstractmethod
    def load(self) -> LoadReport:
        """Current scheduler stats."""

    @abc.abstractmethod
    async def close(self) -> None:
        """Stop everything and release the model."""
