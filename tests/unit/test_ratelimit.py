"""Property tests of policies/ratelimit.py: token buckets with reservations and refunds.

Hypothesis drives a tenant through arbitrary sequences of (time advance,
admit(cost) | settle(reservation, used)) against the pure functions, with
``now`` injected, and checks after every step:

(a) over any window of the admitted log, no more than ``L + L * t / 60``
    units were taken (requests, and tokens net of refunds and overage);
(b) a settle gives back at most what was reserved (minus what was used), and
    no bucket ever holds more than its capacity;
(c) a refused admit changes neither bucket;
(d) ``retry_after`` is exact: after it the same request fits, just before it
    it does not (for refusals on requests or tokens).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from itertools import accumulate

import pytest
from hypothesis import example, given
from hypothesis import strategies as st

from policies.ratelimit import QUEUED_RETRY, Bucket, Decision, admit, level, prune_leases, settle

# -- a scenario: limits, a start time and a list of steps ----------------------

# Small limits too, so that short sequences drain the buckets and hit refusals.
limits_rpm = st.one_of(st.just(0), st.integers(1, 8), st.integers(1, 120))
limits_tpm = st.one_of(st.just(0), st.integers(1, 40), st.integers(1, 5000))
advance = st.one_of(st.just(0.0), st.floats(0, 1), st.floats(0, 90))


@dataclass(frozen=True)
class Admit:
    cost: int


@dataclass(frozen=True)
class Settle:
    pick: int  # which outstanding reservation (modulo how many there are)
    used_ratio: float  # used = round(reserved * ratio); > 1 is an overage


def ops(tpm: int) -> st.SearchStrategy:
    top = max(10, int(tpm * 1.2))  # sometimes more than the whole bucket
    return st.one_of(
        st.builds(Admit, st.integers(0, top)),
        st.builds(Admit, st.integers(0, max(1, tpm // 4))),  # small requests: more get in
        st.builds(Settle, st.integers(0, 1000), st.one_of(st.floats(0, 1), st.floats(1, 3))),
    )


@st.composite
def scenarios(draw):
    rpm = draw(limits_rpm)
    tpm = draw(limits_tpm)
    start = draw(st.one_of(st.just(0.0), st.floats(0, 1e7)))
    steps = draw(st.lists(st.tuples(advance, ops(tpm)), max_size=60))
    return rpm, tpm, start, steps


def tol(scale: float) -> float:
    """Float tolerance for unit counts of magnitude ``scale``."""
    return 1e-6 * max(1.0, abs(scale))


# -- the simulation ---------------------------------------------------------------


@dataclass
class Event:
    t: float
    admitted: bool  # an admission (the window ends the log is checked on)
    requests: float  # requests taken
    tokens: float  # tokens charged: cost at admission, used - reserved at settle


@dataclass
class Tenant:
    rpm: int
    tpm: int
    now: float
    requests: Bucket | None = None
    tokens: Bucket | None = None
    outstanding: list[int] = field(default_factory=list)
    log: list[Event] = field(default_factory=list)
    reserved_total: float = 0.0
    refunded_total: float = 0.0
    refusals: list[tuple[Decision, Bucket | None, Bucket | None, int, float]] = field(default_factory=list)

    def try_admit(self, cost: int) -> Decision:
        before = (self.requests, self.tokens)
        d, req, tok = admit(
            self.requests, self.tokens, 0, rpm=self.rpm, tpm=self.tpm, max_concurrent=0, cost_tokens=cost, now=self.now
        )
        if not d.ok:
            # (c) a refusal takes nothing
            assert req == before[0] and tok == before[1], (d, before, req, tok)
            self.refusals.append((d, self.requests, self.tokens, cost, self.now))
            return d
        self.requests, self.tokens = req, tok
        self.outstanding.append(cost)
        self.reserved_total += cost if self.tpm else 0
        self.log.append(Event(self.now, True, 1.0 if self.rpm else 0.0, float(cost) if self.tpm else 0.0))
        return d

    def try_settle(self, pick: int, used_ratio: float) -> None:
        if not self.outstanding:
            return
        reserved = self.outstanding.pop(pick % len(self.outstanding))
        used = round(reserved * used_ratio)
        old = level(self.tokens, self.tpm, self.now) if self.tpm else 0.0
        self.tokens = settle(self.tokens, tpm=self.tpm, reserved=reserved, used=used, now=self.now)
        if not self.tpm:
            return
        new = level(self.tokens, self.tpm, self.now)
        gained = new - old
        # (b) a refund is at most reserved - used (never more than was reserved) ...
        assert gained <= max(0, reserved - used) + tol(self.tpm), (reserved, used, old, new)
        if used > reserved:  # ... and an overage is taken in full
            assert gained == pytest.approx(reserved - used, abs=tol(self.tpm))
        self.refunded_total += max(0.0, gained)
        self.log.append(Event(self.now, False, 0.0, float(used - reserved)))

    def check_capacity(self) -> None:
        # (b) no bucket above its capacity, stored or read
        for bucket, cap in ((self.requests, self.rpm), (self.tokens, self.tpm)):
            if cap and bucket is not None:
                assert bucket.tokens <= cap + tol(cap), (bucket, cap)
                assert level(bucket, cap, self.now) <= cap
        assert self.refunded_total <= self.reserved_total + tol(self.reserved_total)


def run(rpm: int, tpm: int, start: float, steps: list) -> Tenant:
    tenant = Tenant(rpm, tpm, start)
    for dt, op in steps:
        tenant.now += dt
        if isinstance(op, Admit):
            d = tenant.try_admit(op.cost)
            if tpm and op.cost > tpm:
                assert (d.ok, d.reason, d.retry_after) == (False, "too_large", math.inf)
            elif not d.ok:
                assert d.reason in ("requests", "tokens") and 0 < d.retry_after < math.inf, d
        else:
            tenant.try_settle(op.pick, op.used_ratio)
        tenant.check_capacity()
    return tenant


# -- (a) bounded over every window -------------------------------------------------


def assert_windows_bounded(log: list[Event], limit: int, units: list[float]) -> None:
    """For all admissions i <= j: units taken in log[i..j] <= limit + limit * (t_j - t_i) / 60."""
    if not limit:
        return
    prefix = [0.0, *accumulate(units)]
    ends = [k for k, e in enumerate(log) if e.admitted]
    for a, i in enumerate(ends):
        for j in ends[a:]:
            taken = prefix[j + 1] - prefix[i]
            bound = limit + limit * (log[j].t - log[i].t) / 60.0
            assert taken <= bound + tol(bound), (
                f"{taken} units taken in [{log[i].t}, {log[j].t}] (events {i}..{j}), bound {bound}"
            )


@given(scenarios())
def test_never_more_than_capacity_plus_refill_over_any_window(scenario) -> None:
    rpm, tpm, start, steps = scenario
    tenant = run(rpm, tpm, start, steps)
    assert_windows_bounded(tenant.log, rpm, [e.requests for e in tenant.log])
    # Tokens net of settles: refunds count negative, overages positive (a
    # window ends at an admission, when the level is >= 0 again).
    assert_windows_bounded(tenant.log, tpm, [e.tokens for e in tenant.log])


@given(st.integers(1, 120), st.floats(0, 1e7), st.lists(st.floats(0, 5), min_size=1, max_size=80))
def test_request_windows_without_settles(rpm: int, start: float, gaps: list[float]) -> None:
    """Plain admissions only: the admitted count itself is bounded."""
    steps = [(g, Admit(0)) for g in gaps]
    tenant = run(rpm, 0, start, steps)
    assert_windows_bounded(tenant.log, rpm, [1.0] * len(tenant.log))
    # The very first burst takes exactly the bucket.
    burst = run(rpm, 0, start, [(0.0, Admit(0))] * (rpm + 5))
    assert len(burst.log) == rpm


# -- (b) refunds and capacity ---------------------------------------------------------


@given(scenarios())
def test_refunds_never_exceed_reservations_and_levels_stay_under_capacity(scenario) -> None:
    rpm, tpm, start, steps = scenario
    # run() checks after every step; here also every settle of every reservation at once.
    tenant = run(rpm, tpm, start, steps)
    for _ in range(len(tenant.outstanding)):
        tenant.try_settle(0, 0.0)  # used nothing: the largest possible refund
        tenant.check_capacity()
    assert tenant.refunded_total <= tenant.reserved_total + tol(tenant.reserved_total)


@given(st.integers(1, 5000), st.floats(-5000, 5000), st.floats(0, 1e7), st.floats(0, 120),
       st.integers(0, 10000), st.integers(0, 10000))
def test_settle_is_bounded_from_any_bucket(tpm, tokens, ts, dt, reserved, used) -> None:
    bucket = Bucket(min(tokens, float(tpm)), ts)
    now = ts + dt
    before = level(bucket, tpm, now)
    after = settle(bucket, tpm=tpm, reserved=reserved, used=used, now=now)
    assert after is not None and after.ts == now
    assert after.tokens <= tpm
    assert after.tokens - before <= max(0, reserved - used) + tol(tpm)
    assert after.tokens == pytest.approx(min(float(tpm), before + reserved - used), abs=tol(tpm))


@given(st.integers(1, 5000), st.integers(0, 10000), st.integers(0, 10000), st.floats(0, 1e7))
def test_settle_on_a_missing_bucket_is_settle_on_a_full_one(tpm, reserved, used, now) -> None:
    missing = settle(None, tpm=tpm, reserved=reserved, used=used, now=now)
    full = settle(Bucket(float(tpm), now), tpm=tpm, reserved=reserved, used=used, now=now)
    assert level(missing, tpm, now) == level(full, tpm, now)


# -- (c) refusals take nothing ----------------------------------------------------------


@given(scenarios())
def test_refused_admit_leaves_buckets_unchanged(scenario) -> None:
    rpm, tpm, start, steps = scenario
    tenant = run(rpm, tpm, start, steps)  # try_admit asserts it on every refusal
    for d, req, tok, cost, now in tenant.refusals:
        again, req2, tok2 = admit(req, tok, 0, rpm=rpm, tpm=tpm, max_concurrent=0, cost_tokens=cost, now=now)
        assert not again.ok and again.reason == d.reason
        assert (req2, tok2) == (req, tok)
        assert req2 is req and tok2 is tok


@given(
    st.integers(1, 120), st.integers(1, 5000), st.integers(1, 20), st.integers(0, 40), st.integers(0, 6000),
    st.floats(0, 1e7),
)
def test_concurrency_refusal_takes_nothing(rpm, tpm, max_concurrent, leases, cost, now) -> None:
    req, tok = Bucket(rpm / 2, now - 1), Bucket(tpm / 2, now - 1)
    d, req2, tok2 = admit(req, tok, leases, rpm=rpm, tpm=tpm, max_concurrent=max_concurrent, cost_tokens=cost, now=now)
    if leases >= max_concurrent:
        assert not d.ok
        assert (req2, tok2) == (req, tok)
    else:
        assert d.reason != "concurrency"
    if not d.ok:
        assert (req2, tok2) == (req, tok)


# -- (d) retry_after is exact ------------------------------------------------------------


def _check_retry(d: Decision, req: Bucket | None, tok: Bucket | None, rpm: int, tpm: int, cost: int, now: float) -> None:
    assert d.reason in ("requests", "tokens")
    wait = d.retry_after
    assert 0 < wait < math.inf
    # At exactly now + retry_after the binding bucket holds exactly what is needed ...
    at = now + wait
    need, bucket, cap = (1, req, rpm) if d.reason == "requests" else (cost, tok, tpm)
    assert level(bucket, cap, at) == pytest.approx(need, abs=tol(cap))
    # ... so the same request fits then (a microsecond of float slack) ...
    ok, _, _ = admit(req, tok, 0, rpm=rpm, tpm=tpm, max_concurrent=0, cost_tokens=cost, now=at + 1e-6)
    assert ok.ok, (d, ok)
    # ... and slightly before it does not: the binding bucket is still short.
    # (On a tie between the buckets either may be named then.)
    early = min(1e-3, wait / 2)
    if wait > 1e-6 and now + wait - early > now:
        no, _, _ = admit(req, tok, 0, rpm=rpm, tpm=tpm, max_concurrent=0, cost_tokens=cost, now=now + wait - early)
        assert not no.ok and no.reason in ("requests", "tokens"), (d, no)
        assert level(bucket, cap, now + wait - early) < need
        assert no.retry_after == pytest.approx(early, abs=1e-6), (d, no)


@given(scenarios())
def test_retry_after_is_exact(scenario) -> None:
    rpm, tpm, start, steps = scenario
    tenant = run(rpm, tpm, start, steps)
    for d, req, tok, cost, now in tenant.refusals:
        if d.reason in ("requests", "tokens"):
            _check_retry(d, req, tok, rpm, tpm, cost, now)


@given(st.integers(1, 120), st.integers(1, 5000), st.floats(-5000, 5000), st.floats(-200, 200),
       st.floats(0, 1e7), st.floats(0, 120), st.integers(0, 5000))
@example(rpm=60, tpm=600, req_level=0.0, tok_level=100.0, ts=1000.0, dt=0.0, cost=200)  # the README's example
def test_retry_after_is_exact_from_any_state(rpm, tpm, req_level, tok_level, ts, dt, cost) -> None:
    """The same, from arbitrary bucket states (including debt after an overage)."""
    req = Bucket(min(req_level, float(rpm)), ts)
    tok = Bucket(min(tok_level, float(tpm)), ts)
    now = ts + dt
    d, _, _ = admit(req, tok, 0, rpm=rpm, tpm=tpm, max_concurrent=0, cost_tokens=cost, now=now)
    if cost > tpm:
        assert (d.ok, d.reason, d.retry_after) == (False, "too_large", math.inf)
    elif not d.ok:
        _check_retry(d, req, tok, rpm, tpm, cost, now)
    else:
        assert level(req, rpm, now) >= 1 and level(tok, tpm, now) >= cost


def test_retry_after_worked_example() -> None:
    """600 tokens/min, 500 taken: a 200-token request waits for 100 tokens at 10/s."""
    d, _, tok = admit(None, None, 0, rpm=0, tpm=600, max_concurrent=0, cost_tokens=500, now=0.0)
    assert d.ok and tok == Bucket(100.0, 0.0)
    d, _, _ = admit(None, tok, 0, rpm=0, tpm=600, max_concurrent=0, cost_tokens=200, now=0.0)
    assert (d.ok, d.reason, d.retry_after) == (False, "tokens", 10.0)
    assert d.remaining_tokens == 100.0 and d.reset_tokens == 50.0



def test_an_admission_reports_its_buckets_after_its_own_cost() -> None:
    """The x-ratelimit-* headers of an admitted request: what is left once
    it took its cost, and how long until that refills (not the level before)."""
    d, req, tok = admit(None, None, 0, rpm=60, tpm=600, max_concurrent=0, cost_tokens=60, now=0.0)
    assert d.ok and (d.remaining_tokens, d.reset_tokens) == (540.0, 6.0)
    assert (d.remaining_requests, d.reset_requests) == (59.0, 1.0)


def test_a_request_behind_others_of_its_tenant_asks_again_soon() -> None:
    """``behind``: refused even where its limits pass, and told to ask again
    in ``QUEUED_RETRY`` (the head of a line moves on quickly), nothing taken."""
    d, req, tok = admit(None, None, 0, rpm=60, tpm=600, max_concurrent=0, cost_tokens=60, now=0.0, behind=True)
    assert (d.ok, d.reason, d.retry_after) == (False, "queued", QUEUED_RETRY) and QUEUED_RETRY == 0.25
    assert (req, tok) == (None, None)

# -- leases -------------------------------------------------------------------------------


@given(st.dictionaries(st.text(max_size=4), st.floats(0, 100)), st.floats(0, 100))
def test_prune_leases_keeps_exactly_the_live_ones(expiries, now) -> None:
    live = prune_leases(expiries, now)
    assert live == {k: v for k, v in expiries.items() if v > now}
    assert prune_leases(live, now) == live
