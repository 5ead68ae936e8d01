"""``policies.batching.AimdLimiter``: the adaptive per-replica in-flight cap.

Pure: every call gets an explicit ``now``; no event loop, no sleeping.
"""

from __future__ import annotations

import math

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from policies.batching import AimdLimiter, AimdSettings

TARGET_ITL = 0.05
TARGET_TTFT = 1.0


def mk(**kw) -> AimdSettings:
    base = dict(enabled=True, initial=16, min_inflight=2, max_inflight=64, target_itl=TARGET_ITL,
                target_ttft=TARGET_TTFT, window=0.5, increase=2, backoff=0.5)
    base.update(kw)
    return AimdSettings(**base)


def window(lim: AimdLimiter, now: float, *, itl=(), ttft=(), inflight: int | None = None) -> bool:
    """Feed one window of samples, then close it at ``now``."""
    for x in itl:
        lim.observe_itl(x)
    for x in ttft:
        lim.observe_ttft(x)
    if inflight is not None:
        lim.note_inflight(inflight)
    return lim.tick(now)


# -- multiplicative decrease ------------------------------------------------------


def test_slow_itl_cuts_the_cap_multiplicatively() -> None:
    lim = AimdLimiter(mk(initial=40, backoff=0.5), now=0.0)
    assert lim.cap == 40
    assert window(lim, 0.5, itl=[0.2] * 20)
    assert lim.cap == 20
    assert window(lim, 1.0, itl=[0.2] * 20)
    assert lim.cap == 10


def test_slow_ttft_cuts_the_cap_even_with_fast_itl() -> None:
    lim = AimdLimiter(mk(initial=40, backoff=0.75), now=0.0)
    assert window(lim, 0.5, itl=[0.001] * 50, ttft=[5.0] * 10)
    assert lim.cap == 30


def test_a_cut_does_not_need_saturation() -> None:
    """Over target is bad whether or not the cap was reached."""
    lim = AimdLimiter(mk(initial=40), now=0.0)
    assert window(lim, 0.5, itl=[1.0] * 10, inflight=1)
    assert lim.cap == 20


def test_the_decision_is_on_p90_not_on_single_outliers() -> None:
    """Fewer than 10% of samples over target: no cut. Most over: cut."""
    lim = AimdLimiter(mk(initial=40), now=0.0)
    assert not window(lim, 0.5, itl=[0.01] * 95 + [5.0] * 4)
    assert lim.cap == 40
    assert window(lim, 1.0, itl=[0.01] * 50 + [5.0] * 50)
    assert lim.cap == 20


def test_the_p90_of_ten_samples_is_the_ninth() -> None:
    """Nearest rank: of 10 samples the 9th smallest, so one slow sample in
    ten is an outlier (no cut), two are not (cut)."""
    lim = AimdLimiter(mk(initial=40), now=0.0)
    assert not window(lim, 0.5, itl=[0.01] * 9 + [5.0])
    assert lim.cap == 40
    assert window(lim, 1.0, itl=[0.01] * 8 + [5.0] * 2)
    assert lim.cap == 20

def test_the_cap_never_goes_below_min() -> None:
    lim = AimdLimiter(mk(initial=8, min_inflight=3, backoff=0.5), now=0.0)
    for i in range(1, 20):
        window(lim, i * 0.5, itl=[1.0] * 10)
        assert lim.cap >= 3
    assert lim.cap == 3


# -- additive increase ------------------------------------------------------------


def test_fast_and_saturated_grows_additively() -> None:
    lim = AimdLimiter(mk(initial=10, increase=3), now=0.0)
    assert window(lim, 0.5, itl=[0.01] * 10, inflight=10)
    assert lim.cap == 13
    assert window(lim, 1.0, itl=[0.01] * 10, inflight=13)
    assert lim.cap == 16


def test_fast_but_not_saturated_keeps_the_cap() -> None:
    """Headroom nobody uses is no evidence the replica can take more."""
    lim = AimdLimiter(mk(initial=10), now=0.0)
    assert not window(lim, 0.5, itl=[0.01] * 10, inflight=9)
    assert lim.cap == 10
    assert not window(lim, 1.0, itl=[0.01] * 10)
    assert lim.cap == 10


def test_saturated_without_samples_keeps_the_cap() -> None:
    lim = AimdLimiter(mk(initial=10), now=0.0)
    assert not window(lim, 0.5, inflight=10)
    assert lim.cap == 10


def test_saturation_is_forgotten_at_the_end_of_a_window() -> None:
    lim = AimdLimiter(mk(initial=10, increase=1), now=0.0)
    assert window(lim, 0.5, itl=[0.01], inflight=10)
    assert lim.cap == 11
    assert not window(lim, 1.0, itl=[0.01])  # not saturated in this window
    assert lim.cap == 11


def test_the_cap_never_goes_above_max() -> None:
    lim = AimdLimiter(mk(initial=60, max_inflight=64, increase=3), now=0.0)
    for i in range(1, 10):
        window(lim, i * 0.5, itl=[0.01], inflight=lim.cap)
        assert lim.cap <= 64
    assert lim.cap == 64


# -- windows ------------------------------------------------------------------------


def test_nothing_changes_before_the_window_is_over() -> None:
    lim = AimdLimiter(mk(initial=40, window=1.0), now=10.0)
    assert not window(lim, 10.9, itl=[1.0] * 10)
    assert lim.cap == 40
    assert window(lim, 11.0)  # the samples of the unfinished window still count
    assert lim.cap == 20


