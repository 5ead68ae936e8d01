"""Router side of the replica protocol: one connection, one reader task.

``ReplicaClient.generate`` returns a ``Collector``: a single slot that merges
deltas while its consumer is busy (vLLM's ``RequestOutputCollector``), so a
slow client never makes the reader buffer without bound and never blocks
other requests on the same connection.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
from collections.abc import Callable
from typing import Any

from replicas.protocol import (
    Abort,
    Delta,
    Deltas,
    FinishReason,
    FrameDecoder,
    Generate,
    Hello,
    LoadReport,
    Ping,
    Pong,
    Ready,
    Refused,
    SamplingParams,
    encode_frame,
    replica_decoder,
)
from replicas.handshake import read_handshake
from replicas.spec import host_port

__all__ = ["ReplicaClient", "Collector", "CredentialsRefused", "ReplicaDead", "ReplicaRefused", "ReplicaStalled",
           "connect"]

log = logging.getLogger("fairstream.replica_client")

# (s) how long ``close`` lets the reader of a connection a write found closing
# see its end for itself (it does within a loop turn or two)
CLOSE_WAIT = 0.5


class ReplicaDead(ConnectionError):
    """The replica's connection is gone; its streams can be resumed elsewhere."""


class ReplicaBusy(ReplicaDead):
    """The replica answered that it takes no request now (an upstream's 429 or
    503): alive, not dead, so going straight back to it is not "finding it
    still dead"; ``retry_after``: the seconds it asked for (0: none said)."""

    def __init__(self, reason: str, retry_after: float = 0.0) -> None:
        super().__init__(reason)
        self.retry_after = retry_after


class CredentialsRefused(ReplicaDead):
    """An upstream refused the router's credentials (HTTP 401 or 403 to a
    generation request): the operator's configuration, not the client's
    request, and no death either; the upstream is not chosen again until a
    health check shows it takes them (``replicas.upstream``), so a request
    moves off it once, and with no other replica ready ends at once."""


class ReplicaStalled(ReplicaDead):
    """The replica took a request and answered nothing within its limit (an
    upstream's response head), while its health checks may pass: the stream
    fails over and the router treats the replica as one a stream's stall
    limit caught (``ReplicaPool.caught_stalling``): out of dispatch until a
    health check shows it answers again (``ReplicaClient.stalling``)."""


class ReplicaRefused(ConnectionError):
    """The replica refused the handshake (bad secret or version)."""


class KeyRefused(ReplicaRefused):
    """An upstream refused the router's API key at connect (``GET /models``
    answered 401 or 403, as ``vllm serve --api-key`` does): the operator's
    configuration. Its message is ``upstream_credentials.refusal``'s, which
    names ``api_key_env``, as a refused generation request's does."""


