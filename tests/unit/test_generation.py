"""How a ``Generation`` counts its output and ends, driven by hand.

A real ``Generation`` over a real ``Collector``; only the replica
connection (``Client``: hands out collectors, records aborts) and the
consumer (``Sink``: records pieces and the failure) are stand-ins.
"""

from __future__ import annotations

import asyncio
import time
from types import SimpleNamespace

import pytest

from replicas.client import Collector, ReplicaDead
from replicas.protocol import FEATURES, Delta, FinishReason, Ready, SamplingParams
from router.errors import BadRequest, RouterShutdown
from policies.batching import AimdSettings
from replicas.pool import CONTINUES, LoadHandle, ReplicaPool, ReplicaSlot
from replicas.spec import ReplicaSpec
from router.deadlines import Deadlines, Stalled, StreamTimeout
from router.generation import Generation, StreamLost
from router.job import Job
from router.scheduler import Scheduler
from router.scheduler_settings import SchedulerSettings
from router.metrics import Metrics
from router.relay import EventStream
from router.resume import ResumeMeta, ResumeWriter
from router.resume_http import handle_resume, parse_last_event_id
from router.sse import ChunkEncoder
from router.state.memory import MemoryStore
from tests.unit.generations import Client, Sink
from tests.unit.generations import started as _started
from tests.unit.pools import queueing_policy

NONE, STOP, ERROR = FinishReason.NONE, FinishReason.STOP, FinishReason.ERROR


def started(prompt_token_ids: list[int] | None = None) -> tuple[Generation, Collector, Sink, Metrics]:
    sink, metrics = Sink(), Metrics()
    gen, col, _, _ = _started(sink, prompt_token_ids, metrics=metrics)
    return gen, col, sink, metrics


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


async def test_a_stream_whose_token_ids_stop_ends_its_resume_buffer_with_an_error() -> None:
    store = MemoryStore()
    writer = ResumeWriter(store, 60)
    await writer.open("s1", ResumeMeta("t", False, "m", "cmpl-s1", 0, False, SamplingParams(max_tokens=8), [1, 2]))
    tasks: list[asyncio.Future] = []
    svc = SimpleNamespace(metrics=Metrics(), resume=writer, background=lambda c: tasks.append(asyncio.ensure_future(c)))
    policy = SimpleNamespace(name="t", priority="normal")
    gen, col, sink, _ = started([1, 2])
    es = EventStream(svc, gen, ChunkEncoder(False, "cmpl-s1", "m", 0), (False, False), policy, None,  # type: ignore[arg-type]
                     SimpleNamespace(started=time.monotonic()), "s1")  # type: ignore[arg-type]
    col.put(Delta(1, [5], "a", NONE))
    assert es.event("a", 1, NONE) is not None
    col.put(Delta(1, [], "b", NONE, count=1))  # the upstream stops sending ids
    live = es.event("b", 1, NONE)
    assert live is not None and b'"b"' in live  # the client still gets it
    await asyncio.gather(*tasks)
    snap = await store.stream_read("s1", 0)
    assert snap is not None and snap.finished and snap.token_ids == [5]
    assert b'"a"' in snap.events[0] and b"not_resumable" in snap.events[-1]
    assert not any(b'"b"' in e for e in snap.events)  # never a continuation without ids
    # a client that read the live events past the buffer's end learns why it cannot resume
    svc.store = store
    for last_id in ("2", "3"):  # live events "b", ...: plain ids, at and past the buffer's error event
        with pytest.raises(BadRequest) as refused:
            await handle_resume(svc, policy, "s1", parse_last_event_id(last_id))  # type: ignore[arg-type]
        assert refused.value.code == "not_resumable" and "no token ids" in refused.value.message
    # one that stopped before: gets the error event from the buffer
    assert await handle_resume(svc, policy, "s1", parse_last_event_id("1-1-1")) is not None  # type: ignore[arg-type]



def _scheduler() -> Scheduler:
    return Scheduler(ReplicaPool([]), Metrics(), SchedulerSettings(), AimdSettings())


