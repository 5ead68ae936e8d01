"""What the text tests of the replica's output share (test_output.py,
test_splice.py, test_stops.py): the byte-level tokenizer, strategies for
text and stop strings over a small alphabet, chunk boundaries, and feeding
token chunks to an ``OutputProcessor``."""

from __future__ import annotations

from hypothesis import strategies as st

from replicas.output import OutputProcessor
from replicas.protocol import FinishReason
from replicas.sim import ByteTokenizer

TOK = ByteTokenizer()
NONE, STOP, LENGTH = FinishReason.NONE, FinishReason.STOP, FinishReason.LENGTH

# A small alphabet of 1- to 4-byte characters makes stop strings hit often.
SMALL = st.sampled_from(list("ab é日😀\n"))
small_text = st.text(SMALL, min_size=1, max_size=24)
stops = st.lists(st.text(SMALL, min_size=1, max_size=4), min_size=0, max_size=4)

# Chunk boundaries, drawn independently of the text and folded into it by ``points``.
boundaries = st.sets(st.integers(1, 1000), max_size=12)


def points(raw: set[int], n: int) -> list[int]:
    """Sorted chunk boundaries inside ``range(1, n)``."""
    return sorted({p % n for p in raw} - {0}) if n > 1 else []


def split(ids: list[int], cut: list[int]) -> list[list[int]]:
    bounds = [0, *cut, len(ids)]
    return [ids[a:b] for a, b in zip(bounds, bounds[1:])]


def feed(proc: OutputProcessor, parts: list[list[int]], final: FinishReason,
         separate_finish: bool = False) -> tuple[str, FinishReason]:
    """Feed ``parts``; the last carries ``final`` (or, with ``separate_finish``,
    an extra empty call does, as an engine may send finish without tokens)."""
    out: list[str] = []
    finish = NONE
    for i, part in enumerate(parts):
        last = i == len(parts) - 1 and not separate_finish
        text, finish = proc.process(part, final if last else NONE)
        out.append(text)
        if finish != NONE:
            return "".join(out), finish
    if separate_finish:
        text, finish = proc.process([], final)
        out.append(text)
    return "".join(out), finish
