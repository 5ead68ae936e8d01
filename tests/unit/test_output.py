"""Properties of ``replicas.output.OutputProcessor`` with the sim's byte tokenizer.

The text contract: whatever the chunking of tokens into ``process`` calls, and
wherever a stream is resumed on another replica (a new processor given the
delivered tokens and the number of characters the client has), the client
receives ``decode(all tokens)``, cut exactly before the first stop string.
"""

from __future__ import annotations

import pytest
from hypothesis import assume, example, given
from hypothesis import strategies as st

from replicas.output import _CONTEXT, OutputProcessor
from replicas.protocol import FinishReason, SamplingParams
from tests.unit.chunking import (
    LENGTH,
    NONE,
    STOP,
    TOK,
    boundaries,
    feed,
    points,
    small_text,
    split,
    stops,
)

any_text = st.text(min_size=1, max_size=40)  # all of Unicode except surrogates


def run_with_resume(ids: list[int], cut: list[int], k: int, stop: list[str]) -> tuple[str, FinishReason]:
    """Tokens ``ids[:k]`` on one processor, the rest on a resumed one (a
    failover after ``k`` tokens), chunked at ``cut``."""
    cut = sorted(set(cut) | {k})
    parts = split(ids, cut)
    n_first = cut.index(k) + 1
    e1, finish = feed(OutputProcessor(TOK, stop), parts[:n_first], NONE)
    if finish != NONE:
        return e1, finish
    resumed = OutputProcessor(TOK, stop, prefix_token_ids=ids[:k], prefix_text_len=len(e1))
    e2, finish = feed(resumed, parts[n_first:], LENGTH)
    return e1 + e2, finish


def final_text(ids: list[int]) -> str:
    """``decode(ids)``, less the bytes of a character the sequence ends
    inside (at most 3 tokens), which vLLM's detokenizer drops; a longer run
    of bytes that are no UTF-8 is text (U+FFFD) like any other."""
    for r in range(min(3, len(ids)) + 1):
        text = TOK.decode(ids[: len(ids) - r])
        if not text.endswith("\ufffd"):
            return text
    return TOK.decode(ids)


def expected_with_stops(text: str, stop: list[str]) -> tuple[str, FinishReason]:
    hits = [text.find(s) for s in stop if s in text]
    return (text[: min(hits)], STOP) if hits else (text, LENGTH)


def nested(stop: list[str]) -> bool:
    """True if one stop string occurs inside another other than as its prefix
    (then which one "comes first" depends on when the text is checked)."""
    return any(a != b and a in b[1:] for a in stop for b in stop)


# -- plain detokenization --------------------------------------------------------------


@given(any_text, boundaries, st.booleans())
def test_concatenated_text_equals_decode_of_all_tokens(text: str, raw: set[int], separate_finish: bool) -> None:
    ids = TOK.encode(text)
    parts = split(ids, points(raw, len(ids)))
    out, finish = feed(OutputProcessor(TOK, []), parts, LENGTH, separate_finish)
    # (a text that ends in a real U+FFFD loses it, up to the 3 tokens of an
    # unfinished character, as vLLM's detokenizer drops those: ``final_text``)
    assert out == final_text(ids)
    if not text.endswith("\ufffd"):
        assert out == text
    assert finish == LENGTH


@given(any_text, boundaries)
def test_no_partial_character_is_ever_emitted(text: str, raw: set[int]) -> None:
    ids = TOK.encode(text)
    proc = OutputProcessor(TOK, [])
    for part in split(ids, points(raw, len(ids))):
        piece, _ = proc.process(part, NONE)
        assert "\ufffd" not in piece


@given(st.binary(min_size=1, max_size=40), boundaries)
def test_arbitrary_bytes_decode_the_same_in_any_chunking(data: bytes, raw: set[int]) -> None:
    """Invalid UTF-8 too (a model can emit any byte): replacement characters
    come out exactly where a one-shot decode puts them (but at the end, see
    ``final_text``)."""
    ids = list(data)
    parts = split(ids, points(raw, len(ids)))
    out, _ = feed(OutputProcessor(TOK, []), parts, LENGTH)
    assert out == final_text(ids)