async def test_stop_all_ends_a_running_generation_once_and_refuses_new_ones() -> None:
    sched = _scheduler()
    sink = Sink()
    gen, col, _, _ = _started(sink, scheduler=sched)
    assert gen in sched.running  # what a stopping router ends
    col.put(Delta(1, [5], "a", NONE))
    assert sched.stop_all() == (1, 0)
    first = sink.failure
    assert isinstance(first, RouterShutdown) and gen.ended and gen not in sched.running
    col.put(Delta(1, [6], "b", NONE))  # the replica's late output goes nowhere
    gen.stop(RouterShutdown())
    assert sink.failure is first and sink.pieces == [("a", 1, NONE)]
    # a generation dispatched just before the stop does not start on its replica
    late = Sink()
    gen2 = Generation(ReplicaPool([]), gen.job, Metrics(), 0, scheduler=sched)
    gen2.sink = late
    slot = ReplicaSlot(ReplicaSpec(name="r1"))
    slot.client = Client()  # type: ignore[assignment]
    handle = LoadHandle(slot, 8)
    gen2._attach(handle)
    assert isinstance(late.failure, RouterShutdown) and gen2._col is None and not sched.running
    assert slot.inflight == 0, "its replica slot is given back"


async def test_a_finished_generation_leaves_the_running_set() -> None:
    sched = _scheduler()
    sink = Sink()
    gen, col, _, _ = _started(sink, scheduler=sched)
    col.put(Delta(1, [5], "a", STOP))
    assert gen.ended and gen not in sched.running
    gen.stop(RouterShutdown())
    assert sink.failure is None


@pytest.mark.parametrize("first_token", [0.0, 10.0])
async def test_the_stall_limit_runs_from_the_first_token_whatever_the_other_limits(first_token: float) -> None:
    # first_token 0 (none) or later than total: before the first token the
    # timer waits for total; the first token must bring the stall limit in
    sink = Sink()
    slot = ReplicaSlot(ReplicaSpec(name="r0"))
    slot.client = Client()  # type: ignore[assignment]
    job = Job("m", SamplingParams(max_tokens=100), prompt_token_ids=[1, 2])
    gen = Generation(ReplicaPool([]), job, Metrics(), 0, Deadlines(first_token=first_token, stall=0.1, total=3.0))
    gen.sink = sink
    gen._attach(LoadHandle(slot, 100))
    gen._col.put(Delta(1, [7], "x", FinishReason.NONE))  # the first token; then the replica goes silent
    await asyncio.sleep(0.6)
    # noticed (no other replica to fail over to: the stream is lost), not at total
    assert isinstance(sink.failure, StreamLost), f"no stall after 0.6 s; the watchdog waits for {gen._dog._which!r}"


async def test_a_request_the_replica_connection_cannot_send_frees_its_slot_and_is_lost() -> None:
    class Unsendable(Client):
        def generate(self, params, **kw):
            raise OverflowError("can't serialize ints > 2**64 - 1")

    sink = Sink()
    slot = ReplicaSlot(ReplicaSpec(name="r0"))
    slot.client = Unsendable()  # type: ignore[assignment]
    job = Job("m", SamplingParams(max_tokens=4), prompt_token_ids=[1, 2])
    gen = Generation(ReplicaPool([]), job, Metrics(), 0, Deadlines(first_token=0, stall=0, total=0))
    gen.sink = sink
    handle = LoadHandle(slot, 4)
    assert slot.inflight == 1
    gen._attach(handle)
    assert slot.inflight == 0  # before, the slot stayed taken for good
    assert isinstance(sink.failure, StreamLost)


class _Replica(Client):
    """A ready replica connection serving model ``m``; records what it was asked."""

    closed = None
    refused = False
    credentials_refused = None
    model = "m"
    load = None
    ready = Ready(1, "m", "sim", 4096, 1, int(FEATURES))  # (this version's: every field taken)

    def __init__(self) -> None:
        super().__init__()
        self.asked: list[dict] = []

    def generate(self, params, **kw) -> Collector:
        self.asked.append(kw)
        return Collector(len(self.asked))


def _on_one_replica(failover_wait: float, deadlines: Deadlines | None = None):
    """A generation on the only replica of its pool, 2 tokens delivered."""
    pool = ReplicaPool([ReplicaSpec(name="r0")])
    slot = pool.slots[0]
    slot.client, slot.state = _Replica(), "ready"  # type: ignore[assignment]
    sink = Sink()
    job = Job("m", SamplingParams(max_tokens=8), prompt="p", prompt_token_ids=[1, 2])
    gen = Generation(pool, job, Metrics(), 3, deadlines, failover_wait=failover_wait)
    gen.sink = sink
    gen._attach(pool.choose("m", 8))
    col = gen._col
    assert col is not None
    col.put(Delta(1, [5, 6], "ab", NONE))
    return pool, slot, gen, col, sink


