"""A stream resumed on an OpenAI upstream, through the router's splice
(``replicas.upstream._Splice``), gives the text one replica gives.

The model, as the router runs it: tokens ``ids[:k]`` went out through a
replica's ``OutputProcessor``; the upstream (the sim's OpenAI server, as
``prepare`` primes it: it decodes in the context of its prompt, which ends
with the delivered tokens) gets no stop strings and streams the rest; its
text goes through the splice, built from what the router learns through
``/detokenize`` (here the tokenizer itself answers). The existing
exhaustive splice tests of an upstream that does apply stop strings are in
test_output.py.
"""

from __future__ import annotations

import asyncio
from types import SimpleNamespace

from hypothesis import assume, example, given
from hypothesis import strategies as st

from replicas.output import OutputProcessor
from replicas.prepare import prepare
from replicas.protocol import FinishReason, SamplingParams
from replicas.sim import ByteTokenizer
from replicas.upstream import UpstreamClient, _Splice

TOK = ByteTokenizer()
NONE, STOP, LENGTH = FinishReason.NONE, FinishReason.STOP, FinishReason.LENGTH

SMALL = st.sampled_from(list("ab é日😀\n"))
small_text = st.text(SMALL, min_size=1, max_size=24)
stops = st.lists(st.text(SMALL, min_size=1, max_size=4), min_size=0, max_size=4)
boundaries = st.sets(st.integers(1, 1000), max_size=12)


def points(raw: set[int], n: int) -> list[int]:
    return sorted({p % n for p in raw} - {0}) if n > 1 else []


def split(ids: list[int], cut: list[int]) -> list[list[int]]:
    bounds = [0, *cut, len(ids)]
    return [ids[a:b] for a, b in zip(bounds, bounds[1:])]


def feed(proc: OutputProcessor, parts: list[list[int]], final: FinishReason) -> tuple[str, FinishReason]:
    out: list[str] = []
    for i, part in enumerate(parts):
        text, finish = proc.process(part, final if i == len(parts) - 1 else NONE)
        out.append(text)
        if finish != NONE:
            return "".join(out), finish
    return "".join(out), NONE


def one_replica(ids: list[int], cut: list[int], stop: list[str], include: bool,
                min_tokens: int) -> tuple[str, FinishReason]:
    return feed(OutputProcessor(TOK, stop, min_tokens=min_tokens, include_stop_str=include), split(ids, cut), LENGTH)


async def _detokenize(ids: list[int]) -> str:
    return TOK.decode(ids)


def splice_for(prefix: list[int], emitted: int, stop: list[str], include: bool, min_tokens: int) -> _Splice:
    """The splice ``UpstreamClient._run`` builds, from its own ``/detokenize``
    calls (answered by the tokenizer)."""
    client = SimpleNamespace(_detokenize=_detokenize)
    ask = UpstreamClient._prefix_text(client, prefix, emitted, min_tokens)  # type: ignore[arg-type]
    text, min_chars = asyncio.run(ask)
    return _Splice(stop, text, emitted, include, tokens=len(prefix), min_tokens=min_tokens, min_chars=min_chars)


def run_spliced(ids: list[int], cut: list[int], k: int, stop: list[str], include: bool = False,
                min_tokens: int = 0) -> tuple[str, FinishReason]:
    """``ids[:k]`` on a replica, the rest on an upstream through the splice,
    chunked at ``cut`` (a chunk of the upstream: one SSE event)."""
    cut = sorted(set(cut) | {k})
    parts = split(ids, cut)
    n_first = cut.index(k) + 1
    e1, finish = feed(OutputProcessor(TOK, stop, min_tokens=min_tokens, include_stop_str=include),
                      parts[:n_first], NONE)
    if finish != NONE:
        return e1, finish
    splice = splice_for(ids[:k], len(e1), stop, include, min_tokens)
    engine = SimpleNamespace(max_model_len=10_000, tokenizer=TOK)
    params = SamplingParams(max_tokens=len(ids) + 1, include_stop_str_in_output=include)  # (no stop: the router's)
    _, _, upstream = prepare(engine, ids[:k], params, prime=True)  # type: ignore[arg-type]
    out = [e1]
    rest = parts[n_first:]
    for i, part in enumerate(rest):
        # (token by token, as vLLM's detokenizer and the sim's server take
        # them; a chunk holds the text of its tokens that is complete)
        pieces = [upstream.process([t], NONE)[0] for t in part[:-1]]
        text, finish = upstream.process(part[-1:], LENGTH if i == len(rest) - 1 else NONE)
        text, stopped = splice.feed("".join(pieces) + text, finish != NONE, len(part))
        out.append(text)
        if stopped:
            return "".join(out), STOP
        if finish != NONE:
            return "".join(out), finish
    raise AssertionError("the upstream never finished")


