"""Turning one request into engine input: limits, resumed prefixes, output processing.

Pure and synchronous. Both front ends of an engine use it
(``ReplicaServer._generate`` for the replica protocol,
``replicas.openai_server`` for the OpenAI API), so they reject and continue
requests alike: the router's default ``max_tokens`` lowered to the model's
own default and to what the context leaves, the context length, ``max_tokens`` left after a resumed
prefix, an ``OutputProcessor`` that knows the prefix.
"""

from __future__ import annotations

import msgspec

from replicas.engine import Engine, EngineError, Tokenizer
from replicas.output import OutputProcessor
from replicas.protocol import FinishReason, SamplingParams

__all__ = ["prepare", "finish_prefix", "context_error", "prompt_error"]

# Prompt tokens an output processor sees as context when it is primed with the
# prompt: enough to hold the start of one unfinished UTF-8 character.
_PRIME_TOKENS = 8
# ... and at most this many where the prompt's text ends in a long run of
# U+FFFD (``_prime_window``): the router's splice refuses a resume inside a
# run longer than 64 tokens (replicas.splice.WALK_LIMIT), so a longer window
# serves nothing it accepts, and the processor's start decodes the window
# once per token of it (a whole 8,000-token prompt took 9 s)
_PRIME_MAX = 128
_REPLACEMENT = "\ufffd"


def prompt_error(engine: Engine, prompt_len: int) -> EngineError:
    """A prompt that leaves no room for a completion token."""
    return EngineError(
        f"This model's maximum context length is {engine.max_model_len} tokens. However, your prompt "
        f"contains {prompt_len} input tokens, which leaves no room for a completion. Please reduce the "
        "length of the prompt."
    )


def context_error(engine: Engine, prompt_len: int, max_tokens: int) -> EngineError:
    """vLLM's wording for a ``max_tokens`` over the context length."""
    return EngineError(
        f"This model's maximum context length is {engine.max_model_len} tokens. However, you "
        f"requested {prompt_len + max_tokens} tokens ({prompt_len} in the prompt, {max_tokens} "
        "in the completion). Please reduce the length of the prompt or max_tokens."
    )


def prepare(
    engine: Engine,
    prompt_ids: list[int],
    params: SamplingParams,
    prefix_token_ids: list[int] = (),  # type: ignore[assignment]
    prefix_text_len: int = 0,
    *,
    prime: bool = False,
) -> tuple[list[int], SamplingParams, OutputProcessor]:
    """Engine input for a request: (token ids, params, output processor).

    ``prefix_token_ids``/``prefix_text_len`` continue a resumed stream (the
    fairstream replica protocol). ``prime`` makes the processor decode the
    first completion tokens in the context of the prompt's last tokens, as
    vLLM's detokenizer does: a prompt that ends inside a multi-byte character
    gets that character completed by the first new token. Raises
    ``EngineError`` (or ``ValueError`` for a bad prefix) when the request
    cannot run. ``max_tokens`` 0 in the params returned: the prefix holds
    every token the request may have, nothing is to run (``finish_prefix``).
    """
    model_max = engine.default_max_tokens
    if params.max_tokens_default and model_max is not None and params.max_tokens > model_max:
        # a request that set no max_tokens gets the model's own default where
        # it has one, as from vLLM's server (get_max_tokens: it and the
        # context's remainder, the least), when lower than the router's (the
        # tenant's cap, or its default_max_tokens); a min_tokens above it is
        # refused by vLLM's SamplingParams, as there. Never below a resumed
        # prefix: a replica that did not apply this default (an upstream, the
        # sim, an older replica) may have made more; that stream ends there,
        # at ``length``, not on an error after its failover.
        # (a min_tokens that raised the default over that limit is lowered
        # with it for a resumed prefix only: its first replica ran it, so
        # vLLM's refusal would end the stream on an error mid-way)
        limit = max(model_max, len(prefix_token_ids))
        params = msgspec.structs.replace(params, max_tokens=min(params.max_tokens, limit), min_tokens=(
            min(params.min_tokens, limit) if prefix_token_ids else params.min_tokens))
    room = engine.max_model_len - len(prompt_ids)
    if room <= 0:
        raise prompt_error(engine, len(prompt_ids))
    # (an unset max_tokens, the router's default, is lowered just below
    # instead, however large: a client is not refused for a field it never
    # sent; but a min_tokens the client did send, over the whole context, is)
    asked = params.min_tokens if params.max_tokens_default else params.max_tokens
    if asked > engine.max_model_len:
        raise context_error(engine, len(prompt_ids), asked)
    if params.max_tokens > room:
        # what the context leaves after the prompt, the client's max_tokens
        # as the router's default, as vLLM's server does (get_max_tokens)
        params = msgspec.structs.replace(params, max_tokens=room, min_tokens=min(params.min_tokens, room))
    remaining = params.max_tokens - len(prefix_token_ids)
    if remaining < 0 or (remaining == 0 and not prefix_token_ids):
        raise EngineError("max_tokens already reached by the resumed prefix")
    include = params.include_stop_str_in_output
    if prefix_token_ids:
        proc = OutputProcessor(engine.tokenizer, params.stop, prefix_token_ids, prefix_text_len, params.min_tokens,
                               include_stop_str=include)
        params = msgspec.structs.replace(
            params,
            max_tokens=remaining,
            min_tokens=max(0, params.min_tokens - len(prefix_token_ids)),
        )
    elif prime and prompt_ids:
        tail = _prime_window(engine.tokenizer, prompt_ids)
        proc = OutputProcessor(engine.tokenizer, params.stop, tail, None,
                               params.min_tokens + len(tail), include_stop_str=include, prefix_is_output=False)
    else:
        proc = OutputProcessor(engine.tokenizer, params.stop, min_tokens=params.min_tokens, include_stop_str=include)
    # a stop token's id is vLLM's stop_reason, but for EOS (unless ignore_eos): vLLM checks EOS first
    eos = engine.tokenizer.eos_token_id
    proc.stop_ids = frozenset(t for t in params.stop_token_ids if t != eos or params.ignore_eos)
    return prompt_ids + list(prefix_token_ids), params, proc


def finish_prefix(proc: OutputProcessor) -> tuple[str, FinishReason]:
    """The end of a resumed stream whose prefix holds all its ``max_tokens``
    tokens (``prepare`` gave ``max_tokens`` 0: its replica failed after the
    last token, before the finish): the text that replica held back, since it
    could have started a stop string (less the bytes of a character the
    sequence ends inside), and ``LENGTH``, as that replica would have ended
    it; the client then has every character of an uninterrupted run."""
    return proc.process([], FinishReason.LENGTH)


def _prime_window(tok: Tokenizer, prompt_ids: list[int]) -> list[int]:
    """The prompt's last tokens a primed processor decodes with: the last
    ``_PRIME_TOKENS``, or the last ``_PRIME_MAX`` when the text ends in
    U+FFFD at every token boundary in them (a long run of bytes that are no
    UTF-8). vLLM's detokenizer primes with the whole prompt then, and so
    re-decodes the text after the prompt's last boundary whose text does not
    end in U+FFFD with its first new tokens; the router's splice onto an
    upstream counts on exactly that text coming first
    (``replicas.splice.Splice``), for a run of up to 64 tokens."""
    tail = prompt_ids[-_PRIME_TOKENS:]
    if len(tail) < len(prompt_ids) and all(tok.decode(tail[:i]).endswith(_REPLACEMENT)
                                           for i in range(len(tail), 0, -1)):
        return prompt_ids[-_PRIME_MAX:]
    return tail