async def test_a_failover_with_no_ready_replica_waits_for_one_and_continues_token_exact() -> None:
    pool, slot, gen, col, sink = _on_one_replica(failover_wait=5.0)
    slot.state = "down"  # its only replica died: the supervisor restarts it
    col.fail(ReplicaDead("replica r0 closed the connection"))
    assert sink.failure is None and not gen.ended and gen._col is None  # waiting
    assert slot.inflight == 0
    restarted = _Replica()
    slot.client, slot.state = restarted, "ready"  # type: ignore[assignment]
    pool.notify_ready()
    assert restarted.asked == [{"prompt_token_ids": [1, 2], "prefix_token_ids": [5, 6], "prefix_text_len": 2}]
    assert gen._col is not None and slot.inflight == 1
    gen._col.put(Delta(1, [7], "c", STOP))
    assert sink.pieces == [("ab", 2, NONE), ("c", 1, STOP)] and sink.failure is None
    assert gen.completion_ids == [5, 6, 7] and gen.failovers == 1


async def test_a_failover_that_waits_in_vain_ends_the_stream_as_lost() -> None:
    pool, slot, gen, col, sink = _on_one_replica(failover_wait=0.05)
    slot.state = "down"
    col.fail(ReplicaDead("replica r0 closed the connection"))
    assert sink.failure is None
    await asyncio.sleep(0.1)
    assert isinstance(sink.failure, StreamLost) and "none became ready within 0.05s" in str(sink.failure)
    assert not pool._ready_waiters


async def test_a_failover_waits_no_longer_than_the_tenants_total_limit_and_ends_as_its_timeout() -> None:
    pool, slot, gen, col, sink = _on_one_replica(failover_wait=30.0,
                                                 deadlines=Deadlines(total=0.1, start=time.monotonic()))
    slot.state = "down"
    col.fail(ReplicaDead("replica r0 closed the connection"))
    await asyncio.sleep(0.2)
    assert isinstance(sink.failure, StreamTimeout) and sink.failure.which == "total"
    assert not pool._ready_waiters


async def test_a_stream_closed_while_it_waits_for_a_replica_is_not_continued() -> None:
    pool, slot, gen, col, sink = _on_one_replica(failover_wait=5.0)
    slot.state = "down"
    col.fail(ReplicaDead("replica r0 closed the connection"))
    gen.close()  # the client left
    assert not pool._ready_waiters and gen._waiting is None  # (at once, not at the next ready replica)
    restarted = _Replica()
    slot.client, slot.state = restarted, "ready"  # type: ignore[assignment]
    pool.notify_ready()
    assert restarted.asked == [] and slot.inflight == 0 and not pool._ready_waiters


async def test_a_stopping_router_ends_a_stream_that_waits_for_a_replica() -> None:
    sched = _scheduler()
    pool, slot, gen, col, sink = _on_one_replica(failover_wait=5.0)
    gen.scheduler = sched
    slot.state = "down"
    col.fail(ReplicaDead("replica r0 closed the connection"))
    assert gen in sched.running
    sched.stop_all()
    assert isinstance(sink.failure, RouterShutdown) and gen not in sched.running and not pool._ready_waiters


async def test_with_no_failover_wait_a_stream_without_a_ready_replica_is_lost_at_once() -> None:
    pool, slot, gen, col, sink = _on_one_replica(failover_wait=0.0)
    slot.state = "down"
    col.fail(ReplicaDead("replica r0 closed the connection"))
    assert isinstance(sink.failure, StreamLost)


def _ready_pool(*names: str) -> ReplicaPool:
    pool = ReplicaPool([ReplicaSpec(name=n) for n in names])
    for slot in pool.slots:
        slot.client, slot.state = _Replica(), "ready"  # type: ignore[assignment]
    return pool


def _running(pool: ReplicaPool, metrics: Metrics, max_tokens: int, max_failovers: int,
             failover_wait: float) -> tuple[Generation, Sink]:
    """A generation started on ``pool``'s choice, its output going to a ``Sink``."""
    job = Job("m", SamplingParams(max_tokens=max_tokens), prompt="p", prompt_token_ids=[1, 2])
    gen = Generation(pool, job, metrics, max_failovers, None, failover_wait=failover_wait)
    gen.sink = sink = Sink()
    gen._attach(pool.choose("m", max_tokens))
    return gen, sink


