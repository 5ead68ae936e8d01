"""Admission: a tenant's limits applied to one request, through the state store.

``Admission.admit`` takes one request, its token estimate and the tenant's
policy, and returns a ``Ticket`` (a concurrency lease and a token
reservation) or raises ``RateLimited`` with a Retry-After computed from the
bucket. With ``on_limit: queue`` it waits instead, up to the tenant's
``queue_wait``, in the tenant's line (first come, first served in this
process; at most ``queue_depth`` long), or less when the request's
first-token or total limit ends the wait first (as it ends a wait for a
replica: the request then gets that limit's timeout, a 504). Only the line's head asks the state
store again, when its limit should have freed or one of the tenant's streams
ends, and hands the turn on when it leaves. The store keeps a line too, of
the heads of every router's line (``StateStore.admit``), so routers sharing
Redis take turns: a busy router's line cannot take every slot that frees
while another router's waits. ``finish`` settles the
reservation with the real usage and releases the lease; the lease keeper
(router/leases.py) renews every live lease so a crashed router's leases
expire on their own, and adds them back when the store lost them.
"""

from __future__ import annotations

import asyncio
import collections
import logging
import math
from collections.abc import Callable, Iterable, Mapping

import msgspec

from policies.dispatch_pace import DispatchPace
from policies.ratelimit import QUEUED_RETRY, Decision
from router.deadlines import Deadlines, StreamTimeout
from router.errors import RateLimited, RouterShutdown, ServiceUnavailable
from router.ids import new_id
from router.leases import LEASE_TTL, LeaseKeeper
from router.metrics import Metrics
from router.state import AdmitRequest, MemoryStore, StateStore, StoreUnavailable
from router.tenants import TenantPolicy
from router.ticket import Ticket, fmt_duration, ratelimit_headers
from router.waiter import Waiter

__all__ = ["Admission", "Ticket", "ratelimit_headers", "fmt_duration"]

log = logging.getLogger("fairstream.admission")


# how far past its queue_wait a waiting request may wait for a limit that frees by then
DEADLINE_SLACK = 0.05
# longest sleep of a line's head between two asks, by the reason it was
# refused: a stream that ends or tokens given back on another router wake
# nothing here, and the store's line holds the other routers' heads behind it
HEAD_POLL = {"concurrency": QUEUED_RETRY, "queued": QUEUED_RETRY, "": 1.0}


_REASONS = {
    "requests": "requests per minute",
    "tokens": "tokens per minute",
    "concurrency": "concurrent streams",
    "queued": "its line (earlier requests of the tenant wait on other routers)",
}


def _wait_limit(deadlines: Deadlines | None, delivered: bool, now: float) -> tuple[float, StreamTimeout | None]:
    """When (on the clock of ``now``) the request's first-token or total limit
    ends its wait, and the timeout it then gets; ``inf``: neither is set."""
    ends = deadlines.wait_limit(delivered) if deadlines is not None else None
    if ends is None:
        return math.inf, None
    return now + ends[0], ends[1]


