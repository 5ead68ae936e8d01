"""Properties of ``policies.fairshare`` checked on a small discrete-event simulation.

The simulation is built only from the policy (``VirtualCounters``, ``Head``,
``pick``, ``vtc_bound``); no asyncio, no clock. It mirrors how
``router/scheduler.py`` drives the policy:

* a request that finds its tenant's queue empty calls ``activate`` with the
  tenants whose queues are non-empty at that moment (the scheduler's
  ``backlogged`` list);
* whenever a slot is free the head chosen by ``pick`` is dispatched (work
  conserving) and reported with ``served``, as ``Scheduler._dispatched`` does;
* served tokens are charged as they are produced, as ``router/generation.py``
  does: the prompt with the first token, then one completion token per step.

Time is discrete: one step = one engine step in which every running request
produces one completion token. Phases of a step: dispatch into free slots,
then requests that arrive while the step runs, then one token for every
running request (charged), then completions (a closed-loop client submits
its next request at once, so it is queued for the next dispatch).

"Served weighted service" of a tenant is ``W_IN * prompt + W_OUT *
completion`` summed over the tokens it was served (the counter's increments
before the division by the tenant's weight).
"""

from __future__ import annotations

import math
import random
from collections import deque
from dataclasses import dataclass, field

from hypothesis import given, settings
from hypothesis import strategies as st

from policies.fairshare import W_IN, W_OUT, Head, HeadIndex, VirtualCounters, aged_rank, pick, vtc_bound

# -- the simulation ------------------------------------------------------------


@dataclass(eq=False)
class Req:
    tenant: str
    prompt: int
    completion: int
    enqueued: int
    started: int | None = None
    emitted: int = 0


@dataclass(eq=False)
class Tenant:
    """One tenant's client. ``mode``:

    * ``backlogged``: a new request is queued just before the head is
      dispatched, so the queue is never empty (continuously backlogged);
    * ``closed``: ``concurrency`` requests outstanding, the next one is
      submitted when one completes (its queue may be empty between picks);
    * ``manual``: requests only come from ``Sim.submit`` calls.
    """

    name: str
    rank: int
    weight: float
    sizes: list[tuple[int, int]]  # (prompt, completion), cycled
    mode: str = "backlogged"
    concurrency: int = 1
    queue: deque[Req] = field(default_factory=deque)
    served: float = 0.0
    dispatched: list[Req] = field(default_factory=list)
    _next: int = 0
    active: bool = False  # the client is running (submits requests)

    def next_size(self) -> tuple[int, int]:
        size = self.sizes[self._next % len(self.sizes)]
        self._next += 1
        return size


class Sim:
    def __init__(self, tenants: list[Tenant], slots: int = 1, aging: float = 0.0) -> None:
        self.tenants = {t.name: t for t in tenants}
        self.slots = slots
        self.aging = aging
        self.counters = VirtualCounters()
        self.now = 0
        self.running: list[Req] = []
        self.picks = 0

    # -- arrivals ---------------------------------------------------------

    def submit(self, t: Tenant) -> Req:
        """Queue one request of ``t``, activating the tenant as the scheduler does."""
        if not t.queue:
            backlogged = [name for name, other in self.tenants.items() if other.queue]
            self.counters.activate(t.name, backlogged)
        prompt, completion = t.next_size()
        r = Req(t.name, prompt, completion, self.now)
        t.queue.append(r)
        return r

    def start(self, t: Tenant) -> None:
        """The tenant's client starts sending."""
        t.active = True
        n = t.concurrency if t.mode == "closed" else 1
        for _ in range(n):
            self.submit(t)

    def stop(self, t: Tenant) -> None:
        """The tenant's client stops sending; what it queued is withdrawn."""
        t.active = False
        t.queue.clear()

    # -- one step ---------------------------------------------------------

    def dispatch(self) -> None:
        while len(self.running) < self.slots:
            names = [name for name, t in self.tenants.items() if t.queue]
            if not names:
                return
            heads = [Head(n, self.tenants[n].rank, self.tenants[n].queue[0].enqueued) for n in names]
            i = pick(heads, self.counters, self.now, self.aging)
            assert 0 <= i < len(heads)
            t = self.tenants[heads[i].tenant]
            if t.mode == "backlogged" and t.active:
                self.submit(t)  # before the head leaves: the queue never empties
            r = t.queue.popleft()
            r.started = self.now
            self.counters.served(t.name)  # as Scheduler._dispatched does
            t.dispatched.append(r)
            self.running.append(r)
            self.picks += 1

    def serve(self) -> None:
        """Every running request produces one token; charge it."""
        done: list[Req] = []
        for r in self.running:
            t = self.tenants[r.tenant]
            prompt = r.prompt if r.emitted == 0 else 0
            r.emitted += 1
            self.counters.charge(t.name, prompt, 1, t.weight)
            t.served += W_IN * prompt + W_OUT * 1
            if r.emitted >= r.completion:
                done.append(r)
        for r in done:
            self.running.remove(r)
        self.now += 1
        for r in done:
            t = self.tenants[r.tenant]
            if t.mode == "closed" and t.active:
                self.submit(t)

    def step(self, arrivals: list[Tenant] = ()) -> None:
        self.dispatch()
        for t in arrivals:  # requests that come in while the step runs
            if not t.active:
                self.start(t)
            else:  # one more request outstanding
                t.concurrency += 1
                self.submit(t)
        self.serve()


