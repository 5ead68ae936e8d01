"""What to send: tenants, request classes, lengths and prompt text. Pure and seeded.

Every random choice takes a ``random.Random``; the same scenario and seed give
the same requests in the same order per tenant.
"""

from __future__ import annotations

import math
import random
from dataclasses import dataclass

import msgspec

from ops.loadgen.scenario import Choice, Dist, LogNormal, Normal, Scenario, Uniform

__all__ = ["RequestSpec", "Planner", "sample", "make_prompt", "split_workers", "pick"]

# Short common words: about one BPE token each; varied enough that prompts differ.
_WORDS = (
    "the of and to in is that for it as was with be by on not he this are or his from at which but have an "
    "they you were her she there been one all we their has would when if more no out so said what up its "
    "about into than them can only other new some could time these two may then do first any my now such "
    "like our over man me even most made after also did many before must through back years where much your "
    "way well down should because each just those people how too little state good very make world still "
    "own see men work long get here between both life being under never day same another know while last "
    "might us great old year off come since against go came right used take three river stream router token"
).split()


def pick(weights: dict[str, float], rng: random.Random) -> str:
    names = list(weights)
    return rng.choices(names, weights=[weights[n] for n in names])[0]


def _clip(x: float, lo: int, hi: int | None) -> int:
    v = max(lo, int(round(x)))
    return v if hi is None else min(v, hi)


def sample(d: Dist, rng: random.Random) -> int:
    """One draw of a length distribution (always >= 1)."""
    if isinstance(d, int):
        return d
    if isinstance(d, Uniform):
        return rng.randint(d.min, d.max)
    if isinstance(d, Normal):
        return _clip(rng.gauss(d.mean, d.stddev), d.min, d.max)
    if isinstance(d, LogNormal):
        return _clip(rng.lognormvariate(math.log(d.median), d.sigma), d.min, d.max)
    if isinstance(d, Choice):
        return rng.choices(d.values, weights=d.weights)[0]
    raise TypeError(f"not a distribution: {d!r}")


def make_prompt(tokens: int, chars_per_token: float, rng: random.Random) -> str:
    """Text of about ``tokens`` tokens: random words, ``tokens * chars_per_token`` characters."""
    target = max(1, int(round(tokens * chars_per_token)))
    words: list[str] = []
    n = 0
    while n < target:
        w = rng.choice(_WORDS)
        words.append(w)
        n += len(w) + 1
    return " ".join(words)[:target]


def split_workers(n: int, weights: dict[str, float]) -> dict[str, int]:
    """``n`` workers across tenants by weight (largest remainder); every tenant
    with weight > 0 gets at least one when ``n`` allows."""
    active = {t: w for t, w in weights.items() if w > 0}
    total = sum(active.values())
    exact = {t: n * w / total for t, w in active.items()}
    out = {t: int(x) for t, x in exact.items()}
    for t in sorted(active, key=lambda t: exact[t] - out[t], reverse=True)[: n - sum(out.values())]:
        out[t] += 1
    # Starved tenants take one worker from the largest share.
    for t in active:
        if out[t] == 0 and n >= len(active):
            donor = max(out, key=lambda k: out[k])
            out[donor] -= 1
            out[t] = 1
    return out


@dataclass(frozen=True, slots=True)
class RequestSpec:
    """One request to send."""

    tenant: str
    cls: str
    api_key: str
    path: str
    body: bytes
    stream: bool
    prompt_tokens: int
    max_tokens: int


class Planner:
    """Draws the next request of a tenant (its own seeded rng per tenant)."""

    def __init__(self, scenario: Scenario) -> None:
        self.s = scenario
        self._rngs = {t: random.Random(f"{scenario.seed}:{t}") for t in scenario.tenants}
        self._mix = {t: scenario.class_mix(t) for t in scenario.tenants}
        self._keys = {t: m.key() for t, m in scenario.tenants.items()}
        self.tenant_rng = random.Random(f"{scenario.seed}:tenants")

    def tenant_weights(self) -> dict[str, float]:
        return {t: m.weight for t, m in self.s.tenants.items() if m.weight > 0}

    def next_tenant(self) -> str:
        return pick(self.tenant_weights(), self.tenant_rng)

    def next(self, tenant: str) -> RequestSpec:
        rng = self._rngs[tenant]
        cname = pick(self._mix[tenant], rng)
        c = self.s.classes[cname]
        prompt_tokens = sample(c.prompt_tokens, rng)
        max_tokens = sample(c.max_tokens, rng)
        text = make_prompt(prompt_tokens, self.s.chars_per_token, rng)
        body: dict = {"model": self.s.model, "max_tokens": max_tokens, "stream": c.stream}
        if c.api == "chat":
            body["messages"] = [{"role": "user", "content": text}]
            path = "/v1/chat/completions"
        else:
            body["prompt"] = text
            path = "/v1/completions"
        if c.ignore_eos:
            body["ignore_eos"] = True
        if c.temperature is not None:
            body["temperature"] = c.temperature
        if c.stream and self.s.include_usage:
            body["stream_options"] = {"include_usage": True, "continuous_usage_stats": True}
        return RequestSpec(tenant, cname, self._keys[tenant], path, msgspec.json.encode(body), c.stream,
                           prompt_tokens, max_tokens)