class Admission:
    def __init__(self, store: StateStore, metrics: Metrics) -> None:
        self.store = store
        self.metrics = metrics
        self._leases: dict[str, Ticket] = {}
        self._lines: dict[str, collections.deque[Waiter]] = {}  # per tenant, in arrival order
        # per tenant: the pace at which its line is admitted, for a full line's Retry-After
        self._paces: dict[str, DispatchPace] = {}
        self._ends: dict[str, int] = {}  # per tenant: streams ended (a refusal older than that is stale)
        self._keeper = LeaseKeeper(store, self._leases)
        self._stopped = asyncio.Event()  # set: requests waiting for a limit get RouterShutdown
        self._gone: dict[str, Callable[[], BaseException]] = {}  # tenants a reload removed: their refusal
        # the tenants' policies since the last reload (``follow``): what a waiting request asks with
        self._policies: Mapping[str, TenantPolicy] = {}

    def queued(self, tenant: str) -> int:
        line = self._lines.get(tenant)
        return len(line) if line else 0

    async def start(self) -> None:
        self._keeper.start()
        self.store.watch(self._turn)

    def _turn(self, tenant: str) -> None:
        """Another router freed ``tenant``'s limits or moved its line: the
        head of its line here asks again at once."""
        line = self._lines.get(tenant)
        if line:
            line[0].wake()

    async def close(self) -> None:
        await self._keeper.close()

    async def admit(self, policy: TenantPolicy, cost_tokens: int, *, count_request: bool = True,
                    prompt_tokens: int = 0, lease_id: str = "", replaces: tuple[str, ...] = (),
                    deadlines: Deadlines | None = None, delivered: bool = False, hold: float = 0.0,
                    base: int = 0) -> Ticket:
        """``count_request=False`` for the continuation of a resumed stream:
        it holds a lease and reserves tokens, but is not a new request.
        ``prompt_tokens``: the prompt's share of ``cost_tokens`` (what a
        refusal for size tells the client to cut). ``lease_id``: the new
        lease's id, if the caller drew it already (a continuation names it in
        its claim); else a new one. ``replaces``: leases this one takes the
        place of (``AdmitRequest.replaces``; a continuation names those of
        the stream's earlier generators, which a router that died running
        it left in the store, counted against the continuation for their
        TTL). The lease is a new one all the same: one ticket, one lease,
        whatever the original's ending does with its own. ``hold``, ``base``:
        keep the reservation for a continuation to take over if this router
        dies (a resumable stream's; ``AdmitRequest``): a continuation that
        takes one over settles for the tokens its generators used too.

        ``deadlines``: the request's time limits, asked only when it has to
        wait (``Deadlines.wait_limit``, with ``delivered``: the stream has
        output, so only its total limit applies): the wait ends at its
        first-token or total limit when that comes before ``queue_wait``
        does, with that limit's ``StreamTimeout`` (the caller's 504), as a
        wait for a replica does (``Scheduler.acquire``); being admitted
        after it would only time out at once."""
        # (the caller looked the policy up before an await of its own, a
        # large body's turn: a reload since then decides, removal included)
        self._raise_if_gone(policy.name)
        policy = self._policies.get(policy.name, policy)
        lim = policy.limits
        req = AdmitRequest(
            rpm=lim.requests_per_minute if count_request else 0,
            tpm=lim.tokens_per_minute,
            max_concurrent=lim.max_concurrent,
            cost_tokens=cost_tokens,
            lease_id=lease_id or new_id(),
            lease_ttl=LEASE_TTL,
            line=policy.on_limit == "queue",
            replaces=replaces,
            hold=hold if lim.tokens_per_minute else 0.0,
            base=base,
        )
        loop = asyncio.get_running_loop()
        started = loop.time()
        deadline = started + lim.queue_wait if lim.queue_wait else math.inf
        name = policy.name
        line = self._lines.get(name)
        decision: Decision | None = None
        limit_at: float | None = None  # (the wait's other end, and its error: asked once it has to wait)
        timeout: StreamTimeout | None = None
        ends = self._ends.get(name, 0)
        too_large = bool(lim.tokens_per_minute) and cost_tokens > lim.tokens_per_minute
        if policy.on_limit == "queue" and line and len(line) >= policy.queue_depth and not too_large:
            raise self._line_full(policy)  # (not a try at the store: it could take the head's turn)
        if policy.on_limit != "queue" or not line or too_large:
            # nobody of this tenant waits here (or the tenant does not queue): try now
            try:
                decision = await self.admit_once(name, req)
            except BaseException:
                await self._leave(name, req)  # (cancelled: the store may have put it in its line)
                raise
            if decision.ok:
                return self._ticket(policy, req, cost_tokens, decision)
            asked = policy
            policy, req, deadline = self._follow(policy, req, count_request, started, deadline)
            if policy is not asked:
                # A reload while the store answered: one more ask, as a new request would
                # make now (its limits, its words; in the store's line if it queues now)
                try:
                    if req.line and policy.on_limit != "queue":
                        await self._leave(name, req)
                    req = msgspec.structs.replace(req, line=policy.on_limit == "queue")
                    decision = await self.admit_once(name, req)
                except BaseException:
                    await self._leave(name, req)
                    raise
                if decision.ok:
                    return self._ticket(policy, req, cost_tokens, decision)
            try:
                self._check_fits(policy, decision, cost_tokens, prompt_tokens)
                line = self._lines.get(name)  # (the await may have made or ended the line)
                if policy.on_limit != "queue":
                    raise self._refused(policy, decision)
                limit_at, timeout = _wait_limit(deadlines, delivered, loop.time())
                if loop.time() + min(decision.retry_after, 0.05) >= min(deadline, limit_at):
                    raise self._time_up(policy, decision, deadline, limit_at, timeout)
                if len(line or ()) >= policy.queue_depth:
                    raise self._line_full(policy)
                self._raise_if_gone(name)
            except BaseException:
                await self._leave(name, req)
                raise
            if line:
                # (others of this router came first, while the store answered:
                # only a router's head waits in the store's line, in its order)
                await self._leave(name, req)
        # Wait in the tenant's line. Only its head asks the store, when its
        # limit should have freed or when one of the tenant's streams ends; a
        # request admitted or given up hands the turn to the next at once.
        if line is None:
            line = self._lines[name] = collections.deque()
        if limit_at is None:
            limit_at, timeout = _wait_limit(deadlines, delivered, loop.time())
        me = Waiter()
        line.append(me)
        (self._paces.get(name) or self._paces.setdefault(name, DispatchPace())).waiting(loop.time())
        if self._ends.get(name, 0) != ends:
            me.wake()  # a stream ended while the store answered: try again at once
        self.metrics.gauge_up(self.metrics.admission_waiting, name)
        admitted = False
        try:
            while True:
                now = loop.time()
                if line[0] is not me:
                    await me.sleep((min(deadline, limit_at) if policy.on_limit == "queue" else limit_at) - now)
                    self._raise_if_gone(name)
                    # (a reload's policy: its limits, and its wait, which may end later or sooner now)
                    policy, req, deadline = self._follow(policy, req, count_request, started, deadline)
                    if line[0] is not me and policy.on_limit != "queue":
                        # (a reload to reject: each asks once, its turn at
                        # once as those ahead leave; asked together, a freed
                        # slot went to the ask answered first, not the head's)
                        if timeout is not None and loop.time() >= limit_at:
                            raise timeout
                        continue
                    if line[0] is not me:
                        if loop.time() < min(deadline, limit_at):
                            continue
                        if timeout is not None and limit_at < deadline:
                            raise timeout
                        # its time is up before its turn came: one last try, then a 429
                        decision = await self.admit_once(name, req)
                        if not decision.ok:
                            self._check_fits(policy, decision, cost_tokens, prompt_tokens)
                            raise self._refused(policy, decision)
                        admitted = True
                        return await self._waited(policy, req, cost_tokens, decision)
                elif decision is not None:  # the head, refused: until the limit frees
                    self._raise_if_gone(name)
                    # (a stream ending on another router, or tokens it gives
                    # back, wake nothing here: look again soon)
                    wait = min(decision.retry_after, HEAD_POLL.get(decision.reason, HEAD_POLL[""]))
                    end = min(deadline, limit_at)
                    # (a limit that frees just after queue_wait's end is waited for; past the
                    # request's own time limit, never: it would time out as soon as admitted)
                    if now + wait > end + (DEADLINE_SLACK if deadline <= limit_at else 0.0):
                        if now >= end:
                            raise self._time_up(policy, decision, deadline, limit_at, timeout)
                        wait = end - now  # one more try at the end (or when a stream ends)
                    await me.sleep(max(0.01, wait))
                    self._raise_if_gone(name)
                policy, req, deadline = self._follow(policy, req, count_request, started, deadline)
                if policy.on_limit != "queue" and req.line:
                    # A reload made the tenant refuse (an operator shedding
                    # load): it asks once as a new request would, outside
                    # the store's line. Its place there goes first: neither
                    # that ask nor the leave below would take it out, and it
                    # would hold back the other routers' heads behind it.
                    await self._leave(name, req)
                    req = msgspec.structs.replace(req, line=False)
                if timeout is not None and loop.time() >= limit_at:
                    raise timeout
                decision = await self.admit_once(name, req)
                if decision.ok:
                    admitted = True
                    return await self._waited(policy, req, cost_tokens, decision)
                self._check_fits(policy, decision, cost_tokens, prompt_tokens)
                if policy.on_limit != "queue":
                    raise self._refused(policy, decision)
        finally:
            head = line[0] is me
            line.remove(me)
            self.metrics.gauge_down(self.metrics.admission_waiting, name)
            # every wait in the line, when it ends, however it ends (admitted,
            # refused, timed out, cancelled, a reload or the shutdown)
            self.metrics.child(self.metrics.admission_wait, name, policy.priority).observe(loop.time() - started)
            if not line:
                if self._lines.get(name) is line:
                    del self._lines[name]
                    self._paces[name].idle()
            elif head:
                line[0].wake()
            if not admitted:
                await self._leave(name, req)

    async def _waited(self, policy: TenantPolicy, req: AdmitRequest, cost_tokens: int, decision: Decision) -> Ticket:
        """The ticket of a request admitted after a wait; the reload's
        refusal instead if its tenant was removed meanwhile (while the store
        answered)."""
        ticket = self._ticket(policy, req, cost_tokens, decision)
        self._paces[policy.name].dispatched(asyncio.get_running_loop().time())
        gone = self._gone.get(policy.name)
        if gone is not None:
            await self.finish(ticket, 0)
            raise gone()
        return ticket

    async def _leave(self, tenant: str, req: AdmitRequest) -> None:
        """Take a request that was not admitted (refused, cancelled, shut
        down, or waiting behind another of this router) out of the store's
        line, where a refusal put it."""
        if req.line:
            try:
                await self.store.leave(tenant, req.lease_id)
            except StoreUnavailable:
                pass  # (its place expires within seconds)

    def _ticket(self, policy: TenantPolicy, req: AdmitRequest, cost_tokens: int, decision: Decision) -> Ticket:
        ticket = Ticket(policy, req.lease_id, max(cost_tokens, decision.taken), decision,
                        req.base - decision.base if decision.taken else 0, req.hold > 0)
        self._leases[req.lease_id] = ticket
        return ticket

    def _check_fits(self, policy: TenantPolicy, decision: Decision, cost_tokens: int, prompt_tokens: int) -> None:
        """A request larger than the tenant's whole token budget never fits: a 429 at once."""
        if decision.reason == "too_large":
            self.metrics.limited(policy.name, "tokens")
            tpm = policy.limits.tokens_per_minute
            cut = (f"its prompt alone is about {prompt_tokens}: shorten it" if prompt_tokens >= tpm
                   else "lower max_tokens")
            raise RateLimited(
                f"Request needs {cost_tokens} tokens, more than the tenant's limit of "
                f"{tpm} tokens per minute; {cut}.",
                retry_after=None, code="tokens_exceed_limit", headers=ratelimit_headers(policy, decision),
            )

    def _refused(self, policy: TenantPolicy, decision: Decision) -> RateLimited:
        self.metrics.limited(policy.name, decision.reason)
        retry = decision.retry_after
        return RateLimited(
            f"Rate limit reached for tenant {policy.name!r} on {_REASONS.get(decision.reason, decision.reason)}. "
            f"Please try again in {fmt_duration(max(retry, 0.001))}.",
            retry_after=retry, headers=ratelimit_headers(policy, decision),
        )

    def _time_up(self, policy: TenantPolicy, decision: Decision, deadline: float, limit_at: float,
                 timeout: StreamTimeout | None) -> Exception:
        """What ends a wait whose time is up: the request's time limit when it
        came before ``queue_wait``'s end (``deadline``), else the refusal."""
        if timeout is not None and limit_at < deadline:
            return timeout
        return self._refused(policy, decision)

    def _line_full(self, policy: TenantPolicy) -> RateLimited:
        """The 429 ``queue_full``, with the scheduler's basis for its own: the
        requests in the line ahead times the pace at which it is admitted."""
        self.metrics.limited(policy.name, "queue")
        pace = self._paces.get(policy.name) or DispatchPace()  # (none yet: 1 s a turn, as the scheduler's)
        retry = pace.retry_after(self.queued(policy.name), asyncio.get_running_loop().time())
        return RateLimited(
            f"Too many requests of tenant {policy.name!r} wait for its limits (queue depth {policy.queue_depth}); "
            "retry later.", retry_after=retry, code="queue_full",
        )

    def _raise_if_gone(self, tenant: str) -> None:
        """The router stops (``RouterShutdown``), or a reload removed ``tenant``."""
        if self._stopped.is_set():
            raise RouterShutdown()
        gone = self._gone.get(tenant)
        if gone is not None:
            raise gone()

    def follow(self, policies: Mapping[str, TenantPolicy]) -> None:
        """A reload made ``policies`` the tenants' policies: a request still
        waiting for its limits asks with its tenant's policy from now on (its
        limits, and its line's wait counted from its arrival), not the one
        it arrived with (raising a limit to clear a backlog let the backlog
        in at the old one). Every waiter wakes: the heads ask again at once,
        the others wait on until their new deadline; if the tenant no longer
        queues (``on_limit: reject``), each asks once, in the line's order,
        and is admitted or refused as a new request would be."""
        self._policies = policies
        for line in self._lines.values():
            for w in line:
                w.wake()

    def _follow(self, policy: TenantPolicy, req: AdmitRequest, count_request: bool, started: float,
                deadline: float) -> tuple[TenantPolicy, AdmitRequest, float]:
        """``policy``, ``req`` and ``deadline`` as the policy in force makes them."""
        now = self._policies.get(policy.name)
        if now is None or now is policy:
            return policy, req, deadline
        lim = now.limits
        req = msgspec.structs.replace(req, rpm=lim.requests_per_minute if count_request else 0,
                                      tpm=lim.tokens_per_minute, max_concurrent=lim.max_concurrent)
        return now, req, started + lim.queue_wait if lim.queue_wait else math.inf

    def fail_tenant(self, tenant: str, error: Callable[[], BaseException]) -> int:
        """A reload removed ``tenant``: its requests waiting for its limits,
        and those that would wait from now on, end with ``error()`` (until a
        reload adds it again: ``restore``); return how many were waiting."""
        self._gone[tenant] = error
        line = self._lines.get(tenant, ())
        for w in line:
            w.wake()
        return len(line)

    def restore(self, tenants: Iterable[str]) -> None:
        """These tenants are in the policy again (see ``fail_tenant``)."""
        for name in tenants:
            self._gone.pop(name, None)

    def fail_waiting(self) -> int:
        """End every request waiting for its tenant's limits, and refuse new
        ones, with ``RouterShutdown`` (the router is stopping); return how
        many were waiting."""
        self._stopped.set()
        waiting = 0
        for line in self._lines.values():
            waiting += len(line)
            for w in line:
                w.wake()
        return waiting

    async def admit_once(self, tenant: str, req: AdmitRequest) -> Decision:
        """One ask of the store, no waiting; a store that cannot answer (fail
        closed) is the 503 ``state_store_unavailable``."""
        try:
            return await self.store.admit(tenant, req)
        except StoreUnavailable as e:
            raise ServiceUnavailable(
                "Rate-limit state is unavailable and this router is configured to fail closed; retry shortly.",
                code="state_store_unavailable", headers={"retry-after": "1"},
            ) from e

    async def drop(self, tenant: str, lease_ids: Iterable[str]) -> None:
        """End leases no ticket of this router holds: those of a stream's
        earlier generators, which died holding them, once a resume finished
        the stream with no continuation to replace them. The tenant's line
        may go on."""
        try:
            for lease_id in lease_ids:
                await self.store.release(tenant, lease_id)
        except StoreUnavailable as e:
            log.warning("could not end the leases of %s's dead routers: %s (they expire by themselves)", tenant, e)
        self._ended(tenant)

    async def finish(self, ticket: Ticket, used_tokens: int) -> None:
        """Settle the reservation with the real usage and release the lease. Idempotent."""
        if ticket.done:
            return
        ticket.done = True
        ticket.used = used_tokens + ticket.inherited
        self._leases.pop(ticket.lease_id, None)
        try:
            if ticket.tpm:
                await self.store.settle(ticket.tenant, tpm=ticket.tpm, reserved=ticket.reserved,
                                        used=used_tokens + ticket.inherited, lease_id=ticket.lease_id,
                                        held=ticket.held)
            await self.store.release(ticket.tenant, ticket.lease_id)
        except StoreUnavailable as e:
            log.warning("could not settle lease of %s: %s (it expires by itself)", ticket.tenant, e)
        self._ended(ticket.tenant)

    @property
    def in_process(self) -> bool:
        """Its store is this process's own (``finish_now`` settles at once).
        (A Redis outage's fallback is inside ResilientStore: not this.)"""
        return isinstance(self.store, MemoryStore)

    def finish_now(self, ticket: Ticket, used_tokens: int) -> None:
        """``finish`` at once, without an await, where the store is this
        process's own (``MemoryStore``: nothing to wait for): a stream's last
        bytes go out right after it, so a client whose next request follows
        ``[DONE]`` at once finds the lease free (``max_concurrent: 1``). On a
        shared store nothing happens here: ``EventStream.release`` settles
        before the last bytes, a round trip. Idempotent."""
        store = self.store
        if ticket.done or not self.in_process:
            return
        ticket.done = True
        ticket.used = used_tokens + ticket.inherited
        self._leases.pop(ticket.lease_id, None)
        if ticket.tpm:
            store.settle_now(ticket.tenant, tpm=ticket.tpm, reserved=ticket.reserved,
                             used=used_tokens + ticket.inherited, lease_id=ticket.lease_id, held=ticket.held)
        store.drop(ticket.tenant, ticket.lease_id)
        self._ended(ticket.tenant)

    def _ended(self, tenant: str) -> None:
        """A stream and its lease ended, tokens came back: the tenant's next may fit now."""
        self._ends[tenant] = self._ends.get(tenant, 0) + 1
        line = self._lines.get(tenant)
        if line:
            line[0].wake()
