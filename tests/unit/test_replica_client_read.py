"""The replica connection's reader: a read's engine steps of one request go
on as one piece (when the router is behind its replica), in order, never
across a finish and at most the collector's ``limit`` tokens a piece."""

from __future__ import annotations

import asyncio

from replicas.client import Collector, ReplicaClient
from replicas.protocol import Delta, Deltas, FinishReason, Ready, encode_frame


class _Writer:
    def write(self, data: bytes) -> None:
        pass

    def close(self) -> None:
        pass


class _Sink:
    def __init__(self) -> None:
        self.got: list[tuple[int, list[int], str, FinishReason]] = []

    def on_delta(self, col: Collector, d: Delta) -> None:
        self.got.append((col.rid, list(d.token_ids), d.text, FinishReason(d.finish)))

    def on_fail(self, col: Collector, exc: BaseException) -> None:
        pass


def _step(*items: Delta) -> bytes:
    return encode_frame(Deltas(list(items)))


async def _client(limit: int = 16):
    reader = asyncio.StreamReader()
    client = ReplicaClient("r", reader, _Writer(), Ready(1, "m", "sim", 64, 1))  # type: ignore[arg-type]
    sink = _Sink()
    for rid in (1, 2):
        col = Collector(rid)
        col.sink, col.limit = sink, limit
        client._streams[rid] = col
    return client, reader, sink


async def _settle(client: ReplicaClient, reader: asyncio.StreamReader) -> None:
    for _ in range(3):
        await asyncio.sleep(0)
    reader.feed_eof()
    await asyncio.wait_for(client._task, 5)


async def test_the_steps_of_one_read_reach_each_request_as_one_piece() -> None:
    client, reader, sink = await _client()
    reader.feed_data(_step(Delta(1, [5], "a"), Delta(2, [9], "x"))
                     + _step(Delta(1, [6], "b"), Delta(2, [10], "y"))
                     + _step(Delta(1, [7], "c")))
    await _settle(client, reader)
    assert sorted(sink.got) == [(1, [5, 6, 7], "abc", FinishReason.NONE), (2, [9, 10], "xy", FinishReason.NONE)]


async def test_a_finish_goes_after_what_came_before_it_and_alone() -> None:
    client, reader, sink = await _client()
    reader.feed_data(_step(Delta(1, [5], "a")) + _step(Delta(1, [6], "b"))
                     + _step(Delta(1, [7], "c", finish=FinishReason.STOP)) + _step(Delta(1, [8], "late")))
    await _settle(client, reader)
    assert sink.got == [(1, [5, 6], "ab", FinishReason.NONE), (1, [7], "c", FinishReason.STOP)]


async def test_no_piece_is_merged_past_the_collectors_limit() -> None:
    client, reader, sink = await _client(limit=2)
    reader.feed_data(b"".join(_step(Delta(1, [t], chr(96 + t))) for t in range(1, 6)))
    await _settle(client, reader)
    assert sink.got == [(1, [1, 2], "ab", FinishReason.NONE), (1, [3, 4], "cd", FinishReason.NONE),
                        (1, [5], "e", FinishReason.NONE)]


async def test_steps_in_reads_of_their_own_go_one_by_one() -> None:
    client, reader, sink = await _client()
    for t in (1, 2):
        reader.feed_data(_step(Delta(1, [t], "ab"[t - 1])))
        for _ in range(3):
            await asyncio.sleep(0)
    await _settle(client, reader)
    assert sink.got == [(1, [1], "a", FinishReason.NONE), (1, [2], "b", FinishReason.NONE)]


async def _read(reader: asyncio.StreamReader, data: bytes) -> None:
    reader.feed_data(data)
    for _ in range(3):
        await asyncio.sleep(0)


async def test_tokens_without_text_wait_for_the_next_reads_tokens() -> None:
    # (a character's first bytes come as tokens without text; they make no
    # event of their own but join the next, which was up to 3 tokens past
    # chunk_tokens when the next read's 16 came as one piece)
    client, reader, sink = await _client(limit=4)
    await _read(reader, _step(Delta(1, [1], "")) + _step(Delta(1, [2], "")))
    assert sink.got == []
    await _read(reader, b"".join(_step(Delta(1, [t], "é" if t == 3 else "x")) for t in range(3, 7)))
    await _settle(client, reader)
    assert sink.got == [(1, [1, 2, 3, 4], "éx", FinishReason.NONE), (1, [5, 6], "xx", FinishReason.NONE)]


async def test_tokens_without_text_wait_one_read_at_most() -> None:
    # (the stall timer and the in-flight load see tokens as they come: a long
    # run of them without text, text held back for a long stop string, is
    # not held in the reader)
    client, reader, sink = await _client()
    await _read(reader, _step(Delta(1, [1], "")))
    assert sink.got == []
    await _read(reader, _step(Delta(1, [2], "")))
    assert sink.got == [(1, [1, 2], "", FinishReason.NONE)]
    await _read(reader, _step(Delta(1, [3], "")))
    await _read(reader, _step(Delta(1, [4], "")))
    await _settle(client, reader)
    assert sink.got[1:] == [(1, [3, 4], "", FinishReason.NONE)]


async def test_a_collector_without_a_limit_gets_every_step_as_it_came() -> None:
    # (a consumer that pulls merges what waits itself; merging in the reader
    # without a bound copied the piece at every step)
    client, reader, sink = await _client(limit=0)
    await _read(reader, _step(Delta(1, [1], "a")) + _step(Delta(1, [2], "")) + _step(Delta(1, [3], "b")))
    await _settle(client, reader)
    assert sink.got == [(1, [1], "a", FinishReason.NONE), (1, [2], "", FinishReason.NONE),
                        (1, [3], "b", FinishReason.NONE)]


async def test_a_merge_leaves_room_for_the_tokens_sent_without_text() -> None:
    # (tokens without text that waited their read and went on join the next
    # event: the next piece is merged to ``limit`` less them, not past it)
    client, reader, sink = await _client(limit=4)
    await _read(reader, _step(Delta(1, [1], "")))
    await _read(reader, _step(Delta(1, [2], "")))  # (waited a read: goes on, 2 tokens owed)
    await _read(reader, b"".join(_step(Delta(1, [t], "x")) for t in range(3, 8)))
    await _settle(client, reader)
    assert sink.got == [(1, [1, 2], "", FinishReason.NONE), (1, [3, 4], "xx", FinishReason.NONE),
                        (1, [5, 6, 7], "xxx", FinishReason.NONE)]