async def test_replicas_found_dead_on_the_way_do_not_use_up_the_failovers() -> None:
    # (all replicas killed at once: the stream went to one already dead, not
    # yet seen down, and that death counted as a failover too. A stream with
    # max_failovers 1 was lost at the second death of a replica serving it.)
    pool = _ready_pool("r0", "r1", "r2")
    metrics = Metrics()
    gen, sink = _running(pool, metrics, max_tokens=8, max_failovers=1, failover_wait=0.0)
    gen._col.put(Delta(1, [5], "a", NONE))
    gen._col.fail(ReplicaDead("killed"))  # a death with output: failover 1 of 1
    gen._col.fail(ReplicaDead("connection reset"))  # the next one was dead already: not charged
    assert not gen.ended and gen.failovers == 2
    gen._col.put(Delta(1, [6], "b", NONE))
    gen._col.fail(ReplicaDead("killed"))  # a second death with output: past max_failovers
    assert gen.ended and sink.failure is not None and "gave up after 1 failovers" in str(sink.failure)
    assert gen.failovers == 2  # (moves: the give-up is none; the log said 3 here, "after 1")
    assert sum(metrics.failovers.labels(s.name)._value.get() for s in pool.slots) == 2


async def test_going_straight_back_to_the_only_replica_and_finding_it_dead_is_one_death_not_two() -> None:
    # (a single url: upstream SIGKILLed: the stream went straight back to it,
    # the only one ready, and its refused connect was charged too: each
    # crash cost two failovers, and the third crash lost the stream)
    pool = _ready_pool("solo")
    slot = pool.slots[0]
    metrics = Metrics()
    gen, sink = _running(pool, metrics, max_tokens=20, max_failovers=3, failover_wait=5.0)
    for death in range(3):
        gen._col.put(Delta(1, [10 + death], "x", NONE))
        gen._col.fail(ReplicaDead("replica solo closed the connection"))  # charged: failover death+1 of 3
        assert gen.replica == "solo" and gen._col is not None  # straight back: the only one ready
        slot.state = "down"  # ... and found dead (its connect refused): free; the stream waits
        gen._col.fail(ReplicaDead("connect refused"))
        assert not gen.ended and gen._col is None, (death, sink.failure)
        slot.client, slot.state = _Replica(), "ready"  # type: ignore[assignment]
        pool.notify_ready()
        assert gen._col is not None
    gen._col.put(Delta(1, [20], "y", STOP))
    assert sink.failure is None and gen.completion_ids == [10, 11, 12, 20]
    # a stall on going straight back is a replica alive and slow: charged as any failover (the
    # stream waits for the stalled replica to answer a ping, which makes it ready again)
    gen3, sink3 = _running(pool, metrics, max_tokens=20, max_failovers=1, failover_wait=5.0)
    gen3._col.put(Delta(1, [10], "x", NONE))
    gen3._col.fail(ReplicaDead("closed"))  # charged 1 of 1, straight back
    gen3._col.fail(Stalled("replica solo produced no token for 10s"))  # not freed: the single free retry
    assert gen3._col is None and not gen3.ended and slot.status == "stalled"
    assert slot.answered(time.monotonic())
    pool.notify_ready()
    gen3._col.fail(Stalled("replica solo produced no token for 10s"))  # nothing left
    assert gen3.ended and "gave up after 1 failovers" in str(sink3.failure)
    assert slot.answered(time.monotonic())
    # a replica that takes the stream and dies at once, over and over, while it stays ready: a
    # freed retry is never followed by another, so the stream gives up within its budget
    gen2, sink2 = _running(pool, metrics, max_tokens=20, max_failovers=1, failover_wait=0.0)
    gen2._col.put(Delta(1, [10], "x", NONE))
    deaths = 0
    while not gen2.ended:
        gen2._col.fail(ReplicaDead("closed"))
        deaths += 1
        assert deaths <= 2 * (1 + 1) + 1  # (max_failovers 1, one free retry: each may be followed by one freed)
    assert "gave up after 1 failovers" in str(sink2.failure)


