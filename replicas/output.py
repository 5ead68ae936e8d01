"""Per-request output processing: incremental detokenization and stop strings.

Pure and synchronous (vLLM keeps its ``OutputProcessor`` the same way): the
replica server feeds new token ids in and gets text out.

Text contract: the concatenation of every emitted ``text`` equals
``tokenizer.decode(all completion tokens)`` (truncated before a matched stop
string), whatever the chunking and whichever replica produced which tokens,
except at the end, as vLLM's detokenizer has it: the bytes of a character
the sequence ended inside (at most ``_INCOMPLETE`` tokens held) are dropped,
not emitted as U+FFFD, and a stop
token's text is not emitted (the server leaves it out). Two things are held
back until they are settled:

* bytes of a multi-byte character that is not complete yet;
* when stop strings are set, the last ``len(longest stop) - 1`` characters,
  since they could be the start of a stop string (vLLM does the same).

With vLLM's ``include_stop_str_in_output`` the text is cut after the stop
string instead, and a stop token's text is emitted too. Nothing is held back
for stop strings then (as in vLLM: whatever matches, the text before it goes
out); the last ``len(longest stop) - 1`` characters already emitted are kept
to match a stop string that starts in them.

Stop strings are looked for only once more than ``min_tokens`` completion
tokens exist, and only where they end in text decoded since the last look
(vLLM's rule: a stop string inside the first ``min_tokens`` tokens' text
ends nothing). The holding, keeping and cutting is ``replicas.stops.StopMatcher``'s
(the router's splice onto an OpenAI upstream uses the same one); this
processor decodes and tells it where the first ``min_tokens`` tokens' text ends.

A request resumed on another replica passes the tokens and the number of
characters the client already has (``prefix_text_len``); the processor rebuilds
the held-back text (and the kept characters) from them, so a stop string or a
character that spans the failover point is handled exactly as without the
failover.
"""

from __future__ import annotations

from replicas.engine import Tokenizer
from replicas.protocol import FinishReason
from replicas.stops import StopMatcher

__all__ = ["OutputProcessor"]

_STUCK = 8  # undecodable tokens before _unstick cuts the window
_INCOMPLETE = 3  # tokens a character can end inside at the most (its first 3 of 4 bytes)
# How many tokens before the undecoded ones to re-decode for context; enough
# for byte-level and sentencepiece tokenizers (vLLM uses 5).
_CONTEXT = 6
_REPLACEMENT = "\ufffd"


