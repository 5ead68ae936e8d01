"""Load-generator scenarios: a strict YAML schema (msgspec), one docstring per field.

A scenario says how long to run (``duration_s`` and/or ``max_requests``; at
least one is required and a run is always bounded in time), how to drive the
router (``concurrency``: N closed-loop workers, or ``rate``: Poisson arrivals
per second), which tenants send (API key and weight) and which request
classes they send (prompt and output length distributions, streaming, chat
or completions). Unknown keys and bad values fail with ``file:line: key:
reason`` (the router's own config loader does the locating).

Lengths are drawn from a distribution written as a plain integer (fixed) or
a mapping tagged by ``dist``::

    prompt_tokens: 128                                   # fixed
    prompt_tokens: {dist: uniform, min: 64, max: 512}    # inclusive
    prompt_tokens: {dist: normal, mean: 200, stddev: 50, min: 8, max: 1000}
    prompt_tokens: {dist: lognormal, median: 200, sigma: 0.7, min: 8, max: 2000}
    max_tokens: {dist: choice, values: [32, 128, 512], weights: [3, 2, 1]}
"""

from __future__ import annotations

import math
import os
from pathlib import Path
from typing import Literal

import msgspec

from router.configfile import ConfigError, Located, load_yaml

__all__ = [
    "Scenario",
    "RequestClass",
    "TenantMix",
    "Dist",
    "Uniform",
    "Normal",
    "LogNormal",
    "Choice",
    "ConfigError",
    "load_scenario",
    "MAX_DURATION_S",
]

MAX_DURATION_S = 3600.0
"""No run sends for longer than this; a scenario with only ``max_requests`` stops here too."""


class Uniform(msgspec.Struct, forbid_unknown_fields=True, tag_field="dist", tag="uniform"):
    """Uniform integer in ``[min, max]``."""

    min: int
    max: int


class Normal(msgspec.Struct, forbid_unknown_fields=True, tag_field="dist", tag="normal", kw_only=True):
    """Normal, rounded and clipped to ``[min, max]``."""

    mean: float
    stddev: float
    min: int = 1
    max: int | None = None


class LogNormal(msgspec.Struct, forbid_unknown_fields=True, tag_field="dist", tag="lognormal", kw_only=True):
    """Log-normal with the given median and sigma (of the log), rounded and clipped."""

    median: float
    sigma: float
    min: int = 1
    max: int | None = None


class Choice(msgspec.Struct, forbid_unknown_fields=True, tag_field="dist", tag="choice", kw_only=True):
    """One of ``values``, with optional relative ``weights``."""

    values: list[int]
    weights: list[float] | None = None


Dist = int | Uniform | Normal | LogNormal | Choice


def _not_finite(values) -> bool:
    return any(v is not None and not math.isfinite(v) for v in values)


def _dist_errors(d: Dist, at: tuple, located: Located) -> list[str]:
    err = lambda reason: located.error(at, reason)  # noqa: E731
    if isinstance(d, (Normal, LogNormal)) and _not_finite(
            (d.mean, d.stddev) if isinstance(d, Normal) else (d.median, d.sigma)):
        return [err("needs finite numbers (not .nan or .inf)")]
    if isinstance(d, Choice) and _not_finite(d.weights or ()):
        return [err("weights must be finite numbers (not .nan or .inf)")]
    if isinstance(d, int):
        return [] if d >= 1 else [err("must be at least 1")]
    if isinstance(d, Uniform):
        if d.min < 1 or d.max < d.min:
            return [err("needs 1 <= min <= max")]
    elif isinstance(d, (Normal, LogNormal)):
        spread = d.stddev if isinstance(d, Normal) else d.sigma
        center = d.mean if isinstance(d, Normal) else d.median
        if spread < 0 or center <= 0:
            return [err("needs a positive center and a non-negative spread")]
        if d.min < 1 or (d.max is not None and d.max < d.min):
            return [err("needs 1 <= min <= max")]
    elif isinstance(d, Choice):
        if not d.values or any(v < 1 for v in d.values):
            return [err("values must be a non-empty list of integers >= 1")]
        if d.weights is not None and (len(d.weights) != len(d.values) or any(w < 0 for w in d.weights)
                                      or sum(d.weights) <= 0):
            return [err("weights must match values, be >= 0 and not all 0")]
    return []