def rounded(min_tokens: int, cut: list[int], k: int, n: int) -> int:
    """min_tokens as the splice can see it past the prefix: the end of the
    upstream chunk that holds the min_tokens-th token (exact for chunks of one token)."""
    if min_tokens <= k:
        return min_tokens
    return next((b for b in sorted(set(cut) | {k, n}) if b >= min_tokens), min_tokens)


# -- stop strings: the router's, over the upstream's unheld text ---------------------------------


@example(text="a\n\n", stop=["\n\n"], k=2, raw=set(), include=False)  # overlapping across the splice
@example(text="aab", stop=["ab", "aa"], k=1, raw=set(), include=False)
@example(text="abcd", stop=["abcd", "c"], k=2, raw=set(), include=False)  # nested
@example(text="aé", stop=["a"], k=1, raw=set(), include=False)
@given(small_text, stops, st.integers(1, 1000), boundaries, st.booleans())
def test_a_resume_onto_an_upstream_gives_the_text_of_one_replica_overlapping_stops_included(
        text: str, stop: list[str], k: int, raw: set[int], include: bool) -> None:
    # (the upstream used to get the stop strings and cut its text before
    # its own: one that spanned the splice and ended inside that one went
    # unseen, and the text ran on)
    ids = TOK.encode(text)
    assume(len(ids) >= 2)
    k = 1 + k % (len(ids) - 1)
    cut = points(raw, len(ids))
    assert run_spliced(ids, cut, k, stop, include) == one_replica(ids, sorted(set(cut) | {k}), stop, include, 0)


def test_overlapping_stop_strings_at_every_resume_point_and_chunk_size() -> None:
    text, stop = "one\n\ntwo\n\n\nthree", ["\n\n", "o\n", "\n\nt"]
    ids = TOK.encode(text)
    for include in (False, True):
        for size in (1, 2, 3):
            cut = list(range(size, len(ids), size))
            want = one_replica(ids, cut, stop, include, 0)
            assert want[1] == STOP
            for k in range(1, len(ids)):
                assert run_spliced(ids, cut, k, stop, include) == one_replica(
                    ids, sorted(set(cut) | {k}), stop, include, 0), (include, size, k)


# -- min_tokens over the spliced text -------------------------------------------------------------


def test_no_stop_string_ends_in_the_first_min_tokens_text_across_a_resume_onto_an_upstream() -> None:
    # (the splice looked for stop strings from the resume point on, min_tokens
    # or not, and a stop string in the first min_tokens tokens' text, the
    # delivered prefix's counted, ended a stream vLLM would have continued)
    ids = TOK.encode("xxabxxabxxab")
    for include in (False, True):
        for min_tokens in range(len(ids) + 1):
            want = one_replica(ids, list(range(1, len(ids))), ["ab"], include, min_tokens)
            for k in range(1, len(ids)):
                got = run_spliced(ids, list(range(1, len(ids))), k, ["ab"], include, min_tokens)
                assert got == want, (include, min_tokens, k)


@example(text="aab", stop=["ab"], k=1, raw=set(), include=False, min_tokens=2)
@given(small_text, stops, st.integers(1, 1000), boundaries, st.booleans(), st.integers(0, 30))
def test_min_tokens_across_a_resume_onto_an_upstream_in_every_chunking(
        text: str, stop: list[str], k: int, raw: set[int], include: bool, min_tokens: int) -> None:
    """Exact inside the prefix; past it, as exact as the upstream's chunks:
    one chunk of several tokens across the min_tokens boundary counts as
    inside it (``_Splice``)."""
    ids = TOK.encode(text)
    assume(len(ids) >= 2)
    k = 1 + k % (len(ids) - 1)
    cut = points(raw, len(ids))
    want = one_replica(ids, sorted(set(cut) | {k}), stop, include, rounded(min_tokens, cut, k, len(ids)))
    assert run_spliced(ids, cut, k, stop, include, min_tokens) == want
