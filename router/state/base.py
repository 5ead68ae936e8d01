"""The ``StateStore`` interface: everything routers share, behind one API.

Implementations: ``MemoryStore`` (one process) and ``RedisStore`` (several
router processes or hosts; each operation one atomic Lua script). Both obey
the same contract suite (tests/contract).
"""

from __future__ import annotations

import abc
from collections.abc import Callable

import msgspec

from policies.ratelimit import Decision

__all__ = ["StateStore", "AdmitRequest", "LINE_SLACK", "SETTLED_TTL", "TenantUsage", "StoreUnavailable",
           "StreamSnapshot", "ERROR_OPS"]


CLAIM_TTL = 10.0  # a stream's generating router loses its claim if it stops appending this long
LINE_SLACK = 2.0  # a waiting request stays in its tenant's line this long past its retry_after
# A settled lease id is kept this long, and settling it again changes nothing:
# a settlement that timed out on a Redis that only hung runs when Redis wakes,
# and the router makes it again from its list of missed ones once its probe
# finds Redis back (about a second later; longer only if Redis is lost again
# in between). (Redis: one sorted-set entry per stream ended in that time.)
SETTLED_TTL = 300.0
# The operations whose failures ``ResilientStore`` counts (the ``op`` of
# fairstream_state_store_errors_total, exported at 0 from the start)
ERROR_OPS = ("connect", "ping", "generation", "admit", "undo_admit", "leave", "settle", "renew", "release", "usage",
             "peers", "stream_open", "stream_append", "stream_read", "stream_claim", "stream_renew",
             "stream_release")


class StoreUnavailable(ConnectionError):
    """The backing store cannot be reached."""


class AdmitRequest(msgspec.Struct, frozen=True, gc=False):
    """One admission attempt against a tenant's limits (0 = unlimited)."""

    rpm: int
    tpm: int
    max_concurrent: int
    cost_tokens: int
    lease_id: str  # "": no lease (a resume's charge: one request, no slot)
    lease_ttl: float
    # The tenant queues (``on_limit: queue``): the store keeps its line of
    # waiting requests across routers (see ``StateStore.admit``).
    line: bool = False
    # Leases this one takes the place of: not counted against it, and gone
    # once it is admitted. A resumed stream's continuation replaces the
    # leases of those that generated the stream before it (the request that
    # started it, the last continuation: ``StreamSnapshot.lease``), which a
    # router that died running it left in the store for their TTL.
    replaces: tuple[str, ...] = ()
    # Keep this admission's token reservation for ``hold`` seconds (0: not
    # at all), for a continuation to take over if its router dies before it
    # settles (``StateStore.admit``). ``base``: the stream's tokens before
    # this request (its prompt and the completion tokens delivered before a
    # continuation), which its reservation does not hold.
    hold: float = 0.0
    base: int = 0


class TenantUsage(msgspec.Struct, frozen=True):
    """Live usage of a tenant, for /admin/tenants."""

    requests_available: float
    tokens_available: float
    active_streams: int


class StreamSnapshot(msgspec.Struct):
    """A stream's resume buffer as stored: what a resuming client needs.

    ``meta`` is opaque to the store (the router's encoded ``ResumeMeta``);
    ``token_ids`` are the completion tokens delivered so far, ``text_len``
    the characters of text they produced, ``events`` the SSE events after
    the requested one, ``total_events`` how many exist, ``owner`` the router
    generating it (empty when none holds a live claim), ``lease`` the
    admission leases the last claim named (``stream_claim``), ``lost``
    whether a router ever held it and died (its claim ran out unreleased):
    only then can a client have events the buffer lacks. ``charged``: the
    completion tokens the stream's requests counted and charged the tenant
    for, as their routers let go of it (``stream_release``); more than
    ``token_ids`` when a generation ran past its events (behind a slow
    client, or as its client left), which a continuation generates again
    and must not charge again.
    """

    meta: bytes
    token_ids: list[int]
    text_len: int
    events: list[bytes]
    total_events: int
    finished: bool
    owner: str
    broken: bool = False  # (it misses events: see ``stream_append``; it cannot be resumed)
    lease: str = ""
    lost: bool = False
    charged: int = 0


