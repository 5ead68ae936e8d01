"""The scheduler: per-tenant queues in front of the replicas' in-flight caps.

A request that has passed admission asks ``Scheduler.acquire`` for a replica.
If nothing is queued and a replica is under its cap, it is dispatched at
once. Otherwise it waits in its tenant's bounded FIFO queue; every time
capacity frees up (a stream ends, a cap grows) ``_dispatch`` hands it out:
``HeadIndex.pick`` chooses the tenant (priority with aging, then VTC, as
the reference ``policies.fairshare.pick`` defines it; the index keeps the
tenants' queue heads ordered, so a decision is O(classes x log tenants)),
``policies.balance`` the replica. It keeps going
while any queued request fits on any replica (work conserving) and stops as
soon as no queued model has room. Streams that wait to fail over (every
replica of their model was down when theirs failed: ``ReplicaPool.when_ready``)
get room before the queue does.

The decisions are pure; this module only applies them. It owns no task: it
runs inside the callbacks of the requests that wait and the streams that end.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections import deque
from collections.abc import Callable, Iterable, Mapping
from policies.batching import AimdLimiter, AimdSettings
from policies.dispatch_pace import DispatchPace
from policies.fairshare import HeadIndex, VirtualCounters
from replicas.pool import LoadHandle, NoReplica, ReplicaPool, ReplicaSlot
from router.deadlines import StreamTimeout
from router.errors import RateLimited, ReplicaUnavailable, RouterShutdown, ServiceUnavailable, retry_after_header
from router.metrics import Metrics
from router.scheduler_settings import SchedulerSettings
from router.tenants import TenantPolicy

__all__ = ["Scheduler"]

log = logging.getLogger("fairstream.scheduler")


def _wait_ended(policy: TenantPolicy, ends: tuple[float, BaseException] | None, waited: float,
                in_queue: float) -> str:
    """What ended a wait for a replica, for the client: the time the request
    waited (``waited`` of it for admission, which counts against the same
    limits) and the limit that ended it, as configured."""
    e = ends[1] if ends is not None else None
    if e is None:
        limit = f"timeouts.queue_wait of {policy.limits.queue_wait:g}s"
    elif isinstance(e, StreamTimeout):
        limit = f"timeouts.{e.which} of {e.seconds:g}s"
    else:
        limit = f"limit ({e})"
    return (f"the request waited {round(waited + in_queue, 2):g}s, {round(in_queue, 2):g}s of it in the queue, "
            f"until tenant {policy.name!r}'s {limit} ended the wait")


class _Waiter:
    __slots__ = ("policy", "rank", "model", "needs", "route", "tokens", "enqueued", "future", "affinity")

    def __init__(self, policy: TenantPolicy, rank: int, model: str, tokens: int, now: float,
                 affinity: int | None = None, needs: int = 0) -> None:
        self.affinity = affinity
        self.policy = policy  # its tenant's, for its class and weight: the one in force (``Scheduler.follow``)
        self.rank = rank
        self.model = model
        self.needs = needs  # (replica features: replicas.protocol.Feature)
        self.route = (model, needs)  # the replicas that can take it
        self.tokens = tokens
        self.enqueued = now
        self.future: asyncio.Future[LoadHandle] = asyncio.get_running_loop().create_future()


class Scheduler:
    def __init__(
        self,
        pool: ReplicaPool,
        metrics: Metrics,
        settings: SchedulerSettings,
        batching: AimdSettings,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.pool = pool
        self.metrics = metrics
        self.settings = settings
        self.clock = clock
        self.counters = VirtualCounters()
        self._queues: dict[str, deque[_Waiter]] = {}
        self._queued = 0
        self._by_route: dict[tuple[str, int], int] = {}  # queued requests per (model, needed features)
        self._fifo = settings.policy == "fifo"
        self._heads = HeadIndex(0.0 if self._fifo else settings.aging)
        self._dispatch_pending = False
        # generations running on the replicas (router.generation adds and
        # removes them); ``stop_all`` ends them and refuses new ones
        self.running: set = set()
        self.stopping = False
        self._gone: dict[str, Callable[[], BaseException]] = {}  # tenants a reload removed: their refusal
        self._policies: Mapping[str, TenantPolicy] = {}  # the tenants' policies in force (``follow``)
        self._limiters: dict[str, AimdLimiter] = {}
        now = clock()
        for slot in pool.slots:
            lim = AimdLimiter(batching, now)
            self._limiters[slot.name] = lim
            slot.cap_fn = lambda lim=lim: lim.cap
            # (the cap the router enforces: the adaptive one, never above max_concurrency)
            metrics.replica_cap.labels(slot.name).set(slot.cap)
        pool.on_release = self._on_release
        pool.on_ready = self._wake_queue  # (a replica restarted, or is chosen again after a refused connect)
        # the pace at which waiting requests get replicas, for Retry-After
        self._pace = DispatchPace()

    # -- what requests call ------------------------------------------------

    def queued(self, tenant: str | None = None) -> int:
        if tenant is None:
            return self._queued
        q = self._queues.get(tenant)
        return len(q) if q else 0

    def limiter(self, slot: ReplicaSlot) -> AimdLimiter:
        return self._limiters[slot.name]

    async def acquire(self, policy: TenantPolicy, rank: int, model: str, tokens: int,
                      waited: float = 0.0, affinity: int | None = None, needs: int = 0,
                      limit: Callable[[], tuple[float, BaseException] | None] | None = None) -> LoadHandle:
        """A load handle on a replica for this request, when the scheduler
        says it is its turn. 429 when the tenant's queue is full, 503 when the
        queue wait passes the tenant's limit (``waited``: seconds the request
        already waited for admission, which count against the same limit),
        or when no ready replica serves ``model`` with the features of
        ``needs``; cancellation leaves the queue. ``limit``, asked only when
        the request must wait: seconds until another limit of the request
        ends its wait first (its first-token or total time), and the error
        it then gets. Its place in the fair-share order (class and weight)
        is its tenant's policy in force, which may be newer than ``policy``
        (see ``follow``); its limits are ``policy``'s."""
        if self.stopping:
            raise RouterShutdown()
        gone = self._gone.get(policy.name)
        if gone is not None:
            raise gone()
        share = self._policies.get(policy.name, policy)
        if share is not policy:
            rank = share.rank
        if not self._queued:
            try:
                handle = self.pool.try_choose(model, tokens, affinity, needs)
            except NoReplica as e:
                raise ReplicaUnavailable(str(e)) from e
            if handle is not None:
                # nobody waits: lift a returning tenant to the last served counter
                self.counters.activate(policy.name, ())
                self._dispatched(share, 0.0)
                return handle
        else:
            try:
                self.pool.serving(model, needs)
            except NoReplica as e:
                raise ReplicaUnavailable(str(e)) from e
        q = self._queues.get(policy.name)
        if q is None:
            q = self._queues[policy.name] = deque()
        if len(q) >= policy.queue_depth:
            self.metrics.limited(policy.name, "queue")
            raise RateLimited(
                f"Too many queued requests for tenant {policy.name!r} "
                f"(queue depth {policy.queue_depth}); retry later.",
                retry_after=self._pace.retry_after(len(q), self.clock()), code="queue_full",
            )
        now = self.clock()
        w = _Waiter(share, rank, model, tokens, now, affinity, needs)
        if not q:
            self._activate(policy.name)
        q.append(w)
        if len(q) == 1:
            self._head_changed(policy.name, q)
        self._by_route[w.route] = self._by_route.get(w.route, 0) + 1
        self._pace.waiting(now)
        self._queued += 1
        self.metrics.gauge_up(self.metrics.queued, policy.name, share.priority)
        self._dispatch()
        wait = policy.limits.queue_wait
        if wait:
            wait = max(0.001, wait - waited)
        ends = limit() if limit is not None else None
        if ends is not None and (not wait or ends[0] < wait):
            wait = max(0.001, ends[0])
        else:
            ends = None
        loop = asyncio.get_running_loop()
        began = loop.time()  # (real time for the message: ``self.clock`` may be a test's)
        try:
            if wait:
                async with asyncio.timeout(wait):
                    return await asyncio.shield(w.future)
            return await asyncio.shield(w.future)
        except TimeoutError:
            # (before it leaves: the tenant's queue with it, as a retry would
            # wait behind the rest and need its own dispatch; and the stall it
            # waited through, which the pace forgets once nobody waits)
            retry = self._pace.retry_after(self.queued(policy.name), self.clock())
            self._leave(w)
            if ends is None:
                self.metrics.limited(policy.name, "queue_wait")
            ended = _wait_ended(policy, ends, waited, loop.time() - began)
            try:
                self.pool.serving(model, needs)
            except NoReplica as e:  # (its replicas went down while it waited: not a full cluster)
                raise ReplicaUnavailable(f"{e} ({ended}); retry later.") from None
            if ends is not None:
                raise ends[1] from None
            raise ServiceUnavailable(
                f"The cluster is over capacity: {ended}; retry later.",
                code="queue_timeout", headers={"retry-after": retry_after_header(retry)},
            ) from None
        except asyncio.CancelledError:
            self._leave(w)
            raise

    def charge(self, policy: TenantPolicy, prompt: int, completion: int) -> None:
        """Served tokens advance the tenant's virtual counter."""
        self.counters.charge(policy.name, prompt, completion, policy.weight)

    def adapts(self, slot: ReplicaSlot) -> bool:
        """Latency samples from ``slot``'s streams move its in-flight cap."""
        lim = self._limiters.get(slot.name)
        return lim is not None and lim.adaptive

    def observe(self, slot: ReplicaSlot, *, itl: float | None = None, ttft: float | None = None) -> None:
        """A latency sample from a stream on ``slot`` for its in-flight cap."""
        if not self.adapts(slot):  # a fixed cap learns nothing from samples
            return
        lim = self._limiters[slot.name]
        if itl is not None:
            lim.observe_itl(itl)
        if ttft is not None:
            lim.observe_ttft(ttft)
        lim.note_inflight(slot.inflight)
        if lim.tick(self.clock()):
            self.metrics.replica_cap.labels(slot.name).set(slot.cap)
            if self._queued or self.pool.waiting:
                self._schedule_dispatch()

    def fail_tenant(self, tenant: str, error: Callable[[], BaseException]) -> int:
        """A reload removed ``tenant``: its queued requests, and those that
        would queue from now on, end with ``error()`` (until a reload adds
        it again: ``restore``); return how many were queued."""
        self._gone[tenant] = error
        waiters = list(self._queues.get(tenant, ()))
        for w in waiters:
            self._remove(w)
            w.future.set_exception(error())
        return len(waiters)

    def restore(self, tenants: Iterable[str]) -> None:
        """These tenants are in the policy again (see ``fail_tenant``)."""
        for name in tenants:
            self._gone.pop(name, None)

    def follow(self, policies: Mapping[str, TenantPolicy]) -> None:
        """A reload made ``policies`` the tenants' policies. Fair share is
        the tenant's, not a request's: from now on every request of a
        tenant, queued or running, is charged at its new weight, and its
        queued requests wait in its new priority class (their queue's head
        re-keyed in the index; each counted in ``fairstream_queue_depth``
        under the new class). What was checked when a request was admitted
        or queued (rate limits, ``max_concurrent``, ``queue_depth``) is not
        asked again, and its ``queue_wait`` stays the one it was queued
        with. O(queued requests), once per reload; a decision costs the same."""
        self._policies = policies
        self.counters.reweight({name: p.weight for name, p in policies.items()})
        # (a removed tenant's counter goes: one float per name ever configured
        # stayed for good; its queued requests, refused next, keep theirs meanwhile)
        self.counters.forget([*policies, *(name for name, q in self._queues.items() if q)])
        for name, q in self._queues.items():
            now = policies.get(name)
            if now is None or not q:  # (a removed tenant's requests are refused: fail_tenant)
                continue
            rank = q[0].rank
            for w in q:
                if w.policy.priority != now.priority:
                    self.metrics.gauge_down(self.metrics.queued, name, w.policy.priority)
                    self.metrics.gauge_up(self.metrics.queued, name, now.priority)
                w.policy = now
                w.rank = now.rank
            if rank != now.rank:
                self._head_changed(name, q)
        # (no dispatch: a new order frees no room, and whatever fitted went)

    def stop_all(self) -> tuple[int, int]:
        """The router is stopping: end every running generation and every
        queued request with ``RouterShutdown``, and refuse new ones; return
        how many were running and queued."""
        self.stopping = True
        waiters = [w for q in self._queues.values() for w in q]
        for w in waiters:
            self._remove(w)
            w.future.set_exception(RouterShutdown())
        running = list(self.running)
        for gen in running:
            gen.stop(RouterShutdown())
        return len(running), len(waiters)

    # -- internals ---------------------------------------------------------

    def _leave(self, w: _Waiter) -> None:
        """Remove a waiter that gave up; give back a handle it got meanwhile."""
        self._remove(w)
        if w.future.done() and not w.future.cancelled() and w.future.exception() is None:
            w.future.result().release()
        else:
            w.future.cancel()

    def _remove(self, w: _Waiter) -> None:
        """Take ``w`` out of its tenant's queue, if it is still in it: its wait
        ended without a replica (timed out, cancelled, refused by a reload or
        the shutdown), observed as a dispatched one's is."""
        q = self._queues.get(w.policy.name)
        if q is not None:
            was_head = bool(q) and q[0] is w
            try:
                q.remove(w)
            except ValueError:
                pass
            else:
                if was_head:
                    self._head_changed(w.policy.name, q)
                self._by_route[w.route] -= 1
                self._queued -= 1
                if not self._queued:
                    self._pace.idle()
                self.metrics.gauge_down(self.metrics.queued, w.policy.name, w.policy.priority)
                self._observe_wait(w.policy, self.clock() - w.enqueued)

    def _on_release(self, slot: ReplicaSlot) -> None:
        self._wake_queue()

    def _wake_queue(self) -> None:
        """A replica has room now (a release, or one became ready): what
        queued may go there."""
        if self._queued:
            self._schedule_dispatch()

    def _schedule_dispatch(self) -> None:
        if not self._dispatch_pending:
            self._dispatch_pending = True
            asyncio.get_running_loop().call_soon(self._dispatch)

    def _activate(self, tenant: str) -> None:
        """``tenant`` becomes backlogged: VTC's lift to the smallest counter
        of the tenants already waiting."""
        # (fifo orders by arrival alone; its heads carry no counters)
        self.counters.lift(tenant, None if self._fifo else self._heads.min_counter(self.counters))

    def _head_changed(self, tenant: str, q: deque[_Waiter]) -> None:
        if q:
            h = q[0]
            counter = 0.0 if self._fifo else self.counters.get(tenant)
            self._heads.set(tenant, 0 if self._fifo else h.rank, h.enqueued, counter)
        else:
            self._heads.remove(tenant)

    def _dispatch(self) -> None:
        self._dispatch_pending = False
        self.pool.offer_room()  # (streams that wait to fail over take room first; try_choose does too)
        full: set[tuple[str, int]] = set()  # (model, needs) with no room left in this pass
        queues = self._queues
        counters = _NO_COUNTERS if self._fifo else self.counters
        skip = None
        while self._queued:
            if not self.pool.any_room():
                return  # (before the fair-share pick and the replica choice a full cluster makes in vain)
            now = self.clock()
            tenant = self._heads.pick(counters, now, skip)
            if tenant is None:
                return
            q = queues[tenant]
            w = q[0]
            try:
                handle = self.pool.try_choose(w.model, w.tokens, w.affinity, w.needs)
            except NoReplica:
                handle = None
            if handle is None:
                full.add(w.route)
                if all(_no_room(r, full) for r, n in self._by_route.items() if n):
                    return  # nothing queued fits anywhere
                skip = lambda t: _no_room(queues[t][0].route, full)  # noqa: E731
                continue
            q.popleft()
            self._head_changed(tenant, q)
            self._by_route[w.route] -= 1
            self._pace.dispatched(now)
            self._queued -= 1
            if not self._queued:
                self._pace.idle()
            self.metrics.gauge_down(self.metrics.queued, w.policy.name, w.policy.priority)
            self._dispatched(w.policy, now - w.enqueued)
            w.future.set_result(handle)

    def _dispatched(self, policy: TenantPolicy, waited: float) -> None:
        self.counters.served(policy.name)
        self._observe_wait(policy, waited)

    def _observe_wait(self, policy: TenantPolicy, waited: float) -> None:
        """Every wait for a replica is observed once, when it ends, however it
        ends (dispatched: ``_dispatch``, or at once; left the queue:
        ``_remove``): the waits that ended in a 503 are a tenant's longest."""
        self.metrics.counts(policy.name, policy.priority).waited(waited)


_NO_COUNTERS = VirtualCounters()


def _no_room(route: tuple[str, int], full: set[tuple[str, int]]) -> bool:
    """No replica has room for a request of ``route`` in this pass: none had
    for one of that route, or for one of its model that needed nothing
    (every replica of the model full; one that needs features can use
    fewer of them, not more)."""
    return route in full or (route[1] != 0 and (route[0], 0) in full)
