"""A stream resumed on an OpenAI upstream, through the router's splice
(``replicas.splice.Splice``), gives the text one replica gives.

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

import pytest
from hypothesis import assume, example, given
from hypothesis import strategies as st

from replicas.engine import Tokenizer
from replicas.output import OutputProcessor
from replicas.prepare import prepare
from replicas.protocol import FinishReason, SamplingParams
from replicas.splice import WALK_LIMIT, Splice, prefix_text, splice_at
from replicas.sim import ByteTokenizer
from replicas.upstream_errors import UpstreamFailed
from tests.unit.chunking import LENGTH, NONE, STOP, TOK, boundaries, feed, points, small_text, split, stops


# Real U+FFFD characters, bytes that are no UTF-8 (a lone continuation byte, a
# lead byte with nothing after it) and ordinary characters, as token runs.
_PIECES = [b"a", b"b", b"\n", "\ufffd".encode(), "日".encode(), b"\x80", b"\xe6"]
odd_ids = st.lists(st.sampled_from(_PIECES), min_size=2, max_size=20).map(lambda ps: list(b"".join(ps)))
odd_stops = st.lists(st.text(st.sampled_from(list("ab\n\ufffd日")), min_size=1, max_size=3), max_size=3)


def one_replica(ids: list[int], cut: list[int], stop: list[str], include: bool,
                min_tokens: int, tok: Tokenizer = TOK) -> tuple[str, FinishReason]:
    return feed(OutputProcessor(tok, stop, min_tokens=min_tokens, include_stop_str=include), split(ids, cut), LENGTH)


def splice_for(prefix: list[int], emitted: int, stop: list[str], include: bool, min_tokens: int,
               tok: Tokenizer = TOK) -> Splice:
    """The splice ``UpstreamClient._run`` builds (``splice_at``), its
    ``/detokenize`` calls answered by the tokenizer."""
    async def detokenize(ids: list[int]) -> str:
        return tok.decode(ids)

    params = SamplingParams(stop=stop, include_stop_str_in_output=include, min_tokens=min_tokens)
    return asyncio.run(splice_at(detokenize, prefix, emitted, params))


def run_spliced(ids: list[int], cut: list[int], k: int, stop: list[str], include: bool = False,
                min_tokens: int = 0, tok: Tokenizer = TOK) -> tuple[str, FinishReason]:
    """``ids[:k]`` on a replica, the rest on an upstream through the splice,
    chunked at ``cut`` (a chunk of the upstream: one SSE event)."""
    cut = sorted(set(cut) | {k})
    parts = split(ids, cut)
    n_first = cut.index(k) + 1
    e1, finish = feed(OutputProcessor(tok, stop, min_tokens=min_tokens, include_stop_str=include),
                      parts[:n_first], NONE)
    if finish != NONE:
        return e1, finish
    splice = splice_for(ids[:k], len(e1), stop, include, min_tokens, tok)
    engine = SimpleNamespace(max_model_len=10_000, tokenizer=tok, default_max_tokens=None)
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
    inside it (``Splice``)."""
    ids = TOK.encode(text)
    assume(len(ids) >= 2)
    k = 1 + k % (len(ids) - 1)
    cut = points(raw, len(ids))
    want = one_replica(ids, sorted(set(cut) | {k}), stop, include, rounded(min_tokens, cut, k, len(ids)))
    assert run_spliced(ids, cut, k, stop, include, min_tokens) == want


# -- U+FFFD at the resume point -----------------------------------------------------------------


def test_a_prefix_ending_in_replacement_characters_the_client_has_splices_exactly() -> None:
    # (the router cut the prefix's text at its last character that is not
    # U+FFFD, below what the client had, and refused the resume: the stream
    # could not continue on an upstream)
    ids = TOK.encode("caf\ufffd\ufffd\ufffd\ufffd au lait, s'il vous pla\u00eet")
    for stop in (["zz"], ["\ufffd a"], ["\ufffd\ufffd\ufffd\ufffd\ufffd"], ["t, s"]):
        for include in (False, True):
            want = one_replica(ids, list(range(1, len(ids))), stop, include, 0)
            for k in range(1, len(ids)):
                assert run_spliced(ids, list(range(1, len(ids))), k, stop, include) == want, (stop, include, k)