# -- strategies ----------------------------------------------------------------


@st.composite
def workloads(draw, max_len: int = 48):
    """(L_in, L_out, a strategy for one request's (prompt, completion) within them)."""
    l_in = draw(st.integers(1, max_len))
    l_out = draw(st.integers(1, max_len))
    size = st.tuples(st.integers(1, l_in), st.integers(1, l_out))
    return l_in, l_out, size


def sizes(draw, size, n: int = 30) -> list[tuple[int, int]]:
    """A tenant's request sizes (cycled by the simulation)."""
    return draw(st.lists(size, min_size=1, max_size=n))


def _u(l_in: int, l_out: int) -> float:
    """The largest charge one request adds (the paper's ``U``)."""
    return W_IN * l_in + W_OUT * l_out


# -- (a) the VTC fairness bound ------------------------------------------------


@settings(max_examples=150)
@given(st.data(), workloads(), st.floats(0.1, 10), st.integers(150, 600))
def test_two_backlogged_tenants_stay_within_the_vtc_bound(data, workload, weight, steps) -> None:
    """One request at a time: over every interval in which both tenants are
    backlogged, their served weighted service differs by at most
    ``vtc_bound(L_in, L_out)`` (2U; the paper's Theorem for the
    one-request-at-a-time server).

    Over all intervals [t1, t2] the largest |W_a(t1,t2) - W_b(t1,t2)| is the
    range (max - min) of D(t) = W_a(t) - W_b(t), so that is what is checked,
    after every step."""
    l_in, l_out, size = workload
    a = Tenant("a", 0, weight, sizes(data.draw, size))
    b = Tenant("b", 0, weight, sizes(data.draw, size))
    sim = Sim([a, b], slots=1)
    sim.start(a)
    sim.start(b)
    bound = vtc_bound(l_in, l_out)
    lo = hi = 0.0
    for _ in range(steps):
        sim.step()
        d = a.served - b.served
        lo, hi = min(lo, d), max(hi, d)
        assert hi - lo <= bound + 1e-9, (sim.now, hi, lo, bound)
    assert a.dispatched and b.dispatched