_BAD_BYTES = st.binary(min_size=1, max_size=400).map(lambda b: bytes(0x80 | (x & 0x7F) if x % 3 else x for x in b))


@given(_BAD_BYTES, boundaries)
def test_long_runs_of_bad_bytes_decode_the_same_and_stay_bounded(data: bytes, raw: set[int]) -> None:
    """A model emitting long runs of bytes that are not UTF-8 (mostly
    continuation and lead bytes): the text is still exactly a one-shot decode,
    and the processor never holds more than a few tokens undecoded (it used to
    hold the whole run and decode all of it on every step: quadratic)."""
    ids = list(data)
    tok = _Windows()
    proc = OutputProcessor(tok, [])
    out = []
    for part in split(ids, points(raw, len(ids))):
        tok.widest = 0
        piece, _ = proc.process(part, NONE)
        out.append(piece)
        # (what it decodes is the context kept, what it held, and ``part``)
        assert tok.widest <= _CONTEXT + 8 + len(part)
    piece, _ = proc.process([], LENGTH)
    assert "".join(out) + piece == final_text(ids)


class _Windows(type(TOK)):
    """The sim's tokenizer, noting the most tokens one ``decode`` was given:
    the window the processor re-decodes, whose length is the tokens it holds
    undecided plus its few tokens of context."""

    widest = 0

    def decode(self, token_ids: list[int]) -> str:
        self.widest = max(self.widest, len(token_ids))
        return super().decode(token_ids)


def test_a_resumed_processor_continues_the_prefix_tokens_it_was_given() -> None:
    """The prefix's tokens are the start of its sequence: a character that the
    failover split is finished by the next replica's first token, with
    nothing of the prefix sent again."""
    ids = TOK.encode("ab日")
    proc = OutputProcessor(TOK, [], prefix_token_ids=ids[:-1], prefix_text_len=2)  # (the client has "ab")
    assert proc.process(ids[-1:], NONE) == ("日", NONE)
    assert proc.process(TOK.encode("c"), LENGTH) == ("c", LENGTH)


def test_a_sequence_that_ends_inside_a_character_drops_its_bytes_as_vllm_does() -> None:
    # (it ended with a U+FFFD that vLLM's server never sends)
    ids = TOK.encode("ab日")[:-1]  # ends inside 日
    proc = OutputProcessor(TOK, [])
    first, _ = proc.process(ids, NONE)
    rest, finish = proc.process([], LENGTH)
    assert first + rest == "ab" and TOK.decode(ids) == "ab\ufffd"
    assert finish == LENGTH


def test_special_tokens_are_not_text() -> None:
    from replicas.sim import BOS, EOS

    out, _ = feed(OutputProcessor(TOK, []), [[BOS], TOK.encode("hi"), [EOS]], STOP)
    assert out == "hi"


# -- resume on another replica ------------------------------------------------------------


@example(text="\ufffd", k=1, raw=set())  # (a real U+FFFD at the end: dropped both ways)
@given(any_text, st.integers(1, 1000), boundaries)
def test_resume_at_any_point_gives_identical_text(text: str, k: int, raw: set[int]) -> None:
    ids = TOK.encode(text)
    assume(len(ids) >= 2)
    k = 1 + k % (len(ids) - 1)
    out, finish = run_with_resume(ids, points(raw, len(ids)), k, [])
    # (what one processor gives: a text that ends in a real U+FFFD loses it, as
    # vLLM's detokenizer drops an unfinished character's bytes: ``final_text``)
    assert out == final_text(ids)
    assert finish == LENGTH


@example(text="日本", k=1)  # resume inside the first character
@example(text="a😀b", k=3)
@given(small_text, st.integers(1, 200))
def test_resume_inside_a_character_token_by_token(text: str, k: int) -> None:
    ids = TOK.encode(text)
    assume(len(ids) >= 2)
    k = 1 + k % (len(ids) - 1)
    out, _ = run_with_resume(ids, list(range(1, len(ids))), k, [])
    assert out == text


def test_resume_rejects_a_prefix_text_len_beyond_the_prefix() -> None:
    ids = TOK.encode("abc")
    with pytest.raises(ValueError):
        OutputProcessor(TOK, [], prefix_token_ids=ids, prefix_text_len=4)


