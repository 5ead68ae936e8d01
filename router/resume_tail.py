"""The end of a stream's buffer: its last event, and the end of a stream
whose router died with that end half stored.

A stream ends with its finish event (the last token's, or one with no text),
the usage event when the client asked for it, and ``[DONE]``, which also
marks the buffer finished. They reach the state store in separate writes
(with Redis, a flush every few milliseconds, then the finish in the
request's settlement), so a router that dies between them leaves a buffer
that is not finished while its generation is. Continued like any other, that
stream generated past its end (after an end-of-sequence) or, at
``max_tokens``, asked a replica for no tokens and ended with ``stream_lost``.

``finish_tail`` reads the buffer's last events, and where the output has
ended, sends what of the end is not stored (after what the client already
has), stores it and finishes the buffer, with no replica and no admission:
nothing is generated. Its output has also ended where the client's own id
says it has the finish (``N-T-C-1`` or ``-2``) with every token and
character the buffer holds, and the buffer's event N is a placeholder: a
resume that padded for that client's finish regenerated the rest (up to an
end-of-sequence or a stop string as well as ``max_tokens``) and was cut off
before its usage event or ``[DONE]`` were stored (``client_on_placeholder``).
Except at ``max_tokens`` with stop strings (and
without ``include_stop_str_in_output``): the finish the buffer lacks may
have carried the last characters its replica held back (they could have
started a stop string), which only a replica can rebuild from the tokens.
That stream is continued: a replica asked for no more tokens sends that
text, then ``length`` (``replicas.prepare.finish_prefix``), as it does for
a failover after the last token.
"""

from __future__ import annotations

import logging

import msgspec

from replicas.protocol import FinishReason
from router.resume import ResumeMeta, decode_meta
from router.sse import END_FINISH, END_USAGE, ChunkEncoder, Usage, is_done, numbered
from router.state import StoreUnavailable, StreamSnapshot

__all__ = ["finish_tail", "tail_after", "client_on_placeholder", "last_event", "error_code", "done_at"]

log = logging.getLogger("fairstream.resume")

FINISH, USAGE = "finish", "usage"  # the parts of a stream's end that go before [DONE]
# each part's ``Position.end`` (router/resume_http.py): the last part of its event's id
_END = {FINISH: 1, USAGE: 2}


class _Choice(msgspec.Struct):
    finish_reason: str | None = None


class _Chunk(msgspec.Struct):
    choices: list[_Choice] = []
    usage: dict | None = None


_decode = msgspec.json.Decoder(_Chunk).decode
# a ``stream_read`` after past any buffer's events (the stores clamp it): its count, no event
_PAST_ANY_EVENT = 1 << 52


def _data(event: bytes) -> bytes:
    """An SSE event's data (a chat stream's event 1: its own, not its role chunk's)."""
    return b"".join(line[6:] for line in numbered(event).split(b"\n") if line.startswith(b"data: "))


def _chunk(event: bytes) -> _Chunk | None:
    """The chunk an SSE event carries; None for a placeholder (an event lost
    with a router) or anything else."""
    data = _data(event)
    try:
        return _decode(data) if data else None
    except msgspec.DecodeError:
        return None


async def last_event(svc, sid: str, snap: StreamSnapshot) -> bytes | None:
    """A finished buffer's last event: ``[DONE]``, or the error that ended it
    (``EventStream._unbuffer``'s, when the output lost its token ids); None
    if it cannot be read now."""
    try:
        last = await svc.store.stream_read(sid, snap.total_events - 1, False)
    except StoreUnavailable:
        return None
    return last.events[-1] if last is not None and last.events else None


async def done_at(svc, sid: str, tenant: str, pos) -> bool:
    """Whether ``pos`` is the id of the ``[DONE]`` that ended ``tenant``'s
    stream ``sid``: its client has all of it (an EventSource reconnecting
    after the end, which it does not know ``[DONE]`` is), and is answered
    204 No Content, uncharged. Any doubt (a read that fails) is False: the
    resume is served, and charged, as any other."""
    if pos.tokens is not None or pos.event < 1:  # ([DONE]'s id is its number alone)
        return False
    try:
        # (the count first, no event, then the one event: this runs before the
        # resume is charged, and reading from the id on read all of a long
        # stream's events for an early id, again at every try)
        head = await svc.store.stream_read(sid, _PAST_ANY_EVENT, False)
        if (head is None or not head.finished or head.total_events != pos.event
                or decode_meta(head.meta).tenant != tenant):
            return False
    except StoreUnavailable:
        return False
    last = await last_event(svc, sid, head)
    return last is not None and is_done(last)


def error_code(event: bytes) -> str:
    """The ``code`` of an SSE error event's OpenAI error."""
    try:
        return str(msgspec.json.decode(_data(event))["error"]["code"])
    except (msgspec.DecodeError, KeyError, TypeError):
        return "unknown"


