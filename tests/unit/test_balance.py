"""policies/balance.py: power of two choices and prefix affinity."""

from __future__ import annotations

import random

from hypothesis import given
from hypothesis import strategies as st

from policies.balance import AFFINITY_SLACK, ReplicaLoad, choose, score

loads_st = st.lists(
    st.builds(ReplicaLoad, st.integers(0, 50), st.integers(0, 5000), st.integers(0, 50), st.integers(0, 20),
              st.floats(0, 1)),
    min_size=1, max_size=8,
)


@given(loads_st, st.integers(0, 2**32))
def test_p2c_never_picks_the_worse_of_its_two(loads, seed):
    i = choose(loads, random.Random(seed))
    assert 0 <= i < len(loads)
    # the pick is never the single most loaded replica when there are several
    if len(loads) > 1 and len({score(x) for x in loads}) == len(loads):
        assert score(loads[i]) < max(score(x) for x in loads)


@given(loads_st, st.integers(0, 2**32), st.data())
def test_affinity_wins_only_within_the_slack(loads, seed, data):
    prefer = data.draw(st.integers(0, len(loads) - 1))
    i = choose(loads, random.Random(seed), prefer)
    other = choose(loads, random.Random(seed))
    if len(loads) == 1:
        assert i == 0
    elif score(loads[prefer]) <= score(loads[other]) + AFFINITY_SLACK:
        assert i == prefer
    else:
        assert i == other


def test_a_much_busier_preferred_replica_is_passed_over():
    idle = ReplicaLoad(0, 0, 0, 0, 0.0)
    busy = ReplicaLoad(20, 0, 20, 5, 0.5)
    assert all(choose([busy, idle], random.Random(s), prefer=0) == 1 for s in range(50))
    assert all(choose([idle, idle], random.Random(s), prefer=1) == 1 for s in range(50))


def test_models_while_no_replica_is_ready_are_the_names_clients_use() -> None:
    """With every replica down, a request for a served model must get a 503
    (retry), not a 404: the pool still knows the name clients ask for, which
    for vLLM is ``served_name``, not the weights' path."""
    from replicas.pool import ReplicaPool
    from replicas.spec import ReplicaSpec

    pool = ReplicaPool([
        ReplicaSpec(name="vllm-0", engine="vllm", config={"model": "/models/tiny", "served_name": "tiny-llama"}),
        ReplicaSpec(name="sim-0", config={"model": "sim-model"}),
    ])
    assert not pool.ready_slots()
    assert pool.models() == ["sim-model", "tiny-llama"]


def test_a_replica_whose_connection_closed_shows_down_before_the_supervisor_notices() -> None:
    # (/ready said {"ready": false, "replicas": {"solo": "ready"}} in that window)
    from types import SimpleNamespace

    from replicas.pool import ReplicaSlot
    from replicas.spec import ReplicaSpec

    slot = ReplicaSlot(ReplicaSpec(name="solo"))
    assert slot.status == "starting"
    slot.state = "ready"
    slot.client = SimpleNamespace(closed=None, refused=False, credentials_refused=None)  # type: ignore[assignment]
    assert slot.ready and slot.status == "ready"
    slot.client.closed = ConnectionResetError("gone")  # type: ignore[union-attr]
    assert not slot.ready and slot.status == "down"


@given(st.lists(loads_st.map(lambda ls: ls[0]), min_size=2, max_size=2), st.integers(0, 2**32))
def test_two_replicas_are_chosen_as_the_draws_would_have_chosen_them(loads, seed):
    # (choose takes no draw for two: the less loaded, a tie to the first, as the draws' rule gave)
    rng = random.Random(seed)
    a = rng.randrange(2)
    b = rng.randrange(1)
    b += b >= a
    sa, sb = score(loads[a]), score(loads[b])
    assert choose(loads, random.Random(seed)) == (a if sa < sb or (sa == sb and a < b) else b)


def test_the_replicas_report_of_running_requests_breaks_a_tie():
    """Equal by the router's own counts (with ``--workers`` each worker counts
    only its own streams; the replica's report counts every worker's), the
    replica running fewer requests is chosen, with two replicas or more."""
    busier = ReplicaLoad(2, 100, 9, 0, 0.2)
    freer = ReplicaLoad(2, 100, 3, 0, 0.2)
    assert score(freer) < score(busier)
    assert choose([busier, freer], random.Random(0)) == 1
    # p2c: the freer one wins each pair it is drawn into (two of the three pairs)
    picks = [choose([busier, freer, busier], random.Random(s)) for s in range(300)]
    assert picks.count(1) >= 180


def test_running_only_breaks_ties_it_never_outweighs_one_in_flight_token():
    """The report lags by up to one report interval: the router's own count,
    current, decides wherever it differs at all."""
    one_token_more = ReplicaLoad(2, 101, 0, 0, 0.0)
    far_more_running = ReplicaLoad(2, 100, 4000, 0, 0.0)
    assert score(far_more_running) < score(one_token_more)


def test_requests_waiting_inside_the_engine_count_against_it():
    """A request queued in the engine's own FIFO (``waiting``) weighs two in
    the router's count: a replica with one running and one waiting is busier
    than one with two running."""
    queueing = ReplicaLoad(1, 0, 1, 1, 0.0)
    running = ReplicaLoad(2, 0, 2, 0, 0.0)
    assert choose([queueing, running], random.Random(0)) == 1


def test_kv_cache_use_counts_only_past_90_percent():
    """Below 90% the engine has room for more, and KV use decides nothing
    (the router's in-flight tokens do); past it, a nearly full cache does."""
    more_kv = ReplicaLoad(1, 50, 0, 0, 0.85)
    more_tokens = ReplicaLoad(1, 100, 0, 0, 0.1)
    assert choose([more_tokens, more_kv], random.Random(0)) == 1
    assert choose([more_kv, more_tokens], random.Random(0)) == 0
    full = ReplicaLoad(1, 50, 0, 0, 1.0)  # (0.1 past 90%: 0.4, more than 50 tokens' 0.012)
    assert choose([full, more_tokens], random.Random(0)) == 1


def test_a_preferred_replica_exactly_the_slack_busier_still_wins():
    preferred = ReplicaLoad(2, 0, 0, 0, 0.0)
    idle = ReplicaLoad(0, 0, 0, 0, 0.0)
    assert score(preferred) == score(idle) + AFFINITY_SLACK
    assert choose([preferred, idle], random.Random(0), prefer=0) == 0


def test_ties_among_three_or_more_replicas_are_spread_evenly():
    # (a tie went to the lower index: among three equally loaded replicas the
    # first got two thirds of the requests and the last none)
    for n in (3, 5):
        loads = [ReplicaLoad(inflight=1, inflight_tokens=10, running=1, waiting=0, kv_usage=0.0)] * n
        rng = random.Random(7)
        counts = [0] * n
        for _ in range(3000 * n):
            counts[choose(loads, rng)] += 1
        assert all(2500 < c < 3500 for c in counts), counts