async def test_a_chat_moved_before_its_prompt_ids_came_renders_its_chat_template_kwargs_again() -> None:
    # (the next replica renders the messages again: without the kwargs it
    # would render another prompt than the one the client asked for)
    pool = ReplicaPool([ReplicaSpec(name="r0"), ReplicaSpec(name="r1")])
    for slot in pool.slots:
        slot.client, slot.state = _Replica(), "ready"  # type: ignore[assignment]
    messages, kwargs = [{"role": "user", "content": "hi"}], {"enable_thinking": False}
    job = Job("m", SamplingParams(max_tokens=8), messages=messages, template_kwargs=kwargs, reasoning_effort="low")
    gen = Generation(pool, job, Metrics(), 3, failover_wait=0)
    gen.sink = sink = Sink()
    gen._attach(pool.choose("m", 8))
    first = gen.replica
    assert gen._col is not None
    gen._col.fail(ReplicaDead(f"replica {first} closed the connection"))
    assert gen.replica != first and sink.failure is None
    want = {"prompt": None, "messages": messages, "chat_template_kwargs": kwargs, "reasoning_effort": "low"}
    assert [slot.client.asked for slot in pool.slots] == [[want], [want]]  # type: ignore[attr-defined]


async def test_a_stream_that_fails_on_every_ready_replica_does_not_go_straight_back_to_the_last() -> None:
    # (a frozen replica and a starved one, both still "ready": the stream
    # went from the frozen one to the starved one, back, and then to the
    # frozen one again, spending a failover on the replica that had just
    # stalled it while the other was ready)
    pool = ReplicaPool([ReplicaSpec(name=f"r{i}") for i in range(2)])
    for slot in pool.slots:
        slot.client, slot.state = _Replica(), "ready"  # type: ignore[assignment]
    sink = Sink()
    job = Job("m", SamplingParams(max_tokens=20), prompt="p", prompt_token_ids=[1, 2])
    gen = Generation(pool, job, Metrics(), 10, None, failover_wait=0.0)
    gen.sink = sink
    gen._attach(LoadHandle(pool.slots[0], 20))
    went = []
    for i in range(6):
        gen._col.put(Delta(1, [10 + i], "x", NONE))
        gen._col.fail(ReplicaDead("no token for 10s"))  # both stay ready
        went.append(gen.replica)
    assert went == ["r1", "r0", "r1", "r0", "r1", "r0"] and not gen.ended and sink.failure is None
    # the only ready replica is taken again, even the one that just failed it
    pool.slots[0].state = "down"
    gen._col.put(Delta(1, [20], "x", NONE))
    gen._col.fail(ReplicaDead("no token for 10s"))
    assert gen.replica == "r1"
    gen._col.put(Delta(1, [21], "x", NONE))
    gen._col.fail(ReplicaDead("no token for 10s"))
    assert gen.replica == "r1" and gen.failovers == 8 and not gen.ended


def _waiting_for_replicas(n: int, caps: int, *names: str, failover_wait: float = 5.0, scheduler=None):
    """``n`` generations on ``names`` in turn (each replica's
    ``max_concurrency`` ``caps``), 2 tokens delivered each; then every
    replica dies: they all wait for one, in the order of the list."""
    pool = ReplicaPool([ReplicaSpec(name=name, max_concurrency=caps) for name in names])
    for slot in pool.slots:
        slot.client, slot.state = _Replica(), "ready"  # type: ignore[assignment]
    gens, sinks = [], []
    for i in range(n):
        job = Job("m", SamplingParams(max_tokens=8), prompt="p", prompt_token_ids=[1, 2])
        gen = Generation(pool, job, Metrics(), 3, None, scheduler=scheduler, failover_wait=failover_wait)
        gen.sink = sink = Sink()
        for j, slot in enumerate(pool.slots):  # (the pool's choice, made to be this one)
            slot.state = "ready" if j == i % len(names) else "down"
        gen._attach(pool.choose("m", 8))
        gen._col.put(Delta(1, [5, 6], "ab", NONE))
        gens.append(gen)
        sinks.append(sink)
    for slot in pool.slots:
        slot.state = "down"
    for gen in gens:
        gen._col.fail(ReplicaDead(f"replica {gen.replica} closed the connection"))
    assert all(gen._waiting is not None and gen._col is None for gen in gens)
    assert [s.inflight for s in pool.slots] == [0] * len(names)
    return pool, gens, sinks


def _back(pool: ReplicaPool, name: str) -> _Replica:
    """Replica ``name`` restarted and is ready again (the supervisor's notify_ready)."""
    slot = next(s for s in pool.slots if s.name == name)
    slot.client, slot.state = _Replica(), "ready"  # type: ignore[assignment]
    pool.notify_ready()
    return slot.client  # type: ignore[return-value]


