"""Stop strings over a stream of text: what is held back, what is kept, where a match cuts.

Pure and synchronous. One ``StopMatcher`` per request is fed the request's
text in pieces, however the text was chunked and wherever it was resumed, and
says what may go out now and whether a stop string ended the stream. Two
owners feed it: ``replicas.output.OutputProcessor`` (a replica's detokenizer:
the text of its tokens) and ``replicas.splice.Splice`` (a stream continued
on an OpenAI-compatible upstream: the upstream's text after what the
previous replica held back). Writing it once keeps the two cuts identical.

As vLLM has it:

* without ``include`` the last ``len(longest stop) - 1`` characters are held
  back, since they could be the start of a stop string; a match cuts the
  text before the stop string;
* with ``include`` (vLLM's ``include_stop_str_in_output``) nothing is held
  back and a match cuts the text after the stop string; the last
  ``len(longest stop) - 1`` characters already out are kept (``tail``) to
  match a stop string that starts in them;
* a stop string ending in the text of the first ``min_tokens`` completion
  tokens ends nothing: the owner, which knows the tokens, says so per piece
  (``look``) and, when it is known, where that text ends (``min_end``).

A resumed stream starts a matcher with the text the stream already has and
how much of it the client has (``emitted``): the rest is held back again, so
a stop string across the resume point is found as without the resume.
"""

from __future__ import annotations

__all__ = ["StopMatcher", "find_stop"]


class StopMatcher:
    """Stop strings of one request over its text (module docstring).

    Positions called absolute count characters of the request's whole
    completion text (a resumed prefix's included): ``emitted`` characters are
    out before ``pending``."""

    __slots__ = ("stops", "include", "hold", "keep", "tail", "pending", "looked", "emitted", "min_end", "matched")

    def __init__(self, stops: list[str], *, include: bool = False, text: str = "", emitted: int = 0,
                 text_is_output: bool = True) -> None:
        """``text``: text the stream already has, of which the client has
        the first ``emitted`` characters (the rest is pending again).
        ``text_is_output``: False when ``text`` is the prompt's end a
        detokenizer is primed with, not output: no stop string starts in it
        (vLLM looks for stop strings in the output only)."""
        self.stops = [s for s in stops if s]
        longest = max((len(s) for s in self.stops), default=1) - 1
        self.include = include
        self.hold = 0 if include else longest  # characters held back
        self.keep = longest if include else 0  # characters out, kept to match in
        self.tail = text[max(0, emitted - self.keep) : emitted] if self.keep and text_is_output else ""
        self.pending = text[emitted:]  # text not out yet
        self.looked = 0  # characters of pending a stop string can no longer end in
        self.emitted = emitted  # characters out before pending (absolute)
        self.min_end = 0  # a stop string must end past this absolute position (min_tokens' text)
        self.matched: str | None = None  # the stop string that ended the stream

    def feed(self, text: str, final: bool = False, look: bool = True) -> tuple[str, bool]:
        """Take the next ``text``; return (text to emit now, whether a stop
        string matched: the stream ends with that text).

        ``final``: the stream ends after ``text``; nothing is held back.
        ``look``: False while ``text`` is part of the first ``min_tokens``
        tokens' text: no stop string may end in it, now or later.
        """
        pending = self.pending + text if text else self.pending
        stops = self.stops
        if stops and len(pending) > self.looked:
            if look:
                after = self.looked
                quiet = self.min_end - self.emitted
                if quiet > after:
                    after = quiet
                tail = self.tail
                start, end = find_stop(tail + pending, stops, len(tail) + after)
                if end >= 0:
                    self.pending = ""
                    self.matched = (tail + pending)[start:end]
                    return pending[: (end if self.include else start) - len(tail)], True
            self.looked = len(pending)
        if final:
            self.pending = ""
            self.emitted += len(pending)
            return pending, False
        hold = self.hold
        if hold:
            if len(pending) > hold:
                self.pending = pending[-hold:]
                self.looked = min(self.looked, hold)
                self.emitted += len(pending) - hold
                return pending[:-hold], False
            self.pending = pending
            return "", False
        self.pending = ""
        self.looked = 0
        self.emitted += len(pending)
        if self.keep:
            self.tail = (self.tail + pending)[-self.keep :]
        return pending, False


def find_stop(text: str, stops: list[str], after: int = 0) -> tuple[int, int]:
    """(start, end) of the stop string that completes first in ``text`` (as
    it would token by token), the longest on a tie, among those that end
    past the first ``after`` characters; (-1, -1) if none. Completion order,
    not start order, makes the cut independent of how the text was chunked."""
    best_end = best_start = -1
    for s in stops:
        i = text.find(s, max(0, after - len(s) + 1))
        if i < 0:
            continue
        end = i + len(s)
        if best_end < 0 or end < best_end or (end == best_end and i < best_start):
            best_end, best_start = end, i
    return best_start, best_end
