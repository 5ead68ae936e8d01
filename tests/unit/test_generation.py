"""How a ``Generation`` counts its output and ends, driven by hand.

A real ``Generation`` over a real ``Collector``; only the replica
connection (``Client``: hands out collectors, records aborts) and the
consumer (``Sink``: records pieces and the failure) are stand-ins.
"""

from __future__ import annotations

from replicas.client import Collector
from replicas.pool import LoadHandle, ReplicaSlot
from replicas.protocol import Delta, FinishReason, SamplingParams
from replicas.spec import ReplicaSpec
from router.errors import BadRequest
from router.generation import Generation, Job, StreamLost
from router.metrics import Metrics

NONE, STOP, ERROR = FinishReason.NONE, FinishReason.STOP, FinishReason.ERROR


class Client:
    def generate(self, params, **kw) -> Collector:
        return Collector(1)

    def abort(self, col: Collector) -> None:
        pass

    def release(self, col: Collector) -> None:
        pass


class Sink:
    def __init__(self) -> None:
        self.pieces: list[tuple[str, int, FinishReason]] = []
        self.failure: BaseException | None = None

    def piece(self, text: str, n: int, finish: FinishReason) -> None:
        self.pieces.append((text, n, finish))

    def fail(self, exc: BaseException) -> None:
        self.failure = exc


def started(prompt_token_ids: list[int] | None = None) -> tuple[Generation, Collector, Sink, Metrics]:
    slot = ReplicaSlot(ReplicaSpec(name="r0"))
    slot.client = Client()  # type: ignore[assignment]
    metrics = Metrics()
    job = Job("m", SamplingParams(max_tokens=8), prompt="p", prompt_token_ids=prompt_token_ids)
    gen = Generation(None, job, metrics, 0)  # type: ignore[arg-type]
    sink = gen.sink = Sink()
    gen._attach(LoadHandle(slot, 8))
    assert gen._col is not None
    return gen, gen._col, sink, metrics


def lost(metrics: Metrics) -> float:
    return metrics.streams_lost._value.get()


async def test_output_without_token_ids_counts_one_token_per_chunk() -> None:
    gen, col, sink, _ = started()
    col.put(Delta(1, [], "Hel", NONE, count=1))
    col.put(Delta(1, [], "lo", NONE, count=2))  # the chunks of one read, merged
    assert gen.completion_tokens == 3 and not gen.exact
    assert gen._dog is not None and gen._dog.delivered  # the stall limit applies, not the first-token one
    col.put(Delta(1, [], "", STOP))
    assert sink.pieces == [("Hel", 1, NONE), ("lo", 2, NONE), ("", 0, STOP)]
    assert gen.completion_tokens == 3 and sink.failure is None


async def test_output_with_token_ids_is_exact() -> None:
    gen, col, sink, _ = started()
    col.put(Delta(1, [5, 6], "ab", NONE, [1, 2, 3]))
    assert gen.completion_tokens == 2 and gen.exact


async def test_an_engine_error_before_any_output_is_no_lost_stream() -> None:
    gen, col, sink, metrics = started([1, 2])
    col.put(Delta(1, [9], "x", ERROR, error="engine died"))
    assert isinstance(sink.failure, StreamLost) and not sink.pieces
    assert lost(metrics) == 0  # nothing reached the client (start_generation answers 500)


async def test_an_engine_error_after_output_is_a_lost_stream() -> None:
    gen, col, sink, metrics = started([1, 2])
    col.put(Delta(1, [9], "x", NONE))
    col.put(Delta(1, [], "", ERROR, error="engine died"))
    assert isinstance(sink.failure, StreamLost) and sink.pieces == [("x", 1, NONE)]
    assert lost(metrics) == 1


async def test_a_rejected_prompt_is_a_bad_request() -> None:
    gen, col, sink, metrics = started([1, 2])
    col.put(Delta(1, [], "", ERROR, error="prompt too long"))
    assert isinstance(sink.failure, BadRequest) and lost(metrics) == 0