@given(odd_ids, odd_stops, st.integers(1, 1000), boundaries, st.booleans(), st.integers(0, 30))
def test_a_resume_onto_an_upstream_anywhere_in_text_with_replacement_characters_and_bad_bytes(
        ids: list[int], stop: list[str], k: int, raw: set[int], include: bool, min_tokens: int) -> None:
    k = 1 + k % (len(ids) - 1)
    # (not with min_tokens and U+FFFD in a stop string: the upstream holds
    # back a real U+FFFD at the end of a chunk's text, so it can come in the
    # next chunk, past min_tokens, where the replica had it inside them: a
    # stop string of it then ends the stream there, a corner the README
    # names; ``rounded`` does not model that move. At the prefix's end too: a
    # CI run found ids "aaaa" + 2 x U+FFFD, k 9, min_tokens 9, stop U+FFFD:
    # 'aaaa' where the replica had 'aaaa\ufffd'. And before it: the U+FFFD run
    # a replica held back at the resume point comes again from the upstream,
    # so min_tokens a little below k is the same corner: ids "aa" + 3 x
    # U+FFFD, k 10, min_tokens 9: 'aa' against 'aa\ufffd' (a fresh-clone run
    # found it; 3 in 6,000 examples under the old assumption, min_tokens < k,
    # and none in 6,000 under this one)
    assume(min_tokens == 0 or not any("\ufffd" in s for s in stop))
    cut = points(raw, len(ids))
    want = one_replica(ids, sorted(set(cut) | {k}), stop, include, rounded(min_tokens, cut, k, len(ids)))
    assert run_spliced(ids, cut, k, stop, include, min_tokens) == want


def test_a_stop_string_of_u_fffd_past_min_tokens_can_end_a_spliced_stream_at_a_held_back_one() -> None:
    # (the README's corner, as found by hypothesis in a CI run: the upstream's
    # text of tokens 2..29 ends before a real U+FFFD (it could be a
    # character's start), which comes with token 30, past min_tokens; the
    # replica had it inside the first 29 tokens, where stop strings do not
    # count, and stopped at the next one)
    ids = [97] * 14 + [239, 191, 189] * 3 + [97] + [239, 191, 189] * 2
    assert one_replica(ids, [1, 29], ["\ufffd"], False, 29) == ("a" * 14 + "\ufffd" * 3 + "a\ufffd", STOP)
    assert run_spliced(ids, [29], 1, ["\ufffd"], False, 3) == ("a" * 14 + "\ufffd" * 3 + "a", STOP)


def test_a_stop_string_of_u_fffd_can_end_a_spliced_stream_at_one_the_replica_held_back_at_the_resume_point() -> None:
    # (the README's corner's other side, as a fresh-clone run's hypothesis
    # found it: the replica's first 10 tokens end inside the third of three
    # U+FFFD characters, so it held the run back; the upstream sends the run
    # again with the rest, where the splice counts it past min_tokens 9 and the
    # first U+FFFD ends the stream; the replica let that one through inside
    # min_tokens and stopped at the second)
    ids = [97, 97] + [239, 191, 189] * 3
    assert one_replica(ids, [9, 10], ["\ufffd", "aa"], False, 9) == ("aa\ufffd", STOP)
    assert run_spliced(ids, [9], 10, ["\ufffd", "aa"], False, 9) == ("aa", STOP)


class MergedTokenizer(ByteTokenizer):
    """Bytes, and tokens of several bytes that hold a whole character and
    the start of the next, or the end of one and a whole one, as byte-level
    BPE vocabularies have them."""

    MERGED = {300: b"f\xc3", 301: b"\xa9 ", 302: "日".encode()[:2], 303: "日".encode()[2:] + b"a", 304: b"\xbd\n"}

    def decode(self, token_ids: list[int]) -> str:
        return b"".join(self.MERGED.get(t, bytes([t]) if t < 256 else b"") for t in token_ids).decode("utf-8",
                                                                                                     "replace")


MERGED = MergedTokenizer()
merged_ids = st.lists(st.sampled_from([97, 98, 10, 0xC3, 0xA9, 0xEF, 0xBF, *MergedTokenizer.MERGED]),
                      min_size=2, max_size=16)


