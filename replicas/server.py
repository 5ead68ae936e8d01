"""The replica process: one engine behind the replica protocol.

``ReplicaServer`` accepts router connections on a Unix socket (local) or TCP
(remote), checks the shared secret, and multiplexes every connection's
requests onto the one engine. All deltas produced in one engine step are sent
in one ``Deltas`` frame per connection, flushed once per event-loop turn.
"""

from __future__ import annotations

import asyncio
import hmac
import itertools
import logging
import os
import signal
from typing import Any

import msgspec

from replicas.engine import Engine, EngineDead, EngineError
from replicas.logs import write_error_file
from replicas.output import OutputProcessor
from replicas.prepare import finish_prefix, prepare
from replicas.spec import join_host_port
from replicas.protocol import (
    FEATURES,
    PROTOCOL_VERSION,
    Abort,
    Delta,
    Deltas,
    FinishReason,
    FrameDecoder,
    Generate,
    Hello,
    Ping,
    Pong,
    Ready,
    Refused,
    encode_frame,
    router_decoder,
)

__all__ = ["ReplicaServer", "create_engine", "serve", "wait_for_stop", "watch_engine", "exit_if_dead",
           "PARENT_PID_ENV"]

log = logging.getLogger("fairstream.replica")

LOAD_REPORT_INTERVAL = 0.2
HANDSHAKE_TIMEOUT = 10.0  # (s) for a router's Hello, all of it: a peer trickling it is dropped
# (bytes) most output a connection may have waiting to go out: a router that
# reads nothing (partitioned, its loop stuck) is dropped and its streams
# aborted, as a silent one is (Hello.silence), not buffered without end
WRITE_BUFFER_LIMIT = 64 * 1024 * 1024
# the pid of the process that started a replica with --exit-with-parent (its supervisor)
PARENT_PID_ENV = "FAIRSTREAM_PARENT_PID"
ENGINE_CHECK_INTERVAL = 1.0  # seconds between checks that the engine is alive
ENGINE_CLOSE_TIMEOUT = 10.0  # seconds a dead engine gets to shut down before the process exits anyway


def create_engine(name: str, config: dict[str, Any], sink) -> Engine:
    """Build engine ``name`` ("sim" or "vllm") from its config mapping."""
    if name == "sim":
        from replicas.sim import SimConfig, SimEngine

        return SimEngine(msgspec.convert(config, SimConfig), sink)
    if name == "vllm":
        from replicas.vllm_engine import VllmEngine, VllmEngineConfig

        return VllmEngine(msgspec.convert(config, VllmEngineConfig), sink)
    raise ValueError(f"unknown engine {name!r} (expected 'sim' or 'vllm')")


class _Request:
    __slots__ = ("conn", "rid", "proc", "first", "prompt_ids", "done")

    def __init__(self, conn: _Connection, rid: int, proc: OutputProcessor, prompt_ids: list[int]):
        self.conn = conn
        self.rid = rid
        self.proc = proc
        self.first = True
        self.prompt_ids = prompt_ids
        self.done = False


class _Connection:
    """One router connection: its requests, its outbox and its writer."""

    def __init__(self, writer: asyncio.StreamWriter) -> None:
        self.writer = writer
        self.requests: dict[int, int] = {}  # router rid -> engine rid
        self.outbox: list[Delta] = []
        self.flush_scheduled = False
        self.closed = False

    def send(self, msg: msgspec.Struct) -> None:
        if not self.closed:
            self.writer.write(encode_frame(msg))
            transport = self.writer.transport
            if transport.get_write_buffer_size() > WRITE_BUFFER_LIMIT:
                log.warning("connection dropped: the router read none of %d bytes of output", WRITE_BUFFER_LIMIT)
                self.closed = True
                transport.abort()  # (its read ends: ``_serve`` aborts its streams)

    def queue(self, delta: Delta) -> None:
        self.outbox.append(delta)
        if not self.flush_scheduled:
            self.flush_scheduled = True
            asyncio.get_running_loop().call_soon(self.flush)

    def flush(self) -> None:
        self.flush_scheduled = False
        if self.outbox:
            items, self.outbox = self.outbox, []
            self.send(Deltas(items))