async def test_streams_that_waited_for_a_replica_continue_only_where_one_has_room_in_the_order_they_waited(
        caplog: pytest.LogCaptureFixture) -> None:
    # (every replica of the model down: the 4 streams waiting all continued on the first
    # one back, past its max_concurrency of 2, while the other came back soon after)
    caplog.set_level("INFO", "fairstream.generation")
    pool, gens, sinks = _waiting_for_replicas(4, 2, "r0", "r1")
    r0, r1 = pool.slots
    first = _back(pool, "r0")
    assert r0.inflight == 2 and len(first.asked) == 2, "past its max_concurrency"
    assert [g._col is not None for g in gens] == [True, True, False, False]  # the first to wait go first
    assert all(g._waiting is not None for g in gens[2:]) and len(pool._waiter_keys) == 2
    second = _back(pool, "r1")
    assert r1.inflight == 2 and len(second.asked) == 2 and not pool._ready_waiters
    assert [g.replica for g in gens] == ["r0", "r0", "r1", "r1"]
    for gen, sink in zip(gens, sinks):  # token-exact from what was delivered, one failover each
        assert gen.failovers == 1 and sink.failure is None and gen._waiting is None
        gen._col.put(Delta(1, [7], "c", STOP))
        assert sink.pieces == [("ab", 2, NONE), ("c", 1, STOP)] and gen.completion_ids == [5, 6, 7]
    assert [s.inflight for s in pool.slots] == [0, 0]
    lines = [r.getMessage() for r in caplog.records if " continues on " in r.getMessage()]
    assert lines == [f"stream on {a} continues on {b}, which became ready"
                     for a, b in (("r0", "r0"), ("r1", "r0"), ("r0", "r1"), ("r1", "r1"))], lines


async def test_room_on_a_ready_replica_goes_to_a_stream_that_waits_before_the_queued_requests() -> None:
    pool, gens, sinks = _waiting_for_replicas(3, 1, "r0")
    sched = Scheduler(pool, Metrics(), SchedulerSettings(), AimdSettings(enabled=False))  # (cap: max_concurrency 1)
    for gen in gens:
        gen.scheduler = sched
    slot = pool.slots[0]
    _back(pool, "r0")
    assert [g._col is not None for g in gens] == [True, False, False] and slot.inflight == 1
    policy = queueing_policy("t")
    queued = asyncio.create_task(sched.acquire(policy, 1, "m", 8))  # a new request: the replica is full
    await asyncio.sleep(0)
    assert sched.queued("t") == 1
    # each stream that ends hands its room to the next that waits, in order; then to the queue
    on_r0_after = [[False, True, False], [False, False, True], [False, False, False]]
    for i in range(3):
        gens[i]._col.put(Delta(1, [7], "c", STOP))
        assert sinks[i].failure is None and gens[i].ended
        await asyncio.sleep(0.01)  # (the queue's dispatch runs a turn later)
        assert [g._col is not None for g in gens] == on_r0_after[i], i
        assert sched.queued("t") == (1 if i < 2 else 0) and queued.done() == (i == 2), i
    assert [g.failovers for g in gens] == [1, 1, 1] and [s.pieces[-1] for s in sinks] == [("c", 1, STOP)] * 3
    assert slot.inflight == 1
    (await queued).release()
    assert slot.inflight == 0 and not sched.running and not pool._ready_waiters


def test_room_of_another_model_asks_none_of_the_streams_that_wait() -> None:
    # (every request and every stream end asked every waiting stream while
    # any replica had room: with 500 streams waiting for a model that
    # restarts, 2.8 ms per request of every other model)
    pool = ReplicaPool([ReplicaSpec(name="b0")])

    class _OtherModel(_Replica):
        model = "b"

    pool.slots[0].client, pool.slots[0].state = _OtherModel(), "ready"  # type: ignore[assignment]
    asked: list[str] = []
    for name in ("first", "second"):  # (two streams waiting for model m, none of whose replicas is ready)
        pool.when_ready(lambda name=name: asked.append(name) or True, "m")
    for _ in range(3):
        pool.try_choose("b", 8).release()
    pool.notify_ready()
    assert asked == [] and pool.waiting
    pool.slots[0].client.model = "m"  # (a replica of m with room: its waiters in order, until one finds none)
    pool.offer_room()
    assert asked == ["first"]


