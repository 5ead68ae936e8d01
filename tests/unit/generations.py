"""A real ``Generation`` on a real ``Collector``, with only the replica
connection stood in: the setup the unit tests of the relay share."""

from __future__ import annotations

from replicas.client import Collector
from replicas.pool import LoadHandle, ReplicaPool, ReplicaSlot
from replicas.protocol import FinishReason, SamplingParams
from replicas.spec import ReplicaSpec
from router.generation import Generation
from router.job import Job
from router.metrics import Metrics


class Client:
    """The replica connection: hands out collectors, records releases."""

    continues = True

    def __init__(self) -> None:
        self.released: list[int] = []

    def generate(self, params, **kw) -> Collector:
        return Collector(1)

    def abort(self, col: Collector) -> None:
        pass

    def release(self, col: Collector) -> None:
        self.released.append(col.rid)


class Sink:
    """A consumer that records pieces and the failure."""

    def __init__(self) -> None:
        self.pieces: list[tuple[str, int, FinishReason]] = []
        self.failure: BaseException | None = None

    def piece(self, text: str, n: int, finish: FinishReason) -> None:
        self.pieces.append((text, n, finish))

    def fail(self, exc: BaseException) -> None:
        self.failure = exc


def started(sink, prompt_token_ids: list[int] | None = None, max_tokens: int = 8,
            metrics: Metrics | None = None, scheduler=None) -> tuple[Generation, Collector, ReplicaSlot, Client]:
    """A generation attached to a stand-in replica, output going to ``sink``."""
    slot = ReplicaSlot(ReplicaSpec(name="r0"))
    client = slot.client = Client()  # type: ignore[assignment]
    job = Job("m", SamplingParams(max_tokens=max_tokens), prompt="p", prompt_token_ids=prompt_token_ids)
    gen = Generation(ReplicaPool([]), job, metrics or Metrics(), 0, scheduler=scheduler)
    gen.sink = sink
    gen._attach(LoadHandle(slot, max_tokens))
    assert gen._col is not None
    return gen, gen._col, slot, client
