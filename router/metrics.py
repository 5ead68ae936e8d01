"""Prometheus metrics of the router (prometheus-client).

Tenant and priority labels are bounded by tenants.yaml; replica labels by
router.yaml. Nothing is labelled by request, key or model input.

With several worker processes (``fairstream serve --workers N``) the
``PROMETHEUS_MULTIPROC_DIR`` environment variable is set before any worker
starts: every process writes its values to files there and any worker's
``/metrics`` aggregates all of them (counters and histograms summed; each
gauge with the mode named at its definition, e.g. ``livesum`` for in-flight
counts, ``livemax`` for replica reports).

A request's own counts (its outcome, tokens, time to first token, duration
and queue wait) are plain additions in a ``TenantCounts`` (``counts``), added
to their children when /metrics is built (router/metric_batches.py).

A tenant a reload removes is retired (``retire``): its series leave
/metrics at once, those of gauges still counting its requests once they are
back to 0, and nothing counted for it later is exported (see ``retire``).
prometheus-client cannot remove series in multiprocess mode: there they stay
until the router restarts.
"""

from __future__ import annotations

import asyncio
import os
from collections.abc import Coroutine, Iterable, Iterator, Mapping
from typing import Any

from prometheus_client import (CollectorRegistry, Counter, Gauge, Histogram, disable_created_metrics,
                               generate_latest)
from prometheus_client.metrics import MetricWrapperBase

from router.metric_batches import HistogramBatch, TenantCounts
from router.state.base import ERROR_OPS

__all__ = ["Metrics", "HistogramBatch", "TenantCounts"]

# No ``*_created`` series (one beside every counter and histogram child, so
# twice the series for each counter; nothing reads them). Process-wide: this
# process's metrics are the router's.
disable_created_metrics()

# up to the built-in ``timeouts.total`` (900 s): long generations and queue waits stay measurable
_LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.5, 0.75, 1, 1.5, 2, 3, 5, 10, 30, 60,
                    120, 300, 600, 900)
# label values of fairstream_rate_limited_total's ``limit`` and fairstream_timeouts_total's ``timeout``
RATE_LIMITS = ("requests", "tokens", "concurrency", "queued", "queue", "queue_wait")
TIMEOUTS = ("first_token", "total")
# label values of fairstream_http_connections_refused_total's ``reason`` (router/connection.py, and for
# WebSocket upgrades router/handshake.py): past the connection cap, a head or body too slow, a head too
# large, bytes that are not HTTP/1.1, a request or upgrade that came after shutdown began, an upgrade that
# is not a valid WebSocket handshake, one to a path with no WebSocket endpoint, and one the application
# closed or failed before accepting it
CONNECTION_REFUSALS = ("max_connections", "header_timeout", "body_timeout", "header_too_large", "invalid_http",
                       "shutdown", "invalid_websocket_handshake", "websocket_not_found", "websocket_refused")
# fairstream_requests_total's outcomes FairstreamRequestsFailing counts as failures, exported at 0 per
# tenant for the endpoints of completion requests (``declare``), and fairstream_tokens_total's directions
FAILURES = ("unavailable", "timeout_first_token", "timeout_total", "lost", "error")
FAILURE_ENDPOINTS = ("chat", "completions")
DIRECTIONS = ("prompt", "completion")
DECLARE_BATCH = 10  # tenants ``declare_gradually`` declares per turn of the event loop (23 children each: ~2 ms)
RETIRE_BATCH = 500  # children ``retire_gradually`` looks at per turn of the event loop (~1 ms)
FLUSH_BATCH = 50  # tenants' waiting counts a scrape flushes per turn of the event loop (~1.3 ms)
_ITL_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.015, 0.02, 0.03, 0.05, 0.075, 0.1, 0.2, 0.5, 1, 2, 5)