def test_waiters_of_a_model_are_asked_in_the_order_they_began_to_wait_whatever_they_need() -> None:
    # (kept per (model, needs), the waiters of the key made first were asked
    # first: one needing a feature that began to wait before another was
    # served after it, and with steady failovers could be passed over)
    pool = ReplicaPool([ReplicaSpec(name="r0", max_concurrency=1)])
    slot = pool.slots[0]
    slot.client, slot.state = _Replica(), "ready"  # type: ignore[assignment]
    slot.inflight = 1  # full
    order: list[str] = []
    handles = []

    def wait(name: str, needs: int) -> None:
        def ready() -> bool | None:
            handle = pool.choose_room("m", 1, None, needs)
            if handle is None:
                return True
            order.append(name)
            handles.append(handle)
            return None
        pool.when_ready(ready, "m", needs)

    wait("a0", 0)
    wait("b1", 1)  # (began to wait before c0)
    wait("c0", 0)
    slot.inflight = 0
    pool.offer_room()
    assert order == ["a0"]
    handles[-1].release()
    assert order == ["a0", "b1"], order


def test_a_waiter_for_any_replica_that_goes_on_waiting_does_not_hide_the_others() -> None:
    pool = ReplicaPool([ReplicaSpec(name="r0")])
    pool.slots[0].client, pool.slots[0].state = _Replica(), "ready"  # type: ignore[assignment]
    called: list[int] = []
    pool.when_ready(lambda: called.append(1) or True)  # (goes on waiting)
    pool.when_ready(lambda: called.append(2))
    pool.notify_ready()
    assert called == [1, 2], called


