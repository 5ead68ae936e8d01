"""Adaptive per-replica in-flight caps (AIMD, as in Netflix concurrency-limits).

Each replica gets a limit on the requests the router keeps on it. Latency
samples (inter-token latency and the replica-side time to first token) are
gathered over a window; at the end of each window:

* over target (p90 ITL above ``target_itl`` or p90 TTFT above
  ``target_ttft``): multiply the limit by ``backoff`` (multiplicative decrease);
* under target and the limit was actually reached during the window: add
  ``increase`` (additive increase);
* otherwise keep it.

So under overload requests wait in the router's fair queues instead of
piling into one engine's FIFO, and when the engine has headroom the limit
climbs to use it. Pure: ``now`` is passed in.
"""

from __future__ import annotations

import math

import msgspec

__all__ = ["AimdSettings", "AimdLimiter"]


class AimdSettings(msgspec.Struct, forbid_unknown_fields=True, kw_only=True, frozen=True):
    """router.yaml ``batching``: the adaptive in-flight cap of every replica."""

    enabled: bool = True
    """Adapt the cap; when false every replica takes up to ``max_inflight``."""
    initial: int = 32
    """Starting cap per replica."""
    min_inflight: int = 2
    """The cap never goes below this."""
    max_inflight: int = 256
    """The cap never goes above this."""
    target_itl: float = 0.05
    """Target p90 inter-token latency in seconds."""
    target_ttft: float = 1.0
    """Target p90 time from dispatch to first token, in seconds."""
    window: float = 0.5
    """Seconds of samples per decision."""
    increase: int = 2
    """Added to the cap after a good window in which the cap was reached."""
    backoff: float = 0.85
    """The cap is multiplied by this after a bad window."""

    def __post_init__(self) -> None:
        if not 1 <= self.min_inflight <= self.max_inflight:
            raise ValueError("need 1 <= min_inflight <= max_inflight")
        if self.enabled and not self.min_inflight <= self.initial <= self.max_inflight:
            raise ValueError("initial must lie between min_inflight and max_inflight")
        if not 0 < self.backoff < 1:
            raise ValueError("backoff must be between 0 and 1")
        if self.increase < 1 or self.window <= 0:
            raise ValueError("increase must be >= 1 and window > 0")
        if self.enabled and not (self.target_itl > 0 and self.target_ttft > 0):
            raise ValueError("target_itl and target_ttft must be positive")


def _p90(xs: list[float]) -> float:
    """Nearest-rank 90th percentile."""
    xs = sorted(xs)
    return xs[max(0, math.ceil(0.9 * len(xs)) - 1)]


class AimdLimiter:
    __slots__ = ("s", "limit", "_itl", "_ttft", "_window_start", "_saturated")

    def __init__(self, settings: AimdSettings, now: float) -> None:
        self.s = settings
        self.limit = float(settings.initial if settings.enabled else settings.max_inflight)
        self._itl: list[float] = []
        self._ttft: list[float] = []
        self._window_start = now
        self._saturated = False

    @property
    def cap(self) -> int:
        return max(self.s.min_inflight, int(self.limit))

    @property
    def adaptive(self) -> bool:
        """Whether samples move the cap (``enabled``); else it stays fixed."""
        return self.s.enabled

    def observe_itl(self, seconds: float) -> None:
        if len(self._itl) < 4096:
            self._itl.append(seconds)

    def observe_ttft(self, seconds: float) -> None:
        if len(self._ttft) < 4096:
            self._ttft.append(seconds)

    def note_inflight(self, inflight: int) -> None:
        if inflight >= self.cap:
            self._saturated = True

    def tick(self, now: float) -> bool:
        """Close the window if it is over; return True if the cap changed."""
        s = self.s
        if not s.enabled or now - self._window_start < s.window:
            return False
        old = self.cap
        bad = (self._itl and _p90(self._itl) > s.target_itl) or (
            self._ttft and _p90(self._ttft) > s.target_ttft
        )
        if bad:
            self.limit = max(float(s.min_inflight), self.limit * s.backoff)
        elif self._saturated and (self._itl or self._ttft):
            self.limit = min(float(s.max_inflight), self.limit + s.increase)
        self._itl.clear()
        self._ttft.clear()
        self._saturated = False
        self._window_start = now
        return self.cap != old
