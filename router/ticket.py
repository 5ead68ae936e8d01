"""An admitted request (``Ticket``) and the ``x-ratelimit-*`` headers of a decision."""

from __future__ import annotations

import math

import msgspec

from policies.ratelimit import Decision
from router.tenants import TenantPolicy

__all__ = ["Ticket", "ratelimit_headers", "fmt_duration"]


def fmt_duration(seconds: float) -> str:
    """OpenAI's reset format: ``20ms``, ``1.5s``, ``6m0s``; rounded up, so a
    client that waits exactly that long is not refused for the rest."""
    if seconds <= 0.999:
        return f"{max(0, math.ceil(seconds * 1000 - 1e-6))}ms"  # (- 1e-6: 0.29 * 1000 is 290.00000000000006)
    if seconds < 10:
        return f"{math.ceil(seconds * 100 - 1e-6) / 100:g}s"
    if seconds < 60:
        return f"{math.ceil(seconds * 10 - 1e-6) / 10:g}s"
    m, s = divmod(math.ceil(seconds - 1e-6), 60)
    return f"{m}m{s}s"


def ratelimit_headers(policy: TenantPolicy, d: Decision) -> dict[str, str]:
    """``x-ratelimit-*`` headers for limits the tenant has."""
    lim = policy.limits
    h: dict[str, str] = {}
    if lim.requests_per_minute:
        h["x-ratelimit-limit-requests"] = str(lim.requests_per_minute)
        h["x-ratelimit-remaining-requests"] = str(max(0, math.floor(d.remaining_requests)))
        h["x-ratelimit-reset-requests"] = fmt_duration(d.reset_requests)
    if lim.tokens_per_minute:
        h["x-ratelimit-limit-tokens"] = str(lim.tokens_per_minute)
        h["x-ratelimit-remaining-tokens"] = str(max(0, math.floor(d.remaining_tokens)))
        h["x-ratelimit-reset-tokens"] = fmt_duration(d.reset_tokens)
    return h


class Ticket:
    """An admitted request: its lease and its token reservation."""

    __slots__ = ("lease_id", "reserved", "inherited", "held", "done", "used", "tenant", "tpm", "_policy",
                 "_decision")

    def __init__(self, policy: TenantPolicy, lease_id: str, reserved: int, decision: Decision,
                 inherited: int = 0, held: bool = False) -> None:
        self.lease_id = lease_id
        self.held = held  # (admitted with a hold: AdmitRequest.hold)
        self.reserved = reserved
        # a continuation that took over its stream's earlier generators'
        # reservations (``Decision.taken``): the tokens they used, which it
        # settles for (``reserved`` holds theirs)
        self.inherited = inherited
        self.done = False
        self.used: int | None = None  # the tokens it was settled for, once it is (router.admission finish)
        self._policy = policy  # as admitted (a reload makes new policy objects)
        self._decision = decision
        # (the policy is frozen: read once here, not through a property at
        # each of the ~5 reads of a request's settlement)
        self.tenant: str = policy.name
        self.tpm: int = policy.limits.tokens_per_minute

    @property
    def headers(self) -> dict[str, str]:
        """The ``x-ratelimit-*`` headers as of admission (built when asked:
        a long stream does not hold them); once the request is settled (one
        refused after admission, such as a 400 ``prompt_too_long``), with its
        reservation given back as ``policies.ratelimit.settle`` gives it:
        they showed tokens taken that the tenant had back."""
        d = self._decision
        tpm = self.tpm
        if self.used is not None and tpm:
            remaining = min(float(tpm), d.remaining_tokens + self.reserved - self.used)
            d = msgspec.structs.replace(d, remaining_tokens=remaining,
                                        reset_tokens=max(0.0, (tpm - remaining) * 60.0 / tpm))
        return ratelimit_headers(self._policy, d)
