"""Tenant policy (configs/tenants.yaml): schema, defaults, effective policy.

The file has a ``defaults`` block and one entry per tenant; a tenant inherits
every field it leaves out from ``defaults``, and ``defaults`` from the
built-in values below (field by field, also inside ``limits`` and
``timeouts``). API keys are stored only as SHA-256 hex digests
(``fairstream hash-key KEY`` prints one). A limit or timeout of 0 means no
limit (not "none allowed"); ``queue_depth: 0`` means no request may wait. docs/configuration.md is generated from the docstrings here and a test
keeps it in sync.
"""

from __future__ import annotations

import math
import re
from typing import ClassVar, Literal

import msgspec

from router.configfile import Located

__all__ = ["Limits", "Timeouts", "TenantSpec", "Defaults", "TenantsFile", "TenantPolicy", "ResolvedLimits"]

MAX_COUNT = 2**53  # largest limit, timeout or count: exact in a double (Redis's Lua scripts count in them)
# A weight's range: the fair-share counters charge (tokens) / weight, which
# must stay a finite number (5e-324 made it infinite), and shares past a
# million to one are no longer a share
MIN_WEIGHT, MAX_WEIGHT = 0.001, 1000.0
_SHA256 = re.compile(r"^[0-9a-f]{64}$")
_NAME = re.compile(r"^[A-Za-z0-9_.-]{1,64}$")


class Limits(msgspec.Struct, forbid_unknown_fields=True, kw_only=True, omit_defaults=True):
    """Rate and size limits. 0 means no limit (not "none allowed"); a missing field is inherited."""

    requests_per_minute: int | None = None
    """Requests admitted per minute (token bucket, refilled continuously). 0: no limit."""
    tokens_per_minute: int | None = None
    """Prompt + completion tokens per minute. Reserved at admission as
    estimated prompt tokens + max_tokens, settled with the real usage at the end;
    a stream's reservation that a router dying mid-stream left unsettled is
    taken over by its resumed continuation (the tenant pays for the stream once). 0: no limit."""
    max_concurrent: int | None = None
    """Streams in flight at once (a lease held until the stream's end, freed before its `[DONE]` goes out).
    0: no limit (not "no streams": to shut a tenant out, remove it or its keys)."""
    max_prompt_tokens: int | None = None
    """Longest prompt accepted, in tokens (checked on the real token count). 0: no limit."""
    max_tokens: int | None = None
    """Largest ``max_tokens`` a request may ask for. 0: no limit."""
    max_sockets: int | None = None
    """WebSockets (``/v1/ws``) of the tenant open at once on one router process; one more is closed at authentication (code 4429, ``too_many_sockets``). 0: no limit."""


class Timeouts(msgspec.Struct, forbid_unknown_fields=True, kw_only=True, omit_defaults=True):
    """Time limits in seconds. 0 means no limit (not "no time"); a missing field is inherited."""

    queue_wait: float | None = None
    """Longest wait for admission (over a limit with ``on_limit: queue``, or for a replica). 0: no limit
    (a request waits until it is admitted, or its ``first_token`` or ``total`` limit passes)."""
    first_token: float | None = None
    """Longest time from the request's arrival (its waits for limits and a replica included) to the first token.
    0: no limit."""
    stall: float | None = None
    """Longest gap between two tokens of a running stream. 0: no limit. The stream then fails over, and the replica it stalled on is out of dispatch (``stalled``: no new request, no failover, for any tenant) until it answers a ping the router sends it at once: one round trip for a replica that is merely slow, while a frozen one stays out until the health timeout restarts it."""
    total: float | None = None
    """Longest time for a whole request. 0: no limit."""


class _PolicyFields(msgspec.Struct, forbid_unknown_fields=True, kw_only=True, omit_defaults=True):
    priority: str | None = None
    """Priority class, one of ``priority_classes`` (first is highest)."""
    weight: float | None = None
    """Fair-share weight inside the priority class, from 0.001 to 1000: tenants that wait in one class get
    service in proportion to their weights."""
    models: list[str] | None = None
    """Models the tenant may use; ``["*"]`` allows all."""
    limits: Limits | None = None
    """See Limits."""
    timeouts: Timeouts | None = None
    """See Timeouts."""
    queue_depth: int | None = None
    """Requests that may wait at once, more get 429: this many in the queue for a replica, and (``on_limit: queue``) this many waiting for the tenant's limits, a separate queue before it. 0: none may wait (unlike the limits, where 0 means no limit)."""
    chunk_tokens: int | None = None
    """Most tokens merged into one SSE event: tokens that arrive together (one read from an upstream that is
    ahead of the router) and tokens waiting for a slow client go out as one event of up to this many; tokens
    that arrive apart go out one by one."""
    on_limit: Literal["reject", "queue"] | None = None
    """Over a rate or concurrency limit: ``reject`` answers 429 at once;
    ``queue`` waits until the request fits, up to ``timeouts.queue_wait`` (or its ``first_token`` or
    ``total``, a 504, when that passes first), first come first served
    (the first in line holds back later ones, even smaller ones; routers sharing Redis take turns)."""
    log_content: bool | None = None
    """Log prompts and completions of this tenant (off by default)."""


