"""ops/chaos.py's schedule and its errors, against stand-in processes and a
stand-in admin endpoint (the router's side is tests/chaos/test_chaos_sim.py)."""

from __future__ import annotations

import asyncio
import subprocess

import httpx
import pytest

from ops.chaos import ChaosConfig, ChaosReport, _chaos


def _state(pid: int) -> str:
    with open(f"/proc/{pid}/stat") as f:
        return f.read().rsplit(")", 1)[1].split()[0]


async def test_a_freeze_does_not_hold_up_the_next_action_and_everything_frozen_is_thawed() -> None:
    # (it slept through each freeze: the default mixed run of 20 s acted 2-3
    # times instead of about 6, and a Ctrl-C left a replica SIGSTOPped)
    procs = [subprocess.Popen(["sleep", "30"]) for _ in range(5)]
    try:
        listed = [{"name": f"r{i}", "ready": True, "local": True, "pid": p.pid} for i, p in enumerate(procs)]
        admin = httpx.AsyncClient(base_url="http://router", transport=httpx.MockTransport(
            lambda request: httpx.Response(200, json={"replicas": listed})))
        cfg = ChaosConfig("http://127.0.0.1:1", "k", "a", kill_every=0.2, freeze=5.0, mode="freeze")
        rep, stop = ChaosReport(), asyncio.Event()
        task = asyncio.create_task(_chaos(admin, cfg, rep, stop))
        await asyncio.sleep(1.1)
        assert len(rep.actions) == 4, rep.actions  # (every 0.2 s, one replica left serving; it was 1)
        assert sum(_state(p.pid) == "T" for p in procs) == 4
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        assert not any(_state(p.pid) == "T" for p in procs)  # thawed at once, not 5 s later
        await admin.aclose()
    finally:
        for p in procs:
            p.kill()
            p.wait()
