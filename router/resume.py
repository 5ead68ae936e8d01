"""Client resume: every streamed event is kept in the state store for a while.

A stream's buffer holds its SSE events (numbered as their ``id:``), the
completion token ids delivered and the characters of text they made, and
a ``ResumeMeta`` with what is needed to continue generating (prompt token
ids, sampling parameters, the response's id and model). With Redis the
buffer is shared, so a client can resume on any router process.

A client that reconnects with ``Last-Event-ID`` gets the events after it
from the buffer and then:

* if the stream finished, nothing more (``[DONE]`` is an event too);
* if a live router still generates it, the tail of the buffer as it grows;
* otherwise (the client's disconnect aborted it, or its router died) a
  continuation: the router claims the stream and resumes generation from the
  delivered tokens exactly as a failover does. The generation is never
  restarted from scratch.

``ResumeWriter`` batches appends: the relay hands it each event before the
event is sent, and one task flushes all streams' pending events every few
milliseconds (one store round trip per stream per flush). An in-process
store (memory) takes each event at once instead (``append_now``): there is
no round trip to save.
"""

from __future__ import annotations

import asyncio
import logging
import os
import socket
import uuid

import msgspec

from replicas.protocol import SamplingParams
from router.background import KeepGoing, spawn
from router.state import StateStore, StoreUnavailable
from router.state.base import CLAIM_TTL
from router.stopping import stop

__all__ = ["ResumeMeta", "ResumeWriter", "router_identity"]

log = logging.getLogger("fairstream.resume")

FLUSH_INTERVAL = 0.005
RENEW_INTERVAL = CLAIM_TTL / 3  # seconds between renewals of this router's claims


def router_identity() -> str:
    return f"{socket.gethostname()}:{os.getpid()}:{uuid.uuid4().hex[:8]}"


class ResumeMeta(msgspec.Struct, array_like=True, omit_defaults=True):
    """What a router needs to continue someone else's stream."""

    tenant: str
    chat: bool
    model: str
    response_id: str
    created: int
    include_usage: bool
    params: SamplingParams
    prompt_token_ids: list[int]
    continuous_usage: bool = False  # (defaults last: metadata written before them still decodes)
    lease: str = ""  # the admission lease of the request that started the stream (its continuations take it)


_meta_encoder = msgspec.msgpack.Encoder()
_meta_decoder = msgspec.msgpack.Decoder(ResumeMeta)


def encode_meta(meta: ResumeMeta) -> bytes:
    return _meta_encoder.encode(meta)


def decode_meta(data: bytes) -> ResumeMeta:
    return _meta_decoder.decode(data)


class _Pending:
    __slots__ = ("first", "events", "token_ids", "text_len", "finished")

    def __init__(self, first: int) -> None:
        self.first = first  # events this router put in the buffer before these (-1: unknown)
        self.events: list[bytes] = []
        self.token_ids: list[int] = []
        self.text_len: int | None = None
        self.finished = False