def test_samples_are_cleared_after_each_window() -> None:
    lim = AimdLimiter(mk(initial=40), now=0.0)
    assert window(lim, 0.5, itl=[1.0] * 10)
    assert not window(lim, 1.0)  # no new samples: no second cut
    assert lim.cap == 20


def test_sample_buffers_are_bounded() -> None:
    lim = AimdLimiter(mk(), now=0.0)
    for _ in range(10_000):
        lim.observe_itl(0.01)
        lim.observe_ttft(0.1)
    assert len(lim._itl) <= 4096 and len(lim._ttft) <= 4096


# -- disabled -----------------------------------------------------------------------


def test_disabled_is_a_constant_max_inflight_cap() -> None:
    lim = AimdLimiter(mk(enabled=False, initial=4, max_inflight=12), now=0.0)
    assert lim.cap == 12
    for i in range(1, 20):
        changed = window(lim, i * 0.5, itl=[5.0] * 10 if i % 2 else [0.001] * 10, ttft=[9.0], inflight=12)
        assert not changed
        assert lim.cap == 12


# -- properties ---------------------------------------------------------------------


@st.composite
def aimd_settings(draw, enabled: bool | None = None) -> AimdSettings:
    lo = draw(st.integers(1, 32))
    hi = draw(st.integers(lo, 256))
    return AimdSettings(
        enabled=draw(st.booleans()) if enabled is None else enabled,
        initial=draw(st.integers(lo, hi)),
        min_inflight=lo,
        max_inflight=hi,
        target_itl=draw(st.floats(0.001, 0.5)),
        target_ttft=draw(st.floats(0.01, 5.0)),
        window=draw(st.floats(0.01, 2.0)),
        increase=draw(st.integers(1, 16)),
        backoff=draw(st.floats(0.1, 0.99)),
    )


event = st.one_of(
    st.tuples(st.just("itl"), st.floats(0, 2.0)),
    st.tuples(st.just("ttft"), st.floats(0, 10.0)),
    st.tuples(st.just("inflight"), st.integers(0, 300)),
    st.tuples(st.just("time"), st.floats(0, 3.0)),
)


@given(aimd_settings(), st.lists(event, max_size=300))
def test_the_cap_stays_within_min_and_max(s: AimdSettings, events) -> None:
    now = 0.0
    lim = AimdLimiter(s, now)
    for kind, v in events:
        if kind == "itl":
            lim.observe_itl(v)
        elif kind == "ttft":
            lim.observe_ttft(v)
        elif kind == "inflight":
            lim.note_inflight(v)
        else:
            now += v
            lim.tick(now)
        assert s.min_inflight <= lim.cap <= s.max_inflight
        if not s.enabled:
            assert lim.cap == s.max_inflight


@given(aimd_settings(enabled=True), st.lists(st.floats(0, 2.0), min_size=1, max_size=50),
       st.lists(st.floats(0, 10.0), max_size=20), st.integers(0, 300))
def test_one_window_follows_the_aimd_rule(s: AimdSettings, itls, ttfts, inflight) -> None:
    """One closed window: cut when a p90 is over target, grow when under target
    and saturated, otherwise keep; always within [min, max]."""
    lim = AimdLimiter(s, now=0.0)
    before = lim.limit
    cap = lim.cap
    window(lim, s.window, itl=itls, ttft=ttfts, inflight=inflight)
    itl_bad = _p90_upper(itls) > s.target_itl
    ttft_bad = bool(ttfts) and _p90_upper(ttfts) > s.target_ttft
    if itl_bad or ttft_bad:
        assert lim.limit == max(s.min_inflight, before * s.backoff)
        assert lim.cap <= cap
    elif inflight >= cap:
        assert lim.limit == min(s.max_inflight, before + s.increase)
        assert lim.cap >= cap
    else:
        assert lim.limit == before
    assert s.min_inflight <= lim.cap <= s.max_inflight


def _p90_upper(xs: list[float]) -> float:
    """The limiter's p90: nearest rank, the sample at index ceil(0.9 n) - 1 of the sorted list."""
    xs = sorted(xs)
    return xs[max(0, math.ceil(0.9 * len(xs)) - 1)]


@settings(max_examples=50)
@given(aimd_settings(enabled=True))
def test_steady_overload_reaches_min_and_steady_headroom_reaches_max(s: AimdSettings) -> None:
    lim = AimdLimiter(s, now=0.0)
    now = 0.0
    step = s.window * 1.001  # each tick closes exactly one window (no float ties)
    cuts = math.ceil(math.log(s.max_inflight / s.min_inflight + 1) / -math.log(s.backoff)) + 2
    for _ in range(cuts):
        now += step
        window(lim, now, itl=[s.target_itl * 4] * 10)
    assert lim.cap == s.min_inflight
    for _ in range(math.ceil((s.max_inflight - s.min_inflight) / s.increase) + 2):
        now += step
        window(lim, now, itl=[s.target_itl / 4] * 10, inflight=lim.cap)
    assert lim.cap == s.max_inflight


@pytest.mark.parametrize("kw", [
    dict(initial=500, max_inflight=64),  # above max
    dict(initial=1, min_inflight=2),  # below min
    dict(min_inflight=0, initial=0),  # a cap of 0 would stop the replica
    dict(min_inflight=80, max_inflight=64, initial=70),  # empty range
    dict(backoff=1.0),  # would never cut
    dict(backoff=0.0),
    dict(increase=0),  # would never grow
    dict(window=0.0),
])
def test_inconsistent_settings_are_rejected(kw) -> None:
    """Settings that would put the cap outside [min, max] (or never move it)
    fail when the config is loaded, not at run time."""
    with pytest.raises(ValueError):
        mk(**kw)