@given(small_text, stops, st.integers(1, 1000), boundaries)
def test_resume_never_changes_the_output(text: str, stop: list[str], k: int, raw: set[int]) -> None:
    """For the same chunking, splitting the stream across two processors
    (a failover) gives exactly the output of one processor, stop strings included."""
    ids = TOK.encode(text)
    assume(len(ids) >= 2)
    k = 1 + k % (len(ids) - 1)
    cut = sorted(set(points(raw, len(ids))) | {k})
    whole = feed(OutputProcessor(TOK, stop), split(ids, cut), LENGTH)
    assert run_with_resume(ids, cut, k, stop) == whole


# -- stop strings ----------------------------------------------------------------------------


@example(text="ab日😀", stop=["日😀"], raw={3, 4, 7})  # stop string split inside characters
@example(text="aab", stop=["ab", "aa"], raw=set())  # overlapping stops: the earlier start wins
@given(small_text, stops, boundaries)
def test_stop_strings_cut_exactly_before_the_first_occurrence(text: str, stop: list[str], raw: set[int]) -> None:
    assume(not nested(stop))
    ids = TOK.encode(text)
    out, finish = feed(OutputProcessor(TOK, stop), split(ids, points(raw, len(ids))), LENGTH)
    assert (out, finish) == expected_with_stops(text, stop)


@given(small_text, stops, st.integers(1, 1000), boundaries)
def test_stop_strings_with_a_resume_anywhere(text: str, stop: list[str], k: int, raw: set[int]) -> None:
    assume(not nested(stop))
    ids = TOK.encode(text)
    assume(len(ids) >= 2)
    k = 1 + k % (len(ids) - 1)
    out, finish = run_with_resume(ids, points(raw, len(ids)), k, stop)
    assert (out, finish) == expected_with_stops(text, stop)


@given(small_text, stops, boundaries)
def test_emitted_text_never_contains_a_stop_string(text: str, stop: list[str], raw: set[int]) -> None:
    ids = TOK.encode(text)
    proc = OutputProcessor(TOK, stop)
    emitted = ""
    for part in split(ids, points(raw, len(ids))):
        piece, finish = proc.process(part, NONE)
        emitted += piece
        assert not any(s in emitted for s in stop)
        if finish != NONE:
            assert finish == STOP
            assert proc.process(TOK.encode("more"), NONE) == ("", NONE), "no text after a stop"
            break


def test_nested_stop_strings_do_not_depend_on_chunking() -> None:
    stop = ["abcd", "c"]
    ids = TOK.encode("abcd")
    one_chunk = feed(OutputProcessor(TOK, stop), [ids], LENGTH)
    per_token = feed(OutputProcessor(TOK, stop), [[t] for t in ids], LENGTH)
    # the stop string that completes first wins ("c" at 3 before "abcd" at 4), as
    # it would token by token, so the cut does not depend on the chunking
    assert one_chunk == ("ab", STOP)
    assert per_token == one_chunk


@given(st.integers(0, 6), boundaries)
def test_no_stop_string_ends_in_the_text_of_the_first_min_tokens(min_tokens: int, raw: set[int]) -> None:
    # (vLLM looks for stop strings only once more than min_tokens tokens
    # exist; the processor looked from the first token on, and a stop string
    # ended a stream min_tokens was to keep going)
    ids = TOK.encode("aaaaaaaaaa")
    out, finish = feed(OutputProcessor(TOK, ["a"], min_tokens=min_tokens), split(ids, points(raw, len(ids))), LENGTH)
    assert (out, finish) == ("a" * min_tokens, STOP)
    ids = TOK.encode("xxabxx")
    out, finish = feed(OutputProcessor(TOK, ["ab"], min_tokens=3), split(ids, points(raw, len(ids))), LENGTH)
    assert (out, finish) == ("xx", STOP)  # ("b", the 4th token, ends it: past min_tokens)
    out, finish = feed(OutputProcessor(TOK, ["ab"], min_tokens=4), split(ids, points(raw, len(ids))), LENGTH)
    assert (out, finish) == ("xxabxx", LENGTH)