class Collector:
    """Single-slot mailbox for one request's deltas.

    With a ``sink`` (the router: its ``Generation``) every delta goes on at
    once. Without one (``replicas.openai_server``, ops tools, tests), deltas
    that arrive while the consumer is busy wait here and are merged by the
    next ``get`` (up to ``limit`` tokens per call), so a slow consumer gets
    bigger pieces instead of a growing queue of small ones.
    """

    __slots__ = ("rid", "finish", "error", "prompt_token_ids", "dead", "sink", "limit", "lane", "_pending", "_ready",
                 "_waiter")

    def __init__(self, rid: int) -> None:
        self.rid = rid
        self.finish = FinishReason.NONE
        self.error = ""
        self.prompt_token_ids: list[int] | None = None
        self.dead: BaseException | None = None
        self._pending: list[Delta] = []
        # "get would not wait"; a future only while the consumer waits (an
        # asyncio.Event would hold a waiter deque per stream, all the time)
        self._ready = False
        self._waiter: asyncio.Future[None] | None = None
        # set: deltas and the failure go to sink.on_delta(self, delta) /
        # sink.on_fail(self, exc) at once, nothing waits here (the router's
        # Generation); None: ``get`` pulls them
        self.sink = None
        # most tokens a producer should merge into one delta (0: any)
        self.limit = 0
        # set (router.lane.Lane): a producer may hand plain pieces (token ids
        # and text, no finish) to ``lane.tokens(ids, text)``, which returns
        # False for those it does not take (they go to ``put``)
        self.lane = None

    def put(self, delta: Delta) -> None:
        if delta.prompt_token_ids is not None:
            self.prompt_token_ids = delta.prompt_token_ids
        if delta.finish:
            self.finish = FinishReason(delta.finish)
            self.error = delta.error
        if self.sink is not None:
            self.sink.on_delta(self, delta)
            return
        self._pending.append(delta)
        self._wake()

    def fail(self, exc: BaseException) -> None:
        self.dead = exc
        if self.sink is not None:
            self.sink.on_fail(self, exc)
            return
        self._wake()

    def _wake(self) -> None:
        self._ready = True
        w = self._waiter
        if w is not None and not w.done():
            w.set_result(None)

    @property
    def ready(self) -> bool:
        """``get`` would return without waiting."""
        return self._ready

    async def get(self, limit: int = 0) -> tuple[list[int], str, FinishReason]:
        """Wait for output; return (token ids, text, finish) merged since the
        last call, at most ``limit`` tokens (0: no limit; a single delta larger
        than ``limit`` is returned whole).

        Raises ``ReplicaDead`` if the connection died first (output that
        arrived before the death is returned first).
        """
        if not self._ready:
            self._waiter = asyncio.get_running_loop().create_future()
            try:
                await self._waiter
            finally:
                self._waiter = None
        pending = self._pending
        if not pending:
            self._ready = False
            if self.dead is not None and self.finish == FinishReason.NONE:
                raise self.dead
            return [], "", self.finish
        if len(pending) == 1:
            d = pending[0]
            self._pending = []
            # still ready if a death waits to be reported on the next call
            self._ready = self.dead is not None and not d.finish
            return d.token_ids, d.text, FinishReason(d.finish)
        ids: list[int] = []
        texts: list[str] = []
        finish = FinishReason.NONE
        taken = 0
        for d in pending:
            if limit and ids and len(ids) + len(d.token_ids) > limit:
                break
            ids.extend(d.token_ids)
            texts.append(d.text)
            taken += 1
            if d.finish:
                finish = FinishReason(d.finish)
        rest = pending[taken:]
        self._pending = rest
        if not rest and (self.dead is None or finish):
            self._ready = False
        return ids, "".join(texts), finish


