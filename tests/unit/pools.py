"""What the scheduler's unit tests share: a stand-in for a ready replica's
connection, as far as the pool looks at one, and a tenant policy that
queues."""

from __future__ import annotations

from replicas.protocol import FEATURES, LoadReport, Ready
from router.tenants import ResolvedLimits, TenantPolicy

MODEL = "m"


class ReadyClient:
    """A ready replica connection serving ``MODEL`` that announced ``features``."""

    model = MODEL
    closed = None
    refused = False
    credentials_refused = None
    continues = True
    load = LoadReport(0, 0, 0.0)

    def __init__(self, features: int = int(FEATURES)) -> None:
        self.ready = Ready(1, MODEL, "sim", 4096, 1, features)


def queueing_policy(name: str) -> TenantPolicy:
    """A tenant with no limits of its own whose requests queue (depth 10)."""
    return TenantPolicy(
        name=name, priority="normal", rank=1, weight=1.0, models=["*"], queue_depth=10, chunk_tokens=16,
        on_limit="queue", log_content=False,
        limits=ResolvedLimits(requests_per_minute=0, tokens_per_minute=0, max_concurrent=0, max_prompt_tokens=0,
                              max_tokens=0, max_sockets=0, queue_wait=0.0, first_token=0.0, stall=0.0, total=0.0),
    )
