"""The push relay's ordering and ending rules, driven by hand.

``PushRelay`` writes to uvicorn's transport from the replica reader's
callbacks and, while the transport is paused, from the request task. These
tests run the real relay, the real ``TransportWire`` over uvicorn's real
``FlowControl`` and (for the second) a real ``Generation`` fed through a
real ``Collector``; only the socket (a list of writes), the events'
encoding and the replica connection are stand-ins.
"""

from __future__ import annotations

import asyncio
import time

from uvicorn.protocols.http.flow_control import FlowControl

from replicas.protocol import Delta, FinishReason
import pytest

from router.push import ClientTooSlow, PushRelay, TransportWire
from tests.unit.generations import started

NONE, STOP = FinishReason.NONE, FinishReason.STOP


class Socket:
    """What reaches the client: the chunked writes, de-framed."""

    def __init__(self) -> None:
        self.writes: list[bytes] = []

    def write(self, data: bytes) -> None:
        size, _, rest = data.partition(b"\r\n")
        assert int(size, 16) == len(rest) - 2
        self.writes.append(rest[:-2])

    def pause_reading(self) -> None:
        pass

    def resume_reading(self) -> None:
        pass


class Cycle:
    """The parts of uvicorn's RequestResponseCycle the wire reads."""

    def __init__(self) -> None:
        self.transport = Socket()
        self.flow = FlowControl(self.transport)
        self.disconnected = False


class Events:
    """EventStream's interface: an event is its text, the tail ``[DONE]``."""

    def __init__(self, fail_on_tail: bool = False, gen=None) -> None:
        self.fail_on_tail = fail_on_tail
        self.gen = gen

    def event(self, text: str, n: int, finish: FinishReason) -> bytes | None:
        return text.encode() if text or finish != NONE else None

    def tail(self) -> list[bytes]:
        if self.fail_on_tail:
            raise RuntimeError("encoding the tail failed")
        return [b"[DONE]"]

    def failed(self, e: BaseException) -> bytes:
        return b"error: " + str(e).encode()


async def test_events_queued_behind_a_paused_transport_are_never_overtaken() -> None:
    cycle = Cycle()
    relay = PushRelay(limit=1)
    cycle.flow.pause_writing()  # a slow client: its transport is paused
    run = asyncio.ensure_future(relay.run(Events(), TransportWire(cycle)))
    relay.piece("a", 1, NONE)
    await asyncio.sleep(0)  # the request task now waits for the transport
    # The transport drains; before the request task runs again the
    # replica's reader delivers more, the last piece included.
    cycle.flow.resume_writing()
    relay.piece("b", 1, NONE)
    relay.piece("c", 1, STOP)
    await asyncio.wait_for(run, 1)
    assert cycle.transport.writes == [b"a", b"b", b"c[DONE]"]


async def test_pieces_are_written_at_once_while_the_transport_takes_them() -> None:
    cycle = Cycle()
    relay = PushRelay(limit=16)
    run = asyncio.ensure_future(relay.run(Events(), TransportWire(cycle)))
    await asyncio.sleep(0)
    relay.piece("a", 1, NONE)
    assert cycle.transport.writes == [b"a"]  # in the callback, no task switch
    relay.piece("b", 1, STOP)
    assert cycle.transport.writes == [b"a", b"b[DONE]"]
    await asyncio.wait_for(run, 1)


async def test_a_failure_on_the_last_piece_ends_the_stream_with_an_error_event() -> None:
    cycle = Cycle()
    relay = PushRelay()
    gen, col, slot, client = started(relay, max_tokens=4)
    col.put(Delta(1, [7], "x", NONE, [1, 2]))
    run = asyncio.ensure_future(relay.run(Events(fail_on_tail=True), TransportWire(cycle)))
    await asyncio.sleep(0)
    col.put(Delta(1, [8], "y", STOP))  # its tail fails to encode
    await asyncio.wait_for(run, 1)  # ends: does not wait for a piece that will never come
    assert cycle.transport.writes[0] == b"x"
    assert cycle.transport.writes[-1].startswith(b"error: internal error"), cycle.transport.writes
    assert slot.inflight == 0 and client.released == [1]


async def test_a_failure_on_a_last_piece_queued_behind_a_slow_client_ends_the_stream_with_an_error_event() -> None:
    # (the request task encodes what waited: the failure is its own to handle)
    cycle = Cycle()
    relay = PushRelay()
    gen, col, slot, client = started(relay, max_tokens=4)
    col.put(Delta(1, [7], "x", NONE, [1, 2]))
    run = asyncio.ensure_future(relay.run(Events(fail_on_tail=True, gen=gen), TransportWire(cycle)))
    await asyncio.sleep(0)
    cycle.flow.pause_writing()  # a slow client
    col.put(Delta(1, [8], "y", STOP))  # waits behind the paused transport; its tail fails to encode
    cycle.flow.resume_writing()
    await asyncio.wait_for(run, 1)
    assert cycle.transport.writes[-1].startswith(b"error: internal error"), cycle.transport.writes
    assert slot.inflight == 0 and client.released == [1]


async def test_a_client_that_takes_nothing_for_send_timeout_is_given_up() -> None:
    # (nginx's send_timeout: a client that stopped reading would otherwise
    # hold its request, its lease and its queued pieces as long as TCP lasts)
    cycle = Cycle()
    relay = PushRelay()
    cycle.flow.pause_writing()  # the client's buffers are full and it reads nothing
    relay.piece("a", 1, NONE)
    started_at = time.monotonic()
    with pytest.raises(ClientTooSlow):
        await asyncio.wait_for(relay.run(Events(), TransportWire(cycle, timeout=0.2)), 5)
    assert 0.2 <= time.monotonic() - started_at < 1
    assert cycle.transport.writes == []


async def test_a_slow_client_that_keeps_taking_its_stream_is_not_given_up() -> None:
    cycle = Cycle()
    relay = PushRelay()
    run = asyncio.ensure_future(relay.run(Events(), TransportWire(cycle, timeout=0.2)))
    for text in "abcdef":
        cycle.flow.pause_writing()
        relay.piece(text, 1, NONE)
        await asyncio.sleep(0.1)  # each wait is shorter than the limit; all of them together longer
        cycle.flow.resume_writing()
    relay.piece("g", 1, STOP)
    await asyncio.wait_for(run, 1)
    assert b"".join(cycle.transport.writes) == b"abcdefg[DONE]"
