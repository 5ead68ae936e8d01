"""The router's long-lived state and its one owner: ``RouterService``.

It owns the replica pool, the supervisor (and through it every replica
process and connection, with their reader tasks), the tenant policy registry
(and its watcher), the state store, admission (and its lease keeper), the
scheduler, the resume writer (and its flush task), the open WebSockets, the
metrics and the event-loop lag probe, and the tasks ``background`` starts
(settlements, a reload's metric batches). The Litestar lifespan calls
``start()`` and ``close()``. The only other tasks are per request, owned by
the request's handler (FastPath's disconnect listener, a WebSocket's
generations) and ended with it.
"""

from __future__ import annotations

import asyncio
import gc
import logging
import time
from collections.abc import Coroutine
from pathlib import Path
from typing import Any, Protocol

from replicas.pool import ReplicaPool, ReplicaSlot
from replicas.supervisor import Supervisor, SupervisorSettings
from router.admission import Admission
from router.auth import bearer
from router.config import RouterConfig
from router.errors import Unauthorized
from router.estimate import PromptEstimates
from router.logs import batch_lines
from router.metrics import Metrics
from router.largebody import LargeBodies
from router.peers import PolicyPeers
from router.policy import PolicyRegistry
from router.resume import ResumeWriter
from router.scheduler import Scheduler
from router.state import create_store
from router.background import report, spawn
from router.stopping import stop
from router.tenants import TenantPolicy

# allocations between young-generation collections (CPython's default: 700)
GC_THRESHOLD = 50_000
SETTLE_WAIT = 5.0  # seconds the ``background`` tasks still running at shutdown get to finish

__all__ = ["RouterService"]


class _Drains(Protocol):
    def drain(self) -> None: ...
    def recheck(self) -> None: ...

log = logging.getLogger("fairstream.router")


