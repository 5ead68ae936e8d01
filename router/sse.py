"""OpenAI streaming chunks as SSE bytes, encoded once per event.

Each stream gets a ``ChunkEncoder`` whose fixed JSON parts are built once; an
event then costs one msgspec string encode and a few byte concatenations.

Every SSE event carries an ``id:`` so a client can resume with
``Last-Event-ID``. The id is ``N-T-C``: the event number, and the completion
tokens and text characters the client has once it has this event. The
number finds the event in the resume buffer; the position lets a router
continue the stream exactly even when the buffer lost the last events with
the router that produced them (see router/resume_http.py). The events of a
stream's end say so with a fourth part: the finish event (the one with a
``finish_reason``) ``N-T-C-1`` (``END_FINISH``), the usage event after it
``N-T-C-2`` (``END_USAGE``). A client whose last events the buffer lost
with their router then is not sent that end again (``N-T-C`` alone does
not say whether its event had the finish). Plain token events never carry
one: their ids are unchanged. ``data: [DONE]`` has an id too, its number
alone (``N``): a client that has it resumes with that id and is answered
204 No Content, which stops an EventSource's reconnects; one that missed it
resumes from the event before and gets it (router/resume_http.py).

A chat stream opens with a role-only chunk, as vLLM's (``"delta":
{"role":"assistant","content":""}``). It is an SSE event without an
``id:`` line, and its bytes go out and into the resume buffer ahead of
event 1, as part of that event's bytes: the events keep their numbers, a
client's ``Last-Event-ID`` stays as it was (an event without an id leaves
it unchanged), a replay from the start has the role chunk and a resume
after event 1 or later has none. Who reads a stored event's id or chunk
takes ``numbered(event)``, the event without it; a WebSocket sends it as a
message of its own (``lead``: router/websocket_stream.py).
"""

from __future__ import annotations

import msgspec

from replicas.protocol import FinishReason

__all__ = ["ChunkEncoder", "Usage", "DONE", "END_FINISH", "END_USAGE", "is_done", "lead", "numbered"]

DONE = b"data: [DONE]\n\n"  # (the end of every stream's ``[DONE]`` event, after its id: ``ChunkEncoder.done``)
# the last part of the id of a resumable stream's finish event, and of its usage event
END_FINISH, END_USAGE = b"-1", b"-2"
_enc = msgspec.json.encode


class Usage(msgspec.Struct):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int


def _finish_json(finish: FinishReason) -> bytes:
    reason = finish.openai
    return b"null" if reason is None else _enc(reason)


