"""Chaos with sim replicas: SIGKILL and SIGSTOP replicas under concurrent load.

Uses the ops chaos runner's engine (ops/chaos.py) against a real router with
three sim replicas: every stream completes, equals its uninterrupted greedy
reference, nothing is lost, and the supervisor brings every replica back.
"""

from __future__ import annotations

import httpx
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
    if mode == "freeze":
        assert rep.freezes_seen >= 1, rep.table()
    assert rep.noticed()
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


async def test_the_counts_come_from_metrics_an_admin_key_opens(make_router):
    # metrics_require_admin_key: /metrics refuses the tenant key; the report
    # said "failovers 0, streams lost 0" (the refusal's JSON parsed as no
    # samples) and passed, whatever the router had counted
    router = make_router(replicas=2, sim=SIM, settings={**SETTINGS, "metrics_require_admin_key": True})
    cfg = ChaosConfig(
        base_url=router.base_url, api_key=GOLD, admin_key=ADMIN, streams=6, duration=4.0,
        max_tokens=150, kill_every=1.0, mode="kill", seed=1,
    )
    rep = await run_chaos(cfg)
    assert rep.actions
    assert rep.failovers >= 1, rep.table()
    async with httpx.AsyncClient(headers={"Authorization": f"Bearer {ADMIN}"}) as admin:
        counted = await router.ametrics(admin)
    assert rep.failovers == sum(counted.value("fairstream_failovers_total", replica=r) for r in router.replica_names)


async def test_an_unreadable_metrics_endpoint_is_said(make_router):
    # a /metrics the admin key cannot read either (here: a tenant key given as
    # the admin key would be refused earlier, so the run's tenant key is used
    # for a router whose /metrics needs the admin key): counts it cannot read
    # are an error, never zeros
    from ops import chaos

    router = make_router(replicas=2, sim=SIM, settings={"metrics_require_admin_key": True})
    async with httpx.AsyncClient(base_url=router.base_url, headers={"Authorization": f"Bearer {GOLD}"}) as c:
        with pytest.raises(ChaosError, match=r"GET /metrics .*HTTP 403"):
            await chaos._metrics(c)


def _stopped(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] == "T"
    except FileNotFoundError:
        return False