class ReplicaServer:
    """Owns the engine, the listening socket and every connection."""

    def __init__(self, engine_name: str, engine_config: dict[str, Any], secret: str = "") -> None:
        self.engine = create_engine(engine_name, engine_config, self._on_output)
        self.secret = secret
        self._requests: dict[int, _Request] = {}
        self._ids = itertools.count(1)
        self._server: asyncio.AbstractServer | None = None
        self._conns: set[_Connection] = set()

    async def start(self, *, socket_path: str | None = None, host: str | None = None, port: int = 0):
        await self.engine.start()
        if socket_path:
            try:
                os.unlink(socket_path)
            except FileNotFoundError:
                pass
            self._server = await asyncio.start_unix_server(self._serve, path=socket_path)
        else:
            self._server = await asyncio.start_server(self._serve, host=host or "127.0.0.1", port=port)
        return self._server

    async def close(self) -> None:
        if self._server is not None:
            self._server.close()
        dead = self.engine.dead
        for conn in list(self._conns):
            conn.closed = True
            if dead:  # nothing more may go out (no error for any request: they fail over)
                conn.writer.transport.abort()
            else:
                conn.writer.close()
        try:
            await asyncio.wait_for(self.engine.close(), ENGINE_CLOSE_TIMEOUT if dead else None)
        except TimeoutError:
            log.warning("the dead engine did not shut down within %gs", ENGINE_CLOSE_TIMEOUT)

    # -- engine output -----------------------------------------------------

    def _on_output(self, erid: int, new_ids: list[int], finish: FinishReason, error: str,
                   stop_id: int | None = None) -> None:
        req = self._requests.get(erid)
        if req is None or req.done:
            return
        text, finish_out = req.proc.process(new_ids, finish, stop_id)
        if finish_out != FinishReason.NONE:
            req.done = True
            del self._requests[erid]
            req.conn.requests.pop(req.rid, None)
            if finish == FinishReason.NONE:  # a stop string ended it early
                self.engine.abort(erid)
        delta = Delta(req.rid, new_ids, text, finish_out, None, error, stop_reason=req.proc.stop_reason)
        if req.first:
            req.first = False
            delta.prompt_token_ids = req.prompt_ids
        req.conn.queue(delta)

    # -- connections -------------------------------------------------------

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        conn = _Connection(writer)
        decoder = FrameDecoder(router_decoder())
        self._conns.add(conn)
        reporter: asyncio.Task[None] | None = None
        try:
            hello = await self._handshake(reader, decoder, conn)
            if hello is None:
                return
            reporter = asyncio.create_task(self._report_load(conn))
            silence = hello.silence if hello.silence > 0 else None
            while True:
                try:
                    async with asyncio.timeout(silence):
                        data = await reader.read(65536)
                except TimeoutError:
                    # (the router pings within this: a partition, or it froze; what
                    # it ran here it regenerates elsewhere, so it stops here)
                    log.warning("connection dropped: no frame from the router for %gs; its %d streams aborted",
                                silence, len(conn.requests))
                    writer.transport.abort()  # (a close would wait on output that goes nowhere)
                    break
                if not data:
                    break
                for msg in decoder.feed(data):
                    self._handle(conn, msg)
        except (ConnectionError, msgspec.DecodeError, ValueError) as e:
            log.warning("connection dropped: %s", e)
        except TimeoutError:
            log.warning("connection dropped: no complete Hello within %gs", HANDSHAKE_TIMEOUT)
        finally:
            conn.closed = True
            self._conns.discard(conn)
            if reporter is not None:
                reporter.cancel()
            for erid in list(conn.requests.values()):
                self._requests.pop(erid, None)
                self.engine.abort(erid)
            conn.requests.clear()
            writer.close()

    async def _handshake(self, reader, decoder: FrameDecoder, conn: _Connection) -> Hello | None:
        msgs: list = []
        async with asyncio.timeout(HANDSHAKE_TIMEOUT):  # (the whole of it, not each read)
            while not msgs:
                data = await reader.read(65536)
                if not data:
                    return None
                msgs = decoder.feed(data)
        hello = msgs[0]
        if not isinstance(hello, Hello):
            conn.send(Refused("expected Hello as the first frame"))
            return None
        if hello.version != PROTOCOL_VERSION:
            conn.send(Refused(f"protocol version {hello.version} unsupported (want {PROTOCOL_VERSION})"))
            return None
        if not hmac.compare_digest(hello.secret.encode(), self.secret.encode()):
            conn.send(Refused("bad replica secret"))
            return None
        eng = self.engine
        conn.send(Ready(PROTOCOL_VERSION, eng.model, eng.name, eng.max_model_len, os.getpid(), int(FEATURES)))
        for msg in msgs[1:]:
            self._handle(conn, msg)
        return hello

    def _handle(self, conn: _Connection, msg: Any) -> None:
        if isinstance(msg, Generate):
            self._generate(conn, msg)
        elif isinstance(msg, Abort):
            erid = conn.requests.pop(msg.rid, None)
            if erid is not None:
                self._requests.pop(erid, None)
                self.engine.abort(erid)
        elif isinstance(msg, Ping):
            conn.send(Pong(msg.seq, self.engine.load()))

    def _generate(self, conn: _Connection, msg: Generate) -> None:
        eng = self.engine
        erid = None
        try:
            if msg.prompt_token_ids is not None:
                prompt_ids = msg.prompt_token_ids
            elif msg.messages is not None:
                prompt_ids = eng.tokenizer.chat(msg.messages, msg.chat_template_kwargs, msg.reasoning_effort)
            elif msg.prompt is not None:
                prompt_ids = eng.tokenizer.encode(msg.prompt)
            else:
                raise EngineError("request has no prompt")
            ids, params, proc = prepare(eng, prompt_ids, msg.params, msg.prefix_token_ids, msg.prefix_text_len)
            if params.max_tokens == 0:  # (every token delivered, the finish lost: its held-back text and length)
                text, finish = finish_prefix(proc)
                conn.queue(Delta(msg.rid, [], text, finish, prompt_ids))
                return
            erid = next(self._ids)
            self._requests[erid] = _Request(conn, msg.rid, proc, prompt_ids)
            conn.requests[msg.rid] = erid
            eng.add(erid, ids, params, len(msg.prefix_token_ids))
        except EngineDead:
            return  # no answer: ``serve`` drops the connection and the router fails the request over
        except (EngineError, ValueError) as e:
            conn.requests.pop(msg.rid, None)
            self._requests.pop(erid, None)  # (the engine refused it: no output will come for it)
            conn.queue(Delta(msg.rid, [], "", FinishReason.ERROR, None, str(e)))
            return

    async def _report_load(self, conn: _Connection) -> None:
        last = None
        while not conn.closed:
            await asyncio.sleep(LOAD_REPORT_INTERVAL)
            report = self.engine.load()
            key = (report.running, report.waiting, round(report.kv_usage, 3))
            if key != last:
                last = key
                conn.send(report)


