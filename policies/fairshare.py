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

``pick`` states the order over a list of heads (the reference); the
scheduler keeps its heads in a ``HeadIndex``, which gives the same answer in
O(C log T) for C classes and T backlogged tenants instead of O(T).

Pure: no clock of its own, no I/O; ``now`` is passed in.
"""

from __future__ import annotations

import heapq
import sys
from collections.abc import Callable, Iterable, Mapping, Sequence

import msgspec

__all__ = ["Head", "HeadIndex", "VirtualCounters", "pick", "aged_rank", "vtc_bound", "W_IN", "W_OUT"]

W_IN = 1.0  # weight of a prompt token in the counter (the paper's w_p)
W_OUT = 2.0  # weight of a completion token (the paper's w_q)
# Largest counter: the config keeps weights in [0.001, 1000], so no counter
# gets near it, but an infinite one would compare equal to its like, and a
# tenant lifted to it would be infinite too; a finite cap keeps them numbers.
MAX_COUNTER = sys.float_info.max


class Head(msgspec.Struct, frozen=True, gc=False):
    """The first queued request of one tenant, as the chooser sees it."""

    tenant: str
    rank: int  # priority class index, 0 = highest
    enqueued: float  # when the request was queued


def aged_rank(rank: int, since: float, now: float, aging: float) -> int:
    """A class's rank lifted one step per ``aging`` seconds waited since
    ``since`` (its oldest head's enqueue time), down to 0; ``aging`` <= 0:
    strict priority."""
    if aging <= 0:
        return rank
    return max(0, rank - int((now - since) / aging))


class VirtualCounters:
    """Per-tenant virtual token counters (mutable, but no I/O and no clock)."""

    __slots__ = ("values", "last", "weights")

    def __init__(self) -> None:
        self.values: dict[str, float] = {}
        self.last: float | None = None  # counter of the tenant served last
        self.weights: dict[str, float] = {}  # the tenants' weights in force (``reweight``)

    def get(self, tenant: str) -> float:
        return self.values.get(tenant, 0.0)

    def activate(self, tenant: str, backlogged: Iterable[str]) -> None:
        """``tenant`` became backlogged: lift it to the minimum of the others,
        or, when nobody else waits, to the counter of the tenant served last
        (the paper's rule for an empty queue), so idle time is never banked."""
        others = [self.values.get(t, 0.0) for t in backlogged if t != tenant]
        self.lift(tenant, min(others) if others else None)

    def lift(self, tenant: str, others_min: float | None) -> None:
        """``activate`` given the smallest counter of the other backlogged
        tenants (None: nobody else waits)."""
        floor = others_min if others_min is not None else self.last
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

    def reweight(self, weights: Mapping[str, float]) -> None:
        """The tenants' weights are these from now on (a reload): a tenant
        named here is charged at its weight for every request, whatever
        weight the request was admitted with; fair share is the tenant's.
        The counters stay as they are (they hold the service so far, at the
        weights it was served with), so the heads keyed by them stay
        ordered: only how fast each counter grows from now on changes."""
        self.weights = dict(weights)

    def charge(self, tenant: str, prompt: int, completion: int, weight: float) -> None:
        """Served tokens advance ``tenant``'s counter, at its weight in force
        (``weight``, the request's, for a tenant ``reweight`` did not name)."""
        value = self.values.get(tenant, 0.0) + (W_IN * prompt + W_OUT * completion) / self.weights.get(tenant, weight)
        self.values[tenant] = value if value <= MAX_COUNTER else MAX_COUNTER  # (NaN too: not <=)

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
        rank = aged_rank(h.rank, oldest[h.rank], now, aging)
        key = (rank, counters.get(h.tenant), h.enqueued)
        if best_key is None or key < best_key:
            best, best_key = i, key
    return best


def vtc_bound(max_prompt: int, max_completion: int) -> float:
    """The paper's bound on the service gap between two backlogged tenants of
    equal weight, in weighted tokens: ``2 * (w_in * L_in + w_out * L_out)``."""
    return 2.0 * (W_IN * max_prompt + W_OUT * max_completion)


class HeadIndex:
    """The tenants' queue heads, indexed so that ``pick`` is O(C log T).

    Answers like ``pick`` over the same heads (lowest effective class rank,
    then lowest counter, then earliest enqueued; aging by a class's oldest
    head). Per class it keeps two heaps: ``(counter, enqueued, seq, tenant)``
    and ``(enqueued, seq, tenant)`` for the class's oldest head. Entries are
    dropped lazily: a tenant's head is current only while its ``seq`` is.
    Counters only grow (``charge``, ``activate``), so an entry's counter is a
    lower bound of the tenant's current one; an entry whose counter is stale
    is re-keyed when it reaches the top, and the first current top is the
    true minimum. Pure: ``now`` and the counters are passed in.
    """

    __slots__ = ("aging", "_by_counter", "_by_age", "_live", "_seq")

    def __init__(self, aging: float) -> None:
        self.aging = aging
        self._by_counter: dict[int, list[tuple[float, float, int, str]]] = {}
        self._by_age: dict[int, list[tuple[float, int, str]]] = {}
        self._live: dict[str, tuple[int, int]] = {}  # tenant -> (seq, class rank)
        self._seq = 0

    def __len__(self) -> int:
        return len(self._live)

    def __contains__(self, tenant: str) -> bool:
        return tenant in self._live

    def set(self, tenant: str, rank: int, enqueued: float, counter: float) -> None:
        """``tenant``'s queue head is now this request (replacing any other)."""
        self._seq += 1
        seq = self._seq
        self._live[tenant] = (seq, rank)
        by_counter = self._by_counter.get(rank)
        if by_counter is None:
            by_counter = self._by_counter[rank] = []
            self._by_age[rank] = []
        heapq.heappush(by_counter, (counter, enqueued, seq, tenant))
        heapq.heappush(self._by_age[rank], (enqueued, seq, tenant))
        if len(by_counter) > 4 * len(self._live) + 64:
            self._compact()

    def remove(self, tenant: str) -> None:
        """``tenant`` has no queued request any more."""
        self._live.pop(tenant, None)

    def pick(self, counters: VirtualCounters, now: float,
             skip: Callable[[str], bool] | None = None) -> str | None:
        """The tenant whose head goes next (None: no head left); heads of
        tenants for which ``skip`` is true are passed over (and kept)."""
        held: list[tuple[list, tuple]] = []
        try:
            ranks: list[tuple[int, int]] = []
            for rank, heap in self._by_age.items():
                top = self._top(heap, 1, skip, held)
                if top is None:
                    continue
                ranks.append((aged_rank(rank, top[0], now, self.aging), rank))
            if not ranks:
                return None
            first = min(eff for eff, _ in ranks)
            best: tuple[float, float, int, str] | None = None
            for eff, rank in ranks:
                if eff == first:
                    top = self._top_counter(self._by_counter[rank], counters, skip, held)
                    if top is not None and (best is None or top[:2] < best[:2]):
                        best = top
            return best[3] if best is not None else None
        finally:
            for heap, item in held:
                heapq.heappush(heap, item)

    def min_counter(self, counters: VirtualCounters) -> float | None:
        """The smallest counter among the tenants with a head (None: none)."""
        low: float | None = None
        for heap in self._by_counter.values():
            top = self._top_counter(heap, counters, None, [])
            if top is not None and (low is None or top[0] < low):
                low = top[0]
        return low

    def _current(self, seq: int, tenant: str) -> bool:
        live = self._live.get(tenant)
        return live is not None and live[0] == seq

    def _top(self, heap: list, at: int, skip, held: list) -> tuple | None:
        """The first current entry of ``heap`` (its seq at index ``at``)."""
        while heap:
            item = heap[0]
            if not self._current(item[at], item[-1]):
                heapq.heappop(heap)
            elif skip is not None and skip(item[-1]):
                held.append((heap, heapq.heappop(heap)))
            else:
                return item
        return None

    def _top_counter(self, heap: list, counters: VirtualCounters, skip, held: list) -> tuple | None:
        values = counters.values
        while True:
            item = self._top(heap, 2, skip, held)
            if item is None:
                return None
            cur = values.get(item[3], 0.0)
            if cur == item[0]:
                return item
            heapq.heapreplace(heap, (cur, item[1], item[2], item[3]))

    def _compact(self) -> None:
        """Drop stale entries (bounds the heaps at a few times the heads)."""
        for rank, heap in self._by_counter.items():
            heap[:] = [e for e in heap if self._current(e[2], e[3])]
            heapq.heapify(heap)
            ages = self._by_age[rank]
            ages[:] = [e for e in ages if self._current(e[1], e[2])]
            heapq.heapify(ages)