class RequestClass(msgspec.Struct, forbid_unknown_fields=True, kw_only=True):
    """One kind of request: its shape and how often a tenant picks it."""

    weight: float = 1.0
    """Relative frequency among the classes a tenant uses (unless the tenant sets its own)."""
    api: Literal["chat", "completions"] = "chat"
    """``/v1/chat/completions`` (one user message) or ``/v1/completions`` (a text prompt)."""
    stream: bool = True
    """SSE streaming; TTFT and inter-token latency are only measured on streams."""
    prompt_tokens: Dist = 64
    """Prompt length in tokens (approximate: text of ``chars_per_token`` characters per token)."""
    max_tokens: Dist = 128
    """``max_tokens`` of the request."""
    ignore_eos: bool = True
    """Keep generating to ``max_tokens`` (vLLM extension), so output length is what was asked."""
    temperature: float | None = None
    """Sampling temperature; unset leaves the server default."""


class TenantMix(msgspec.Struct, forbid_unknown_fields=True, kw_only=True):
    """One tenant of the mix. Its name (the mapping key) labels results; use the
    router's tenant name so charts line up with the router's metrics."""

    api_key: str | None = None
    """API key sent as ``Authorization: Bearer``."""
    api_key_env: str | None = None
    """Name of an environment variable holding the key (instead of ``api_key``)."""
    weight: float = 1.0
    """Share of the load: of the workers (``concurrency``) or of the arrivals (``rate``)."""
    classes: dict[str, float] | None = None
    """Request classes this tenant sends, by name, with relative weights; default: every class at its own weight."""

    def key(self) -> str:
        if self.api_key is not None:
            return self.api_key
        return os.environ.get(self.api_key_env or "", "")