class RouterService:
    def __init__(self, config: RouterConfig, tenants_path: Path) -> None:
        self.config = config
        self.started = int(time.time())  # (the ``created`` of the models it lists)
        self.metrics = Metrics()
        m = self.metrics
        self.policy = PolicyRegistry(tenants_path, on_reload=self._on_reload)
        self._tenants = set(self.policy.current.tenants)  # (a reload that removes one refuses its waiting requests)
        self.store = create_store(
            config.state,
            on_change=lambda up: m.store_up.set(1 if up else 0),
            on_error=lambda op: m.store_errors.labels(op).inc(),
        )
        self.admission = Admission(self.store, m)
        self.estimates = PromptEstimates()  # the prompt-token estimates admission reserves
        self.large_bodies = LargeBodies()  # large request bodies take turns (router.largebody)
        self.resume = ResumeWriter(self.store, config.resume_retention)
        self.peers = PolicyPeers(self.store, self.policy, m, self.resume.owner)
        self._tasks: set[asyncio.Task[None]] = set()
        self._lag_task: asyncio.Task[None] | None = None
        self._drain: asyncio.TimerHandle | None = None
        self._closing = False  # (``close`` began)
        self._hurry = asyncio.Event()  # (``hurry``: a signal during ``close``)
        self.sockets: set[_Drains] = set()  # open WebSocket connections (router/websocket.py)
        self._warned: set[tuple[str, str]] = set()  # (tenant, model) named by _warn_unserved_models
        self.pool = ReplicaPool(config.replicas)
        self.scheduler = Scheduler(self.pool, m, config.scheduler, config.batching)
        self.scheduler.follow(self.policy.current.tenants)
        self.pool.on_stalled = m.replica_state
        self.supervisor = Supervisor(
            self.pool,
            SupervisorSettings(
                health_interval=config.health_interval,
                health_timeout=config.health_timeout,
                backoff_max=config.restart_backoff_max,
                reconnect_interval=config.reconnect_interval,
            ),
            on_event=self._on_replica_event,
        )

    def _on_reload(self, ok: bool, changed: bool) -> None:
        """After a reload: a new policy (``changed``) followed by the parts.
        The reload metrics count it a failure if that fails part way (the
        registry logs it and keeps the new policy: ``PolicyRegistry._swap``)."""
        m = self.metrics
        applied = False
        try:
            if changed:
                classes = {name: p.priority for name, p in self.policy.current.tenants.items()}
                m.unretire(classes)  # (at once: a tenant added again is counted from now on)
                m.reclass(classes)  # (a queue depth under a class the tenant left goes)
                self.background(m.declare_gradually(classes))  # (its counters at 0: a batch per loop turn)
                self._refuse_removed()
                for conn in list(self.sockets):  # (a revoked key's socket closes once its requests end)
                    conn.recheck()
                self.peers.soon()
                self._warn_unserved_models()
            applied = True
        finally:
            m.reloads.labels("success" if ok and applied else "failure").inc()
            m.reload_ok.set(1 if ok and applied else 0)

    def _refuse_removed(self) -> None:
        """Requests still waiting (for their limits or a replica) of tenants
        the reload removed get 401, as a new request of theirs does; their
        running streams go on (as do those of a key removed from a tenant
        that stays). Their metric series go (``Metrics.retire_gradually``)."""
        names = set(self.policy.current.tenants)
        self.admission.follow(self.policy.current.tenants)
        self.scheduler.follow(self.policy.current.tenants)  # (weights and classes of queued requests too)
        self.admission.restore(names)
        self.scheduler.restore(names)
        removed = self._tenants - names
        for name in removed:
            def error(name=name) -> Unauthorized:  # (one each: an exception raised in many tasks shares its traceback)
                return Unauthorized(f"Tenant {name!r} was removed from the tenant policy while this request waited.")

            n = self.admission.fail_tenant(name, error) + self.scheduler.fail_tenant(name, error)
            if n:
                log.warning("tenant %s removed by the reload: %d waiting requests refused (401)", name, n)
        self.background(self.metrics.retire_gradually(removed))  # (their series: a batch per loop turn)
        self._tenants = names

    def _warn_unserved_models(self) -> None:
        """Log (once each) the tenants' model names no replica serves: a typo
        in tenants.yaml shows here, not only as 404s for that tenant's
        clients. Only once every replica's model is known (a remote replica's
        once it has connected)."""
        served = {s.model for s in self.pool.slots}
        if "" in served:
            return
        for name, pol in self.policy.current.tenants.items():
            unserved = [m for m in pol.models if m != "*" and m not in served and (name, m) not in self._warned]
            if unserved:
                self._warned.update((name, m) for m in unserved)
                log.warning("tenant %s allows models no replica serves: %s (served: %s)",
                            name, ", ".join(unserved), ", ".join(sorted(served)))

    def tenant(self, authorization: str | None) -> TenantPolicy:
        """The caller's tenant policy (401/403 on a bad or admin key)."""
        snap = self.policy.current
        return snap.tenants[snap.keys.tenant(bearer(authorization))]

    def check_admin(self, authorization: str | None) -> None:
        self.policy.current.keys.admin(bearer(authorization))

    @property
    def store_healthy(self) -> bool:
        """The store answers (not while it is down, nor before its first answer)."""
        return self.store.healthy and not self.store.connecting

    def background(self, coro: Coroutine[Any, Any, None]) -> asyncio.Task[None]:
        """Run work that outlives its caller, as a task this service owns:
        a stream's settlement (its resume buffer finished or let go, the
        store's settle and release), which must finish even if its caller
        was cancelled (a caller may await the task it returns through
        ``asyncio.shield``), and a reload's metric batches
        (``Metrics.declare_gradually``, ``retire_gradually``: a batch per
        loop turn, not all in the reload's turn). ``close`` gives them
        ``SETTLE_WAIT`` seconds, then cancels them."""
        task = asyncio.get_running_loop().create_task(coro)
        self._tasks.add(task)
        task.add_done_callback(self._task_done)
        return task

    def _task_done(self, task: asyncio.Task[None]) -> None:
        self._tasks.discard(task)
        report(task)

    async def _watch_loop_lag(self) -> None:
        loop = asyncio.get_running_loop()
        gauge = self.metrics.loop_lag
        turns = 0
        while True:
            t = loop.time()
            await asyncio.sleep(0.1)
            gauge.set(max(0.0, loop.time() - t - 0.1))
            turns += 1
            if self.metrics.multiprocess and turns % 10 == 0:
                # (--workers: a scrape reaches one worker and sums every
                # worker's replica gauges, which each sets only when it is
                # scraped: refreshed every second, they are never stale)
                self.metrics.update_pool(self.pool)

    async def start(self) -> None:
        self._lag_task = spawn(self._watch_loop_lag(), "loop-lag")
        await self.store.start()  # (first contact in the background: /ready says until when)
        await self.resume.start()
        await self.policy.start()
        await self.peers.start()
        self.metrics.declare((slot.name for slot in self.pool.slots),
                             {name: p.priority for name, p in self.policy.current.tenants.items()})
        await self.admission.start()
        await self.supervisor.start()
        self._warn_unserved_models()
        # Everything allocated so far lives as long as the process: keep it
        # out of the cycle collector's way, and collect the young generation
        # less often. A stream's objects form almost no cycles, and with
        # thousands of open streams each collection walks all of them: on
        # the 256-stream benchmark (docs/perf.md) this took the inter-token
        # p99 from x1.4-1.6 to x1.1-1.4 of direct and CPU per token down ~15%.
        gc.freeze()
        gc.set_threshold(GC_THRESHOLD, 20, 100)
        # Started: one write per turn of the loop for the lines logged in it
        # (a summary line per request), not one per line; close() writes
        # what is left and writes at once again.
        batch_lines(asyncio.get_running_loop())

    @property
    def draining(self) -> bool:
        return self._drain is not None

    def drain(self) -> None:
        """Shutdown began (the server takes no new connections): requests in
        flight get ``shutdown_grace`` seconds to finish, then ``_stop_requests``.
        WebSockets take no new requests and close once theirs have ended."""
        if self._drain is None:
            for conn in list(self.sockets):
                conn.drain()
            self._drain = asyncio.get_running_loop().call_later(self.config.shutdown_grace, self._stop_requests)
            log.info("shutting down: %d streams running get up to %gs to finish (a second SIGINT, Ctrl-C, quits at once)",
                     len(self.scheduler.running), self.config.shutdown_grace)

    def stop_now(self) -> None:
        """A second SIGINT (Ctrl-C): the rest of the grace is not waited out;
        what is in flight ends now, as when the grace is over."""
        self.drain()
        assert self._drain is not None
        self._drain.cancel()
        self._stop_requests(forced=True)

    def _stop_requests(self, forced: bool = False) -> None:
        """End every request still in flight with ``RouterShutdown``: queued
        ones and those waiting for a limit get a 503, running streams an
        error event (the stream stays resumable where the state is shared)."""
        running, queued = self.scheduler.stop_all()
        limited = self.admission.fail_waiting()
        why = ("a second SIGINT forced the stop" if forced
               else f"shutdown grace of {self.config.shutdown_grace:g}s is over")
        log.warning("%s: ended %d running, %d queued and %d rate-limited requests", why, running, queued, limited)

    def hurry(self) -> None:
        """A signal came while the router stops (``close``, or the
        shutdown that a port it could not listen on began): the background
        tasks still running are cancelled now, not after up to ``SETTLE_WAIT``.
        (The signal that began the shutdown came before: it changes nothing.)"""
        if self._closing:
            self._hurry.set()

    async def close(self) -> None:
        """Stop every part, each bounded: a task still starting (the first
        contact with Redis, a replica's connect) is ended, never waited for.
        One part's failure is logged and the others still close: a part left
        open keeps tasks that the event loop's own end would wait for."""
        self._closing = True
        if self._drain is not None:
            self._drain.cancel()
        self.store.stop_connecting()  # (no part's close waits up to connect_timeout for Redis's first answer)
        try:
            await stop(self._lag_task)
            await self._settle()
            for part in (self.resume, self.supervisor, self.admission, self.peers, self.policy, self.store):
                try:
                    await part.close()
                except Exception:  # noqa: BLE001 - the next parts must close all the same
                    log.exception("closing %s failed", type(part).__name__)
            log.info("stopped")
        finally:
            batch_lines(None)

    async def _settle(self) -> None:
        """The ``background`` tasks (settlements, a reload's metric batches)
        get ``SETTLE_WAIT`` seconds to finish (none after ``hurry``), then
        are cancelled: the store closes next."""
        loop = asyncio.get_running_loop()
        end = loop.time() + SETTLE_WAIT
        hurried = loop.create_task(self._hurry.wait())
        try:
            while self._tasks and not self._hurry.is_set() and loop.time() < end:
                await asyncio.wait([*self._tasks, hurried], timeout=end - loop.time(),
                                   return_when=asyncio.FIRST_COMPLETED)
        finally:
            hurried.cancel()
        late = list(self._tasks)
        if late:
            log.warning("%d background tasks (settlements, metric batches) were still running at shutdown; "
                        "cancelled", len(late))
            await asyncio.gather(*(stop(task) for task in late))

    def _on_replica_event(self, event: str, slot: ReplicaSlot) -> None:
        if event == "ready":
            self._warn_unserved_models()
        if event == "down" and slot.spec.local:  # (a remote one is reconnected, not restarted)
            self.metrics.replica_restarts.labels(slot.name).inc()
        self.metrics.replica_state(slot)
