"""What a resume request costs its tenant: one request of ``requests_per_minute``.

A resume (``GET /v1/streams/{id}``, or a POST with ``X-Resume-Request-Id``)
is a request the router serves: a replay sends the stream's whole buffer
again, a follower polls it, each writes its log line. Free of charge, a
tenant held to a few requests a minute could replay its streams as fast as
its connections allow, on the event loop every tenant's streams share (a
review: a 60/min tenant made 60 replays a second, and another tenant's
longest gap between events went from 17 to 213 ms), and could try stream
ids at that rate too. So a resume takes one request from the tenant's bucket
before anything else, refused or not, as every attempt does at OpenAI. It
takes no tokens and holds no concurrency slot: a tenant at its
``max_concurrent`` still resumes its own streams, and a continuation's
generation is admitted on its own (``count_request=False``). A tenant at its
request limit waits for one request's refill (60 / ``requests_per_minute``
seconds, far less than ``resume_retention``) and gets a 429 with
``Retry-After`` meanwhile; the stream stays resumable.

Cost: none for a tenant without a request limit; else one store admission
without a lease per resume request (Redis: one round trip), nothing per
event. A resume does not wait in an ``on_limit: queue`` tenant's line: it
takes a request if one is there, else it is refused at once.
"""

from __future__ import annotations

from router.errors import RateLimited
from router.service import RouterService
from router.state import AdmitRequest
from router.tenants import TenantPolicy
from router.ticket import fmt_duration, ratelimit_headers

__all__ = ["charge_resume"]


async def charge_resume(svc: RouterService, policy: TenantPolicy) -> None:
    """Take one request of ``policy``'s ``requests_per_minute`` for a resume;
    a 429 (``rate_limit_exceeded``, ``Retry-After``) when there is none."""
    rpm = policy.limits.requests_per_minute
    if not rpm:
        return
    # (no lease: a resume holds no concurrency slot, not even for the round trip)
    req = AdmitRequest(rpm=rpm, tpm=0, max_concurrent=0, cost_tokens=0, lease_id="", lease_ttl=0.0)
    decision = await svc.admission.admit_once(policy.name, req)
    if not decision.ok:
        svc.metrics.limited(policy.name, "requests")
        raise RateLimited(f"Rate limit reached for tenant {policy.name!r} on requests per minute (a resume is a "
                          f"request). Please try again in {fmt_duration(max(decision.retry_after, 0.001))}.",
                          retry_after=decision.retry_after, headers=_request_headers(policy, decision))


def _request_headers(policy: TenantPolicy, decision) -> dict[str, str]:
    """The refusal's ``x-ratelimit-*-requests`` headers only: the admission
    asked with ``tpm=0``, so its token figures (0 remaining, reset 0ms) are
    not the tenant's bucket, which a resume does not touch."""
    return {k: v for k, v in ratelimit_headers(policy, decision).items() if not k.endswith("-tokens")}