def test_sigterm_thaws_what_it_froze(make_router):
    # `timeout 60 python ops/chaos.py ...` ends it with SIGTERM: the replica it
    # had frozen stayed SIGSTOPped until the router's health check killed it
    import os
    import signal
    import subprocess
    import sys
    import time

    from tests.helpers import ROOT

    router = make_router(replicas=2, sim=SIM)
    pids = set(router.replica_pids().values())
    proc = subprocess.Popen(
        [sys.executable, str(ROOT / "ops" / "chaos.py"), "--base-url", router.base_url, "--duration", "30",
         "--mode", "freeze", "--kill-every", "0.5", "--freeze", "30", "--streams", "2", "--max-tokens", "50"],
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        deadline = time.monotonic() + 20
        while not any(_stopped(p) for p in pids):
            assert time.monotonic() < deadline, "no replica was frozen"
            time.sleep(0.05)
        proc.send_signal(signal.SIGTERM)
        proc.wait(timeout=15)
        assert not [p for p in pids if _stopped(p)], "a replica is still SIGSTOPped after chaos ended"
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        for p in pids:
            try:
                os.kill(p, signal.SIGCONT)
            except ProcessLookupError:
                pass


async def test_the_sdk_base_url_and_a_url_without_scheme(make_router):
    # `--base-url http://127.0.0.1:8080/v1` (the SDK's base URL, which the load
    # generator accepts) was a 404 blamed on --admin-key; `127.0.0.1:8080` was
    # refused as "non-loopback" with exit 1, the code of a failed run
    router = make_router(replicas=1, sim=SIM)
    cfg = ChaosConfig(base_url=router.base_url + "/v1/", api_key=GOLD, admin_key=ADMIN, streams=1, duration=1.0)
    with pytest.raises(ChaosError, match="at least two local replicas"):
        await run_chaos(cfg)
    bare = router.base_url.split("://", 1)[1]
    cfg = ChaosConfig(base_url=bare, api_key=GOLD, admin_key=ADMIN, streams=1, duration=1.0)
    with pytest.raises(ChaosError, match=r"http:// or https://"):
        await run_chaos(cfg)
    cfg = ChaosConfig(base_url="http://10.1.2.3:8080", api_key=GOLD, admin_key=ADMIN, streams=1, duration=1.0)
    with pytest.raises(ChaosError, match="non-loopback"):
        await run_chaos(cfg)


async def test_a_replica_that_does_not_come_back_fails_the_run(make_router):
    # the run passed (exit 0, "replica restarts 7": failed attempts) while a
    # replica it killed could not restart and stayed down
    import os
    import shutil

    router = make_router(replicas=2, sim=SIM, settings={"restart_backoff_max": 0.5})
    rundir = next(router.tmpdir.glob("fairstream-*"))
    # (the replicas running keep their connections; a restarted one cannot bind its socket)
    os.rename(rundir, str(rundir) + ".moved")
    rundir.write_text("")
    try:
        cfg = ChaosConfig(base_url=router.base_url, api_key=GOLD, admin_key=ADMIN, streams=2, duration=2.5,
                          max_tokens=50, kill_every=1.0, mode="kill", seed=1, recover=2.0)
        rep = await run_chaos(cfg)
        assert rep.actions
        assert rep.not_back, rep.table()
        assert "replicas not back" in rep.table()
    finally:
        rundir.unlink()
        shutil.move(str(rundir) + ".moved", rundir)


def test_a_freeze_too_short_for_the_router_to_notice_fails_the_run(make_router):
    # `--freeze 0.3` against the default health settings (a replica is not
    # ready after health_interval + health_timeout, 6 s): it froze replicas,
    # nothing failed over, and it exited 0 as if the router had passed
    import re
    import subprocess
    import sys

    from tests.helpers import ROOT

    router = make_router(replicas=2, sim=SIM)
    done = subprocess.run(
        [sys.executable, str(ROOT / "ops" / "chaos.py"), "--base-url", router.base_url, "--duration", "3",
         "--mode", "freeze", "--kill-every", "0.8", "--freeze", "0.3", "--streams", "2", "--max-tokens", "50"],
        capture_output=True, text=True, timeout=60)
    assert done.returncode == 1, done.stdout + done.stderr
    assert "freeze" in done.stdout  # (it acted)
    assert "nothing was tested" in done.stderr
    assert re.search(r"\| freezes the router noticed \(replica not ready\) +\| 0 of [1-9]", done.stdout), done.stdout


def test_the_recovery_wait_is_an_option() -> None:
    # it was 30 s, fixed: a vLLM replica's restart takes 45-110 s, so a run
    # against vLLM replicas whose streams all completed exact exited 1 with
    # "replicas not back"
    from ops.chaos import config_from_args

    assert config_from_args([]).recover == 30.0
    cfg = config_from_args(["--recover-wait", "150", "--freeze", "50", "--mode", "kill"])
    assert (cfg.recover, cfg.freeze, cfg.mode) == (150.0, 50.0, "kill")
    with pytest.raises(SystemExit):
        config_from_args(["--recover-wait", "0"])


def test_a_replica_not_back_is_named_with_the_wait_to_raise(capsys) -> None:
    from ops.chaos import ChaosReport, verdict

    rep = ChaosReport(started=3, completed=3, failovers=1, actions=["kill sim-0 pid 1"], not_back=["vllm-1"])
    assert verdict(rep, 30.0) == 1
    err = capsys.readouterr().err
    assert "vllm-1 not ready 30 s after the run" in err and "--recover-wait" in err, err