class Scenario(msgspec.Struct, forbid_unknown_fields=True, kw_only=True):
    """A whole scenario file."""

    name: str = "scenario"
    """Shown in the progress bar and written into the results."""
    description: str = ""
    """Free text."""
    model: str
    """Model name sent in every request."""
    duration_s: float | None = None
    """Seconds to send requests for (at most 3600). At least one of ``duration_s`` and ``max_requests``."""
    max_requests: int | None = None
    """Requests to send at most (every tenant together)."""
    drain_timeout_s: float = 30.0
    """After sending stops, wait this long for open requests, then cancel them (counted as ``cancelled``)."""
    request_timeout_s: float = 120.0
    """One request's whole time limit (counted as ``timeout``)."""
    mode: Literal["concurrency", "rate"]
    """``concurrency``: closed-loop workers, each sends its next request when the last ended.
    ``rate``: open loop, Poisson arrivals at ``rate`` per second."""
    concurrency: int | None = None
    """Workers in ``concurrency`` mode, split across tenants by weight (each tenant gets at least one)."""
    rate: float | None = None
    """Mean arrivals per second in ``rate`` mode."""
    max_inflight: int = 1024
    """``rate`` mode: arrivals while this many requests are open are not sent (counted as ``client_overload``)."""
    error_pause_s: float = 0.25
    """``concurrency`` mode: a worker waits this long after a failed request before its next one."""
    seed: int = 0
    """Seed of every random choice (tenant, class, lengths, prompt text, arrival times)."""
    chars_per_token: float = 4.0
    """Prompt characters per token (about 4 for BPE tokenizers on English; 1 for the sim's byte tokenizer)."""
    include_usage: bool = True
    """Ask for ``stream_options.include_usage`` (exact token counts) and ``continuous_usage_stats``
    (per-event token counts, where the server supports it)."""
    scrape_interval_s: float = 1.0
    """Seconds between scrapes of the router's ``/metrics`` during the run (0: don't scrape)."""
    classes: dict[str, RequestClass]
    """Request classes by name."""
    tenants: dict[str, TenantMix]
    """Tenants by name."""

    def validate(self, located: Located) -> list[str]:
        errors: list[str] = []
        e = lambda at, reason: errors.append(located.error(at, reason))  # noqa: E731
        # (.nan passes every comparison below and .inf most of them: a NaN
        # weight silently sent nothing, an infinite chars_per_token killed
        # every worker and the run reported 0 requests)
        finite = "must be a finite number (not .nan or .inf)"
        for key in ("duration_s", "drain_timeout_s", "request_timeout_s", "rate", "error_pause_s",
                    "chars_per_token", "scrape_interval_s"):
            if _not_finite((getattr(self, key),)):
                e((key,), finite)
        for name, c in self.classes.items():
            for key in ("weight", "temperature"):
                if _not_finite((getattr(c, key),)):
                    e(("classes", name, key), finite)
        for name, t in self.tenants.items():
            if _not_finite((t.weight,)):
                e(("tenants", name, "weight"), finite)
            for cname, w in (t.classes or {}).items():
                if _not_finite((w,)):
                    e(("tenants", name, "classes", cname), finite)
        if errors:
            return errors
        if self.duration_s is None and self.max_requests is None:
            e(("duration_s",), "set duration_s and/or max_requests: a run must be bounded")
        if self.duration_s is not None and not (0 < self.duration_s <= MAX_DURATION_S):
            e(("duration_s",), f"must be in (0, {MAX_DURATION_S:g}]")
        if self.max_requests is not None and self.max_requests < 1:
            e(("max_requests",), "must be at least 1")
        for key in ("drain_timeout_s", "request_timeout_s"):
            if getattr(self, key) <= 0:
                e((key,), "must be positive")
        if self.error_pause_s < 0 or self.scrape_interval_s < 0:
            e(("error_pause_s" if self.error_pause_s < 0 else "scrape_interval_s",), "must not be negative")
        if self.chars_per_token <= 0:
            e(("chars_per_token",), "must be positive")
        if self.mode == "concurrency":
            if self.concurrency is None or self.concurrency < 1:
                e(("concurrency",), "mode concurrency needs concurrency >= 1")
            if self.rate is not None:
                e(("rate",), "only for mode rate")
        else:
            if self.rate is None or self.rate <= 0:
                e(("rate",), "mode rate needs rate > 0")
            if self.concurrency is not None:
                e(("concurrency",), "only for mode concurrency")
            if self.max_inflight < 1:
                e(("max_inflight",), "must be at least 1")
        if not self.classes:
            e(("classes",), "at least one request class is needed")
        for name, c in self.classes.items():
            if c.weight < 0:
                e(("classes", name, "weight"), "must not be negative")
            errors.extend(_dist_errors(c.prompt_tokens, ("classes", name, "prompt_tokens"), located))
            errors.extend(_dist_errors(c.max_tokens, ("classes", name, "max_tokens"), located))
        if not self.tenants:
            e(("tenants",), "at least one tenant is needed")
        if self.tenants and all(t.weight <= 0 for t in self.tenants.values()):
            e(("tenants",), "at least one tenant needs weight > 0")
        for name, t in self.tenants.items():
            if t.weight < 0:
                e(("tenants", name, "weight"), "must not be negative")
            if (t.api_key is None) == (t.api_key_env is None):
                e(("tenants", name), "set exactly one of api_key and api_key_env")
            elif t.api_key_env is not None and not os.environ.get(t.api_key_env):
                e(("tenants", name, "api_key_env"), f"environment variable {t.api_key_env} is not set")
            mix = t.classes if t.classes is not None else {c: self.classes[c].weight for c in self.classes}
            for cname, w in (t.classes or {}).items():
                if cname not in self.classes:
                    e(("tenants", name, "classes", cname), "no such request class")
                elif w < 0:
                    e(("tenants", name, "classes", cname), "must not be negative")
            if t.weight > 0 and not any(w > 0 for w in mix.values()):
                e(("tenants", name, "classes"), "no request class with weight > 0")
        return errors

    def time_limit(self) -> float:
        """Seconds to keep sending: ``duration_s``, or the hard cap when only a count is set."""
        return self.duration_s if self.duration_s is not None else MAX_DURATION_S

    def class_mix(self, tenant: str) -> dict[str, float]:
        t = self.tenants[tenant]
        if t.classes is not None:
            return {c: w for c, w in t.classes.items() if w > 0}
        return {c: rc.weight for c, rc in self.classes.items() if rc.weight > 0}


def load_scenario(path: str | Path) -> Scenario:
    """Load and check a scenario file; ``ConfigError`` lists ``file:line: key: reason``."""
    scenario, _ = load_yaml(path, Scenario)
    return scenario
