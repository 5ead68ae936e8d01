"""Waiting for a tenant's rate limit (``on_limit: queue``) with the real
``Admission`` on a ``MemoryStore``: a request whose limit frees at its
``queue_wait`` deadline is admitted, not refused a moment before."""

from __future__ import annotations

import asyncio

import pytest

from router.admission import DEADLINE_SLACK, Admission
from router.errors import RateLimited
from router.metrics import Metrics
from router.state.memory import MemoryStore
from router.tenants import ResolvedLimits, TenantPolicy

RPM = 60  # a bucket of 60 requests, one more each second


def _policy(queue_wait: float) -> TenantPolicy:
    return TenantPolicy(
        name="t", priority="normal", weight=1.0, models=["*"], queue_depth=10, chunk_tokens=16,
        on_limit="queue", log_content=False,
        limits=ResolvedLimits(requests_per_minute=RPM, tokens_per_minute=0, max_concurrent=0, max_prompt_tokens=0,
                              max_tokens=0, queue_wait=queue_wait, first_token=0.0, stall=0.0, total=0.0),
    )


async def _drained(policy: TenantPolicy) -> Admission:
    adm = Admission(MemoryStore(), Metrics())
    for _ in range(RPM):
        await adm.admit(policy, 1)
    return adm


async def test_a_limit_that_frees_right_at_the_deadline_admits() -> None:
    policy = _policy(1.0 - DEADLINE_SLACK / 2)  # the next request is due just after the deadline
    adm = await _drained(policy)
    ticket = await asyncio.wait_for(adm.admit(policy, 1), 3)
    assert ticket is not None


async def test_a_limit_that_frees_well_after_the_deadline_refuses_with_a_usable_hint() -> None:
    policy = _policy(0.5)
    adm = await _drained(policy)
    loop = asyncio.get_running_loop()
    t = loop.time()
    with pytest.raises(RateLimited) as refused:
        await adm.admit(policy, 1)
    assert 0.45 <= loop.time() - t <= 0.5 + DEADLINE_SLACK + 0.1
    assert "Please try again in 0ms" not in refused.value.message
    assert refused.value.headers["retry-after"] == "1"
