"""Chaos with sim replicas: SIGKILL and SIGSTOP replicas under concurrent load.

Uses the ops chaos runner's engine (ops/chaos.py) against a real router with
three sim replicas: every stream completes, equals its uninterrupted greedy
reference, nothing is lost, and the supervisor brings every replica back.
"""

from __future__ import annotations

import pytest

from ops.chaos import ChaosConfig, ChaosError, run_chaos
from tests.helpers import ADMIN, GOLD

# Short health timeouts so a frozen replica is detected within the test's bound.
SETTINGS = {"health_interval": 0.3, "health_timeout": 1.0, "max_failovers": 6}
SIM = {"step_base_ms": 6}


@pytest.mark.parametrize("mode", ["kill", "freeze"])
async def test_streams_survive_replica_chaos(make_router, mode):
    router = make_router(replicas=3, sim=SIM, settings=SETTINGS)
    cfg = ChaosConfig(
        base_url=router.base_url, api_key=GOLD, admin_key=ADMIN, streams=8, duration=6.0,
        max_tokens=150, kill_every=1.5, freeze=1.5, mode=mode, seed=1,
    )
    rep = await run_chaos(cfg)
    assert rep.actions, "the chaos schedule must have acted"
    assert rep.started > 8
    assert rep.errored == 0, rep.errors
    assert rep.completed == rep.started
    assert rep.mismatches == 0
    assert rep.streams_lost == 0
    assert rep.failovers >= 1
    assert rep.restarts >= 1
    # the restarted replicas take traffic again
    before = {r: router.metrics().value("fairstream_replica_up", replica=r) for r in router.replica_names}
    assert all(v == 1 for v in before.values()), before


async def test_chaos_refuses_a_router_with_nothing_to_act_on(make_router):
    router = make_router(replicas=1, sim=SIM)
    cfg = ChaosConfig(base_url=router.base_url, api_key=GOLD, admin_key=ADMIN, streams=1, duration=1.0)
    with pytest.raises(ChaosError, match="at least two local replicas"):
        await run_chaos(cfg)


async def test_a_wrong_key_is_said_as_the_router_says_it(make_router):
    # (KeyError: 'replicas', and an httpx traceback for the tenant key)
    router = make_router(replicas=2, sim=SIM)
    cfg = ChaosConfig(base_url=router.base_url, api_key=GOLD, admin_key="wrong", streams=1, duration=1.0)
    with pytest.raises(ChaosError, match=r"GET /admin/replicas \(--admin-key\): HTTP 401: invalid_api_key: "):
        await run_chaos(cfg)
    cfg = ChaosConfig(base_url=router.base_url, api_key="wrong", admin_key=ADMIN, streams=1, duration=1.0)
    with pytest.raises(ChaosError, match=r"the reference completion .*: HTTP 401: invalid_api_key: "):
        await run_chaos(cfg)
