"""Routers sharing a state store, and their tenants files.

Each router admits with its own tenants.yaml against buckets it shares with
the others, so two files mean two limits on one bucket. ``PolicyPeers``
publishes this router's file digest (``PolicySnapshot.digest``) to the store
every ``PEERS_INTERVAL`` seconds, and at once after a reload, and reads the
other live routers' digests: a router whose file differs is logged (once per
change), counted in ``fairstream_tenants_files_differ`` and listed in
``/ready``. With the memory store there is one router and nothing to do; during
a Redis outage the last answer stands.
"""

from __future__ import annotations

import asyncio
import logging

from router.background import KeepGoing, spawn
from router.metrics import Metrics
from router.policy import PolicyRegistry
from router.state.base import StateStore, StoreUnavailable
from router.stopping import stop

__all__ = ["PolicyPeers"]

log = logging.getLogger("fairstream.router")

PEERS_INTERVAL = 10.0  # seconds between two publications
PEERS_TTL = 3 * PEERS_INTERVAL  # a router that has not published for this long is gone


class PolicyPeers:
    """Owns the ``policy-peers`` task (``start``, ``close``)."""

    def __init__(self, store: StateStore, policy: PolicyRegistry, metrics: Metrics, router: str) -> None:
        self.store = store
        self.policy = policy
        self.metrics = metrics
        self.router = router
        self.differ: dict[str, str] = {}  # live routers whose file differs: router -> digest
        self._said: tuple[str, frozenset] | None = None
        self._last: tuple[str, frozenset] | None = None  # the previous check's answer
        self._wake = asyncio.Event()
        self._task: asyncio.Task[None] | None = None

    async def start(self) -> None:
        if self.store.name != "memory":
            self._task = spawn(self._run(), "policy-peers")

    def soon(self) -> None:
        """Publish and compare now (the policy was reloaded)."""
        self._wake.set()

    async def close(self) -> None:
        if self._task is not None:
            await stop(self._task)
            if self.store.connecting:
                return  # (no answer from the store yet: nothing was published, and a stop waits for no start)
            try:  # (leave: a router started next with another file must not see this one for PEERS_TTL)
                await self.store.peers(self.router, "", 0)
            except StoreUnavailable:
                pass  # (its entry expires after PEERS_TTL)

    async def _run(self) -> None:
        guard = KeepGoing("policy peers check", log)
        while True:
            async with guard:
                await self.check()
            try:
                await asyncio.wait_for(self._wake.wait(), PEERS_INTERVAL)
            except TimeoutError:
                pass
            self._wake.clear()

    async def check(self) -> None:
        digest = self.policy.current.digest
        try:
            peers = await self.store.peers(self.router, digest, PEERS_TTL)
        except StoreUnavailable:
            return  # (the outage is logged by the store; the last answer stands)
        self.differ = {r: d for r, d in peers.items() if r != self.router and d != digest}
        self.metrics.tenants_files_differ.set(len(self.differ))
        said = (digest, frozenset(self.differ.items()))
        last, self._last = self._last, said
        # (logged once the same answer came twice: routers that watch one
        # file reload it a moment apart, and the first to check sees the
        # others' old digest)
        if said == self._said or said != last:
            return
        if self.differ:
            log.error("tenants.yaml differs between routers sharing the state store: this router's digest is %s, "
                      "%s; each admits with its own limits against the shared buckets, so run the same file",
                      digest, ", ".join(f"{r} has {d}" for r, d in sorted(self.differ.items())))
        elif self._said is not None and self._said[1]:
            log.info("tenants.yaml is the same again on the %d routers sharing the state store (digest %s)",
                        len(peers), digest)
        self._said = said
