"""The token lane (router/lane.py) does what the layered path does.

Each test relays the same replica output twice through the real
``Generation``, ``PushRelay``, ``EventStream``, ``ChunkEncoder``,
``Scheduler``, ``Metrics`` and resume buffer (``ResumeWriter`` on a
``MemoryStore``): once as the replica readers deliver it (plain pieces to the
run's lane once it has one), once all through ``Collector.put``. The client's
bytes, the resume buffer, the generation's and the scheduler's counts and the
metrics must be the same. Only the socket is a stand-in.
"""

from __future__ import annotations

import asyncio
import time
from types import SimpleNamespace

from hypothesis import given, settings
from hypothesis import strategies as hs
from prometheus_client import Histogram

from replicas.client import Collector
from replicas.pool import LoadHandle, ReplicaPool
from policies.batching import AimdSettings
from replicas.protocol import Delta, FinishReason, SamplingParams
from replicas.spec import ReplicaSpec
from router.generation import Generation
from router.job import Job
from router.metrics import HistogramBatch, Metrics
from router.push import PushRelay, TransportWire
from router.relay import EventStream, Outcome
from router.resume import ResumeMeta, ResumeWriter
from router.scheduler import Scheduler
from router.scheduler_settings import SchedulerSettings
from router.sse import ChunkEncoder
from router.state.memory import MemoryStore
from tests.unit.generations import Client
from tests.unit.test_push import Cycle

NONE, STOP = FinishReason.NONE, FinishReason.STOP
PROMPT = [1, 2, 3]


def deliver(col: Collector, d: Delta) -> bool:
    """What the replica readers do with a delta (replicas/client.py,
    replicas/upstream_sse.py); True: the lane took it."""
    lane = col.lane
    if lane is not None and d.token_ids and not d.finish and d.prompt_token_ids is None and not d.count:
        if lane.tokens(d.token_ids, d.text):
            return True
    col.put(d)
    return False


async def relay(deltas: list[Delta], use_lane: bool, pause_at: int | None = None, chat: bool = True,
                adaptive: bool = False):
    """Relay ``deltas``; the client's transport pauses before delta
    ``pause_at`` and resumes two deltas later; ``adaptive``: the replica's
    in-flight cap learns from the stream's latencies. Returns what is
    compared and how many deltas the lane took."""
    store = MemoryStore()
    writer = ResumeWriter(store, 60)
    await writer.open("s1", ResumeMeta("t", chat, "m", "r1", 0, False, SamplingParams(max_tokens=64), PROMPT))
    metrics = Metrics()
    pool = ReplicaPool([ReplicaSpec(name="r0")])
    sched = Scheduler(pool, metrics, SchedulerSettings(), AimdSettings(enabled=adaptive))
    policy = SimpleNamespace(name="t", priority="normal", weight=2.0, chunk_tokens=16, log_content=False)
    svc = SimpleNamespace(metrics=metrics, resume=writer, background=asyncio.ensure_future)
    slot = pool.slots[0]
    slot.client = Client()  # type: ignore[assignment]
    gen = Generation(ReplicaPool([]), Job("m", SamplingParams(max_tokens=64), prompt_token_ids=list(PROMPT)),
                     metrics, 0, scheduler=sched, policy=policy)  # type: ignore[arg-type]
    sink = PushRelay(16)
    gen.sink = sink
    handle = LoadHandle(slot, 64)
    gen._attach(handle)
    col = gen._col
    assert col is not None
    es = EventStream(svc, gen, ChunkEncoder(chat, "r1", "m", 0), (False, False), policy,  # type: ignore[arg-type]
                     None, Outcome(svc, policy, "chat", time.monotonic(), "r1"), "s1")  # type: ignore[arg-type]
    cycle = Cycle()
    run = asyncio.ensure_future(sink.run(es, TransportWire(cycle)))
    await asyncio.sleep(0)
    taken = 0
    for i, d in enumerate(deltas):
        if i == pause_at:
            cycle.flow.pause_writing()
        elif pause_at is not None and i == pause_at + 2:
            cycle.flow.resume_writing()
            await asyncio.sleep(0)  # the request task writes what waited
        if use_lane:
            taken += deliver(col, d)
        else:
            col.put(d)
    await asyncio.wait_for(run, 1)
    es.settle()
    await asyncio.sleep(0.01)
    snap = await store.stream_read("s1", 0)
    assert snap is not None
    itl = metrics.child(metrics.itl, "t", "normal")
    state = {
        "writes": cycle.transport.writes,
        "buffer": (snap.events, snap.token_ids, snap.text_len, snap.finished),
        "gen": (gen.completion_ids, gen.text_len, gen.completion_tokens, gen.finish, gen.ended),
        "load": (slot.inflight, slot.inflight_tokens),
        "fair share": sched.counters.values,
        "itl samples": sum(b.get() for b in itl._buckets),
        "tokens": metrics.child(metrics.tokens, "t", "completion")._value.get(),
        "cap samples": len(sched.limiter(slot)._itl),
    }
    return state, taken


