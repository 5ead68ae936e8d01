"""router.yaml: where the router listens and which replicas it serves from."""

from __future__ import annotations

import math
import signal
from pathlib import Path
from typing import ClassVar
from urllib.parse import urlsplit

import msgspec

from replicas.spec import ReplicaSpec
from router.configfile import Located, load_yaml
from router.schema_errors import schema_errors
from router.cors import CorsSettings
from policies.batching import AimdSettings
from router.scheduler_settings import SchedulerSettings
from router.state import StateConfig
from router.state.base import CLAIM_TTL

__all__ = ["RouterConfig", "load_router_config", "SHUTDOWN_MARGIN"]

# After ``shutdown_grace``, seconds for the router's shutdown errors to go out
# before the server cancels what still runs (router.server).
SHUTDOWN_MARGIN = 5.0
# What ``serve --workers`` sends its workers for a second SIGINT: a worker's
# stop, forced, whatever signal it had before (router.server, router.workers).
FORCE_SIGNAL = signal.SIGUSR1


class RouterConfig(msgspec.Struct, forbid_unknown_fields=True, kw_only=True):
    """The whole router.yaml."""

    host: str = "127.0.0.1"
    """Address to listen on."""
    port: int = 8080
    """Port to listen on (0: any free one; the router logs ``listening on http://...``)."""
    tenants: str = "tenants.yaml"
    """Path of the tenant policy file, relative to router.yaml."""
    replicas: list[ReplicaSpec]
    """Replicas to supervise (local) or attach to (``address``)."""
    default_max_tokens: int = 256
    """``max_tokens`` of a chat request that does not set it, lowered by its replica to what the model's context leaves after the prompt (a request that fits is not refused for a limit it did not ask for). A ``/v1/completions`` request that does not set it gets 16, as OpenAI's and vLLM's do (or this, if smaller). The tenant's ``max_tokens`` caps both."""
    max_body_bytes: int = 4 * 1024 * 1024
    """Largest request body accepted (413 above)."""
    max_failovers: int = 3
    """How many times one stream may move to another replica because the one serving it failed. A move off a replica that gave the stream no token (most often one found dead on the way, when several die at once) is not counted, up to one per replica, nor is going straight back to the only ready replica, the one that just failed the stream, and finding it still dead (one death, one failover); every move is in ``fairstream_failovers_total`` and the request's log line."""
    failover_wait: float = 30.0
    """Seconds a stream whose replica failed waits for a replica to become ready when none is (its only replica, or every one, restarting), then continues there token-exact; never past the tenant's time limits. The streams that wait go on only where a ready replica has room under its ``max_concurrency`` (and in-flight cap), in the order they began to wait and before queued requests; one whose wait runs out while a ready replica is full goes there past its cap. 0: it ends at once (`stream_lost`, or a 503 before its first token)."""
    ready_timeout: float = 180.0
    """With ``--workers``: seconds the parent waits for a local replica before starting the workers (it logs an error and starts them anyway). A single router listens at once; wait for ``/ready``."""
    health_interval: float = 1.0
    """Seconds between health pings to each replica."""
    health_timeout: float = 5.0
    """A replica that does not answer a ping within this is restarted (time in which the router's own event loop was blocked does not count: a pong that came meanwhile is read first), as is one whose engine takes no step for this long while it has requests, its first step included (a frozen vLLM engine core behind a front end that still answers)."""
    restart_backoff_max: float = 30.0
    """Longest wait between restarts of a failing replica. A restart that fails because the router itself is out of file descriptors (``EMFILE``, ``ENFILE``: a flood of connections, which passes) is no failure of the replica: it is tried again within ``reconnect_interval``, and the wait does not grow."""
    reconnect_interval: float = 1.0
    """Longest wait between attempts to reach a replica the router does not start (``address:``, ``url:``; with ``--workers``, the parent's replicas) while it cannot be reached (a connect refused, timed out or with no route), and after its connection went away while it was ready, however often before; one that answers with errors, or stalls, keeps the restart backoff. A failed connect costs little, so a replica back from its restart is used again within this, not after the restart backoff (which could outlast ``failover_wait``)."""
    state: StateConfig = msgspec.field(default_factory=StateConfig)
    """Where rate-limit buckets, leases and resume buffers live (memory, or Redis shared by routers)."""
    scheduler: SchedulerSettings = msgspec.field(default_factory=SchedulerSettings)
    """Queue order: priority classes with aging and weighted fair share, or FIFO."""
    resume_retention: float = 300.0
    """Seconds a stream's events stay resumable (Last-Event-ID) after its last event; longer than 10 s (the claim of a router that died, which a resume waits out)."""
    batching: AimdSettings = msgspec.field(default_factory=AimdSettings)
    """Adaptive per-replica in-flight caps."""
    cors: CorsSettings = msgspec.field(default_factory=CorsSettings)
    """Which browser apps on other origins may call the API (off by default)."""
    shutdown_grace: float = 20.0
    """Seconds requests in flight may take to finish after SIGTERM/SIGINT (no new connections meanwhile); then each one still running ends with an explicit error (`router_shutdown`: a 503, or an SSE error event). Keep it at least 10 s below the orchestrator's kill timeout (Kubernetes: 30 s unless set)."""

    send_timeout: float = 60.0
    """Seconds a streaming client may take none of its stream (its connection's buffers full: it stopped reading) before the router closes the connection, as nginx's ``send_timeout`` does. Its lease and request end then, and the stream stays resumable like a disconnected one. 0: wait as long as TCP keeps the connection. Applies to streamed completions, to resumes (``GET /v1/streams/{id}`` and resume POSTs) and the router's other responses, and to WebSocket frames (the socket's requests end and its connection is dropped)."""

    header_timeout: float = 30.0
    """Seconds a connection may take to send a request's head (request line and headers), from its start or the request's first byte: a connection that sends nothing, or trickles its head, gets a 408 and is closed (nginx's ``client_header_timeout``). Heads over 64 KiB are a 431, as are a chunked body's trailers over 64 KiB."""
    body_timeout: float = 60.0
    """Seconds a request's body may go without arriving, after its head or between two reads (408 and closed after; nginx's ``client_body_timeout``)."""
    body_total_timeout: float = 120.0
    """Seconds a request's body may take to arrive whole, from the end of its head, however steadily it trickles in (408 ``body_timeout`` and closed after, as for ``header_timeout``'s head). A body of ``max_body_bytes`` (4 MiB) must arrive at about 35 KB/s or faster; raise it with ``max_body_bytes`` for clients on slower links."""
    ws_idle_timeout: float = 300.0
    """Seconds an authenticated WebSocket may stay open with no request running and no message from its client; then the router closes it (code 1000, reason ``idle``). uvicorn's pings keep a silent socket alive, so without this one client could hold connection slots for good. 0: no limit."""

    max_connections: int = 0
    """Client connections one router process serves at once (each worker, with ``--workers``). One more is answered once its request is read (at most 2 s after it connects; at once if it waits for ``100 Continue``): a 503 in OpenAI's error shape (code ``too_many_connections``, ``Retry-After: 1``), then closed (after a lingering close of up to 2 s); at most 64 such connections are read or lingering at once, and one more past those gets the 503 as it connects, without its request being read, and is closed at once (so they hold at most a quarter of the 256 descriptors kept below); the streams already open go on, and the file descriptors they need for their replicas and upstreams stay free. 0: (the process's open-file limit - 256) / 2, rounded down, and at least 64 (256 descriptors are kept for listeners, replicas, Redis and health checks; half of the rest, since a stream through a ``url:`` upstream holds two), the limit being raised to its hard limit at start (an unlimited one, macOS's default, to 1,048,576 or else 10,240)."""

    metrics_require_admin_key: bool = False
    """When true, ``GET /metrics`` needs an admin key (``Authorization: Bearer KEY``; in Prometheus ``authorization: {credentials_file: FILE}``, a file holding the key). Off, anyone who reaches the port sees every tenant's name and traffic there."""

    # validate() checks every field on its own, and each replica on its own
    # but for duplicate names: a part that fails the schema is set aside and
    # the rest is still checked (router.configfile). Every field: set below.
    separable: ClassVar[frozenset[str]]

    def validate(self, located: Located) -> list[str]:
        errors = []
        if not (0 <= self.port < 65536):  # (0: any free one, as --port 0; the log says which)
            errors.append(located.error(("port",), "must be between 0 and 65535"))
        if not self.replicas:
            errors.append(located.error(("replicas",), "at least one replica is needed"))
        seen: set[str] = set()
        for i, r in enumerate(self.replicas):
            if r.name in seen:
                errors.append(located.error(("replicas", i, "name"), f"duplicate replica name {r.name!r}"))
            seen.add(r.name)
            if r.local:
                errors.extend(_check_engine_config(r, ("replicas", i, "config"), located))
        for at, value in _nonfinite_fields(self, ()):  # NaN passes every range check below; inf is no time
            errors.append(located.error(at, "must be a number, not NaN" if value != value else "must be finite"))
        if self.resume_retention <= CLAIM_TTL:
            errors.append(located.error(("resume_retention",), f"must be longer than {CLAIM_TTL:g} s, the time a "
                                        "router that died holds its streams' claim (a resume waits that out)"))
        for key in ("default_max_tokens", "max_body_bytes"):
            if getattr(self, key) < 1:
                errors.append(located.error((key,), "must be at least 1"))
        if self.max_failovers < 0:
            errors.append(located.error(("max_failovers",), "must not be negative"))
        if self.state.max_connections < 1:
            errors.append(located.error(("state", "max_connections"), "must be at least 1"))
        if self.state.timeout <= 0:  # (every Redis call an outage; NaN is refused as such)
            errors.append(located.error(("state", "timeout"), "must be more than 0"))
        if self.state.connect_timeout < 0:
            errors.append(located.error(("state", "connect_timeout"), "must not be negative"))
        if self.state.backend == "redis":
            error = _redis_url_error(self.state.url)
            if error:
                errors.append(located.error(("state", "url"), error))
        if self.max_connections < 0:
            errors.append(located.error(("max_connections",), "must not be negative (0: from the open-file limit)"))
        if self.failover_wait < 0:
            errors.append(located.error(("failover_wait",), "must not be negative"))
        for key in ("shutdown_grace", "send_timeout", "ws_idle_timeout"):
            if getattr(self, key) < 0:
                errors.append(located.error((key,), "must not be negative"))
        for key in ("header_timeout", "body_timeout", "body_total_timeout", "reconnect_interval", "health_interval",
                    "health_timeout", "restart_backoff_max"):
            if getattr(self, key) <= 0:  # (0: pings in a busy loop, every replica stalled at once, restarts in one)
                errors.append(located.error((key,), "must be positive"))
        if self.ready_timeout < 0:
            errors.append(located.error(("ready_timeout",), "must not be negative"))
        if self.scheduler.aging < 0:
            errors.append(located.error(("scheduler", "aging"), "must not be negative (0: no aging)"))
        if self.cors.max_age < 0:
            errors.append(located.error(("cors", "max_age"), "must not be negative"))
        for i, origin in enumerate(self.cors.allow_origins):
            if not origin.strip():
                errors.append(located.error(("cors", "allow_origins", i), "must not be empty"))
        return errors


