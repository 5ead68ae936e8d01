"""What a stream its client left counts: the tokens its resume buffer holds.

A slow client's transport pauses; the generation's pieces then wait in the
push relay (merged) while its tokens arrive. A client that leaves then
leaves the stream resumable at the tokens its events hold: a resume
generates the rest again, and counts them (``Outcome.counted``: from the
buffer's tokens on). The request it left must count only the buffer's
tokens, or those are counted (and charged to the tenant's token bucket)
twice. Runs the real relay, ``EventStream``, ``Generation`` and
``Outcome``; only the socket, the replica and the stores are stand-ins.
"""

from __future__ import annotations

import asyncio
import time
from types import SimpleNamespace

import pytest

from replicas.protocol import Delta, FinishReason
from router.metrics import Metrics
from router.push import PushRelay, TransportWire
from router.relay import EventStream, Outcome
from router.sse import ChunkEncoder
from tests.unit.generations import started
from tests.unit.test_push import Cycle

NONE = FinishReason.NONE


class _Buffer:
    """The resume buffer's writer: the token ids it was given."""

    def __init__(self) -> None:
        self.token_ids: list[int] = []
        self.detached = False

    def append(self, sid, event, token_ids, text_len) -> None:
        self.token_ids += token_ids

    def appender(self, sid):
        return None

    async def detach(self, sid, text_len) -> None:
        self.detached = True

    async def finish(self, sid, final, text_len) -> None:
        raise AssertionError("a stream its client left is not finished")


class _Admission:
    def __init__(self) -> None:
        self.store = SimpleNamespace(shared=False, healthy=True)
        self.used: list[int] = []

    async def finish(self, ticket, used: int) -> None:
        self.used.append(used)


@pytest.mark.parametrize("resumable", [True, False])
async def test_a_stream_left_behind_a_paused_transport_counts_what_its_buffer_holds(resumable: bool) -> None:
    cycle = Cycle()
    relay = PushRelay(limit=16)
    tasks: list[asyncio.Task] = []
    metrics = Metrics()
    buffer, admission = _Buffer(), _Admission()
    svc = SimpleNamespace(metrics=metrics, admission=admission, resume=buffer,
                          background=lambda coro: tasks.append(asyncio.ensure_future(coro)) or tasks[-1])
    gen, col, slot, client = started(relay, prompt_token_ids=[1, 2, 3], max_tokens=8, metrics=metrics)
    policy = SimpleNamespace(name="t", priority="normal", log_content=False)
    outcome = Outcome(svc, policy, "completions", time.monotonic(), "rid")  # type: ignore[arg-type]
    es = EventStream(svc, gen, ChunkEncoder(False, "cmpl-x", "m", 0), (False, False), policy,  # type: ignore[arg-type]
                     SimpleNamespace(done=False), outcome, "rid" if resumable else None)  # type: ignore[arg-type]
    run = asyncio.ensure_future(relay.run(es, TransportWire(cycle)))
    col.put(Delta(1, [10], "a", NONE, [1, 2, 3]))
    await asyncio.sleep(0)
    assert cycle.transport.writes, "the first event went out"
    cycle.flow.pause_writing()  # the client stops reading
    for tok in (11, 12, 13):
        col.put(Delta(1, [tok], "b"))  # generated, waiting behind the paused transport
    await asyncio.sleep(0)
    assert gen.completion_tokens == 4
    cycle.disconnected = True
    run.cancel()  # (what the router does when the client's connection goes)
    with pytest.raises(asyncio.CancelledError):
        await run
    gen.close()  # (then, as router/fastpath.py ends a request: the abort, the settlement)
    es.settle()
    await asyncio.gather(*tasks)
    counted = metrics.tokens.labels("t", "completion")._value.get()
    if resumable:
        # a resume continues from the one token the buffer holds, and counts the others itself
        assert buffer.token_ids == [10] and buffer.detached
        assert counted == 1 and admission.used == [3 + 1], (counted, admission.used)
    else:
        # (not resumable, a WebSocket's: nothing will count them again)
        assert counted == 4 and admission.used == [3 + 4], (counted, admission.used)