class Defaults(_PolicyFields, kw_only=True):
    """Values for every field a tenant leaves out."""


class TenantSpec(_PolicyFields, kw_only=True):
    """One tenant: its keys plus any field of ``defaults`` it overrides."""

    keys: list[str]
    """SHA-256 hex digests of the tenant's API keys (several allow rotation)."""


class TenantsFile(msgspec.Struct, forbid_unknown_fields=True, kw_only=True):
    """The whole tenants.yaml."""

    admin_keys: list[str] = []
    """SHA-256 hex digests of keys that may call /admin endpoints (no inference)."""
    priority_classes: list[str] = msgspec.field(default_factory=lambda: ["high", "normal", "low"])
    """Priority classes, highest first."""
    defaults: Defaults = msgspec.field(default_factory=Defaults)
    """Fields every tenant inherits unless it sets them."""
    tenants: dict[str, TenantSpec]
    """Tenants by name."""

    # validate() checks each tenant and admin key on its own (but for keys
    # used twice), with priority_classes and defaults as their context: a
    # tenant or admin key that fails the schema is set aside and the others
    # are still checked (router.configfile)
    separable: ClassVar[frozenset[str]] = frozenset({"admin_keys", "tenants"})

    def validate(self, located: Located) -> list[str]:
        errors: list[str] = []
        err = lambda at, reason: errors.append(located.error(at, reason))  # noqa: E731
        if not self.priority_classes:
            err(("priority_classes",), "must list at least one class name")
        elif len(set(self.priority_classes)) != len(self.priority_classes):
            err(("priority_classes",), "must list distinct class names")
        owner: dict[str, tuple] = {}

        def check_key(digest: str, at: tuple) -> None:
            if not _SHA256.match(digest):
                err(at, "must be a SHA-256 hex digest (64 lowercase hex chars); use `fairstream hash-key`")
            elif digest in owner:
                err(at, f"duplicate key (also at {located.name(owner[digest])})")
            else:
                owner[digest] = at

        for i, digest in enumerate(self.admin_keys):
            check_key(digest, ("admin_keys", i))
        _check_fields(self.defaults, ("defaults",), self.priority_classes, err)
        if not self.tenants:
            err(("tenants",), "at least one tenant is needed")
        for name, spec in self.tenants.items():
            at = ("tenants", name)
            if not _NAME.match(name):
                err(at, "tenant names use letters, digits, _ . - (1-64 chars)")
            if not spec.keys:
                err(at + ("keys",), "a tenant needs at least one key")
            for i, digest in enumerate(spec.keys):
                check_key(digest, at + ("keys", i))
            _check_fields(spec, at, self.priority_classes, err)
            if spec.priority is None and self.defaults.priority is None and BUILTIN.priority not in self.priority_classes:
                # (the built-in default class, which these classes do not have)
                err(at, f"sets no priority, and neither does `defaults`: the built-in {BUILTIN.priority!r} is not "
                        f"one of priority_classes ({', '.join(self.priority_classes)})")
        return errors

    def policies(self) -> dict[str, TenantPolicy]:
        return {name: _resolve(name, spec, self.defaults, self.priority_classes) for name, spec in self.tenants.items()}


