"""Counts kept in plain Python and added to prometheus-client's children in bulk.

prometheus-client's ``inc`` and ``observe`` check the metric, take a lock
per value and call three or four functions on the way; a request's own
counts (its outcome, its tokens, its time to first token, its duration, its
queue wait) were ~50 Python calls of the ~775 a streamed request took.
Here they are plain additions, and the children get them when ``/metrics``
is built (``Metrics.flush``, on the event loop before the text), so a
scrape shows every count made before it, as before.

``HistogramBatch`` does the same for one histogram child with a timer (the
inter-token samples of a token lane).

Both write prometheus-client's internals (a histogram child's ``_buckets``,
``_sum``, ``_upper_bounds``; a counter child's ``_value``), unchanged since
its first releases; tests/unit/test_metric_batches.py and test_lane.py
compare the exposition with ``inc``'s and ``observe``'s, so a change there
fails a test, not a scrape.
"""

from __future__ import annotations

from bisect import bisect_left
from typing import Any

__all__ = ["HistogramBatch", "TenantCounts"]


class HistogramBatch:
    """Samples of one histogram child counted here and added to it in bulk.

    prometheus-client's ``observe`` checks the metric, takes a lock for the
    sum and another for the bucket, and calls three functions on the way:
    per token, that was the largest single cost of the token lane. A batch
    costs a bisect per sample. With a ``loop``, what waits is added ``every``
    seconds after the first sample that waits (one timer at a time), so a
    scrape misses at most that much; the owner flushes at the end. Works in
    multiprocess mode too: those values have the same ``inc``. Without a
    ``loop``, its owner flushes (``TenantCounts``: at each scrape). The sum
    is added as the batch's total: it may differ from ``observe``'s, one by
    one, in the last digit (float addition is not associative); anything
    else may observe into the same child.
    """

    __slots__ = ("child", "bounds", "counts", "total", "every", "loop", "timer")

    def __init__(self, child: Any, every: float = 1.0, loop: Any = None) -> None:
        self.child = child
        self.bounds = child._upper_bounds
        self.counts = [0] * len(self.bounds)
        self.total = 0.0
        self.every = every
        self.loop = loop
        self.timer = None

    def add(self, value: float) -> None:
        self.counts[bisect_left(self.bounds, value)] += 1
        self.total += value
        if self.timer is None and self.loop is not None:
            self.timer = self.loop.call_later(self.every, self.flush)

    def flush(self) -> None:
        """Add what waits to the histogram now."""
        if self.timer is not None:
            self.timer.cancel()
            self.timer = None
        buckets = self.child._buckets
        counts = self.counts
        for i, c in enumerate(counts):
            if c:
                buckets[i].inc(c)
                counts[i] = 0
        if self.total:
            self.child._sum.inc(self.total)
            self.total = 0.0


class _Count:
    """One counter child's increments since the last flush (whole numbers:
    their sum is exact whatever the order)."""

    __slots__ = ("child", "n")

    def __init__(self, child: Any) -> None:
        self.child = child
        self.n = 0

    def flush(self) -> None:
        if self.n:
            self.child._value.inc(self.n)
            self.n = 0


class TenantCounts:
    """A request's counts for one (tenant, priority class), from
    ``Metrics.counts``: ``fairstream_requests_total`` (by endpoint and
    outcome) and ``fairstream_tokens_total`` of the tenant, and the
    class's ``fairstream_time_to_first_token_seconds``,
    ``fairstream_request_duration_seconds`` and
    ``fairstream_queue_wait_seconds``.

    Each child is made (``Metrics.child``) where the request path made it
    before (the first request that counted in it), so the series appear as
    they did, in the same order. Counts wait here until ``flush``: the
    first one after a flush puts this on the metrics' list to flush
    (``pending``); with ``pending`` None (multiprocess mode: a scrape reads
    every worker's files, and another worker cannot flush this one) each
    count is flushed at once."""

    __slots__ = ("metrics", "tenant", "priority", "requests", "prompt", "completion", "ttft", "e2e", "queue_wait",
                 "itl", "pending", "waiting")

    def __init__(self, metrics: Any, tenant: str, priority: str, pending: list[TenantCounts] | None) -> None:
        self.metrics = metrics
        self.tenant = tenant
        self.priority = priority
        self.requests: dict[tuple[str, str], _Count] = {}
        self.prompt: _Count | None = None
        self.completion: _Count | None = None
        self.ttft: HistogramBatch | None = None
        self.e2e: HistogramBatch | None = None
        self.queue_wait: HistogramBatch | None = None
        self.itl: Any = None  # the inter-token histogram's child (observed directly, and by HistogramBatch)
        self.pending = pending
        self.waiting = False  # on ``pending``

    def streaming(self) -> Any:
        """A stream's events begin: its time to first token and inter-token
        series exist from here (at 0 until their first sample). The
        inter-token child."""
        if self.ttft is None:
            self.ttft = self._hist(self.metrics.ttft)
        if self.itl is None:
            m = self.metrics
            self.itl = m.child(m.itl, self.tenant, self.priority)
        return self.itl

    def first_token(self, seconds: float) -> None:
        h = self.ttft
        if h is None:
            h = self.ttft = self._hist(self.metrics.ttft)
        h.add(seconds)
        self._counted()

    def waited(self, seconds: float) -> None:
        """A wait in the scheduler's queue ended."""
        h = self.queue_wait
        if h is None:
            h = self.queue_wait = self._hist(self.metrics.queue_wait)
        h.add(seconds)
        self._counted()

    def ended(self, endpoint: str, outcome: str) -> None:
        """A request ended without a generation."""
        c = self.requests.get((endpoint, outcome))
        if c is None:
            c = self._request(endpoint, outcome)
        c.n += 1
        self._counted()

    def generated(self, endpoint: str, outcome: str, prompt: int, completion: int, seconds: float) -> None:
        """A request with a generation ended: its tokens and its duration."""
        c = self.requests.get((endpoint, outcome))
        if c is None:
            c = self._request(endpoint, outcome)
        c.n += 1
        if self.prompt is None:  # (made in this order: requests, tokens, duration)
            m = self.metrics
            self.prompt = _Count(m.child(m.tokens, self.tenant, "prompt"))
            self.completion = _Count(m.child(m.tokens, self.tenant, "completion"))
        self.prompt.n += prompt
        self.completion.n += completion  # type: ignore[union-attr]
        h = self.e2e
        if h is None:
            h = self.e2e = self._hist(self.metrics.e2e)
        h.add(seconds)
        self._counted()

    def flush(self) -> None:
        """Add what waits to the children."""
        self.waiting = False
        for c in self.requests.values():
            c.flush()
        for one in (self.prompt, self.completion, self.ttft, self.e2e, self.queue_wait):
            if one is not None:
                one.flush()

    def _counted(self) -> None:
        if not self.waiting:
            if self.pending is None:
                self.flush()
            else:
                self.waiting = True
                self.pending.append(self)

    def _request(self, endpoint: str, outcome: str) -> _Count:
        m = self.metrics
        c = self.requests[(endpoint, outcome)] = _Count(m.child(m.requests, self.tenant, endpoint, outcome))
        return c

    def _hist(self, family: Any) -> HistogramBatch:
        return HistogramBatch(self.metrics.child(family, self.tenant, self.priority))