class OutputProcessor:
    __slots__ = (
        "_tok",
        "_ids",
        "_prefix_offset",
        "_read_offset",
        "_stops",
        "_include",
        "_min_tokens",
        "_min_known",
        "finished",
        "stop_ids",
        "stop_reason",
    )

    def __init__(
        self,
        tokenizer: Tokenizer,
        stop: list[str],
        prefix_token_ids: list[int] = (),  # type: ignore[assignment]
        prefix_text_len: int | None = 0,
        min_tokens: int = 0,
        *,
        include_stop_str: bool = False,
        prefix_is_output: bool = True,
    ) -> None:
        """``include_stop_str``: vLLM's ``include_stop_str_in_output``.
        ``prefix_is_output``: the prefix's text is output a stop string may
        start in (False when the prefix is the prompt's end, as ``prepare``
        primes it: vLLM looks for stop strings in the output only).
        ``prefix_text_len`` None: the prefix's text up to its last complete
        character is out (a primed prefix)."""
        self._tok = tokenizer
        self._ids: list[int] = list(prefix_token_ids)
        self._include = include_stop_str
        self._min_tokens = min_tokens  # (completion tokens, a resumed prefix's included)
        self._min_known = not min_tokens  # the matcher's min_end is set (once: _min_chars)
        self.finished = False
        # ids of stop tokens whose id is the stop_reason (set by prepare), and that reason once finished
        self.stop_ids: frozenset[int] = frozenset()
        self.stop_reason: str | int | None = None
        text = ""
        if self._ids:
            # Find the longest prefix of tokens whose text is complete; the
            # tokens after it stay undecoded until a later token completes them.
            # (Never below the text the client has: a U+FFFD already emitted,
            # from bytes that are no UTF-8, is text like any other.)
            read = len(self._ids)
            text = tokenizer.decode(self._ids)
            while read > 0 and text.endswith(_REPLACEMENT):
                shorter = tokenizer.decode(self._ids[: read - 1])
                if prefix_text_len is not None and len(shorter) < prefix_text_len:
                    break
                read -= 1
                text = shorter
            if prefix_text_len is None:
                prefix_text_len = len(text)
            elif prefix_text_len > len(text):
                raise ValueError(
                    f"prefix_text_len {prefix_text_len} exceeds the prefix text ({len(text)} chars)"
                )
            # (the matcher looks at all of the held-back text: it finds only
            # what the first replica could not have seen yet, as it would
            # have stopped; min_tokens' text is left out: _min_chars)
            self._read_offset = read
            self._prefix_offset = max(0, read - _CONTEXT)
        else:
            self._read_offset = 0
            self._prefix_offset = 0
        self._stops = StopMatcher(stop, include=include_stop_str, text=text, emitted=prefix_text_len or 0,
                                  text_is_output=prefix_is_output)

    def process(self, new_ids: list[int], finish: FinishReason, stop_id: int | None = None) -> tuple[str, FinishReason]:
        """Take new tokens; return (text to emit now, finish reason).

        The finish reason is ``STOP`` when a stop string matched (the text is
        cut before it, or after it with ``include_stop_str``), else ``finish``
        as given. After a finish the processor emits everything it still
        holds. ``finish`` ``STOP`` from the engine means its last new token is
        a stop token (EOS, or one of ``stop_token_ids``): it counts, but its
        text is not output (unless ``include_stop_str``), as vLLM's
        detokenizer has it. ``stop_id``: that token's id where the engine
        says it is the ``stop_reason`` (``OutputSink``), else one of
        ``stop_ids`` is.
        """
        if self.finished:
            return "", finish
        if finish == FinishReason.STOP and new_ids:
            if stop_id is not None or new_ids[-1] in self.stop_ids:
                self.stop_reason = new_ids[-1] if stop_id is None else stop_id
            if not self._include:
                new_ids = new_ids[:-1]
        ids = self._ids
        new = ""  # text decoded now
        if new_ids:
            ids.extend(new_ids)
            tok = self._tok
            prefix_text = tok.decode(ids[self._prefix_offset : self._read_offset])
            full = tok.decode(ids[self._prefix_offset :])
            if len(full) > len(prefix_text) and not full.endswith(_REPLACEMENT):
                new = full[len(prefix_text) :]
                self._prefix_offset = max(0, len(ids) - _CONTEXT)
                self._read_offset = len(ids)
            elif len(ids) - self._read_offset > _STUCK:
                new = self._unstick(ids, prefix_text, full)
        if finish != FinishReason.NONE and self._read_offset < len(ids):
            # A sequence that ends inside a character: the bytes of that
            # character are dropped, as vLLM drops them, not emitted as
            # U+FFFD. Bytes that are no UTF-8 at all are text as decode gives
            # it, as _unstick would have emitted them.
            tok = self._tok
            prefix_text = tok.decode(ids[self._prefix_offset : self._read_offset])
            end = len(ids)
            for cut in range(len(ids) - 1, max(self._read_offset, len(ids) - _INCOMPLETE) - 1, -1):
                if tok.decode(ids[self._prefix_offset : cut + 1]).endswith(_REPLACEMENT):
                    end = cut  # (without that token)
                else:
                    break
            text = tok.decode(ids[self._prefix_offset : end])
            if text.endswith(_REPLACEMENT):  # (more than one character's end: bytes that are no UTF-8)
                text = tok.decode(ids[self._prefix_offset :])
            new += text[len(prefix_text) :]
            self._read_offset = len(ids)
        stops = self._stops
        if not stops.stops and not stops.pending:  # (no stop strings: the text goes out as it is)
            if finish != FinishReason.NONE:
                self.finished = True
            return new, finish
        # Stop strings are looked for once more than min_tokens completion
        # tokens exist, and never where they end in those tokens' text.
        look = len(ids) > self._min_tokens
        if look and not self._min_known:
            self._min_known = True
            stops.min_end = self._min_chars()
        out, stopped = stops.feed(new, finish != FinishReason.NONE, look)
        if stopped:  # (a stop string the last token's text completed wins over that token, as in vLLM)
            self.finished = True
            self.stop_reason = stops.matched
            return out, FinishReason.STOP
        if finish != FinishReason.NONE:
            self.finished = True
        return out, finish

    def _min_chars(self) -> int:
        """Characters of the text of the first ``min_tokens`` completion
        tokens (decoded once): a stop string ending in them ends nothing
        (vLLM looks for stop strings only past min_tokens)."""
        # (a character they end inside ends past them; replicas.splice.prefix_text counts alike)
        return len(self._tok.decode(self._ids[: self._min_tokens]).rstrip(_REPLACEMENT))

    def _unstick(self, ids: list[int], prefix_text: str, full: str) -> str:
        """A run of bytes that is not UTF-8 keeps the text ending in U+FFFD,
        so the window would grow with every token (and each step decode all
        of it: quadratic in a long garbage run). A character is at most 4
        bytes, so the text of all but the last 4 tokens can no longer change:
        emit it, at a cut that does not split a character (its text is where
        the whole window's text starts). Returns the text it emits."""
        tok = self._tok
        for cut in range(len(ids) - 4, max(self._read_offset, len(ids) - 8), -1):
            left = tok.decode(ids[self._prefix_offset : cut])
            if len(left) > len(prefix_text) and full.startswith(left):
                self._read_offset = cut
                self._prefix_offset = max(0, cut - _CONTEXT)
                return left[len(prefix_text) :]
        return ""