class ResumeWriter:
    """Owns the flush task and the claim-renewal task; ``close()`` flushes
    what is pending and stops both."""

    def __init__(self, store: StateStore, retention: float) -> None:
        self.store = store
        self.retention = retention
        self.owner = router_identity()
        self._pending: dict[str, _Pending] = {}
        self._wake = asyncio.Event()
        self._lock = asyncio.Lock()  # keeps each stream's appends in order
        self._task: asyncio.Task[None] | None = None
        self._renewer: asyncio.Task[None] | None = None
        # streams this router is generating now (its own or taken over): a
        # resume that reaches this router follows their buffer, never claims them
        self.live: set[str] = set()
        # resumes of each stream running on this router, oldest first (router/resume_http.py caps them)
        self.readers: dict[str, list] = {}
        self._now = getattr(store, "append_now", None)  # in-process store: no batching
        # (and its release has no await: a stream's end is written at once, end_now)
        self._release_now = getattr(store, "stream_release_now", None) if self._now is not None else None
        self.ends_now = self._release_now is not None  # (end_now can end a stream here)
        # events put in each buffer this router writes (opened or taken over),
        # so the store can tell a buffer that misses some (stream_append's ``first``)
        self._written: dict[str, int] = {}
        self._refused: set[str] = set()  # buffers the store refused an append of (warned once)
        self._unwritten: set[str] = set()  # buffers an append of failed for an outage (warned once)
        # releases on their way to the store, per stream: a claim of this router's meanwhile would
        # be undone by them when they land (the store takes both from the same owner)
        self._releasing: dict[str, int] = {}

    async def start(self) -> None:
        self._task = spawn(self._run(), "resume-writer")
        self._renewer = spawn(self._renew(), "resume-claims")

    async def close(self) -> None:
        await stop(self._renewer)
        if self._task is not None:
            try:
                await self._flush()
            finally:
                await stop(self._task)

    async def _renew(self) -> None:
        """Renew the claims of the streams this router generates. An append
        renews its stream's claim too, but a live stream can go quiet for
        longer than ``CLAIM_TTL``: a slow replica, a client that stopped
        reading (its events wait unencoded). Its claim would lapse, and a
        resume (here, or on another router sharing the store) would take the
        stream over and start a second generation into its buffer. A router
        that dies stops renewing, and its claims lapse as before."""
        guard = KeepGoing("resume claim renewal", log)
        while True:
            await asyncio.sleep(RENEW_INTERVAL)
            if self.live:
                async with guard:
                    try:
                        # (only claims it still holds: a stream released while
                        # this was on its way is not taken back)
                        await self.store.stream_renew(list(self.live), self.owner, CLAIM_TTL)
                    except StoreUnavailable:
                        pass  # the store is down: the next round tries again

    async def open(self, sid: str, meta: ResumeMeta) -> None:
        self.live.add(sid)
        if self._now is None:  # (an in-process store cannot miss events)
            self._written[sid] = 0
        try:
            await self.store.stream_open(sid, encode_meta(meta), self.owner, self.retention)
        except StoreUnavailable as e:
            log.warning("resume buffer for %s not created: %s", sid, e)

    async def claim(self, sid: str, lease: str = "") -> bool:
        """Claim ``sid`` for this router to generate; False if another
        router holds it, or this one does or is claiming it already (the
        store lets an owner claim again: two resumes here that asked at once
        both took the stream over, two generations into one buffer), or a
        release of it is on its way (it would undo this claim when it lands).
        ``lease``: the admission lease the continuation will hold, which the
        store keeps for the next claim's continuation to replace."""
        if sid in self.live or sid in self._releasing:  # (a resume tries again at its next look)
            return False
        self.live.add(sid)  # (before the await: a second resume here follows this one)
        try:
            claimed = await self.store.stream_claim(sid, self.owner, CLAIM_TTL, lease)
        except BaseException:
            self.live.discard(sid)
            raise
        if not claimed:
            self.live.discard(sid)
        return claimed

    def continue_at(self, sid: str, events: int) -> None:
        """This router continues ``sid`` (claimed) after the buffer's first
        ``events`` events: its appends follow those."""
        if self._now is None:
            self._written[sid] = events

    async def release(self, sid: str, charged: int = 0) -> None:
        """Drop this router's claim on ``sid`` (it no longer generates it);
        ``charged``: the stream's completion tokens counted and charged so
        far (``StateStore.stream_release``)."""
        self._forget(sid)
        self._releasing[sid] = self._releasing.get(sid, 0) + 1
        try:
            await self.store.stream_release(sid, self.owner, charged)
        except StoreUnavailable:
            pass
        finally:
            n = self._releasing.pop(sid) - 1
            if n:
                self._releasing[sid] = n

    def _forget(self, sid: str) -> None:
        self.live.discard(sid)
        self._written.pop(sid, None)
        self._refused.discard(sid)
        self._unwritten.discard(sid)

    def end_now(self, sid: str, final: bytes | None, text_len: int, detach: bool, charged: int = 0) -> None:
        """``finish`` (``detach``: ``detach``, with ``charged``) without an
        await, where ``ends_now``: nothing is ever pending for an in-process
        store, and its release has no await (no release is on its way
        meanwhile). A stream's end then takes no task of its own."""
        if detach:
            self._put(sid, (), (), text_len, False)
        else:
            self._put(sid, () if final is None else (final,), (), text_len, True)
            charged = 0  # (as finish releases)
        self._forget(sid)
        self._release_now(sid, self.owner, charged)  # type: ignore[misc]

    def resumable(self, sid: str) -> bool:
        """Whether a resume of ``sid`` could continue it, as far as this
        router knows: not once the store did not take an append of it
        (broken: it misses events; gone: expired, or lost by a Redis
        restarted without persistence or flushed, which no outage need have
        shown; or another router's, or finished), nor once an append failed
        (its events are lost: the store finds the buffer short of them at
        its next append). What a stream this router ends is told (a resume,
        or a retry) goes by it."""
        return sid not in self._refused and sid not in self._unwritten

    def append(self, sid: str, event: bytes | None, token_ids: list[int], text_len: int) -> None:
        """Add an event (and the tokens it carries) to the buffer."""
        self._put(sid, () if event is None else (event,), token_ids, text_len, False)

    def appender(self, sid: str):
        """``append(sid, event, token_ids, text_len)`` for one stream, as one
        call (the token lane's): straight to an in-process store's record,
        else into the next flush."""
        make = getattr(self.store, "appender", None)
        if self._now is not None and make is not None:
            return make(sid, self.owner, self.retention)
        return lambda event, token_ids, text_len: self._put(sid, (event,), token_ids, text_len, False)

    def pad(self, sid: str, n: int) -> None:
        """Append ``n`` empty placeholder events (events lost with a router),
        so the buffer's numbering stays that of the client's event ids."""
        self._put(sid, [b""] * n, (), None, False)

    async def finish(self, sid: str, final: bytes | None, text_len: int) -> None:
        """Append the last event, mark the stream finished, drop the claim."""
        self._put(sid, () if final is None else (final,), (), text_len, True)
        try:
            await self._flush_one(sid)
        finally:  # (a flush that fails unexpectedly, too: else its claim was renewed for good)
            await self.release(sid)

    async def detach(self, sid: str, text_len: int, charged: int = 0) -> None:
        """The client went away mid-stream: flush and drop the claim so a
        resuming client (on any router) can continue the stream. ``charged``:
        the completion tokens its requests counted and charged the tenant
        for, its generation's (more than the buffer's when it ran past the
        events sent): kept with the buffer, so that the continuation of a
        resume charges only those past them (router/continuation.py)."""
        self._put(sid, (), (), text_len, False)
        try:
            await self._flush_one(sid)
        finally:
            await self.release(sid, charged)

    def _put(self, sid: str, events, token_ids, text_len: int | None, finished: bool) -> None:
        """To the store at once (in-process store), or into the next flush
        (``text_len`` None: unchanged)."""
        if self._now is not None:
            self._now(sid, events, token_ids, text_len, finished, self.owner, self.retention)
            return
        p = self._pending.get(sid)
        written = self._written.get(sid, -1)
        if p is None:
            p = self._pending[sid] = _Pending(written)
            self._wake.set()
        if written >= 0 and events:
            self._written[sid] = written + len(events)
        p.events.extend(events)
        if token_ids:
            p.token_ids.extend(token_ids)
        if text_len is not None:
            p.text_len = text_len
        if finished:
            p.finished = True
            self._wake.set()

    async def _run(self) -> None:
        guard = KeepGoing("resume buffer flush", log)
        while True:
            async with guard:
                if not self._pending:  # (some may be left by a flush that failed)
                    await self._wake.wait()
                self._wake.clear()
                await asyncio.sleep(FLUSH_INTERVAL)
                await self._flush()

    async def _flush(self) -> None:
        for sid in list(self._pending):
            await self._flush_one(sid)

    async def _flush_one(self, sid: str) -> None:
        if self._now is not None:
            return  # nothing is ever pending
        async with self._lock:
            p = self._pending.pop(sid, None)
            if p is None:
                return
            try:
                done = await self.store.stream_append(
                    sid, p.events, p.token_ids, p.text_len, p.finished, self.owner, self.retention, p.first
                )
            except StoreUnavailable as e:
                # (once per stream: in fail-closed mode every flush of every
                # stream fails while Redis is down, one line per event each)
                if sid not in self._unwritten:
                    self._unwritten.add(sid)
                    log.warning("resume buffer append for %s failed: %s (its later failures are not logged)", sid, e)
                return
            except Exception:
                self._unwritten.add(sid)  # (its events are lost all the same: no resume of it reads a short buffer)
                raise
            if not done and sid not in self._refused:
                self._refused.add(sid)
                log.warning("resume buffer of %s not appended to: it is another router's now (it took the "
                            "stream over), finished, gone (expired, or lost by the state store: restarted without "
                            "persistence, or flushed), or broken (events of it came during a state store outage, "
                            "which the local fallback cannot keep for a buffer the store holds); a resume of it gets "
                            "an error, never a wrong text", sid)