def test_a_resume_inside_a_run_of_replacement_characters_the_client_has_continues() -> None:
    # (real U+FFFD characters in the text, as models copy them from mojibake:
    # the resumed processor cut every trailing token whose text ends in one,
    # below the text the client had, and raised: the stream was lost)
    ids = TOK.encode("caf\ufffd\ufffd\ufffd\ufffd au lait")
    whole = feed(OutputProcessor(TOK, []), [[i] for i in ids], LENGTH)
    for k in range(1, len(ids)):
        assert run_with_resume(ids, list(range(1, len(ids))), k, []) == whole, k


def test_the_engines_stop_token_counts_but_its_text_is_not_output() -> None:
    # (in the processor, so both front ends of an engine have it: the OpenAI
    # one still output it after the replica protocol's stopped)
    ids = TOK.encode("hello,")
    proc = OutputProcessor(TOK, [])
    assert proc.process(ids[:3], NONE) == ("hel", NONE)
    assert proc.process(ids[3:], STOP) == ("lo", STOP)  # (",": the stop token)


# -- include_stop_str_in_output (vLLM) ---------------------------------------------------------


def expected_including(text: str, stop: list[str]) -> tuple[str, FinishReason]:
    """vLLM's ``include_stop_str_in_output``: cut after the stop string that
    completes first (which one does not matter for the cut: every choice
    that ends there gives the same text, so nested stops need no care)."""
    ends = [text.find(s) + len(s) for s in stop if s and s in text]
    return (text[: min(ends)], STOP) if ends else (text, LENGTH)


def including(stop: list[str], **kw) -> OutputProcessor:
    return OutputProcessor(TOK, stop, include_stop_str=True, **kw)


def run_with_resume_including(ids: list[int], cut: list[int], k: int, stop: list[str]) -> tuple[str, FinishReason]:
    """``run_with_resume`` with include_stop_str on both processors."""
    cut = sorted(set(cut) | {k})
    parts = split(ids, cut)
    n_first = cut.index(k) + 1
    e1, finish = feed(including(stop), parts[:n_first], NONE)
    if finish != NONE:
        return e1, finish
    e2, finish = feed(including(stop, prefix_token_ids=ids[:k], prefix_text_len=len(e1)), parts[n_first:], LENGTH)
    return e1 + e2, finish


@example(text="ab日😀", stop=["日😀"], raw={3, 4, 7})  # stop string split inside characters
@example(text="abcd", stop=["abcd", "c"], raw=set())  # nested: "c" completes first
@given(small_text, stops, boundaries)
def test_include_stop_str_cuts_after_the_stop_string_that_completes_first(text: str, stop: list[str],
                                                                           raw: set[int]) -> None:
    ids = TOK.encode(text)
    out, finish = feed(including(stop), split(ids, points(raw, len(ids))), LENGTH)
    assert (out, finish) == expected_including(text, stop)


@given(small_text, stops, st.integers(1, 1000), boundaries)
def test_include_stop_str_with_a_resume_anywhere(text: str, stop: list[str], k: int, raw: set[int]) -> None:
    ids = TOK.encode(text)
    assume(len(ids) >= 2)
    k = 1 + k % (len(ids) - 1)
    assert run_with_resume_including(ids, points(raw, len(ids)), k, stop) == expected_including(text, stop)


@pytest.mark.parametrize("text, stop", [
    ("caf\u00e9 au lait, s'il vous pla\u00eet", ["au l", "pla\u00ee"]),  # a stop string that starts in a 2-byte character
    ("\u6771\u4eac\u306e\u7a7a\U0001f600\u306f\u9752\u3044", ["\u306e\u7a7a\U0001f600\u306f"]),  # 3- and 4-byte characters
    ("aaab", ["aab", "b"]),  # nested: both complete at the same point
    ("no stop string here", ["zz"]),
])
def test_include_stop_str_in_pieces_of_every_size_and_across_a_resume_at_every_point(text: str,
                                                                                     stop: list[str]) -> None:
    ids = TOK.encode(text)
    want = expected_including(text, stop)
    for size in range(1, len(ids) + 1):
        cut = list(range(size, len(ids), size))
        assert feed(including(stop), split(ids, cut), LENGTH) == want, size
        for k in range(1, len(ids)):
            assert run_with_resume_including(ids, cut, k, stop) == want, (size, k)