class ReplicaClient:
    """One connection to one replica and the reader task that serves it.

    ``on_close`` is called once when the connection ends, with the reason.
    """

    def __init__(
        self,
        name: str,
        reader: asyncio.StreamReader,
        writer: asyncio.StreamWriter,
        ready: Ready,
        on_close: Callable[[ReplicaClient, BaseException], None] | None = None,
    ) -> None:
        self.name = name
        self.ready = ready
        self.model = ready.model
        self.load = LoadReport(0, 0, 0.0)
        self._reader = reader
        self._writer = writer
        self._streams: dict[int, Collector] = {}
        self._ids = itertools.count(1)
        self._pings: dict[int, asyncio.Future[Pong]] = {}
        self._ping_ids = itertools.count(1)
        self._on_close = on_close
        self.closed: BaseException | None = None
        self._why: BaseException | None = None  # (``close``'s)
        self.refused = False  # (an upstream's: see replicas/upstream.py; never set here)
        self.credentials_refused: str | None = None  # (the same)
        self.stalling: str | None = None  # (the same: why its requests get no answer, until a check shows they do)
        self.continues = True  # continues a stream from its token ids (an upstream's may not)
        self._task = asyncio.get_running_loop().create_task(self._read(), name=f"replica-reader-{name}")

    @property
    def active(self) -> int:
        return len(self._streams)

    def generate(
        self,
        params: SamplingParams,
        *,
        prompt: str | None = None,
        messages: list[dict[str, str]] | None = None,
        prompt_token_ids: list[int] | None = None,
        prefix_token_ids: list[int] | None = None,
        prefix_text_len: int = 0,
        chat_template_kwargs: dict[str, Any] | None = None,
        reasoning_effort: str | None = None,
    ) -> Collector:
        self._check_open()
        rid = next(self._ids)
        frame = encode_frame(Generate(
            rid,
            params,
            prompt=prompt,
            messages=messages,
            prompt_token_ids=prompt_token_ids,
            prefix_token_ids=prefix_token_ids or [],
            prefix_text_len=prefix_text_len,
            chat_template_kwargs=chat_template_kwargs,
            reasoning_effort=reasoning_effort,
        ))  # (first: a request that cannot be encoded leaves nothing registered)
        col = self._streams[rid] = Collector(rid)
        try:
            self._send(frame)
        except ReplicaDead:
            del self._streams[rid]
            raise
        return col

    def abort(self, col: Collector) -> None:
        """Stop the request on the replica (no-op if it already ended)."""
        if self._streams.pop(col.rid, None) is not None and self.closed is None:
            try:
                self._send(encode_frame(Abort(col.rid)))
            except ReplicaDead:
                pass  # (the request ends with its connection)

    def release(self, col: Collector) -> None:
        """Forget a finished request."""
        self._streams.pop(col.rid, None)

    async def ping(self, timeout: float | None) -> Pong:
        """A pong (the replica's load); TimeoutError after ``timeout`` s (None: no limit).
        ``ReplicaDead`` at once if the connection has closed: the reader that
        would take the pong has ended (its EOF can come in the loop iteration
        that starts this ping), so the ping would wait out ``timeout`` and the
        supervisor take a lost connection for a stall."""
        self._check_open()
        seq = next(self._ping_ids)
        fut: asyncio.Future[Pong] = asyncio.get_running_loop().create_future()
        self._pings[seq] = fut
        try:
            self._send(encode_frame(Ping(seq)))
            # not wait_for: on 3.11 it can swallow a cancel that races the pong
            async with asyncio.timeout(timeout):
                return await fut
        finally:
            self._pings.pop(seq, None)

    def _check_open(self) -> None:
        """``ReplicaDead`` if the connection has ended, as far as the reader
        or the transport knows: the transport closes first (a write's EPIPE,
        a read error), and the reader sets ``closed`` only when it next runs;
        a request written in between would be lost, or (uvloop, once the
        transport's ``connection_lost`` has run) raise ``RuntimeError``."""
        if self.closed is not None:
            raise ReplicaDead(f"replica {self.name} is disconnected") from self.closed
        if self._writer.transport.is_closing():
            # (closed from here on, before the reader runs: the replica leaves
            # the choice now, or a failover from this write would pick it
            # again and again in this loop turn; the reader still relays what
            # arrived and then fails the streams it had)
            self.closed = ReplicaDead(f"replica {self.name} connection is closing")
            raise ReplicaDead(f"replica {self.name} connection is closing")

    def _send(self, frame: bytes) -> None:
        """Write one frame; ``ReplicaDead`` if the connection is gone."""
        self._check_open()
        try:
            self._writer.write(frame)
        except (ConnectionError, RuntimeError) as e:  # (uvloop: "the handler is closed")
            why = f"replica {self.name} connection failed: {e!r}"
            if self.closed is None:
                self.closed = ReplicaDead(why)  # (as above; not the one raised, whose traceback holds the frame)
            raise ReplicaDead(why) from e

    async def close(self, why: BaseException | None = None) -> None:
        """End the connection; ``why``: the router's reason (its streams' failures name it)."""
        self._why = why
        if self.closed is not None and not self._task.done():
            # (marked closed by a write that found the transport closing: the
            # reader sees the end within a turn or two and fails its streams
            # with the connection's own reason, not "closed by the router")
            await asyncio.wait({self._task}, timeout=CLOSE_WAIT)
        self._task.cancel()
        try:
            await self._task
        except (asyncio.CancelledError, Exception):
            pass
        self._writer.close()

    async def _read(self) -> None:
        decoder = FrameDecoder(replica_decoder())
        reason: BaseException = ReplicaDead(f"replica {self.name} closed the connection")
        streams = self._streams
        # A read's plain deltas (token ids and text, nothing else) of one
        # request go on as one, up to its collector's ``limit`` tokens: when
        # the router is behind its replica, a read holds several engine
        # steps, and their tokens are relayed in one step (one event), not
        # one per step. Anything else of that request (its finish, an error)
        # sends what it has merged first; the rest goes when the read is done,
        # but for tokens without text (a character's first bytes, text held
        # back for a stop string), which would make no event of their own but
        # join the next one, past ``limit``: they wait for the next read's,
        # one read at most (the stall timer sees tokens when they come, so
        # they are not held longer). Tokens still here when the connection
        # breaks are not delivered: the failover regenerates them. A
        # collector without a limit (a consumer that pulls and merges
        # itself) gets every delta as it comes.
        merged: dict[int, Delta] = {}
        held: set[int] = set()  # the requests whose piece without text waited one read
        # tokens sent without text since the request's last piece with text:
        # the next event carries them, so its merge leaves room for them
        owed: dict[int, int] = {}

        def send(d: Delta) -> None:
            col = streams.get(d.rid)
            if col is None:
                return
            if d.text:
                owed.pop(d.rid, None)
            else:
                owed[d.rid] = owed.get(d.rid, 0) + len(d.token_ids)
            if not (col.lane is not None and col.lane.tokens(d.token_ids, d.text)):
                col.put(d)

        try:
            while True:
                data = await self._reader.read(262144)
                if not data:
                    break
                for msg in decoder.feed(data):
                    if type(msg) is Deltas:
                        for d in msg.items:
                            col = streams.get(d.rid)
                            if col is None:
                                continue
                            if (col.limit and d.token_ids and not d.finish and d.prompt_token_ids is None
                                    and not d.count and not d.error):
                                m = merged.get(d.rid)
                                if m is None:
                                    merged[d.rid] = d
                                elif len(m.token_ids) + len(d.token_ids) + owed.get(d.rid, 0) > col.limit:
                                    send(m)
                                    merged[d.rid] = d
                                else:
                                    merged[d.rid] = Delta(d.rid, m.token_ids + d.token_ids, m.text + d.text)
                                continue
                            m = merged.pop(d.rid, None)
                            if m is not None:
                                send(m)
                                col = streams.get(d.rid)  # (the merged piece may have ended its stream)
                                if col is None:
                                    continue
                            if d.finish:
                                del streams[d.rid]
                                owed.pop(d.rid, None)
                            col.put(d)
                    elif type(msg) is LoadReport:
                        self.load = msg
                    elif type(msg) is Pong:
                        self.load = msg.load
                        fut = self._pings.get(msg.seq)
                        if fut is not None and not fut.done():
                            fut.set_result(msg)
                if merged:
                    kept = {}
                    for rid, d in merged.items():
                        if d.text or rid in held:
                            send(d)
                        elif rid in streams:  # (see above)
                            kept[rid] = d
                    merged = kept
                held = set(merged)
                if owed:  # (aborted or failed over meanwhile: theirs is no one's)
                    for rid in [r for r in owed if r not in streams]:
                        del owed[rid]
        except asyncio.CancelledError:
            why = self._why
            reason = ReplicaDead(f"replica {self.name} connection closed by the router" + (f": {why}" if why else ""))
            raise
        except Exception as e:  # noqa: BLE001 - any failure ends the connection
            reason = ReplicaDead(f"replica {self.name} connection failed: {e}")
        finally:
            self.closed = reason
            cols = list(streams.values())
            streams.clear()
            for col in cols:  # a failover may start on another replica from here
                try:
                    col.fail(reason)
                except Exception:  # noqa: BLE001 - the others must still learn of it
                    log.exception("replica %s: a stream failed handling the disconnect", self.name)
            for fut in self._pings.values():
                if not fut.done():
                    fut.set_exception(reason)
            self._writer.close()
            if self._on_close is not None:
                self._on_close(self, reason)


