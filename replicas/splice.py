"""Continuing a stream on an OpenAI upstream at a splice point (a failover
or a resume onto a ``url:`` replica) when its request has stop strings.

The upstream then gets no ``stop``: ``Splice`` matches the stop strings in
the stream's text from the resume point on, as one replica would, and
``prefix_text`` learns through the upstream's ``/detokenize`` what that
needs of the delivered prefix: its text, where the upstream's own text
starts in it (a prefix whose text ends in U+FFFD), and the characters of the
first ``min_tokens`` tokens' text (docs/upstreams.md, "Stop strings and
min_tokens after a resume"). The upstream client (``replicas.upstream``)
builds a ``Splice`` before it sends such a request, and its SSE reader
(``replicas.upstream_sse``) feeds it.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable

import aiohttp
import msgspec

from replicas.protocol import SamplingParams
from replicas.stops import StopMatcher
from replicas.upstream_errors import UpstreamFailed

__all__ = ["Splice", "splice_at", "prefix_text", "text_start", "post_detokenize", "Detokenize", "WALK_BATCH", "WALK_LIMIT"]

# Cuts /detokenize is asked for at once, and how far back, looking for the
# resumed prefix's last token boundary whose text does not end in U+FFFD.
WALK_BATCH = 4
WALK_LIMIT = 64
_JSON = {"content-type": "application/json"}

Detokenize = Callable[[list[int]], Awaitable[str]]
"""The text of some token ids, as the upstream's ``/detokenize`` gives it
(``post_detokenize`` bound to one upstream)."""


class Splice:
    """Stop strings across a resume point onto an upstream: the router, not
    the upstream, looks for them in the stream's text from the resume on.

    The upstream gets no ``stop`` (``UpstreamClient._body``): its text then
    comes unheld and uncut, and this splice feeds it, after the text the
    previous replica held back (it might start a stop string), to the same
    ``replicas.stops.StopMatcher`` a replica's ``OutputProcessor`` uses, so
    the cut is the one a single replica makes: the stop string that
    completes first wins, overlapping ones included; with ``include``
    (vLLM's ``include_stop_str_in_output``) the text is cut after it and the
    last characters the client has are kept to match one that starts in
    them. A match closes the upstream's response, which aborts it.

    ``min_tokens``: a stop string ending in the text of the first
    ``min_tokens`` completion tokens (the prefix's counted) ends nothing.
    Inside the prefix that text is known exactly (``min_chars``, from
    ``/detokenize``, as ``OutputProcessor`` counts it). Past the prefix the
    upstream's text comes without per-token boundaries, but every chunk says
    which tokens it holds (``return_token_ids``): the text of a chunk whose
    tokens are all past the first ``min_tokens`` is looked in, the text of
    any other is not. That is exact while chunks hold one token each (vLLM
    streams one per step unless its client lags or ``--stream-interval`` is
    set); a chunk of several tokens across the boundary counts as inside
    it, so a stop string ending in its later tokens' text is missed rather
    than one in the first ``min_tokens`` tokens' text matched.

    Where the prefix's text ends in U+FFFD (a character its last tokens
    end inside, or bytes that are no UTF-8) the upstream, decoding in the
    context of its prompt, holds those tokens back as vLLM's detokenizer
    does and sends their text with its first new text: its own text starts
    at ``start``, the prefix's last token boundary whose text does not end
    in U+FFFD. What of that text the client already has (``_unstick`` sent
    it) is dropped here once seen to be the same; a different text fails
    the stream (``UpstreamFailed``) before anything of it goes out, and
    another replica continues it."""

    __slots__ = ("stops", "tokens", "min_tokens", "resent")

    def __init__(self, stops: list[str], text: str, emitted: int, include: bool = False, *,
                 start: int | None = None, tokens: int = 0, min_tokens: int = 0, min_chars: int = 0) -> None:
        """``text``: the resumed prefix's text, of which the client has the
        first ``emitted`` characters and the upstream's own text repeats what
        follows the first ``start`` (default: all of it). ``tokens``: the
        prefix's tokens; ``min_chars``: characters of the first
        ``min_tokens`` tokens' text when they are all in the prefix."""
        start = len(text) if start is None else start
        self.stops = StopMatcher(stops, include=include, text=text[: max(start, emitted)], emitted=emitted)
        self.resent = text[start:emitted]  # the client has it; the upstream sends it again
        self.tokens = tokens  # completion tokens so far
        self.min_tokens = min_tokens
        if min_tokens and min_tokens <= tokens:
            self.stops.min_end = min_chars

    def feed(self, text: str, final: bool, tokens: int = 0) -> tuple[str, bool]:
        """The upstream's next ``text`` (of ``tokens`` tokens): (text to emit
        now, whether a stop string matched)."""
        resent = self.resent
        if resent and text:
            n = min(len(resent), len(text))
            if text[:n] != resent[:n]:
                raise UpstreamFailed("its text after the resume point is not the prefix's (cannot splice exactly)")
            self.resent = resent[n:]
            text = text[n:]
        look = self.tokens >= self.min_tokens  # (this chunk's tokens all past the first min_tokens)
        self.tokens += tokens
        return self.stops.feed(text, final, look)


async def splice_at(detokenize: Detokenize, prefix: list[int], prefix_text_len: int,
                    params: SamplingParams) -> Splice:
    """The splice for a stream with stop strings continued on an upstream
    after ``prefix`` (the client has ``prefix_text_len`` characters of its
    text), the prefix's text from ``detokenize``."""
    text, start, min_chars = await prefix_text(detokenize, prefix, prefix_text_len, params.min_tokens)
    return Splice(params.stop, text, prefix_text_len, params.include_stop_str_in_output, start=start,
                  tokens=len(prefix), min_tokens=params.min_tokens, min_chars=min_chars)


async def prefix_text(detokenize: Detokenize, prefix: list[int], prefix_text_len: int,
                      min_tokens: int) -> tuple[str, int, int]:
    """For a ``Splice``, through the upstream's ``/detokenize`` (vLLM's):
    the text of ``prefix`` (the client has its first ``prefix_text_len``
    characters), where the upstream's own text starts in it, and the
    characters of the first ``min_tokens`` tokens' text when they are
    all in ``prefix`` (as ``OutputProcessor`` counts them: less a
    character they end inside)."""
    text = await detokenize(prefix)
    if prefix_text_len > len(text):
        raise UpstreamFailed(f"prefix_text_len {prefix_text_len} exceeds the prefix text ({len(text)} chars)")
    start = await text_start(detokenize, prefix) if text.endswith("\ufffd") else len(text)
    min_chars = 0
    if 0 < min_tokens <= len(prefix):
        upto = text if min_tokens == len(prefix) else await detokenize(prefix[:min_tokens])
        min_chars = len(upto.rstrip("\ufffd"))
    return text, start, min_chars


async def text_start(detokenize: Detokenize, prefix: list[int]) -> int:
    """Characters of the text of ``prefix`` up to its last token boundary
    whose text does not end in U+FFFD: where an upstream that decodes in
    the context of its prompt (vLLM: its whole prompt, when that ends in
    one) starts its text. Asked back from the end, ``WALK_BATCH`` cuts
    at a time; a run longer than ``WALK_LIMIT`` tokens is refused."""
    end = len(prefix)
    while end > 0:
        if len(prefix) - end >= WALK_LIMIT:
            raise UpstreamFailed(f"cannot resume a stream with stop strings: the text of its last {WALK_LIMIT} "
                                 "tokens ends in U+FFFD at every token")
        cuts = range(end - 1, max(0, end - WALK_BATCH) - 1, -1)
        texts = await asyncio.gather(*(detokenize(prefix[:i]) for i in cuts if i))
        for t in texts:
            if not t.endswith("\ufffd"):
                return len(t)
        end = cuts[-1]
    return 0  # (the text of no tokens)


async def post_detokenize(session: aiohttp.ClientSession, root: str, model: str, ids: list[int]) -> str:
    """The text of ``ids`` from the ``/detokenize`` (vLLM's) of the upstream
    served at ``root`` for ``model``."""
    url = root + "/detokenize"
    body = msgspec.json.encode({"model": model, "tokens": ids})
    async with session.post(url, data=body, headers=_JSON) as r:
        raw = await r.read()
        if r.status != 200:
            raise UpstreamFailed(f"cannot resume a stream with stop strings: POST /detokenize: HTTP {r.status}")
    obj = msgspec.json.decode(raw)
    text = obj.get("prompt") if isinstance(obj, dict) else None
    if not isinstance(text, str):
        raise UpstreamFailed("cannot resume a stream with stop strings: /detokenize gave no text")
    return text