def _missing(tail: StreamSnapshot, snap: StreamSnapshot, meta: ResumeMeta) -> tuple[str, ...] | None:
    """None: the stream's output has not ended (as far as the buffer's last
    events, ``tail``, show), so it is continued. Else the parts of its end
    the buffer lacks, in order (``FINISH``, ``USAGE``; ``[DONE]`` always):
    it ended when a stored event has a finish reason or is the usage event,
    or when its stored tokens reached ``max_tokens`` (a finish sent in an
    event of its own, not stored) and no text can have been held back for a
    stop string."""
    finished = usage = False
    for event in tail.events:
        chunk = _chunk(event)
        if chunk is None:
            continue
        if chunk.choices and chunk.choices[0].finish_reason is not None:
            finished = True
        elif not chunk.choices and chunk.usage is not None:
            # (a usage event is only ever written after the finish: where that
            # finish is a placeholder, padded by a resume cut off after it
            # stored the usage event, the usage event says the output ended)
            finished = usage = True
    params = meta.params
    if not finished and (len(snap.token_ids) < params.max_tokens
                         or (params.stop and not params.include_stop_str_in_output)):
        return None
    return (() if finished else (FINISH,)) + ((USAGE,) if meta.include_usage and not usage else ())


def tail_after(snap: StreamSnapshot) -> int:
    """The event ``finish_tail``'s ``tail`` is read after: the buffer's last
    two events (the finish and the usage event, at most) are in it."""
    return max(0, snap.total_events - 2)


def client_on_placeholder(snap: StreamSnapshot, tail: StreamSnapshot, pos, cursor: int) -> bool:
    """Whether the client, level with the buffer (``snap``) in events by its
    own id (``pos``: no events were replayed to it, ``cursor``), has for its
    last event, N, a placeholder in the buffer (``tail``: its last events,
    read after ``tail_after(snap)``). Only then can its id count more of the
    stream than the buffer: a resume that padded for the events that client
    had was cut off while it regenerated their text. Where event N is one
    the buffer holds, every client that has it has the buffer's text up to
    it, whatever its id says: an id of another stream, a made-up one, or
    that of a second reader whose regenerated events were cut differently
    (its text is then sent again rather than dropped from the buffer, which
    every other client replays)."""
    if not (cursor == pos.event == snap.total_events >= 1 and pos.tokens is not None and pos.chars is not None):
        return False
    at = cursor - 1 - tail_after(snap)  # (event N's index in ``tail.events``)
    return 0 <= at < len(tail.events) and tail.events[at] == b""


async def finish_tail(svc, sid: str, meta: ResumeMeta, snap: StreamSnapshot, tail: StreamSnapshot, pos,
                      cursor: int, padded: bool, leases: tuple[str, ...]) -> list[bytes] | None:
    """For a claimed stream whose output has ended: the events of its end
    that the buffer lacks and the client does not have, and ``[DONE]``. They
    are queued for the buffer at once; its finish, which drops the claim,
    and the end of ``leases`` (those of the stream's earlier generators,
    which a continuation's admission would have replaced: they died holding
    them) go on in the background, whether the client stays or not. None:
    its output has not ended, continue it. ``[]``: the client's position
    (``pos``, ``cursor`` events) cannot be in this stream (the claim is
    dropped; so is one whose id says its last event, one the buffer lacks,
    was another part of the end than the buffer's events make it: ``pos.end``;
    an id without that part, from a router before it, is taken as it was).
    ``tail``: the buffer's last events (read after ``tail_after(snap)``);
    ``padded``: ``client_on_placeholder`` of them."""
    tokens, chars = len(snap.token_ids), snap.text_len
    # (its event N a placeholder, the client's id says which parts of the end it
    # has, ``pos.end``: a resume that padded for them was cut off before it stored
    # them. Event N one the buffer holds, the buffer's end is what counts)
    missing = _missing(tail, snap, meta)
    if missing is None and padded and pos.end and (pos.tokens, pos.chars) == (tokens, chars):
        # (that resume regenerated every token and character the client has, its
        # finish's too (``EventStream.event`` stores those without an event),
        # whatever ended it: generating on would go past its end)
        missing = (FINISH, USAGE) if meta.include_usage else (FINISH,)
    if missing is None:
        return None
    had = cursor - snap.total_events  # the events of that end the client has (the buffer lost them)
    if had > len(missing) or (had and ((pos.tokens, pos.chars) != (tokens, chars)
                                       or pos.end not in (0, _END[missing[had - 1]]))):
        await svc.resume.release(sid)
        return []
    enc = ChunkEncoder(meta.chat, meta.response_id, meta.model, meta.created, event_id=cursor, role_sent=True)
    at = b"-%d-%d" % (tokens, chars)
    prompt = len(meta.prompt_token_ids)
    svc.resume.continue_at(sid, snap.total_events)
    if had:
        svc.resume.pad(sid, had)
    has = pos.end if padded else 0
    left = tuple(part for part in missing[had:] if _END[part] > has)
    out = []
    for part in left:
        if part == FINISH:
            # (``length``: the tokens reached max_tokens. An upstream that ended
            # on a stop at that very token, in a chunk of its own, said ``stop``)
            usage = Usage(prompt, tokens, prompt + tokens) if meta.continuous_usage else None
            event = enc.delta("", FinishReason.LENGTH, at + END_FINISH, usage)
        else:
            event = enc.usage(prompt, tokens, at + END_USAGE)
        svc.resume.append(sid, event, [], chars)
        out.append(event)
    log.info("stream %s: its output had ended when its router stopped (%d tokens); sending what of its end "
             "the buffer lacks: %s", sid, tokens, ", ".join((*left, "[DONE]")))
    out.append(enc.done())  # (numbered after the end's events the buffer gets, and the pads)
    svc.background(_finish(svc, sid, meta.tenant, out[-1], chars, leases))
    return out


async def _finish(svc, sid: str, tenant: str, done: bytes, chars: int, leases: tuple[str, ...]) -> None:
    await svc.resume.finish(sid, done, chars)
    await svc.admission.drop(tenant, leases)