def _stream(texts: list[str]) -> list[Delta]:
    out = [Delta(1, [100], texts[0], NONE, list(PROMPT))]
    out += [Delta(1, [101 + i, 201 + i] if i % 3 == 0 else [101 + i], t, NONE) for i, t in enumerate(texts[1:-1])]
    out.append(Delta(1, [999], texts[-1], STOP))
    return out


TEXTS = ["He", "llo", ' wo"rld\n', "\u00e9", "\\", "", "\U0001f600", "end", "."]


async def test_the_lane_relays_exactly_what_the_layered_path_does() -> None:
    for chat in (True, False):
        layered, none = await relay(_stream(TEXTS), use_lane=False, chat=chat)
        laned, taken = await relay(_stream(TEXTS), use_lane=True, chat=chat)
        assert none == 0
        # all but the first (no lane after a stream's first token), the second
        # (it attaches the lane), the one with no text and the one after it
        # (it carries the ids of the one with no text: no event of their own),
        # and the last (a finish)
        assert taken == len(TEXTS) - 5
        assert laned == layered


async def test_an_adaptive_cap_gets_the_same_latency_samples() -> None:
    layered, _ = await relay(_stream(TEXTS), use_lane=False, adaptive=True)
    laned, taken = await relay(_stream(TEXTS), use_lane=True, adaptive=True)
    assert taken and laned == layered and laned["cap samples"] == len(TEXTS) - 1


async def test_a_failing_histogram_flush_ends_only_its_stream(monkeypatch) -> None:
    # (prometheus-client's internals changed under HistogramBatch, say): the
    # samples are lost and logged, the stream is not, its replica slot is
    # freed, and nothing escapes to the replica connection's reader
    def broken(self) -> None:
        raise AttributeError("'Histogram' object has no attribute '_sum'")

    monkeypatch.setattr(HistogramBatch, "flush", broken)
    layered, _ = await relay(_stream(TEXTS), use_lane=False)
    state, taken = await relay(_stream(TEXTS), use_lane=True)
    assert taken
    assert state["load"] == (0, 0)
    assert state["writes"] == layered["writes"] and state["writes"][-1].endswith(b"data: [DONE]\n\n")


async def test_samples_reach_the_histogram_within_a_second_while_tokens_pause() -> None:
    metrics = Metrics()
    child = metrics.child(metrics.itl, "t", "normal")
    batch = HistogramBatch(child, every=0.05, loop=asyncio.get_running_loop())
    for v in (0.01, 0.02, 0.03):
        batch.add(v)
    assert sum(b.get() for b in child._buckets) == 0  # not yet
    await asyncio.sleep(0.1)  # no more samples: the timer adds them
    assert sum(b.get() for b in child._buckets) == 3
    assert batch.timer is None


async def test_a_paused_client_sends_the_pieces_through_the_queue_in_order() -> None:
    # while the transport is paused the lane declines, and after it resumes
    # the lane waits until the pieces queued meanwhile are out
    texts = TEXTS[:5] + ["x", "y"] + TEXTS[5:]
    layered, _ = await relay(_stream(texts), use_lane=False, pause_at=3)
    laned, taken = await relay(_stream(texts), use_lane=True, pause_at=3)
    assert laned == layered
    _, unpaused = await relay(_stream(texts), use_lane=True)
    assert taken == unpaused - 2  # it declined the two pieces that came while the client was paused, no more


@settings(max_examples=30, deadline=None)
@given(hs.lists(hs.text(max_size=6), min_size=3, max_size=12), hs.booleans())
def test_any_text_relays_the_same_both_ways(texts: list[str], chat: bool) -> None:
    async def both():
        return (await relay(_stream(texts), use_lane=False, chat=chat))[0], \
            (await relay(_stream(texts), use_lane=True, chat=chat))[0]

    layered, laned = asyncio.run(both())
    assert laned == layered


def test_a_histogram_batch_exports_what_observe_does() -> None:
    from prometheus_client import CollectorRegistry, generate_latest

    values = [0.0005, 0.001, 0.0011, 0.02, 0.02, 0.3, 7.0, 0.0, 1e-9, 2.0]
    pages = []
    for batched in (False, True):
        reg = CollectorRegistry()
        h = Histogram("h_seconds", "h", ["tenant"], buckets=(0.001, 0.01, 0.1, 1, 2), registry=reg)
        child = h.labels("t")
        if batched:
            batch = HistogramBatch(child)
            for i, v in enumerate(values):
                batch.add(v)
                if i % 4 == 3:
                    batch.flush()
            batch.flush()
        else:
            for v in values:
                child.observe(v)
        pages.append(b"\n".join(line for line in generate_latest(reg).splitlines() if b"_created" not in line))
    assert pages[0] == pages[1]