@settings(max_examples=150)
@given(st.data(), workloads(max_len=32), st.integers(2, 8), st.integers(150, 600))
def test_continuous_batching_stays_within_the_batched_vtc_bound(data, workload, slots, steps) -> None:
    """A server that runs up to ``slots`` requests at once (continuous
    batching, tokens charged as they are produced, as the router does).

    The charge of a request is not known when it is dispatched, so a tenant
    can be given several slots while its counter is the smaller one; the
    paper's batched bound replaces the single request by what one batch can
    hold. Here: a tenant is only picked while its counter is not above the
    other's, and from then on it can gain at most the charges of the
    requests it has running, at most ``slots * U``; so D(t) stays in
    [-slots*U, slots*U] and its range is at most ``slots * vtc_bound``."""
    l_in, l_out, size = workload
    a = Tenant("a", 0, 1.0, sizes(data.draw, size))
    b = Tenant("b", 0, 1.0, sizes(data.draw, size))
    # Closed loops with more requests than slots: both always backlogged.
    a.mode = b.mode = "closed"
    a.concurrency = b.concurrency = slots + 1
    sim = Sim([a, b], slots=slots)
    sim.start(a)
    sim.start(b)
    u = _u(l_in, l_out)
    for _ in range(steps):
        sim.step()
        assert a.queue and b.queue  # continuously backlogged
        d = a.served - b.served
        assert abs(d) <= slots * u + 1e-9, (sim.now, d, slots * u)


def test_the_batched_bound_is_needed_a_batch_can_go_past_one_vtc_bound() -> None:
    """Why the batched test uses ``slots * vtc_bound``: with 4 slots, a tenant
    whose requests were queued first gets every slot while the counters tie,
    and its counter runs ahead by a whole batch before a slot frees up."""
    l_in, l_out = 8, 16
    a = Tenant("a", 0, 1.0, [(l_in, l_out)], mode="closed", concurrency=8)
    b = Tenant("b", 0, 1.0, [(l_in, l_out)], mode="closed", concurrency=8)
    sim = Sim([a, b], slots=4)
    sim.start(a)
    sim.start(b)
    worst = 0.0
    for _ in range(200):
        sim.step()
        worst = max(worst, abs(a.served - b.served))
    assert worst > vtc_bound(l_in, l_out)
    assert worst <= 4 * _u(l_in, l_out)


# -- (b) weights ---------------------------------------------------------------


@settings(max_examples=60)
@given(
    st.data(),
    workloads(max_len=24),
    st.lists(st.sampled_from([0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 7.0]), min_size=2, max_size=3),
    st.sampled_from([1, 3]),
)
def test_backlogged_tenants_are_served_in_proportion_to_their_weights(data, workload, weights, slots) -> None:
    """Backlogged tenants of one class: served weighted tokens S_i in the
    proportion of the weights. A tenant is picked only while its counter is
    the smallest; after that it gains at most ``slots * U / w_i``, so
    ``S_i/w_i - S_j/w_j <= slots * U / w_i`` for every pair at every moment,
    and over a long run each share is within ``w_i * slots*U/min(w) / total``
    of ``w_i / sum(w)``."""
    l_in, l_out, size = workload
    tenants = [
        Tenant(f"t{i}", 0, w, sizes(data.draw, size), mode="closed", concurrency=slots + 1)
        for i, w in enumerate(weights)
    ]
    sim = Sim(tenants, slots=slots)
    for t in tenants:
        sim.start(t)
    u = _u(l_in, l_out)
    steps = 3000
    for n in range(steps):
        sim.step()
        if n % 50 == 0:
            for i in tenants:
                for j in tenants:
                    gap = i.served / i.weight - j.served / j.weight
                    assert gap <= slots * u / i.weight + 1e-6, (i.name, j.name, gap)
    total = sum(t.served for t in tenants)
    wsum = sum(weights)
    delta = slots * u / min(weights)
    for t in tenants:
        share = t.served / total
        tolerance = t.weight * delta / total
        assert abs(share - t.weight / wsum) <= tolerance + 1e-9, (t.name, share, t.weight / wsum, tolerance)


def test_weights_three_to_one_give_three_quarters() -> None:
    """A concrete long run: weight 3 against weight 1 gets 75% of the
    weighted service, to within the bound over the total."""
    rng = random.Random(7)
    mk = lambda: [(rng.randint(1, 32), rng.randint(1, 64)) for _ in range(200)]  # noqa: E731
    a = Tenant("a", 0, 3.0, mk(), mode="closed", concurrency=5)
    b = Tenant("b", 0, 1.0, mk(), mode="closed", concurrency=5)
    sim = Sim([a, b], slots=4)
    sim.start(a)
    sim.start(b)
    for _ in range(20000):
        sim.step()
    total = a.served + b.served
    tolerance = 4 * _u(32, 64) / total * 3
    assert tolerance < 0.02
    assert abs(a.served / total - 0.75) <= tolerance