def test_include_stop_str_holds_nothing_back():
    # (vLLM holds back nothing for stop strings with include_stop_str_in_output:
    # whatever matches, the text before it goes out)
    ids = TOK.encode("xxab")
    held, including_ = OutputProcessor(TOK, ["abc"]), including(["abc"])
    assert "".join(held.process([t], NONE)[0] for t in ids) == "xx"
    assert "".join(including_.process([t], NONE)[0] for t in ids) == "xxab"
    assert including_.process(TOK.encode("cd"), NONE) == ("c", STOP)


def test_include_stop_str_outputs_the_stop_tokens_text_as_vllm():
    # (vLLM's detokenizer skips a stop token only without include_stop_str_in_output)
    from replicas.sim import EOS

    ids = TOK.encode("hello,")
    proc = including([])
    assert proc.process(ids[:3], NONE) == ("hel", NONE)
    assert proc.process(ids[3:], STOP) == ("lo,", STOP)  # (",": the stop token)
    assert feed(including([]), [TOK.encode("hi"), [EOS]], STOP) == ("hi", STOP)  # (EOS has no text)


@given(st.integers(0, 6), boundaries)
def test_include_stop_str_still_skips_stop_strings_in_the_first_min_tokens(min_tokens: int, raw: set[int]) -> None:
    ids = TOK.encode("aaaaaaaaaa")
    out = feed(including(["a"], min_tokens=min_tokens), split(ids, points(raw, len(ids))), LENGTH)
    assert out == ("a" * (min_tokens + 1), STOP)
    ids = TOK.encode("xxabxx")
    out = feed(including(["ab"], min_tokens=3), split(ids, points(raw, len(ids))), LENGTH)
    assert out == ("xxab", STOP)  # ("b", the 4th token, ends it: past min_tokens)
    assert feed(including(["ab"], min_tokens=4), split(ids, points(raw, len(ids))), LENGTH) == ("xxabxx", LENGTH)


def test_a_stop_string_is_never_matched_in_the_prompt_a_processor_is_primed_with():
    # (vLLM looks for stop strings in the output only; the processor the
    # OpenAI front end primes with the prompt's last tokens keeps them as
    # decoding context, not as output a stop string may start in)
    from types import SimpleNamespace

    from replicas.prepare import prepare

    engine = SimpleNamespace(max_model_len=100, tokenizer=TOK, default_max_tokens=None)
    for include in (False, True):
        params = SamplingParams(max_tokens=10, stop=["ab"], include_stop_str_in_output=include)
        _, _, proc = prepare(engine, TOK.encode("xa"), params, prime=True)  # type: ignore[arg-type]
        assert feed(proc, [TOK.encode("bab"), TOK.encode("c")], LENGTH) == (("bab", STOP) if include else ("b", STOP))


def test_stop_reason_is_the_stop_string_or_stop_token_id_as_vllm_has_it():
    # (vLLM's stop_reason: the stop string that matched, the id of a stop
    # token of stop_token_ids, None for EOS, which vLLM checks first, and for length)
    from types import SimpleNamespace

    from replicas.prepare import prepare
    from replicas.sim import EOS

    engine = SimpleNamespace(max_model_len=100, tokenizer=TOK, default_max_tokens=None)

    def reason(parts: list[list[int]], finish: FinishReason, **kw) -> str | int | None:
        _, _, proc = prepare(engine, TOK.encode("x"), SamplingParams(max_tokens=10, **kw))  # type: ignore[arg-type]
        feed(proc, parts, finish)
        return proc.stop_reason

    assert reason([TOK.encode("abcd")], STOP, stop=["bc", "zz"]) == "bc"
    assert reason([TOK.encode("ab")], STOP, stop_token_ids=[ord("b")]) == ord("b")
    # a stop string the stop token's text would complete: vLLM leaves that text out, no match
    assert reason([TOK.encode("ab")], STOP, stop=["ab"], stop_token_ids=[ord("b")]) == ord("b")
    assert reason([TOK.encode("a") + [EOS]], STOP, stop_token_ids=[EOS]) is None
    assert reason([TOK.encode("a") + [EOS]], STOP, stop_token_ids=[EOS], ignore_eos=True) == EOS
    assert reason([TOK.encode("abc")], LENGTH, stop=["zz"]) is None