class StateStore(abc.ABC):
    name: str
    # other routers read and change this state (Redis); False: this process's
    # own (memory), where a call completes before anything else runs
    shared: bool = False
    healthy: bool = True  # (ResilientStore: False while the store is down)
    connecting: bool = False  # (ResilientStore: True from ``start`` until its first answer or outage)

    @abc.abstractmethod
    async def admit(self, tenant: str, req: AdmitRequest) -> Decision:
        """Atomically check every limit and, if all pass, take one request,
        reserve ``cost_tokens`` and take a concurrency lease.

        With ``req.line`` the tenant's line of waiting requests comes first,
        shared by every router on the store: a request not in the line is
        refused while anyone waits in it, one in the line while anyone waits
        ahead of it (reason ``queued`` when its limits alone would pass). A
        refused request joins the line's end (unless it can never fit), and
        stays for ``retry_after`` plus ``LINE_SLACK`` seconds, each refusal
        renewing it; an admitted one leaves it. A router puts only the head
        of its own line there, so the routers with waiting requests take
        turns, and a line on a crashed router blocks the others a few
        seconds at most.

        Held reservations: with ``req.hold`` the admitted request's
        reservation is kept under its lease id for that long, until settled.
        Those of ``req.replaces`` (a continuation's; the stream's earlier
        generators', which a router that died never settled) are taken over
        if they are still kept: the request needs that many tokens fewer
        (none below 0), its own kept reservation grows by them, and the
        decision says how many (``Decision.taken``) and the ``base`` of the
        oldest of them. Taken over once: a settlement of a taken-over lease
        changes nothing (the continuation settles the stream for it)."""

    @abc.abstractmethod
    async def undo_admit(self, tenant: str, req: AdmitRequest, *, keep_lease: bool = False) -> None:
        """Undo ``req``'s admission, whose answer the caller never used: it
        timed out on a store that only hung, which runs it when it wakes
        (the caller admitted the request elsewhere, or refused it). If it was
        admitted (its lease is there): give back its request and the tokens
        it took, hand back the held reservations it took over as they were
        (another continuation may take them over, their own settlement
        counts; one whose settlement came since the admission, which changed
        nothing then, counts now), drop its own, and end its lease unless
        ``keep_lease`` (the caller runs its stream under that lease: the
        renewal that moves it here counts it). Its own reservation taken over
        since by another continuation (which settles for it): its request
        only. Refused or never made: nothing. Made again, nothing more (its
        lease is gone, or, kept, marked undone for ``SETTLED_TTL``: made
        again without ``keep_lease``, after its stream ended, it only ends
        the lease); admitted late again (another hang, another timeout), it
        is undone again. What it frees wakes the tenant's line, as a release
        does."""

    @abc.abstractmethod
    async def leave(self, tenant: str, lease_id: str) -> None:
        """Take a request out of the tenant's line (it gave up; idempotent)."""

    @abc.abstractmethod
    async def settle(self, tenant: str, *, tpm: int, reserved: int, used: int, lease_id: str = "",
                     held: bool = False) -> None:
        """Correct the tokens bucket with the real usage (see policies.ratelimit.settle);
        nothing if a continuation took over ``lease_id``'s reservation (``admit``). ``held``: it was
        admitted with a hold; its record gone (expired: its router was out of touch longer than
        the hold, a continuation may have taken it over and settled it), no tokens come back.
        Once per ``lease_id``: settled again within ``SETTLED_TTL``, nothing changes (a
        settlement made again after a timeout that Redis ran all the same); one without a lease
        id counts each time."""

    @abc.abstractmethod
    async def renew(self, tenant: str, lease_ids: list[str], ttl: float) -> None:
        """Extend the leases of streams the caller still runs, so they
        outlast the next renewal. A lease the store no longer holds (it
        expired while its router was frozen; Redis restarted or was flushed)
        is added again: the stream it counts is still running."""

    @abc.abstractmethod
    async def release(self, tenant: str, lease_id: str) -> None:
        """End a lease (idempotent)."""

    @abc.abstractmethod
    async def usage(self, tenant: str, *, rpm: int, tpm: int) -> TenantUsage:
        """Current levels and live leases."""

    # -- stream resume buffers ----------------------------------------------

    @abc.abstractmethod
    async def stream_open(self, sid: str, meta: bytes, owner: str, ttl: float, *, lease: str = "",
                          lost: bool = False, charged: int = 0) -> None:
        """Create the resume buffer of stream ``sid``, claimed by ``owner``
        (none: ""). ``lease``, ``lost`` and ``charged``: a buffer copied from
        another store (a fallback's, when Redis is back) keeps its last
        claim's leases, whether a router that held it died, and the tokens
        charged for it (``StreamSnapshot``)."""

    @abc.abstractmethod
    async def stream_append(
        self, sid: str, events: list[bytes], token_ids: list[int], text_len: int | None, finished: bool,
        owner: str, ttl: float, first: int = -1,
    ) -> bool:
        """Append events and delivered tokens; set the text length (None:
        unchanged); renew the owner's claim and the buffer's retention.
        ``first``: how many events the writer put in the buffer before these
        (-1: unchecked); a buffer that holds another number misses some (they
        went elsewhere: the local fallback during an outage) and is marked
        broken, for good. False when the append was not made: no such buffer
        (expired, never made, or lost by the store: a Redis restarted without
        persistence or flushed), or the buffer refused it: broken, finished,
        or another router's now (it took the stream over from this one); True
        when it was made."""

    @abc.abstractmethod
    async def stream_read(self, sid: str, after: int, tokens: bool = True) -> StreamSnapshot | None:
        """The buffer with the events numbered after ``after`` (events are
        numbered from 1); None when it does not exist or has expired.
        ``tokens`` False: ``token_ids`` is left empty (a client following a
        stream needs its events only, and a long stream's ids are read
        again at every poll)."""

    @abc.abstractmethod
    async def stream_claim(self, sid: str, owner: str, claim_ttl: float, lease: str = "") -> bool:
        """Take over generating ``sid`` if no live owner holds it; ``lease``:
        the admission lease its continuation will hold, kept for the next
        claim's (``StreamSnapshot.lease``)."""

    @abc.abstractmethod
    async def stream_renew(self, sids: list[str], owner: str, claim_ttl: float) -> list[bool]:
        """Extend ``owner``'s claim on each of ``sids`` where it still holds
        it (a live router renewing the streams it generates; a shared store
        does them in one round trip per batch). Never takes a stream: one
        released, finished, claimed by another router or gone is left as it
        is (False)."""

    @abc.abstractmethod
    async def stream_release(self, sid: str, owner: str, charged: int = 0) -> None:
        """Drop ``owner``'s claim (the buffer itself stays for its retention).
        ``charged``: the stream's completion tokens counted and charged so
        far (its generation's, which may be past its buffer's), kept as the
        largest given (``StreamSnapshot.charged``); only with the claim."""

    async def peers(self, router: str, digest: str, ttl: float) -> dict[str, str]:
        """Publish ``router``'s tenants-file digest for ``ttl`` seconds and
        return the digest of every router that published one within its
        ``ttl`` (``router`` included; ``ttl`` 0: ``router`` leaves, and is
        not). Routers sharing a store must run the same file: each admits
        with its own limits against shared buckets."""
        return {router: digest} if ttl > 0 else {}  # (an in-process store has one router)

    def watch(self, on_turn: Callable[[str], None]) -> None:
        """Call ``on_turn(tenant)`` when another router frees the limits of
        a tenant whose requests wait in the store's line, or its line moves
        (a shared store; an in-process one has no other router to hear)."""

    async def start(self) -> None:
        """Begin connecting (in the background: ``connecting`` says until when)."""

    async def generation(self) -> str:
        """An id of the data the store holds, which changes when the store
        loses what the routers put in it: a Redis restarted without
        persistence, flushed or replaced; or one back from an outage. The
        leases of running streams are then added back at once (``renew``),
        not at the next renewal. An in-process store never loses them."""
        return ""

    async def ping(self) -> None:
        """Raise ``StoreUnavailable`` if the store cannot be reached."""

    async def prepare(self) -> None:
        """Get ready for requests once the store answers (at the first
        contact, and when it is back from an outage): a shared store loads
        its scripts, so that the first requests after do not each pay for
        that inside their timeout. ``StoreUnavailable`` if it cannot."""

    async def check(self) -> None:
        """Notice an outage now, even while no request uses the store
        (``/ready`` and ``/metrics`` call this)."""

    def stop_connecting(self) -> None:
        """The router stops: end a first contact still under way (``start``)."""

    async def close(self) -> None:
        """Release connections."""