RouterConfig.separable = frozenset(RouterConfig.__struct_fields__)


def _nonfinite_fields(value, at: tuple):
    """Where a NaN or an infinity is in a config, and which: every float
    field, in nested settings and lists of them too (YAML's ``.inf`` as a
    time passes every range check, then breaks what it reaches: a Redis TTL,
    a timer)."""
    if isinstance(value, float):
        if not math.isfinite(value):
            yield at, value
    elif isinstance(value, msgspec.Struct):
        for key in value.__struct_fields__:
            yield from _nonfinite_fields(getattr(value, key), at + (key,))
    elif isinstance(value, (list, tuple)):
        for i, item in enumerate(value):
            yield from _nonfinite_fields(item, at + (i,))
    elif isinstance(value, dict):
        for key, item in value.items():
            yield from _nonfinite_fields(item, at + (key,))


def _redis_url_error(url: str) -> str | None:
    """Why ``url`` is not a Redis URL the router can use: one redis-py
    refuses at start, or a database that is not a number (which redis-py
    would take as database 0). None: it is one."""
    from redis.connection import parse_url

    try:
        parsed = parse_url(url)
    except ValueError as e:
        return f"not a Redis URL ({e}): {url!r}"
    path = urlsplit(url).path.strip("/")
    if "path" not in parsed and path and not path.isdigit():
        return f"the database after the host must be a number (redis://host:6379/0): {url!r}"
    return None


def _check_engine_config(spec: ReplicaSpec, at: tuple, located: Located) -> list[str]:
    """A local replica's engine settings, checked now rather than at every restart."""
    if spec.engine == "sim":
        from replicas.sim import SimConfig as schema
    else:
        from replicas.vllm_engine import VllmEngineConfig as schema
    return [located.error(at + where, reason) for where, reason in schema_errors(spec.config, schema)]


def load_router_config(path: str | Path) -> tuple[RouterConfig, Path]:
    """Load router.yaml; return it and the resolved tenants path."""
    cfg, _ = load_yaml(path, RouterConfig)
    return cfg, tenants_path(cfg, path)


def tenants_path(cfg: RouterConfig, path: str | Path) -> Path:
    """The tenants file router.yaml at ``path`` names (relative to its directory)."""
    tenants = Path(cfg.tenants)
    return tenants if tenants.is_absolute() else Path(path).parent / tenants