class Metrics:
    """All metric families of one router, in their own registry."""

    def __init__(self) -> None:
        self.multiprocess = bool(os.environ.get("PROMETHEUS_MULTIPROC_DIR"))
        self._building: asyncio.Future[bytes] | None = None  # the exposition text being built (``expose``)
        # In multiprocess mode values live in files; /metrics collects them all.
        r = self.registry = None if self.multiprocess else CollectorRegistry()
        # the families labelled by tenant (first label) -> their label names
        self.by_tenant: dict[MetricWrapperBase, tuple[str, ...]] = {}
        # each one's twin that no registry holds: where a retired tenant's counts go
        self._unexported: dict[MetricWrapperBase, MetricWrapperBase] = {}
        self._retired: set[str] = set()  # tenants removed by a reload, not added again
        # (gauge, label values) of retired tenants still counting requests: removed at 0
        self._draining: set[tuple[MetricWrapperBase, tuple[str, ...]]] = set()
        self._walks: list[set[str]] = []  # the tenants of each ``_retiring`` under way (``unretire``)
        tenant = self._per_tenant
        self.requests = tenant(
            Counter, "fairstream_requests", "Requests by tenant, endpoint and outcome.",
            ["tenant", "endpoint", "outcome"],
        )
        self.ttft = tenant(
            Histogram, "fairstream_time_to_first_token_seconds", "Time from request arrival to its first token.",
            ["tenant", "priority"], buckets=_LATENCY_BUCKETS,
        )
        self.itl = tenant(
            Histogram, "fairstream_inter_token_latency_seconds",
            "Per token-carrying event after the first, one sample: the time since the previous such event "
            "divided by this event's tokens (not one sample per token).",
            ["tenant", "priority"], buckets=_ITL_BUCKETS,
        )
        self.e2e = tenant(
            Histogram, "fairstream_request_duration_seconds", "Time from request arrival to its last byte.",
            ["tenant", "priority"], buckets=_LATENCY_BUCKETS,
        )
        self.tokens = tenant(
            Counter, "fairstream_tokens", "Tokens by tenant and direction (prompt, completion).",
            ["tenant", "direction"],
        )
        self.replica_up = Gauge("fairstream_replica_up", "1 when the replica is connected and ready.", ["replica"], registry=r, multiprocess_mode="livemax")
        self.replica_stalled = Gauge(
            "fairstream_replica_stalled", "1 while the replica is out of dispatch: a stream's stall limit caught it "
            "producing nothing, and it has not answered the ping sent it at once. With --workers, the workers' maximum "
            "(fairstream_replica_up too: a replica stalled for one worker and ready for another reads 1 in both).",
            ["replica"], registry=r, multiprocess_mode="livemax")
        self.replica_restarts = Counter("fairstream_replica_restarts", "Replica restarts by the supervisor.", ["replica"], registry=r)
        self.replica_inflight = Gauge(
            "fairstream_replica_inflight_requests", "Requests the router has on the replica.", ["replica"], registry=r, multiprocess_mode="livesum"
        )
        self.replica_running = Gauge("fairstream_replica_running_requests", "Running requests the replica reports.", ["replica"], registry=r, multiprocess_mode="livemax")
        self.replica_waiting = Gauge("fairstream_replica_waiting_requests", "Waiting requests the replica reports.", ["replica"], registry=r, multiprocess_mode="livemax")
        self.replica_kv = Gauge("fairstream_replica_kv_cache_usage_ratio", "KV-cache use the replica reports (0-1).", ["replica"], registry=r, multiprocess_mode="livemax")
        self.failovers = Counter("fairstream_failovers", "Streams moved to another replica mid-generation.", ["replica"], registry=r)
        self.resumed_tokens = Counter("fairstream_resumed_tokens", "Completion tokens carried over to a new replica on failover.", registry=r)
        self.failover_latency = Histogram(
            "fairstream_failover_latency_seconds", "From a replica's death to the stream's next token.",
            buckets=_LATENCY_BUCKETS, registry=r,
        )
        self.rate_limited = tenant(
            Counter, "fairstream_rate_limited", "Requests refused by a tenant limit or a full queue.",
            ["tenant", "limit"],
        )
        self.timeouts = tenant(
            Counter, "fairstream_timeouts", "Requests ended by a tenant time limit.", ["tenant", "timeout"],
        )
        self.tenants_files_differ = Gauge(
            "fairstream_tenants_files_differ",
            "Live routers sharing the state store whose tenants.yaml differs from this router's (0: all the same).",
            registry=r, multiprocess_mode="livemax",
        )
        self.queued = tenant(
            Gauge, "fairstream_queue_depth", "Admitted requests waiting in the scheduler's queue for a replica.",
            ["tenant", "priority"], multiprocess_mode="livesum",
        )
        self.queue_wait = tenant(
            Histogram, "fairstream_queue_wait_seconds",
            "Time a request waited in its tenant's queue for a replica, observed when the wait ends "
            "(dispatched, 0 when at once; timed out, cancelled or refused).",
            ["tenant", "priority"], buckets=_LATENCY_BUCKETS,
        )
        self.replica_cap = Gauge(
            "fairstream_replica_inflight_cap", "In-flight cap the router holds the replica to: the adaptive cap, never above its max_concurrency.", ["replica"], registry=r, multiprocess_mode="livesum"
        )
        self.admission_waiting = tenant(
            Gauge, "fairstream_admission_waiting", "Requests waiting for a tenant limit (on_limit: queue).",
            ["tenant"], multiprocess_mode="livesum",
        )
        self.admission_wait = tenant(
            Histogram, "fairstream_admission_wait_seconds",
            "Time a request waited in its tenant's line for a tenant limit (on_limit: queue), observed when "
            "the wait ends (admitted, refused, timed out or cancelled).",
            ["tenant", "priority"], buckets=_LATENCY_BUCKETS,
        )
        self.loop_lag = Gauge(
            "fairstream_event_loop_lag_seconds", "How late the router's event loop ran a 100 ms timer.",
            registry=r, multiprocess_mode="livemax",
        )
        self.reloads = Counter("fairstream_config_reloads", "Tenant policy reloads by result.", ["result"], registry=r)
        for result in ("success", "failure"):  # (at 0 from the start: the first failure is an increase)
            self.reloads.labels(result)
        self.reload_ok = Gauge(
            "fairstream_config_last_reload_successful", "1 if the last tenant policy reload succeeded.", registry=r, multiprocess_mode="livemin"
        )
        self.reload_ok.set(1)
        self.store_up = Gauge("fairstream_state_store_up", "1 while the shared state store answers.", registry=r, multiprocess_mode="livemin")
        self.store_up.set(1)
        self.store_errors = Counter(
            "fairstream_state_store_errors", "State store operations that failed.", ["op"], registry=r
        )
        for op in ERROR_OPS:  # (at 0 from the start: an outage's first errors are an increase)
            self.store_errors.labels(op)
        self.resumes = tenant(
            Counter, "fairstream_stream_resumes", "Streams resumed by clients with Last-Event-ID.", ["tenant"],
        )
        self.connections = Gauge(
            "fairstream_http_connections", "Client connections open (HTTP and WebSocket).",
            registry=r, multiprocess_mode="livesum",
        )
        self.connections_refused = Counter(
            "fairstream_http_connections_refused",
            "Client connections (and WebSocket upgrades) answered and closed before a request reached the "
            "router, by reason.",
            ["reason"], registry=r,
        )
        for reason in CONNECTION_REFUSALS:
            self.connections_refused.labels(reason)
        self.streams_lost = Counter("fairstream_streams_lost", "Streams that had produced output and ended with an error because no replica could continue them.", registry=r)
        self._children: dict[tuple[object, tuple[str, ...]], Any] = {}
        # a request's own counts, per (tenant, priority), added to their children when /metrics is built
        # (router.metric_batches); in multiprocess mode at once (``pending`` None)
        self._counts: dict[tuple[str, str], TenantCounts] = {}
        self._pending: list[TenantCounts] | None = None if self.multiprocess else []

    def _per_tenant(self, cls: type[MetricWrapperBase], name: str, documentation: str, labels: list[str],
                    **kwargs: Any) -> Any:
        """A family labelled by tenant first, that ``retire`` knows."""
        assert labels[0] == "tenant", labels
        family = cls(name, documentation, labels, registry=self.registry, **kwargs)
        self.by_tenant[family] = tuple(labels)
        if not self.multiprocess:  # (there a family with no registry still writes its files, which are read)
            self._unexported[family] = cls(name, documentation, labels, registry=None, **kwargs)
        return family

    def declare(self, replicas: Iterable[str], tenants: Mapping[str, str]) -> None:
        """Export the event counters of these replicas and tenants (name ->
        priority class) at 0, so that ``rate()`` and ``increase()`` count
        their first event (a series that appears at 1 counts from there),
        and each tenant's queue depth at 0 (a panel of a tenant that never
        queued said "No data"). A retired tenant named here is counted and
        exported again."""
        for name in replicas:
            self.replica_restarts.labels(name)
            self.failovers.labels(name)
        self.unretire(tenants)
        for name, priority in tenants.items():
            self._declare_tenant(name, priority)

    def unretire(self, tenants: Iterable[str]) -> None:
        """``tenants`` are in the policy (again): what is counted for them is
        exported from now on (``declare``'s first half, cheap: a reload does
        it at once, and its counters at 0 a batch per loop turn)."""
        back = self._retired.intersection(tenants)
        if back:
            # One whose series are still going (``retire_gradually``) has them all taken out
            # now: it comes back as a new tenant, not with the old series of the families
            # not yet walked. (Rare: one pass over the families' children.)
            unfinished = back & set().union(*self._walks)
            if unfinished:
                for walk in self._walks:
                    walk -= unfinished
                self.retire(*unfinished)
            self._retired -= back
            self._draining = {k for k in self._draining if k[1][0] not in back}  # (now plain gauges again)

    def _declare_tenant(self, name: str, priority: str) -> None:
        for endpoint in FAILURE_ENDPOINTS:
            for outcome in FAILURES:
                self.child(self.requests, name, endpoint, outcome)
        for direction in DIRECTIONS:
            self.child(self.tokens, name, direction)
        for limit in RATE_LIMITS:
            self.child(self.rate_limited, name, limit)
        for which in TIMEOUTS:
            self.child(self.timeouts, name, which)
        self.child(self.resumes, name)
        self.child(self.queued, name, priority)
        self.child(self.admission_waiting, name)

    async def declare_gradually(self, tenants: Mapping[str, str], batch: int = DECLARE_BATCH) -> None:
        """``declare`` for a reload: ``unretire`` at once, then the tenants'
        counters at 0, ``batch`` tenants per turn of the event loop. Making a
        child costs prometheus-client ~15 us, and a reload that added 2,000
        tenants made 16,000 of them in one turn: every stream stopped ~0.3 s.
        (A tenant's request before its turn here makes its children itself;
        one a later reload retired meanwhile gets unexported ones.)"""
        self.unretire(tenants)
        names = list(tenants)
        for i in range(0, len(names), batch):
            for name in names[i:i + batch]:
                self._declare_tenant(name, tenants[name])
            await asyncio.sleep(0)

    def retire(self, *tenants: str) -> None:
        """A reload removed ``tenants``: their series leave /metrics now, except
        a gauge's while it still counts requests of the tenant (its waiting
        requests are refused just after the reload, asynchronously); that
        one goes when ``gauge_down`` brings it back to 0. From now on what is
        counted for the tenant (those refusals, the ends of its streams still
        running) goes to children no registry exports, so no series comes
        back, until ``declare`` names the tenant again. (A stream that kept a
        child from before keeps counting into it, exported nowhere.)

        One pass over each family's children, whatever the number of tenants
        (it was a pass over every sample per removed tenant: a reload that
        removed 1,000 of them held the event loop ~30 s).

        In multiprocess mode nothing happens: prometheus-client cannot
        remove a series whose values are in files, and the series stay until
        the router restarts."""
        for _ in self._retiring(tenants, RETIRE_BATCH):
            pass

    def retire_gradually(self, tenants: Iterable[str], batch: int = RETIRE_BATCH) -> Coroutine[Any, Any, None]:
        """``retire`` for a reload: the tenants are retired now (what is
        counted for them from now on is exported nowhere) and the first
        ``batch`` children looked at; the coroutine returned (to run as a
        task) takes the rest of their series out, a batch per turn of the
        event loop. Removing 5,000 tenants' 115,000 children in one turn
        stopped every stream ~0.6 s."""
        steps = self._retiring(tuple(tenants), batch)
        next(steps, None)
        return _one_per_turn(steps)

    def _retiring(self, tenants: Iterable[str], batch: int) -> Iterator[None]:
        """``retire``'s work, a pause after every ``batch`` children looked
        at. A tenant a later reload adds again (``unretire``) leaves
        ``gone`` (its series all taken out there)."""
        if self.multiprocess or not tenants:
            return
        gone = set(tenants)
        self._retired |= gone
        # (their counts that wait still go to the children they were counted in)
        self._counts = {key: c for key, c in self._counts.items() if key[0] not in gone}
        self._walks.append(gone)
        try:
            yield from self._walk(gone, batch)
        finally:
            self._walks = [walk for walk in self._walks if walk is not gone]

    def _walk(self, gone: set[str], batch: int) -> Iterator[None]:
        for family in self.by_tenant:
            gauge = isinstance(family, Gauge)
            # (prometheus-client keeps a family's children by label values, tenant first)
            children = list(family._metrics.items())
            for i in range(0, len(children), batch):
                drop = []
                for values, c in children[i:i + batch]:
                    if values[0] not in gone:
                        continue
                    key = (family, values)
                    if gauge and c.collect()[0].samples[0].value:
                        self._draining.add(key)
                        # (``gauge_down`` must reach the exported child, even one made without ``child``)
                        self._children[key] = c
                    else:
                        drop.append(values)
                        if key not in self._draining:
                            self._children.pop(key, None)
                # (as ``family.remove`` each, without its per-call checks: 16,000
                # of those, for 2,000 tenants removed, held the loop ~0.15 s)
                with family._lock:
                    for values in drop:
                        family._metrics.pop(values, None)
                yield

    def reclass(self, classes: Mapping[str, str]) -> None:
        """A reload gave tenants these priority classes: a tenant's queue
        depth under a class it no longer has leaves /metrics, at once if it
        is 0, else when ``gauge_down`` brings it there (its requests queued
        under the old class keep it). One pass over the family's children.
        (Multiprocess mode: nothing, as in ``retire``.)"""
        if self.multiprocess:
            return
        q = self.queued
        for values, c in q._metrics.copy().items():
            now = classes.get(values[0])
            if now is None or values[1] == now:
                continue
            key = (q, values)
            if c.collect()[0].samples[0].value:
                self._draining.add(key)
                self._children[key] = c
            else:
                q.remove(*values)
                self._children.pop(key, None)

    def gauge_up(self, gauge: Gauge, *values: str) -> None:
        """One more request counted in a tenant's gauge (``queued``,
        ``admission_waiting``)."""
        self.child(gauge, *values).inc()

    def gauge_down(self, gauge: Gauge, *values: str) -> None:
        """One request less in a tenant's gauge; the last one of a retired
        tenant takes the series out."""
        c = self.child(gauge, *values)
        c.dec()
        key = (gauge, values)
        if self._draining and key in self._draining and not c.collect()[0].samples[0].value:
            self._draining.discard(key)
            del self._children[key]
            gauge.remove(*values)

    def limited(self, tenant: str, limit: str) -> None:
        """Count a request refused by ``limit``, one of ``RATE_LIMITS`` (the
        values ``declare`` exports at 0)."""
        assert limit in RATE_LIMITS, limit
        self.child(self.rate_limited, tenant, limit).inc()

    def timed_out(self, tenant: str, which: str) -> None:
        """Count a request ended by the time limit ``which``, one of ``TIMEOUTS``."""
        assert which in TIMEOUTS, which
        self.child(self.timeouts, tenant, which).inc()

    def child(self, metric: Any, *values: str) -> Any:
        """``metric.labels(*values)``, remembered: ``labels`` validates the
        values and takes the family's lock on every call (~1.2 us), and the
        request path asks for the same few children once per request.
        ``retire`` forgets a tenant's children as it removes them from their
        families, so a remembered one is always the one the family exports.
        A retired tenant's is a child exported nowhere, not remembered."""
        key = (metric, values)
        c = self._children.get(key)
        if c is None:
            if self._retired and values and values[0] in self._retired and metric in self.by_tenant:
                twin = self._unexported[metric]
                c = twin.labels(*values)
                twin.remove(*values)  # (the twin keeps nothing: counts of a removed tenant are dropped)
                return c
            c = self._children[key] = metric.labels(*values)
        return c

    def counts(self, tenant: str, priority: str) -> TenantCounts:
        """Where the request path counts for ``tenant`` and its ``priority``
        class. Like ``child``: ``retire`` forgets a tenant's, and a retired
        tenant's is one that counts into children exported nowhere."""
        c = self._counts.get((tenant, priority))
        if c is None:
            c = TenantCounts(self, tenant, priority, self._pending)
            if tenant not in self._retired:
                self._counts[(tenant, priority)] = c
        return c

    def flush(self) -> None:
        """The counts that wait (``TenantCounts``), into their children."""
        pending = self._pending
        if pending:
            for c in pending:
                c.flush()
            pending.clear()

    async def flush_gradually(self, batch: int = FLUSH_BATCH) -> None:
        """``flush``, ``batch`` tenants per turn of the event loop: with
        thousands of tenants counting, one flush held every stream ~25 ms
        per 1,000 tenants. (The list is the one the bundles append to: a
        bundle flushed here and counted again meanwhile is appended again.)"""
        pending = self._pending
        while pending:
            todo = pending[:batch]
            del pending[:batch]
            for c in todo:
                c.flush()
            if pending:
                await asyncio.sleep(0)

    def replica_state(self, slot) -> None:
        """``fairstream_replica_up`` and ``fairstream_replica_stalled`` of ``slot``, as it is now."""
        self.replica_up.labels(slot.name).set(1 if slot.ready else 0)
        self.replica_stalled.labels(slot.name).set(1 if slot.stalled_at is not None and slot.usable else 0)

    def update_pool(self, pool) -> None:
        """The replica gauges from this process's view of ``pool``."""
        for slot in pool.slots:
            self.replica_state(slot)
            self.replica_inflight.labels(slot.name).set(slot.inflight)
            load = slot.client.load if slot.client is not None and slot.usable else None
            self.replica_running.labels(slot.name).set(load.running if load else 0)
            self.replica_waiting.labels(slot.name).set(load.waiting if load else 0)
            self.replica_kv.labels(slot.name).set(load.kv_usage if load else 0)

    async def expose(self, pool) -> bytes:
        """The exposition text. The counts that wait (``flush_gradually``) and the
        pool's gauges are set here, on the event loop; the text is built in a thread, since it takes long with many
        tenants (1,000 tenants: about 0.2 s here) and on the loop every
        stream would wait for it. prometheus-client takes a lock per value
        (its own HTTP server scrapes from a thread), so the loop goes on
        counting meanwhile, and the thread yields the interpreter to it
        every few milliseconds."""
        await self.flush_gradually()
        self.update_pool(pool)
        # scrapes that come while one is built share its text (two Prometheus
        # servers, or a dashboard beside one, built it twice at once); the
        # build goes on for the others when one of them leaves
        building = self._building
        if building is None or building.done():
            building = self._building = asyncio.ensure_future(asyncio.to_thread(self._text))
            building.add_done_callback(_retrieved)
        return await asyncio.shield(building)

    def _text(self) -> bytes:
        if self.multiprocess:
            from prometheus_client import multiprocess

            registry = CollectorRegistry()
            multiprocess.MultiProcessCollector(registry)
            return generate_latest(registry)
        return generate_latest(self.registry)


async def _one_per_turn(steps: Iterator[None]) -> None:
    for _ in steps:
        await asyncio.sleep(0)


def _retrieved(fut: asyncio.Future) -> None:
    """(A build whose every scrape left ends unread: no warning for its error.)"""
    if not fut.cancelled():
        fut.exception()
