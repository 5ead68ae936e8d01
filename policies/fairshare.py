"""Who goes next: strict priority classes with aging, then weighted VTC.

Virtual Token Counter (Sheng et al., "Fairness in Serving Large Language
Models", OSDI 2024). Each tenant has a counter that advances by the tokens it
is served, weighted: ``(w_in * prompt + w_out * completion) / weight``. Among
backlogged tenants of one class the one with the smallest counter goes next.
A tenant that becomes backlogged again is lifted to the smallest counter of
the tenants already backlogged, so idle time cannot be banked. The paper's
bound: two continuously backlogged tenants' served service (in weighted
tokens) differs by at most ``2 * U`` where ``U = max(w_in * L_in + w_out *
L_out)``, the largest charge one request can add (``vtc_bound``).

Priority and aging. Classes are strict (rank 0 first) but a class's
effective rank drops by one for every ``aging`` seconds its oldest queued
request has waited, so a class of rank ``r`` competes with the top class
after at most ``r * aging`` seconds; there its tenants are ordered by their
counters, which a newly backlogged tenant is lifted to. That is the
starvation bound stated in the README. Aging lifts whole classes, so inside
a class the weights always decide.

Pure: no clock of its own, no I/O; ``now`` is passed in.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

import msgspec

__all__ = ["Head", "VirtualCounters", "pick", "effective_rank", "vtc_bound", "W_IN", "W_OUT"]

W_IN = 1.0  # weight of a prompt token in the counter (the paper's w_p)
W_OUT = 2.0  # weight of a completion token (the paper's w_q)


class Head(msgspec.Struct, frozen=True, gc=False):
    """The first queued request of one tenant, as the chooser sees it."""

    tenant: str
    rank: int  # priority class index, 0 = highest
    enqueued: float  # when the request was queued


def effective_rank(head: Head, now: float, aging: float) -> int:
    if aging <= 0:
        return head.rank
    return max(0, head.rank - int((now - head.enqueued) / aging))


class VirtualCounters:
    """Per-tenant virtual token counters (mutable, but no I/O and no clock)."""

    __slots__ = ("values", "last")

    def __init__(self) -> None:
        self.values: dict[str, float] = {}
        self.last: float | None = None  # counter of the tenant served last

    def get(self, tenant: str) -> float:
        return self.values.get(tenant, 0.0)

    def activate(self, tenant: str, backlogged: Iterable[str]) -> None:
        """``tenant`` became backlogged: lift it to the minimum of the others,
        or, when nobody else waits, to the counter of the tenant served last
        (the paper's rule for an empty queue), so idle time is never banked."""
        others = [self.values.get(t, 0.0) for t in backlogged if t != tenant]
        floor = min(others) if others else self.last
        cur = self.values.get(tenant)
        if cur is None:
            self.values[tenant] = floor if floor is not None else self._min_all()
        elif floor is not None and cur < floor:
            self.values[tenant] = floor

    def _min_all(self) -> float:
        return min(self.values.values(), default=0.0)

    def served(self, tenant: str) -> None:
        """A request of ``tenant`` was dispatched."""
        self.last = self.values.get(tenant, 0.0)

    def charge(self, tenant: str, prompt: int, completion: int, weight: float) -> None:
        self.values[tenant] = self.values.get(tenant, 0.0) + (W_IN * prompt + W_OUT * completion) / weight

    def forget(self, keep: Iterable[str]) -> None:
        """Drop counters of tenants no longer configured."""
        keep = set(keep)
        for t in [t for t in self.values if t not in keep]:
            del self.values[t]


def pick(heads: Sequence[Head], counters: VirtualCounters, now: float, aging: float) -> int:
    """Index of the head to serve next: lowest effective class rank, then
    lowest counter, then earliest enqueued.

    Aging lifts a whole class, by the wait of its oldest head, not single
    requests: heads of one class always share a rank, so inside a class the
    counters (the weights) decide and aging never turns it into FIFO.
    """
    oldest: dict[int, float] = {}
    for h in heads:
        t = oldest.get(h.rank)
        if t is None or h.enqueued < t:
            oldest[h.rank] = h.enqueued
    best = -1
    best_key: tuple[int, float, float] | None = None
    for i, h in enumerate(heads):
        rank = h.rank if aging <= 0 else max(0, h.rank - int((now - oldest[h.rank]) / aging))
        key = (rank, counters.get(h.tenant), h.enqueued)
        if best_key is None or key < best_key:
            best, best_key = i, key
    return best


def vtc_bound(max_prompt: int, max_completion: int) -> float:
    """The paper's bound on the service gap between two backlogged tenants of
    equal weight, in weighted tokens: ``2 * (w_in * L_in + w_out * L_out)``."""
    return 2.0 * (W_IN * max_prompt + W_OUT * max_completion)