async def connect(
    name: str,
    address: str,
    *,
    secret: str = "",
    timeout: float = 5.0,
    on_close: Callable[[ReplicaClient, BaseException], None] | None = None,
    silence: float = 0.0,
) -> ReplicaClient:
    """Connect to ``address`` ("unix:/path" or "host:port") and handshake,
    within ``timeout`` each. ``silence``: the longest the router leaves the
    connection without a frame (its pings' interval and timeout), after which
    the replica takes it for gone and aborts its streams (0: no limit)."""
    if address.startswith("unix:"):
        opening = asyncio.open_unix_connection(address[5:])
    else:
        parsed = host_port(address)
        if parsed is None:  # (router.yaml's are checked before: ReplicaSpec)
            raise ValueError(f"not host:port or unix:/path: {address!r}")
        opening = asyncio.open_connection(*parsed)
    try:
        reader, writer = await asyncio.wait_for(opening, timeout)
    except TimeoutError:  # (a bare one says nothing in the log and last_error)
        raise TimeoutError(f"replica {name}: no connection to {address} within {timeout:g}s") from None
    try:
        writer.write(encode_frame(Hello(secret=secret, silence=silence)))
        first = await read_handshake(name, reader, timeout)
        if isinstance(first, Refused):
            raise ReplicaRefused(f"replica {name} refused the connection: {first.reason}")
        if not isinstance(first, Ready):
            raise ReplicaDead(f"replica {name} sent {type(first).__name__} instead of Ready")
    except BaseException:
        writer.close()
        raise
    return ReplicaClient(name, reader, writer, first, on_close)