async def serve(
    engine: str,
    config: dict[str, Any],
    *,
    socket_path: str | None = None,
    host: str | None = None,
    port: int = 0,
    secret: str = "",
    exit_with_parent: bool = False,
) -> None:
    """Run a replica until SIGTERM/SIGINT (or, with ``exit_with_parent``,
    until the process that started it exits)."""
    server = ReplicaServer(engine, config, secret=secret)
    await server.start(socket_path=socket_path, host=host, port=port)
    where = socket_path or join_host_port(host or "127.0.0.1", port)
    log.info("replica ready on %s: serving %s (%s)", where, server.engine.model, engine)
    await wait_for_stop(exit_with_parent, watch_engine(server.engine))
    await server.close()
    exit_if_dead(server.engine)


async def watch_engine(eng: Engine) -> None:
    """Until the engine has died (it says so itself, or ``dead`` turns true)."""
    while not eng.dead:
        try:
            await asyncio.wait_for(eng.died.wait(), ENGINE_CHECK_INTERVAL)
        except TimeoutError:
            pass
    eng.die(eng.death or "the engine reports itself dead")


def exit_if_dead(engine: Engine) -> None:
    """After a stop: exit with status 1 if it was the engine's death, so that
    the supervisor (or systemd) restarts this replica."""
    if engine.dead:
        log.error("engine died (%s); exiting so that this replica is restarted", engine.death)
        write_error_file(f"engine died ({engine.death})")
        raise SystemExit(1)


async def wait_for_stop(exit_with_parent: bool, died=None) -> None:
    """Return on SIGTERM/SIGINT, when the coroutine ``died`` returns (the
    engine died), or, with ``exit_with_parent``, when the process that started
    this one exits (even by SIGKILL)."""
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    # (the pid of the process that started it, if it said: one that died
    # before this looked left it a child of init, and getppid() then named
    # init as the parent to wait for: the replica outlived its router for good)
    parent = int(os.environ.get(PARENT_PID_ENV) or os.getppid())

    async def watch_parent() -> None:
        while os.getppid() == parent:
            await asyncio.sleep(0.5)
        stop.set()

    watchers = [asyncio.create_task(watch_parent())] if exit_with_parent else []
    if died is not None:
        watchers.append(asyncio.create_task(died))
        watchers[-1].add_done_callback(lambda t: stop.set())
    await stop.wait()
    for watcher in watchers:
        watcher.cancel()
