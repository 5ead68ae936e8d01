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



@pytest.mark.parametrize("notices", [True, False])
async def test_a_freeze_counts_as_noticed_once_the_router_lists_it_not_ready(notices: bool) -> None:
    # (a freeze too short for the router's health check took actions, caused
    # nothing, and the run passed: nothing said that it had tested nothing)
    procs = [subprocess.Popen(["sleep", "30"]) for _ in range(2)]
    try:
        stopped_at: dict[int, float] = {}

        def answer(request: httpx.Request) -> httpx.Response:
            now = asyncio.get_running_loop().time()
            listed = []
            for i, p in enumerate(procs):
                if _state(p.pid) == "T":
                    stopped_at.setdefault(p.pid, now)
                # a router that notices marks a replica stopped 0.5 s not ready
                ready = not (notices and p.pid in stopped_at and now - stopped_at[p.pid] > 0.5)
                listed.append({"name": f"r{i}", "ready": ready, "local": True, "pid": p.pid})
            return httpx.Response(200, json={"replicas": listed})

        admin = httpx.AsyncClient(base_url="http://router", transport=httpx.MockTransport(answer))
        cfg = ChaosConfig("http://127.0.0.1:1", "k", "a", kill_every=0.3, freeze=3.0, mode="freeze")
        rep, stop = ChaosReport(), asyncio.Event()
        task = asyncio.create_task(_chaos(admin, cfg, rep, stop))
        await asyncio.sleep(1.6)
        stop.set()
        await task
        assert rep.freezes == 1, rep.actions  # (one replica left serving)
        assert rep.freezes_seen == (1 if notices else 0)
        assert rep.noticed() == notices
        assert f"{rep.freezes_seen} of 1" in rep.table()
        await admin.aclose()
    finally:
        for p in procs:
            p.kill()
            p.wait()


@pytest.mark.parametrize("tty", [False, True])
def test_the_progress_line_goes_to_a_terminal_only(monkeypatch, capsys, tty: bool) -> None:
    # (its carriage-return updates, one per stream, went into logs and pipes
    # as one line: 12 KB for a 30 s run, ahead of the report)
    import ops.chaos as chaos

    async def fake_run(cfg, progress=None):
        rep = ChaosReport(actions=["kill r0 pid 1"], failovers=1.0)
        for n in range(3):
            rep.started = rep.completed = n
            progress(rep)
        return rep

    monkeypatch.setattr(chaos, "run_chaos", fake_run)
    monkeypatch.setattr(chaos.sys.stderr, "isatty", lambda: tty)
    assert chaos.main(["--duration", "1"]) == 0
    err = capsys.readouterr().err
    assert ("\rstarted 2 completed 2" in err) == tty, err
