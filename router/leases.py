"""The lease keeper: the concurrency leases of this router's running streams,
kept alive in the state store.

A lease lives ``LEASE_TTL`` seconds in the store unless renewed, so the
leases of a router that dies expire by themselves. The keeper renews every
live lease every ``LEASE_TTL / 3``, and at once when the store lost them
(``StateStore.generation`` changed: a Redis restarted without persistence,
flushed or replaced, or back from an outage during which the local fallback
took leases). Before that second case, the leases came back at the next
renewal, and for up to 10 s every router admitted the tenants of the
streams running meanwhile past ``max_concurrent``.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Mapping
from typing import Protocol

from router.background import KeepGoing, spawn
from router.state import StateStore, StoreUnavailable
from router.stopping import stop

__all__ = ["LeaseKeeper", "LEASE_TTL", "GENERATION_INTERVAL", "lease_chain"]

log = logging.getLogger("fairstream.admission")

LEASE_TTL = 30.0  # seconds; renewed every LEASE_TTL / 3 while the stream lives
# seconds between two looks at the store's generation (one small Redis call
# each; idle too, so that the generation a lease was taken under is known)
GENERATION_INTERVAL = 0.5
# The most lease ids a resume's claim records (``lease_chain``): its own and
# those of the generators before it that may still hold theirs. Each
# continuation refused after its claim adds one that never existed, in
# front: 32 outlast a dead lease's 30 s TTL with a client resuming every second.
LEASE_CHAIN = 32


def lease_chain(lease: str, prior: tuple[str, ...]) -> str:
    """What a resume's claim records for the next one (``StreamSnapshot.lease``):
    the lease its continuation will hold, then the leases that continuation
    replaces. A continuation refused after its claim never holds its lease,
    and the leases it would have replaced stay where they were (a dead
    router's, until their TTL): the next claim must still name them.
    At most ``LEASE_CHAIN`` ids (a claim refused again and again)."""
    return " ".join(list(dict.fromkeys((lease, *prior)))[:LEASE_CHAIN])


class _Leased(Protocol):
    @property
    def tenant(self) -> str: ...


class LeaseKeeper:
    """Owns the ``lease-keeper`` task (``start``, ``close``); reads the live
    leases (lease id -> its ticket) from the mapping its owner keeps."""

    def __init__(self, store: StateStore, leases: Mapping[str, _Leased]) -> None:
        self.store = store
        self._leases = leases
        self._task: asyncio.Task[None] | None = None

    def start(self) -> None:
        self._task = spawn(self._run(), "lease-keeper")

    async def close(self) -> None:
        await stop(self._task)

    async def _run(self) -> None:
        loop = asyncio.get_running_loop()
        seen: str | None = None  # (None: not looked yet; a first look with leases live renews, in case)
        due = loop.time() + LEASE_TTL / 3
        guard = KeepGoing("lease keeper", log)  # (a bug must not end it: every lease would expire)
        while True:
            await asyncio.sleep(GENERATION_INTERVAL)
            async with guard:
                # (it looks while no stream holds a lease too: a store that
                # lost its data between a lease's taking and the first look
                # after it went unseen, that look taking the new generation
                # for the first; its renewal "in case" added the lease back,
                # but nothing said the store had lost it)
                lost = False
                try:
                    generation = await self.store.generation()
                except StoreUnavailable:
                    pass  # (an outage: the leases stay where they are counted; the store logs it)
                else:
                    lost, seen, was = generation != seen, generation, seen
                if not self._leases:
                    due = loop.time() + LEASE_TTL / 3  # (a lease taken now has all its TTL)
                    continue
                if lost and was is not None:
                    log.warning("the state store lost the leases it held (restarted without persistence, "
                                "flushed, or back from an outage): adding back those of this router's %d streams "
                                "now", len(self._leases))
                if lost or loop.time() >= due:
                    due = loop.time() + LEASE_TTL / 3
                    await self.renew()

    async def renew(self) -> None:
        """Renew every live lease (the store adds back one it lost)."""
        by_tenant: dict[str, list[str]] = {}
        for lid, t in list(self._leases.items()):
            by_tenant.setdefault(t.tenant, []).append(lid)
        for tenant, ids in by_tenant.items():
            try:
                await self.store.renew(tenant, ids, LEASE_TTL)
            except StoreUnavailable as e:
                log.warning("lease renewal failed for %s: %s", tenant, e)
                continue
            # (renewing adds back a lease the store lost; one whose stream
            # ended while the renewal was on its way must not stay)
            for lid in ids:
                if lid not in self._leases:
                    try:
                        await self.store.release(tenant, lid)
                    except StoreUnavailable:
                        pass  # (it expires by itself)