def test_a_token_holding_a_character_and_the_start_of_the_next_is_not_sent_twice() -> None:
    # (the router took the prefix's text up to its last character that is not
    # U+FFFD as the text held back: "f" of a token "f\xc3" then went out from
    # it and again from the upstream, which decodes that token with the next)
    ids = [99, 97, 300, 301, 98]  # "café b"
    assert MERGED.decode(ids) == "café b"
    for stop in (["zz"], ["é b"], ["f"]):
        for include in (False, True):
            for k in range(1, len(ids)):
                want = one_replica(ids, list(range(1, len(ids))), stop, include, 0, MERGED)
                assert run_spliced(ids, list(range(1, len(ids))), k, stop, include, 0, MERGED) == want, (stop, k)


@given(merged_ids, odd_stops, st.integers(1, 1000), boundaries, st.booleans(), st.integers(0, 20))
def test_a_resume_onto_an_upstream_with_tokens_of_several_bytes(ids: list[int], stop: list[str], k: int,
                                                                raw: set[int], include: bool, min_tokens: int) -> None:
    k = 1 + k % (len(ids) - 1)
    cut = points(raw, len(ids))
    want = one_replica(ids, sorted(set(cut) | {k}), stop, include, rounded(min_tokens, cut, k, len(ids)), MERGED)
    assert run_spliced(ids, cut, k, stop, include, min_tokens, MERGED) == want


def test_the_splice_fails_an_upstream_whose_text_does_not_repeat_what_the_client_has() -> None:
    # (an upstream that decodes otherwise: failing before any of its text
    # goes out lets another replica continue the stream exactly)
    splice = Splice(["zz"], "ab\ufffd\ufffd", 4, start=2)  # (the client has all four characters)
    assert splice.feed("\ufffd", False, 1) == ("", False)  # (what the client has, again)
    with pytest.raises(UpstreamFailed):
        splice.feed("x", False, 1)
    splice = Splice(["zz"], "ab\ufffd\ufffd", 4, start=2)
    assert splice.feed("\ufffd\ufffdxyz", False, 4) == ("xy", False)  # ("z" held: it may start "zz")
    splice = Splice(["zz"], "ab\ufffd\ufffd", 4, start=2)
    with pytest.raises(UpstreamFailed):
        splice.feed("xy", False, 1)


def test_a_prefix_whose_text_ends_in_replacement_characters_for_too_long_is_refused() -> None:
    async def detokenize(ids: list[int]) -> str:
        return TOK.decode(ids)

    bad = TOK.encode("ok") + [0x80] * (WALK_LIMIT + 1)
    with pytest.raises(UpstreamFailed, match="U\\+FFFD"):
        asyncio.run(prefix_text(detokenize, bad, 2, 0))
    ok = TOK.encode("ok") + [0x80] * (WALK_LIMIT - 1)
    assert asyncio.run(prefix_text(detokenize, ok, 2, 0))[1] == 2


def test_a_primed_processor_decodes_a_bounded_window_of_a_long_undecodable_run() -> None:
    """The sim's server primes with the prompt's run of U+FFFD as vLLM
    does, but with at most ``_PRIME_MAX`` tokens of it: the whole prompt
    made its start decode it once per token (9 s for 8,000 bytes), and the
    splice refuses a run past ``WALK_LIMIT`` anyway."""
    from replicas.prepare import _PRIME_MAX, _prime_window

    run = [0x80] * 8000  # (bytes that are no UTF-8, one token each)
    assert _prime_window(TOK, run) == run[-_PRIME_MAX:]
    assert _PRIME_MAX > WALK_LIMIT
    assert _prime_window(TOK, TOK.encode("plain text") + run[:3]) == (TOK.encode("plain text") + run[:3])[-8:]


def test_include_stop_str_across_a_resume_onto_an_upstream_at_every_point() -> None:
    text, stop = "caf\u00e9 au lait, s'il vous pla\u00eet", ["au l", "pla\u00ee"]
    ids = TOK.encode(text)
    want = one_replica(ids, [], stop, True, 0)
    assert want == ("caf\u00e9 au l", STOP)
    for size in (1, 2, 3, 5):
        for k in range(1, len(ids)):
            assert run_spliced(ids, list(range(size, len(ids), size)), k, stop, True) == want, (size, k)
