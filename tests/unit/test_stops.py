"""``replicas.stops.StopMatcher`` on text alone (the token side is test_output.py's and test_splice.py's)."""

from __future__ import annotations

from hypothesis import given
from hypothesis import strategies as st

from replicas.stops import StopMatcher
from tests.unit.chunking import boundaries, points, small_text, stops

def run(m: StopMatcher, text: str, cut: list[int], final: bool = True) -> tuple[str, bool]:
    """Feed ``text`` in pieces cut at ``cut``; ``final``: the last piece ends the stream."""
    bounds = [0, *cut, len(text)]
    out = []
    for a, b in zip(bounds, bounds[1:]):
        piece, stopped = m.feed(text[a:b], final and b == len(text))
        out.append(piece)
        if stopped:
            return "".join(out), True
    return "".join(out), False


@given(small_text, stops, boundaries, st.booleans())
def test_the_matcher_cuts_text_alike_in_every_chunking(text: str, stop: list[str], raw: set[int],
                                                       include: bool) -> None:
    whole = StopMatcher(stop, include=include).feed(text, True)
    assert run(StopMatcher(stop, include=include), text, points(raw, len(text))) == whole


@given(small_text, stops, boundaries, st.booleans(), st.integers(0, 30))
def test_a_matcher_resumed_anywhere_cuts_as_one(text: str, stop: list[str], raw: set[int], include: bool,
                                                k: int) -> None:
    """A second matcher given the text so far and what the client has (a
    failover) continues exactly as the first would have."""
    cut = points(raw, len(text))
    k = k % (len(text) + 1)
    one = StopMatcher(stop, include=include)
    first, stopped = run(one, text[:k], [c for c in cut if c < k], final=False) if k else ("", False)
    if stopped:
        return
    resumed = StopMatcher(stop, include=include, text=text[:k], emitted=len(first))
    rest = text[k:]
    second = run(resumed, rest, [c - k for c in cut if c > k]) if rest else resumed.feed("", True)
    assert (first + second[0], second[1]) == StopMatcher(stop, include=include).feed(text, True)


def test_no_stop_string_ends_before_min_end_or_in_text_fed_without_looking() -> None:
    m = StopMatcher(["ab"])
    assert m.feed("xab", look=False) == ("xa", False)  # ("b" held: it may start "ab")
    assert m.feed("ab") == ("b", True)  # (the "ab" fed without looking is passed; this one is not)
    m = StopMatcher(["ab"], include=True)
    m.min_end = 3
    assert m.feed("xab") == ("xab", False)
    assert m.feed("xab") == ("xab", True)