def _check_fields(spec: _PolicyFields, at: tuple, classes: list[str], err) -> None:
    if spec.priority is not None and spec.priority not in classes:
        err(at + ("priority",), f"unknown priority class {spec.priority!r} (known: {', '.join(classes)})")
    w = spec.weight
    if w is not None and not MIN_WEIGHT <= w <= MAX_WEIGHT:
        span = f"(weights go from {MIN_WEIGHT:g} to {MAX_WEIGHT:g}: a tenant's share is proportional to its weight)"
        if math.isnan(w):
            err(at + ("weight",), f"must be a number {span}")
        elif w <= 0:
            err(at + ("weight",), f"must be greater than 0 {span}")
        elif w < MIN_WEIGHT:
            err(at + ("weight",), f"must be at least {MIN_WEIGHT:g} {span}")
        else:  # (an infinite weight was never charged in the fair-share counters)
            err(at + ("weight",), f"must be {'finite, ' if w == math.inf else ''}at most {MAX_WEIGHT:g} {span}")
    if spec.queue_depth is not None and spec.queue_depth < 0:
        err(at + ("queue_depth",), "must not be negative")
    if spec.chunk_tokens is not None and spec.chunk_tokens < 1:
        err(at + ("chunk_tokens",), "must be at least 1")
    for field in ("queue_depth", "chunk_tokens"):
        if (getattr(spec, field) or 0) > MAX_COUNT:
            err(at + (field,), f"must be at most {MAX_COUNT}")
    if spec.models is not None and not spec.models:
        err(at + ("models",), 'must list at least one model (use ["*"] for all)')
    for group in ("limits", "timeouts"):
        value = getattr(spec, group)
        if value is None:
            continue
        for field in value.__struct_fields__:
            v = getattr(value, field)
            if v is not None and not v >= 0:  # (NaN too: every comparison with it is false)
                err(at + (group, field), "must not be negative (0 means no limit)" if v < 0 else "must be a number")
            elif v is not None and v > MAX_COUNT:  # (.inf too; limits are counted in Redis's doubles)
                err(at + (group, field), f"must be at most {MAX_COUNT} (0 means no limit)")


class ResolvedLimits(msgspec.Struct, frozen=True, kw_only=True):
    """A tenant's effective limits and timeouts (every field resolved)."""

    requests_per_minute: int
    tokens_per_minute: int
    max_concurrent: int
    max_prompt_tokens: int
    max_tokens: int
    max_sockets: int
    queue_wait: float
    first_token: float
    stall: float
    total: float


class TenantPolicy(msgspec.Struct, frozen=True, kw_only=True):
    """A tenant's effective policy (what /admin/tenants shows)."""

    name: str
    priority: str
    rank: int
    """Index of ``priority`` in the file's ``priority_classes`` (0 = highest),
    fixed with this snapshot: a reload that renames the classes does not
    touch a request that holds the old policy (the scheduler orders a
    queued request by its tenant's policy in force: ``Scheduler.follow``)."""
    weight: float
    models: list[str]
    queue_depth: int
    chunk_tokens: int
    on_limit: str
    log_content: bool
    limits: ResolvedLimits

    def allows_model(self, model: str) -> bool:
        return "*" in self.models or model in self.models


BUILTIN = Defaults(
    priority="normal",
    weight=1.0,
    models=["*"],
    limits=Limits(
        requests_per_minute=0, tokens_per_minute=0, max_concurrent=0, max_prompt_tokens=0, max_tokens=0,
        max_sockets=0,
    ),
    timeouts=Timeouts(queue_wait=30.0, first_token=120.0, stall=60.0, total=900.0),
    queue_depth=64,
    chunk_tokens=16,
    on_limit="reject",
    log_content=False,
)


def _pick(field: str, *layers):
    for layer in layers:
        if layer is not None:
            v = getattr(layer, field)
            if v is not None:
                return v
    raise AssertionError(f"no value for {field}")


def _resolve(name: str, spec: TenantSpec, defaults: Defaults, classes: list[str]) -> TenantPolicy:
    layers = (spec, defaults, BUILTIN)
    lim = tuple(x.limits for x in layers)
    tmo = tuple(x.timeouts for x in layers)
    priority = _pick("priority", *layers)
    return TenantPolicy(
        name=name,
        priority=priority,
        rank=classes.index(priority),
        weight=float(_pick("weight", *layers)),
        models=list(_pick("models", *layers)),
        queue_depth=_pick("queue_depth", *layers),
        chunk_tokens=_pick("chunk_tokens", *layers),
        on_limit=_pick("on_limit", *layers),
        log_content=_pick("log_content", *layers),
        limits=ResolvedLimits(
            requests_per_minute=_pick("requests_per_minute", *lim),
            tokens_per_minute=_pick("tokens_per_minute", *lim),
            max_concurrent=_pick("max_concurrent", *lim),
            max_prompt_tokens=_pick("max_prompt_tokens", *lim),
            max_tokens=_pick("max_tokens", *lim),
            max_sockets=_pick("max_sockets", *lim),
            queue_wait=float(_pick("queue_wait", *tmo)),
            first_token=float(_pick("first_token", *tmo)),
            stall=float(_pick("stall", *tmo)),
            total=float(_pick("total", *tmo)),
        ),
    )