def test_aging_does_not_override_weights_inside_one_class() -> None:
    """Two tenants of the *same* class (rank 1), weights 3 and 1, both far
    more backlogged than the server, with ``aging`` between their queue
    waits (the weight-3 tenant's heads wait less than ``aging``, the
    weight-1 tenant's more). Aging exists to lift a class over the others;
    between tenants of one class the VTC order must still decide, so the
    weight-3 tenant gets 3/4. (When aging lowered the rank of single
    requests, the weight-1 tenant's aged heads won by rank and the share
    fell to 0.57; with aging 20 or 1e9 it was 0.75.)"""
    rng = random.Random(3)
    mk = lambda: [(rng.randint(1, 16), rng.randint(8, 32)) for _ in range(100)]  # noqa: E731
    a = Tenant("a", 1, 3.0, mk(), mode="closed", concurrency=24)
    b = Tenant("b", 1, 1.0, mk(), mode="closed", concurrency=24)
    sim = Sim([a, b], slots=4, aging=250.0)
    sim.start(a)
    sim.start(b)
    for _ in range(20000):
        sim.step()
    mean_wait = lambda t: sum(r.started - r.enqueued for r in t.dispatched[len(t.dispatched) // 2:]) / (  # noqa: E731
        len(t.dispatched) - len(t.dispatched) // 2)
    assert mean_wait(a) < sim.aging <= mean_wait(b)  # the regime in question
    share = a.served / (a.served + b.served)
    assert abs(share - 0.75) <= 0.02, share


# -- (c) no starvation under aging -----------------------------------------------


@settings(max_examples=150)
@given(
    st.data(),
    workloads(max_len=24),
    st.integers(1, 4),
    st.integers(1, 40).map(lambda x: x / 2),  # aging in half steps
    st.integers(0, 200),
    st.floats(0.05, 20),
    st.floats(0.05, 20),
)
def test_low_priority_head_is_served_within_two_agings_and_one_service(
    data, workload, slots, aging, arrive_at, w_high, w_low
) -> None:
    """A rank-2 tenant that starts sending while a rank-0 tenant keeps every
    slot busy (always backlogged): its head reaches the top class after
    ``2 * aging`` and then goes at the next free slot, at most one service
    time (``L_out`` steps) later. It was lifted to the high tenant's counter
    when it became backlogged, and the high tenant has been served since,
    so the low tenant's counter is the smaller one. (+1 step: the
    simulation's time grid.)"""
    l_in, l_out, size = workload
    high = Tenant("high", 0, w_high, sizes(data.draw, size), mode="closed", concurrency=slots + 2)
    low = Tenant("low", 2, w_low, sizes(data.draw, size), mode="manual")
    sim = Sim([high, low], slots=slots, aging=aging)
    sim.start(high)
    for _ in range(arrive_at):
        sim.step()
    sim.step([low])
    (req,) = low.queue
    deadline = req.enqueued + 2 * aging + l_out + 1
    while req.started is None:
        assert sim.now <= deadline, (sim.now, req.enqueued, aging, l_out)
        sim.step()
    assert req.started - req.enqueued <= 2 * aging + l_out + 1
    # and not before its aging made it rank 0 (strict priority holds until then)
    assert aged_rank(2, req.enqueued, req.started, aging) == 0
    assert req.started - req.enqueued >= 2 * aging - 1e-9


@settings(max_examples=100)
@given(st.data(), workloads(max_len=16), st.integers(1, 4))
def test_without_aging_strict_priority_holds(data, workload, slots) -> None:
    """aging 0: the low class is served only when the high class has nothing queued."""
    l_in, l_out, size = workload
    high = Tenant("high", 0, 1.0, sizes(data.draw, size), mode="closed", concurrency=slots + 1)
    low = Tenant("low", 1, 1.0, sizes(data.draw, size), mode="closed", concurrency=2)
    sim = Sim([high, low], slots=slots, aging=0.0)
    sim.start(high)
    sim.start(low)
    for _ in range(300):
        before = len(low.dispatched)
        had_high = bool(high.queue)
        sim.dispatch()
        if had_high and high.queue:
            assert len(low.dispatched) == before
        sim.serve()


# -- (d) lift on activation: no banking -------------------------------------------


def _catch_up_run(l_in, l_out, ys, xs, idle, slots, y_mode, after=400):
    """X is served a little, goes idle for ``idle`` steps while Y keeps the
    server busy, then comes back continuously backlogged. Returns the largest
    lead X gains over Y in weighted service from its return on.

    ``y_mode``: ``backlogged``: Y has requests queued all along.
    ``alone``: while X is away Y has exactly ``slots`` requests outstanding
    (it uses the whole server and never queues, as under the router's fast
    path); when X comes back, Y's demand grows too (two more requests,
    arriving just after X's), so from X's return on both are continuously
    backlogged."""
    x = Tenant("x", 0, 1.0, xs, mode="backlogged")
    if y_mode == "backlogged":
        y = Tenant("y", 0, 1.0, ys, mode="backlogged")
    else:
        y = Tenant("y", 0, 1.0, ys, mode="closed", concurrency=slots)
    sim = Sim([x, y], slots=slots)
    sim.start(x)
    sim.start(y)
    for _ in range(50):
        sim.step()
    sim.stop(x)
    for _ in range(idle):
        sim.step()
    x0, y0 = x.served, y.served
    sim.step([x] if y_mode == "backlogged" else [x, y, y])  # arrivals while a step runs
    lead = 0.0
    for _ in range(after):
        sim.step()
        assert x.queue and y.queue  # both continuously backlogged from here on
        lead = max(lead, (x.served - x0) - (y.served - y0))
    return lead


@settings(max_examples=100)
@given(st.data(), workloads(max_len=24), st.integers(200, 2000), st.integers(1, 4))
def test_a_returning_tenant_is_lifted_to_the_backlogged_minimum(data, workload, idle, slots) -> None:
    """X idle for a long time while Y (continuously backlogged) is served:
    when X comes back it is lifted to Y's counter, so from then on it gains
    at most one bound's worth over Y (``slots * vtc_bound``, the batched
    bound; ``vtc_bound`` itself for one slot): no banking of idle time."""
    l_in, l_out, size = workload
    lead = _catch_up_run(l_in, l_out, sizes(data.draw, size), sizes(data.draw, size), idle, slots, "backlogged")
    assert lead <= slots * vtc_bound(l_in, l_out) + 1e-9, (lead, slots * vtc_bound(l_in, l_out))


def test_a_new_tenant_starts_at_the_backlogged_minimum() -> None:
    c = VirtualCounters()
    c.charge("idle", 1, 0, 1.0)  # (the smallest counter of all, but not backlogged: not the floor)
    c.charge("a", 100, 100, 1.0)
    c.charge("b", 10, 10, 1.0)
    c.activate("new", ["a", "b"])
    assert c.get("new") == c.get("b") == 30
    c.activate("b", ["a"])  # b is behind a: lifted
    assert c.get("b") == c.get("a")
    c.charge("b", 1000, 0, 1.0)
    c.activate("b", ["a"])  # never lowered
    assert c.get("b") > c.get("a")


@settings(max_examples=60)
@given(st.data(), workloads(max_len=24), st.integers(300, 2000), st.integers(1, 4))
def test_a_returning_tenant_is_lifted_even_when_no_queue_is_backlogged(data, workload, idle, slots) -> None:
    """Same property, but while X was away Y used the whole server without
    queueing, so at X's return no queue is non-empty and the scheduler calls
    ``activate(x, backlogged=[])``. X must then be lifted to the counter of
    the tenant served last (the paper's rule for an empty queue; the
    simulation reports dispatches through ``served`` as the scheduler
    does). Without that lift X kept its old counter and won every pick
    until it had caught up all of Y's service during its idle time: with
    idle=300 and one slot X led by 923 weighted tokens against a bound of 10."""
    l_in, l_out, size = workload
    lead = _catch_up_run(l_in, l_out, sizes(data.draw, size), sizes(data.draw, size), idle, slots, "alone")
    assert lead <= slots * vtc_bound(l_in, l_out) + 1e-9, (lead, slots * vtc_bound(l_in, l_out))


# -- (e) work conservation at the policy level ------------------------------------


heads_st = st.lists(
    st.builds(
        Head,
        tenant=st.sampled_from(["a", "b", "c", "d", "e"]),
        rank=st.integers(0, 5),
        enqueued=st.floats(-1e6, 1e6, allow_nan=False),
    ),
    min_size=1,
    max_size=12,
)


@given(
    heads_st,
    st.dictionaries(st.sampled_from(["a", "b", "c", "d"]), st.floats(0, 1e12, allow_nan=False)),
    st.floats(-1e6, 2e6, allow_nan=False),
    st.one_of(st.just(0.0), st.floats(1e-3, 1e4)),
)
def test_pick_always_chooses_one_of_the_heads(heads, values, now, aging) -> None:
    counters = VirtualCounters()
    counters.values.update(values)
    i = pick(heads, counters, now, aging)
    assert 0 <= i < len(heads)
    # the chosen head's class holds a head of the most urgent effective rank
    top = min(aged_rank(h.rank, h.enqueued, now, aging) for h in heads)
    assert any(aged_rank(h.rank, h.enqueued, now, aging) == top for h in heads if h.rank == heads[i].rank)
    if aging == 0:  # plain strict priority, then the smallest counter, then FIFO
        key = lambda h: (h.rank, counters.get(h.tenant), h.enqueued)  # noqa: E731
        assert key(heads[i]) == min(key(h) for h in heads)


def test_pick_on_no_heads_is_minus_one() -> None:
    assert pick([], VirtualCounters(), 0.0, 1.0) == -1


@settings(max_examples=100)
@given(st.data(), workloads(max_len=16), st.integers(1, 6), st.integers(1, 4))
def test_the_simulated_server_is_never_idle_while_work_is_queued(data, workload, slots, n) -> None:
    """Work conservation end to end in the simulation: after every dispatch
    phase either all slots are busy or nothing is queued."""
    l_in, l_out, size = workload
    tenants = [
        Tenant(f"t{i}", data.draw(st.integers(0, 2)), data.draw(st.floats(0.1, 5)), sizes(data.draw, size),
               mode="closed", concurrency=data.draw(st.integers(1, 4)))
        for i in range(n)
    ]
    sim = Sim(tenants, slots=slots, aging=data.draw(st.sampled_from([0.0, 2.0, 10.0])))
    for t in tenants:
        sim.start(t)
    for _ in range(200):
        sim.dispatch()
        queued = sum(len(t.queue) for t in tenants)
        assert len(sim.running) == slots or queued == 0
        sim.serve()


def test_vtc_bound_is_twice_the_largest_request_charge() -> None:
    assert vtc_bound(10, 20) == 2 * (W_IN * 10 + W_OUT * 20)
    assert math.isclose(vtc_bound(0, 0), 0.0)


# -- HeadIndex: the scheduler's O(log T) form of pick -------------------------


_OPS = st.lists(
    st.one_of(
        st.tuples(st.just("enqueue"), st.integers(0, 11), st.integers(0, 3)),  # tenant, class rank
        st.tuples(st.just("serve"), st.integers(0, 2000)),  # charged weighted tokens
        st.tuples(st.just("charge"), st.integers(0, 11), st.integers(1, 2000)),  # a running stream's tokens
        st.tuples(st.just("leave"), st.integers(0, 11)),
        st.tuples(st.just("wait"), st.floats(0, 7)),
        st.tuples(st.just("full"), st.integers(0, 11)),  # pick while this tenant's model is full
        st.tuples(st.just("reweight"), st.integers(0, 11), st.sampled_from([0.5, 1.0, 4.0])),  # a reload
        st.tuples(st.just("reclass"), st.integers(0, 11), st.integers(0, 3)),  # a reload: its queued move
    ),
    min_size=40,
    max_size=200,
)


@given(_OPS, st.sampled_from([0.0, 2.5, 10.0]))
@settings(max_examples=300, deadline=None)
def test_head_index_picks_what_pick_picks(ops, aging) -> None:
    """Any sequence of arrivals, services, departures, waits and reloads
    (a tenant's weight or class changed for its queued requests too): the
    index chooses a head with the same (effective rank, counter, enqueued)
    as the reference ``pick`` over the same heads, skipped heads included."""
    counters = VirtualCounters()
    index = HeadIndex(aging)
    queues: dict[str, deque[Head]] = {}
    weights: dict[str, float] = {}
    now = 0.0

    def head_changed(t: str) -> None:
        q = queues[t]
        if q:
            index.set(t, q[0].rank, q[0].enqueued, counters.get(t))
        else:
            index.remove(t)

    def reference(skipped: str | None) -> tuple | None:
        heads = [q[0] for t, q in queues.items() if q and t != skipped]
        if not heads:
            return None
        h = heads[pick(heads, counters, now, aging)]
        return _key(h, heads)

    def _key(h: Head, heads: list[Head]) -> tuple:
        oldest = min(x.enqueued for x in heads if x.rank == h.rank)
        eff = h.rank if aging <= 0 else max(0, h.rank - int((now - oldest) / aging))
        return eff, counters.get(h.tenant), h.enqueued

    for op in ops:
        kind = op[0]
        if kind == "enqueue":
            t = f"t{op[1]}"
            q = queues.setdefault(t, deque())
            if not q:
                low = index.min_counter(counters)
                others = [counters.get(o) for o, oq in queues.items() if oq and o != t]
                assert low == (min(others) if others else None)
                counters.lift(t, low)
            q.append(Head(t, op[2], now))
            if len(q) == 1:
                head_changed(t)
        elif kind == "wait":
            now += op[1]
        elif kind == "charge":  # counters grow while heads wait: the index must re-key
            counters.charge(f"t{op[1]}", 0, op[2], weight=1.0)
        elif kind == "reweight":  # (what Scheduler.follow does)
            weights[f"t{op[1]}"] = op[2]
            counters.reweight(weights)
        elif kind == "reclass":
            t = f"t{op[1]}"
            if queues.get(t):
                queues[t] = deque(Head(t, op[2], h.enqueued) for h in queues[t])
                head_changed(t)
        elif kind == "leave":
            t = f"t{op[1]}"
            if queues.get(t):
                queues[t].pop()
                if not queues[t]:
                    head_changed(t)
        else:
            skipped = f"t{op[1]}" if kind == "full" else None
            want = reference(skipped)
            got = index.pick(counters, now, (lambda t: t == skipped) if skipped else None)
            if want is None:
                assert got is None
                continue
            heads = [q[0] for t, q in queues.items() if q and t != skipped]
            assert got is not None and got != skipped
            assert _key(queues[got][0], heads) == want
            if kind == "serve":
                h = queues[got].popleft()
                counters.served(got)
                counters.charge(got, 0, op[1], weight=1 + int(h.tenant[1:]) % 3)
                head_changed(got)
    assert len(index) == sum(1 for q in queues.values() if q)


def test_a_charge_too_large_for_a_float_keeps_the_counter_finite() -> None:
    # (weight 5e-324 passed the config's check: the counter became inf, and
    # lifting another tenant to the minimum could spread it)
    c = VirtualCounters()
    c.charge("tiny", 10, 10, 5e-324)
    c.charge("tiny", 10, 10, 5e-324)
    c.charge("b", 10, 0, 1.0)
    assert math.isfinite(c.get("tiny")) and c.get("tiny") > c.get("b")
    c.lift("late", c.get("tiny"))
    assert math.isfinite(c.get("late"))


def test_a_reweighted_tenant_is_charged_at_its_new_weight_whatever_the_request_says() -> None:
    c = VirtualCounters()
    c.charge("a", 10, 0, 1.0)
    c.reweight({"a": 4.0})
    c.charge("a", 0, 10, 1.0)  # a request admitted at weight 1
    c.charge("b", 0, 10, 2.0)  # a tenant not named: the request's weight
    assert c.get("a") == 10 + W_OUT * 10 / 4 and c.get("b") == W_OUT * 10 / 2