class ChunkEncoder:
    """Builds ``chat.completion.chunk`` or ``text_completion`` SSE events."""

    __slots__ = ("chat", "event_id", "_head", "_usage_head", "_role_sent", "_text_pre", "_text_post")

    def __init__(self, chat: bool, response_id: str, model: str, created: int, *,
                 event_id: int = 0, role_sent: bool = False) -> None:
        """(A WebSocket stream's events are these too, each sent as a message
        made from its bytes: router/websocket_stream.py.)"""
        self.chat = chat
        self.event_id = event_id

        obj = b"chat.completion.chunk" if chat else b"text_completion"
        common = (
            b'{"id":' + _enc(response_id) + b',"object":"' + obj + b'","created":'
            + str(created).encode() + b',"model":' + _enc(model)
        )
        self._head = common + b',"choices":[{"index":0,'
        self._usage_head = common + b',"choices":[],"usage":'
        self._role_sent = role_sent
        # a piece's text goes between these (then its finish reason and the end)
        self._text_pre = self._head + (b'"delta":{"content":' if chat else b'"text":')
        self._text_post = (b"}" if chat else b"") + b',"logprobs":null,"finish_reason":'

    def _event(self, payload: bytes, pos: bytes) -> bytes:
        self.event_id += 1
        return b"id: %d%s\ndata: %s\n\n" % (self.event_id, pos, payload)  # (one step, as ``plain``)

    def done(self) -> bytes:
        """The end-of-stream marker, ``data: [DONE]``, with the next number as
        its id (no counts: it adds no text; see the module's docstring)."""
        self.event_id += 1
        return b"id: %d\n%s" % (self.event_id, DONE)

    def delta(self, text: str, finish: FinishReason = FinishReason.NONE, pos: bytes = b"",
              usage: Usage | None = None, stop_reason: str | int | None = None) -> bytes:
        """One chunk; ``pos`` (``b"-T-C"``, ``b"-T-C-1"`` with a finish) is appended to the SSE event id;
        ``usage``: the usage so far, in the chunk (vLLM's continuous usage); a finish chunk
        carries vLLM's ``stop_reason`` (the stop string or token id that ended it, else null)."""
        end = b"}]}" if usage is None else b'}],"usage":' + _enc(usage) + b"}"
        if finish != FinishReason.NONE:
            end = b',"stop_reason":' + _enc(stop_reason) + end
        if self.chat and not text and finish != FinishReason.NONE:
            payload = self._head + b'"delta":{},"logprobs":null,"finish_reason":' + _finish_json(finish) + end
        else:
            payload = self._text_pre + _enc(text) + self._text_post + _finish_json(finish) + end
        if self.chat and not self._role_sent:
            self._role_sent = True
            return self._role(usage) + self._event(payload, pos)
        return self._event(payload, pos)

    def _role(self, usage: Usage | None) -> bytes:
        """vLLM's first chunk of a chat stream (serving_chat.py), which OpenAI
        sends too: the role alone, empty content, no finish; with continuous
        usage, the prompt's and no completion tokens. An app that reads
        ``if delta.role: ... elif delta.content:`` lost the first text when it
        came in the same chunk. It is an SSE event without an id, ahead of
        event 1 in the same bytes (see the module's docstring)."""
        end = b"}]}" if usage is None else b'}],"usage":' + _enc(
            Usage(usage.prompt_tokens, 0, usage.prompt_tokens)) + b"}"
        return (b"data: " + self._head + b'"delta":{"role":"assistant","content":""},"logprobs":null,'
                b'"finish_reason":null' + end + b"\n\n")

    @property
    def plain_ready(self) -> bool:
        """``plain`` can encode the next piece: (chat) the role chunk has gone
        out with the first event."""
        return self._role_sent or not self.chat

    def plain(self, text: str, pos: bytes) -> bytes:
        """``delta(text, FinishReason.NONE, pos)`` in one step, once
        ``plain_ready``: the token lane's event (router/lane.py)."""
        self.event_id += 1
        return b"id: %d%s\ndata: %s%s%snull}]}\n\n" % (self.event_id, pos, self._text_pre, _enc(text),
                                                        self._text_post)

    def usage(self, prompt_tokens: int, completion_tokens: int, pos: bytes = b"") -> bytes:
        u = Usage(prompt_tokens, completion_tokens, prompt_tokens + completion_tokens)
        return self._event(self._usage_head + _enc(u) + b"}", pos)

    def error(self, error_json: bytes, pos: bytes = b"") -> bytes:
        """An error event (OpenAI's error shape); the SDK raises it as APIError."""
        return self._event(error_json, pos)

    def notice(self, error_json: bytes) -> bytes:
        """An error event with no number of its own, for a stream that can
        still be resumed from its last numbered event: it has no ``id:``
        line, so a client keeps the last id it had (a WebSocket message of
        it has no ``event``)."""
        return b"data: " + error_json + b"\n\n"


def is_done(event: bytes) -> bool:
    """Whether an SSE event is ``[DONE]`` (with an id, or stored by a router
    before it had one). (A JSON payload ends in ``}``.)"""
    return event.endswith(DONE)


def lead(event: bytes) -> int:
    """Where ``event``'s numbered SSE event starts: after the id-less role
    chunk a chat stream's first event leads with, else 0. (A JSON payload
    holds no raw newline: a blank line only ever ends an SSE event.)"""
    if event[:6] != b"data: ":
        return 0
    cut = event.find(b"\n\n") + 2
    return cut if 1 < cut < len(event) else 0


def numbered(event: bytes) -> bytes:
    """``event`` without the role chunk it may lead with (``lead``)."""
    cut = lead(event)
    return event[cut:] if cut else event