async def test_a_stream_whose_wait_runs_out_while_the_ready_replicas_are_full_continues_past_the_cap(
        caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level("INFO", "fairstream.generation")
    pool, gens, sinks = _waiting_for_replicas(2, 1, "r0", failover_wait=0.1)
    slot = pool.slots[0]
    _back(pool, "r0")
    assert gens[0]._col is not None and gens[1]._col is None and slot.inflight == 1
    await asyncio.sleep(0.2)  # failover_wait: not lost while a ready replica is full
    assert gens[1]._col is not None and gens[1].replica == "r0" and slot.inflight == 2
    assert sinks[1].failure is None and gens[1].failovers == 1 and not pool._ready_waiters
    assert "continues on r0 past its in-flight cap" in caplog.records[-1].getMessage()
    gens[1]._col.put(Delta(1, [7], "c", STOP))
    assert sinks[1].pieces == [("ab", 2, NONE), ("c", 1, STOP)]
    # a failover that finds a ready replica at once still goes there past its cap
    pool.slots.append(ReplicaSlot(ReplicaSpec(name="r1", max_concurrency=1)))
    r1 = pool.slots[1]
    r1.client, r1.state = _Replica(), "ready"  # type: ignore[assignment]
    job = Job("m", SamplingParams(max_tokens=8), prompt="p", prompt_token_ids=[1, 2])
    moving = Generation(pool, job, Metrics(), 3, None, failover_wait=5.0)
    moving.sink = Sink()
    moving._attach(LoadHandle(r1, 8))
    moving._col.put(Delta(1, [5], "a", NONE))
    assert slot.inflight == 1  # (gens[0]: r0 is full)
    r1.state = "down"
    moving._col.fail(ReplicaDead("replica r1 closed the connection"))
    assert moving.replica == "r0" and moving._col is not None and slot.inflight == 2


class _NoIds(_Replica):
    """An upstream known to return no token ids: it cannot continue a stream
    (``UpstreamClient.generate`` refuses a prefix)."""

    continues = False

    def generate(self, params, **kw) -> Collector:
        if kw.get("prefix_token_ids"):
            self.asked.append(kw)
            raise ReplicaDead("upstream r1 returns no token ids, so it cannot continue a resumed stream")
        return super().generate(params, **kw)


async def test_streams_that_wait_are_not_sent_to_an_upstream_that_cannot_continue_them() -> None:
    # (the upstream refused each on the way, and the pool's next round asked
    # again: 3 waiting streams used up their failovers in 0.8 ms and were lost)
    pool, gens, sinks = _waiting_for_replicas(3, 4, "r0", "r1")
    r1 = pool.slots[1]
    no_ids = r1.client = _NoIds()  # type: ignore[assignment]
    r1.state = "ready"
    pool.notify_ready()
    assert no_ids.asked == [] and all(g._waiting is not None and not g.ended for g in gens)
    assert pool.choose("m", 8).slot is r1  # (a request from the start goes there)
    pool.choose("m", 8).release()
    back = _back(pool, "r0")
    assert len(back.asked) == 3 and [g.replica for g in gens] == ["r0"] * 3 and no_ids.asked == []
    assert all(s.failure is None for s in sinks)


async def test_a_failover_to_only_an_upstream_that_cannot_continue_it_says_so() -> None:
    pool = _ready_pool("r0", "r1")
    pool.slots[1].client = _NoIds()  # type: ignore[assignment]
    pool.slots[1].state = "down"
    gen, sink = _running(pool, Metrics(), max_tokens=8, max_failovers=3, failover_wait=0.0)
    pool.slots[1].state = "ready"
    gen._col.put(Delta(1, [5], "a", NONE))
    pool.slots[0].state = "down"
    gen._col.fail(ReplicaDead("killed"))
    assert isinstance(sink.failure, StreamLost) and pool.slots[1].client.asked == []
    assert "can continue a stream from its token ids" in str(sink.failure), sink.failure


async def test_a_waiting_stream_its_replica_fails_on_the_way_keeps_its_place_and_its_deadline() -> None:
    # (it went to the back of the line, and waited failover_wait again)
    pool, gens, sinks = _waiting_for_replicas(2, 1, "r0", failover_wait=5.0)
    ends = [g._waiting.when() for g in gens]
    slot = pool.slots[0]

    class _DiesOnTheWay(_Replica):
        def generate(self, params, **kw) -> Collector:
            self.closed = ReplicaDead("replica r0 closed the connection")  # (seen at once: down)
            raise self.closed

    slot.client, slot.state = _DiesOnTheWay(), "ready"  # type: ignore[assignment]
    pool.notify_ready()
    assert all(g._waiting is not None for g in gens)
    assert [g._waiting.when() for g in gens] == ends
    assert sorted(pool._ready_waiters[("m", CONTINUES)].values()) == \
        [pool._ready_waiters[("m", CONTINUES)][g._replica_ready] for g in gens]  # first still first
    _back(pool, "r0")  # (room for one)
    assert gens[0]._col is not None and gens[1]._waiting is not None
    assert sinks[0].failure is None and gens[0].failovers == 2


async def test_a_replica_that_fails_after_the_last_token_of_max_tokens_ends_the_stream_with_length() -> None:
    # (an upstream that sends the finish in a chunk of its own, as OpenAI does, and dies or stalls
    # between the last token and that chunk; or one that never sends a finish_reason before
    # [DONE]: every token was delivered, yet the failover asked another replica for 0 tokens,
    # which refused ("max_tokens already reached by the resumed prefix"), and the client got
    # stream_lost after the whole text)
    pool = _ready_pool("r0", "r1")
    metrics = Metrics()
    gen, sink = _running(pool, metrics, max_tokens=3, max_failovers=3, failover_wait=0.0)
    gen._col.put(Delta(1, [5, 6, 7], "abc", NONE))
    gen._col.fail(ReplicaDead("the stream ended before the request finished"))
    assert sink.failure is None, sink.failure
    assert sink.pieces == [("abc", 3, NONE), ("", 0, FinishReason.LENGTH)]
    assert gen.ended and gen.finish == FinishReason.LENGTH and lost(metrics) == 0
    assert all(not s.client.asked[1:] for s in pool.slots)  # no replica was asked for 0 tokens


async def test_an_only_upstream_that_answers_429_is_asked_within_the_failover_budget_and_its_pause_is_passed_on() -> None:
    # (one url: upstream answering 429 Retry-After: 7: each 429 read as "found still dead", so a
    # request asked it 9 times within milliseconds, and the client was told Retry-After: 1)
    from replicas.client import ReplicaBusy
    from router.errors import ReplicaUnavailable

    pool = _ready_pool("solo")
    gen, sink = _running(pool, Metrics(), max_tokens=20, max_failovers=3, failover_wait=0.0)
    asks = 1
    while not gen.ended:
        gen._col.fail(ReplicaBusy("upstream solo failed: HTTP 429: rate limited", 7.0))
        asks += 1 if not gen.ended else 0
        assert asks <= 10
    assert asks == 1 + 1 + 3, asks  # the first try, its one free retry, max_failovers charged
    assert isinstance(sink.failure, ReplicaUnavailable)
    assert sink.failure.headers["retry-after"] == "7"
