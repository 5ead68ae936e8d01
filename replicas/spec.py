"""How the router finds a replica: a local process it supervises, or an address."""

from __future__ import annotations

import re
from typing import Any, Literal
from urllib.parse import urlsplit

import msgspec

__all__ = ["ReplicaSpec", "address_error", "host_port", "join_host_port"]

# (a local replica's socket file and run directory are named after it)
_NAME = re.compile(r"^[A-Za-z0-9_.-]{1,64}$")


def host_port(text: str) -> tuple[str, int] | None:
    """``HOST:PORT`` (an IPv6 host in brackets: ``[::1]:7000``) as (host,
    port), port 0-65535; None: it is not one. The one parser of replica
    addresses: router.yaml's ``address``, ``replica --listen``, the connect.
    An IPv6 host without brackets is refused: ``::1`` would read as host
    ``::`` and port 1."""
    host, sep, port = text.rpartition(":")
    if host.startswith("[") and host.endswith("]"):
        host = host[1:-1]
        if "[" in host or "]" in host:
            return None
    elif ":" in host or "[" in host or "]" in host:
        return None
    if not sep or not host or not (port.isascii() and port.isdigit()) or int(port) > 65535:
        return None
    return host, int(port)


def join_host_port(host: str, port: int) -> str:
    """``HOST:PORT`` as ``host_port`` reads it back (an IPv6 host in brackets)."""
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


def address_error(address: str) -> str | None:
    """Why ``address`` is not ``host:port`` or ``unix:/path`` (None: it is)."""
    if address.startswith("unix:"):
        return None if address[5:] else "`address` unix: needs a socket path (unix:/path)"
    if "://" in address:
        return f"`address` is host:port or unix:/path, not a URL ({address!r}; an OpenAI-compatible server is a `url`)"
    parsed = host_port(address)
    if parsed is None or parsed[1] == 0:
        return (f"`address` must be host:port (port 1-65535; an IPv6 host in brackets, [::1]:7000) or unix:/path,"
                f" not {address!r}")
    return None


class ReplicaSpec(msgspec.Struct, forbid_unknown_fields=True, kw_only=True):
    """One replica in router.yaml's ``replicas`` list."""

    name: str
    """Unique name; used in metrics and logs. A replica the router starts is
    named with letters, digits, ``_ . -`` (1-64 characters: its socket file
    is named after it); one at an ``address`` or ``url`` with any printable
    text."""
    engine: Literal["sim", "vllm"] = "sim"
    """Engine of a local replica: ``sim`` (simulated) or ``vllm``."""
    config: dict[str, Any] = {}
    """Engine settings: see the tables replicas[].config for
    [engine: sim](#replicasconfig-for-engine-sim) and
    [engine: vllm](#replicasconfig-for-engine-vllm) below."""
    address: str | None = None
    """Attach to a replica already running elsewhere (``host:port``, an
    IPv6 host in brackets as in ``[::1]:7000``, or ``unix:/path``) instead of starting a local process. Unset: a local
    process the router starts (unless ``url`` is set)."""
    secret_env: str | None = None
    """Environment variable holding the replica's shared secret. Unset: an
    empty secret, which only a replica without a secret accepts (a local
    replica is started without one)."""
    gpu: int | None = None
    """GPU index for CUDA_VISIBLE_DEVICES of a local vllm replica. Unset:
    CUDA_VISIBLE_DEVICES as in the router's environment (or ``env``)."""
    start_timeout: float = 180.0
    """Seconds a local replica may take to become ready before it is restarted."""
    env: dict[str, str] = {}
    """Extra environment for the local replica process. A local vllm replica
    without a ``gpu`` whose ``VLLM_CPU_OMP_THREADS_BIND`` is set neither here
    nor in the router's environment gets CPU cores of its own (README,
    "Several vLLM replicas on one CPU host")."""
    url: str | None = None
    """Base URL of an OpenAI-compatible server (``vllm serve``, another
    router, a hosted API) to use as this replica, e.g.
    ``http://10.0.0.7:8000/v1``; see docs/upstreams.md. Excludes ``address``;
    ``config`` may then hold only ``model``. Unset: not an upstream (a local
    process, or ``address``)."""
    api_key_env: str | None = None
    """Environment variable holding the API key sent to the ``url`` upstream
    (``Authorization: Bearer``). Unset: no ``Authorization`` header (nor when
    the variable is empty)."""
    upstream_model: str | None = None
    """Model name sent to the ``url`` upstream. Clients use ``config.model``
    if set, else this name. Unset: the first model the upstream's
    ``/models`` lists."""
    token_ids: Literal["auto", "yes", "no"] = "auto"
    """Whether the ``url`` upstream returns token ids (vLLM's
    ``return_token_ids``), which token-exact failover needs: ``auto`` detects
    it from the first response; ``yes`` counts an answer without them as a
    failure of the upstream (the request moves to another replica); ``no``
    never asks (its streams can then move only before their first token)."""
    max_concurrency: int | None = None
    """Most requests the router runs on this replica at once (caps the
    adaptive in-flight limit; for a ``url`` upstream also its connection pool).
    Unset: only the ``batching`` cap (at most ``batching.max_inflight``), and
    no limit on a ``url`` upstream's connection pool."""

    def __post_init__(self) -> None:
        if self.local and not _NAME.match(self.name):  # (its socket file and run directory are named after it)
            raise ValueError(f"a replica the router starts is named with letters, digits, _ . - (1-64 chars), "
                             f"not {self.name!r}")
        if not self.name.strip() or not self.name.isprintable():
            raise ValueError(f"replica names must be printable and not blank, not {self.name!r}")
        if not self.start_timeout > 0:
            raise ValueError("`start_timeout` must be positive")
        if self.gpu is not None and self.gpu < 0:
            raise ValueError("`gpu` must not be negative")
        if not self.local:
            for key, unset in (("gpu", self.gpu is None), ("env", not self.env)):
                if not unset:
                    raise ValueError(f"`{key}` applies only to a replica the router starts, not to one with "
                                     f"`{'url' if self.url is not None else 'address'}`")
        if self.address is not None:
            error = address_error(self.address)
            if error is not None:
                raise ValueError(error)
        if self.url is not None:
            if self.address is not None:
                raise ValueError("set either `url` or `address`, not both")
            if not self.url.startswith(("http://", "https://")):
                raise ValueError("`url` must start with http:// or https://")
            try:
                host, port = urlsplit(self.url).hostname, urlsplit(self.url).port
            except ValueError as e:
                raise ValueError(f"`url` {self.url!r}: {e}") from None
            if not host:
                raise ValueError(f"`url` {self.url!r} names no host")
            if port == 0:
                raise ValueError(f"`url` {self.url!r}: port must be 1-65535")
            extra = set(self.config) - {"model"}
            if extra:
                raise ValueError(f"a `url` replica's config may only set `model` (got {sorted(extra)})")
        if self.max_concurrency is not None and self.max_concurrency < 1:
            raise ValueError("`max_concurrency` must be at least 1")

    @property
    def local(self) -> bool:
        """True for a replica process the router starts itself."""
        return self.address is None and self.url is None
