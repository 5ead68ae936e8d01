"""How the router finds a replica: a local process it supervises, or an address."""

from __future__ import annotations

from typing import Any, Literal

import msgspec

__all__ = ["ReplicaSpec"]


class ReplicaSpec(msgspec.Struct, forbid_unknown_fields=True, kw_only=True):
    """One replica in router.yaml's ``replicas`` list."""

    name: str
    """Unique name; used in metrics and logs."""
    engine: Literal["sim", "vllm"] = "sim"
    """Engine of a local replica: ``sim`` (simulated) or ``vllm``."""
    config: dict[str, Any] = {}
    """Engine settings (see SimConfig / VllmEngineConfig in the README)."""
    address: str | None = None
    """Attach to a replica already running elsewhere (``host:port`` or
    ``unix:/path``) instead of starting a local process."""
    secret_env: str | None = None
    """Environment variable holding the replica's shared secret."""
    gpu: int | None = None
    """GPU index for CUDA_VISIBLE_DEVICES of a local vllm replica."""
    start_timeout: float = 180.0
    """Seconds a local replica may take to become ready before it is restarted."""
    env: dict[str, str] = {}
    """Extra environment for the local replica process."""

    @property
    def local(self) -> bool:
        return self.address is None
