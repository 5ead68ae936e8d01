"""A resume's 429 (router/resume_charge.py) tells the tenant's token limit as it is."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from router.admission import Admission
from router.errors import RateLimited
from router.resume_charge import charge_resume
from router.state.memory import MemoryStore
from router.tenants import ResolvedLimits, TenantPolicy


def _policy() -> TenantPolicy:
    lim = ResolvedLimits(requests_per_minute=1, tokens_per_minute=1000, max_concurrent=0, max_prompt_tokens=0,
                         max_tokens=0, max_sockets=0, queue_wait=0, first_token=0, stall=0, total=0)
    return TenantPolicy(name="a", priority="normal", rank=1, weight=1.0, models=[], queue_depth=10, chunk_tokens=0,
                        on_limit="reject", log_content=False, limits=lim)


async def test_a_resume_refused_for_requests_does_not_say_the_tokens_are_gone() -> None:
    metrics = SimpleNamespace(limited=lambda *a: None)
    svc = SimpleNamespace(admission=Admission(MemoryStore(), metrics), metrics=metrics)
    pol = _policy()
    await charge_resume(svc, pol)  # type: ignore[arg-type]
    with pytest.raises(RateLimited) as e:
        await charge_resume(svc, pol)  # type: ignore[arg-type]
    h = e.value.headers
    assert h["x-ratelimit-remaining-requests"] == "0"
    # the token bucket is full (a resume takes no tokens): a 0 here sends the client waiting for tokens
    assert h.get("x-ratelimit-remaining-tokens", "1000") == "1000", h
    assert h.get("x-ratelimit-reset-tokens", "0ms") == "0ms", h
