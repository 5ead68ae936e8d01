"""The router's long-lived state and its one owner: ``RouterService``.

It owns the replica pool, the supervisor (and through it every replica
process and connection), the key index and the metrics. The Litestar
lifespan calls ``start()`` and ``close()``; nothing else starts background
work.
"""

from __future__ import annotations

import logging
from pathlib import Path

from replicas.pool import ReplicaPool, ReplicaSlot
from replicas.supervisor import Supervisor, SupervisorSettings
from router.auth import KeyIndex
from router.config import RouterConfig
from router.configfile import load_yaml
from router.metrics import Metrics
from router.tenants import TenantsFile

__all__ = ["RouterService"]

log = logging.getLogger("fairstream.router")


class RouterService:
    def __init__(self, config: RouterConfig, tenants_path: Path) -> None:
        self.config = config
        self.tenants_path = tenants_path
        self.tenants, _ = load_yaml(tenants_path, TenantsFile)
        self.keys = KeyIndex(self.tenants)
        self.metrics = Metrics()
        self.pool = ReplicaPool(config.replicas)
        self.supervisor = Supervisor(
            self.pool,
            SupervisorSettings(
                health_interval=config.health_interval,
                health_timeout=config.health_timeout,
                backoff_max=config.restart_backoff_max,
            ),
            on_event=self._on_replica_event,
        )

    def priority(self, tenant: str) -> str:
        return self.tenants.tenants[tenant].priority

    async def start(self) -> None:
        await self.supervisor.start()

    async def close(self) -> None:
        await self.supervisor.close()

    def _on_replica_event(self, event: str, slot: ReplicaSlot) -> None:
        if event == "down":
            self.metrics.replica_restarts.labels(slot.name).inc()
        self.metrics.replica_up.labels(slot.name).set(1 if slot.ready else 0)
