"""Supervisor life cycle against an in-process sim replica (no child processes)."""

from __future__ import annotations

import asyncio
import logging
import signal
import os
import shutil
import tempfile
import types

import pytest

from replicas.pool import ReplicaPool, ReplicaSlot
from replicas.server import ReplicaServer
from replicas.spec import ReplicaSpec
from replicas.supervisor import Supervisor, SupervisorSettings
from tests.helpers import MODEL, alive, apoll


@pytest.fixture
async def replica_address():
    run_dir = tempfile.mkdtemp(prefix="fst-")  # short: Unix socket paths are limited
    path = f"{run_dir}/r.sock"
    server = ReplicaServer("sim", {"model": MODEL, "step_base_ms": 1})
    await server.start(socket_path=path)
    try:
        yield "unix:" + path
    finally:
        await server.close()
        shutil.rmtree(run_dir, ignore_errors=True)


async def _force_stop(sup: Supervisor) -> None:
    for t in sup._tasks:
        while not t.done():
            t.cancel()
            await asyncio.wait({t}, timeout=0.5)


async def test_attaches_to_a_remote_replica_and_closes(replica_address: str) -> None:
    pool = ReplicaPool([ReplicaSpec(name="r0", address=replica_address)])
    sup = Supervisor(pool, SupervisorSettings(health_interval=0.01))
    await sup.start()
    try:
        await apoll(lambda: pool.slots[0].ready, 5, what="replica ready")
        assert pool.models() == [MODEL]
        await asyncio.wait_for(sup.close(), 5)
        assert all(t.done() for t in sup._tasks) or not sup._tasks
        # no local replica, no run directory (a killed --workers worker left an empty one in /tmp)
        assert sup._run_dir is None
    finally:
        await _force_stop(sup)


async def test_close_is_not_lost_when_a_pong_races_it(replica_address: str) -> None:
    """Deterministic replay of a shutdown hang seen with real routers under load:
    ``close()`` is called in the loop iteration where a pong completes a ping."""
    pool = ReplicaPool([ReplicaSpec(name="r0", address=replica_address)])
    sup = Supervisor(pool, SupervisorSettings(health_interval=0.01))
    await sup.start()
    closer: list[asyncio.Future[None]] = []

    class RacingPings(dict):
        def get(self, seq, default=None):
            fut = super().get(seq, default)
            if fut is not None and not closer:
                closer.append(asyncio.ensure_future(sup.close()))
            return fut

    try:
        await apoll(lambda: pool.slots[0].ready, 5, what="replica ready")
        client = pool.slots[0].client
        client._pings = RacingPings(client._pings)
        await apoll(lambda: closer, 5, what="a pong")
        done, _ = await asyncio.wait({closer[0]}, timeout=1.5)  # it takes milliseconds
        assert done, "Supervisor.close() did not return: the health loop survived its cancellation"
    finally:
        await _force_stop(sup)
        if closer:
            await asyncio.wait({closer[0]}, timeout=3)


def test_an_engine_with_requests_that_takes_no_step_is_stuck() -> None:
    from replicas.protocol import LoadReport
    from replicas.health import Progress

    p = Progress(5.0)
    assert not p.stuck(LoadReport(0, 0, 0.0, steps=0), 0.0)  # a fresh engine
    assert not p.stuck(LoadReport(1, 0, 0.0, steps=3), 1.0)
    assert not p.stuck(LoadReport(1, 2, 0.0, steps=9), 2.0)  # stepping
    assert not p.stuck(LoadReport(1, 2, 0.0, steps=9), 6.9)
    assert p.stuck(LoadReport(1, 2, 0.0, steps=9), 7.1)  # 5 s with requests and no step
    assert not p.stuck(LoadReport(0, 0, 0.0, steps=9), 20.0)  # idle: nothing to step
    assert not p.stuck(LoadReport(1, 0, 0.0, steps=9), 24.0)  # (busy again: the clock restarts)
    assert p.stuck(LoadReport(1, 0, 0.0, steps=9), 25.1)
    # an engine that reports no steps (an OpenAI-compatible upstream) is never stuck
    q = Progress(5.0)
    assert not any(q.stuck(LoadReport(3, 1, 0.0), t) for t in (0.0, 10.0, 100.0))


def test_an_engine_that_never_took_its_first_step_is_stuck_too() -> None:
    # an engine core frozen before it ever stepped (or hung on its first
    # batch) while requests wait in it; before, steps == 0 meant "this engine
    # counts no steps" and it stayed ready for good
    from replicas.protocol import LoadReport
    from replicas.health import Progress

    p = Progress(5.0)
    fresh = dict(steps=0, reports_steps=True)
    assert not p.stuck(LoadReport(0, 0, 0.0, **fresh), 0.0)  # idle: nothing to step
    assert not p.stuck(LoadReport(0, 2, 0.0, **fresh), 1.0)  # requests came: the clock runs from the last idle check
    assert not p.stuck(LoadReport(0, 2, 0.0, **fresh), 4.9)
    assert p.stuck(LoadReport(0, 2, 0.0, **fresh), 5.1)
    r = Progress(5.0)  # a connection's first report: its clock starts there, whatever the time
    assert not r.stuck(LoadReport(0, 1, 0.0, **fresh), 1000.0)
    assert not r.stuck(LoadReport(0, 1, 0.0, **fresh), 1004.9)
    assert r.stuck(LoadReport(0, 1, 0.0, **fresh), 1005.1)
    q = Progress(5.0)  # the same engine, stepping
    assert not q.stuck(LoadReport(0, 2, 0.0, **fresh), 0.0)
    assert not q.stuck(LoadReport(2, 0, 0.0, steps=1, reports_steps=True), 4.0)
    assert not q.stuck(LoadReport(2, 0, 0.0, steps=40, reports_steps=True), 8.0)


async def test_the_sim_engine_counts_its_steps() -> None:
    from replicas.sim import SimConfig, SimEngine

    assert SimEngine(SimConfig(), lambda *a: None).load().reports_steps


async def test_close_during_a_restart_stop_leaves_no_process_running(monkeypatch) -> None:
    import replicas.supervisor
    monkeypatch.setattr(replicas.supervisor, "STOP_GRACE", 1.0)
    pool = ReplicaPool([ReplicaSpec(name="r0", address="unix:/nonexistent")])
    sup = Supervisor(pool, SupervisorSettings(health_interval=0.01))
    # (the process left _procs before it was stopped: a close() meanwhile left it running)
    # a replica process that is slow to stop on SIGTERM (e.g. vLLM shutting its engine down)
    proc = await asyncio.create_subprocess_exec(
        "sh", "-c", "trap '' TERM; sleep 30", start_new_session=True)

    async def run_once(slot):
        sup._procs[slot.name] = proc
        await asyncio.sleep(0.1)
        raise RuntimeError("process exited with code 1")  # any failure: _supervise stops it, with the grace

    sup._run_once = run_once
    try:
        await sup.start()
        await asyncio.sleep(0.5)  # _supervise now waits in _stop_process (SIGTERM sent, up to STOP_GRACE)
        await asyncio.wait_for(sup.close(), 15)
        await asyncio.sleep(0.2)
        assert proc.returncode is not None, "the replica's process is still running after Supervisor.close()"
    finally:
        if proc.returncode is None:
            os.killpg(proc.pid, signal.SIGKILL)
            await proc.wait()


def _fake_replica(monkeypatch, script: str) -> None:
    """The supervisor's replica processes run ``sh -c script`` instead (with the env it gives them)."""
    spawn = asyncio.create_subprocess_exec

    async def fake_exec(*cmd, env, **kw):
        return await spawn("sh", "-c", script, env=env, start_new_session=True)

    monkeypatch.setattr(asyncio, "create_subprocess_exec", fake_exec)
    monkeypatch.delenv("VLLM_RPC_BASE_PATH", raising=False)


async def test_each_vllm_process_gets_an_ipc_dir_removed_when_it_stops(monkeypatch) -> None:
    # vLLM's engine binds uuid-named ZMQ sockets in VLLM_RPC_BASE_PATH and
    # removes none when killed: each process of a local vllm replica gets a
    # directory of its own in the run dir, removed when it stops or restarts
    # and when the supervisor closes (a run dir given in the settings stays).
    # (the process: a shell that leaves a file there as a killed engine would)
    _fake_replica(monkeypatch, '[ -d "$VLLM_RPC_BASE_PATH" ] && touch "$VLLM_RPC_BASE_PATH/0166a38b"; exec sleep 30')
    run_dir = tempfile.mkdtemp(prefix="fst-")
    pool = ReplicaPool([ReplicaSpec(name="v0", engine="vllm", config={"model": "m"}),
                        ReplicaSpec(name="v1", engine="vllm", config={"model": "m"},
                                    env={"VLLM_RPC_BASE_PATH": "/nonexistent/ipc"}),
                        ReplicaSpec(name="s0", engine="sim", config={"model": "m"})])
    sup = Supervisor(pool, SupervisorSettings(run_dir=run_dir))
    try:
        ipc = []
        for _ in range(2):  # (started again: its first directory goes)
            await sup._spawn(pool.slots[0])
            ipc.append(sup._ipc["v0"])
            assert os.path.dirname(ipc[-1]) == run_dir
            await apoll(lambda: os.listdir(ipc[-1]) == ["0166a38b"], 5, what="the process's file in its dir")
            await sup._reap("v0", 0.0)
            assert not os.path.exists(ipc[-1])
        assert ipc[0] != ipc[1]
        for slot in pool.slots:
            await sup._spawn(slot)
        assert list(sup._ipc) == ["v0"]  # (v1's env chose its own; a sim replica has no engine sockets)
        v0 = sup._ipc["v0"]
        await sup.close()
        assert not os.path.exists(v0) and os.listdir(run_dir) == []
    finally:
        await sup.close()
        shutil.rmtree(run_dir, ignore_errors=True)


async def test_a_vllm_process_s_ipc_dir_goes_only_once_its_whole_process_group_is_stopped(
        monkeypatch, tmp_path) -> None:
    # An engine still stopping within the grace holds its sockets in the
    # directory (and may still use them): the directory goes after the stop,
    # not before. The engine's children outlive a replica process that
    # exits: the group's last SIGKILL ends them, before the directory goes.
    # (the process: a shell that, when stopped, notes whether its directory
    # is still there, with a child that ignores SIGTERM, as an engine's may)
    seen, child = tmp_path / "seen", tmp_path / "child"
    script = (f"(trap '' TERM; exec sleep 30) & echo $! > {child}; "
              f"trap '[ -d \"$VLLM_RPC_BASE_PATH\" ] && echo there > {seen} || echo gone > {seen}; exit 0' TERM; "
              "while :; do sleep 0.05; done")
    _fake_replica(monkeypatch, script)
    run_dir = tempfile.mkdtemp(prefix="fst-")
    pool = ReplicaPool([ReplicaSpec(name="v0", engine="vllm", config={"model": "m"})])
    sup = Supervisor(pool, SupervisorSettings(run_dir=run_dir))
    pid = None
    try:
        proc, _ = await sup._spawn(pool.slots[0])
        ipc = sup._ipc["v0"]
        await apoll(lambda: child.exists() and child.read_text().strip(), 5, what="the child's pid")
        pid = int(child.read_text())
        await asyncio.wait_for(sup._reap("v0", 5.0), 10)
        assert proc.returncode == 0  # (it stopped on SIGTERM, within the grace)
        assert seen.read_text().strip() == "there", "its IPC directory was removed before its process stopped"
        await apoll(lambda: not alive(pid), 2, what="the replica's child that ignored SIGTERM killed")
        assert not os.path.exists(ipc)
    finally:
        await sup.close()
        if pid is not None and alive(pid):
            os.kill(pid, signal.SIGKILL)
        shutil.rmtree(run_dir, ignore_errors=True)


async def test_a_clean_stop_signals_the_replica_process_first_and_its_group_only_after_it_exits(
        monkeypatch, tmp_path) -> None:
    # vLLM's front end stops its engine core, which stops its workers: a
    # SIGTERM to the whole group at once killed the worker under the engine
    # core, which logged ERROR tracebacks ("Worker proc VllmWorker-0 died
    # unexpectedly", EngineDeadError) at every clean router stop. The replica
    # process gets the SIGTERM alone and stops its child itself; what it
    # leaves behind gets the group's SIGTERM once it exited.
    # (the process: a shell with a child it stops when stopped, and one it leaves)
    log = tmp_path / "log"
    kids = tmp_path / "kids"
    child = "trap 'echo {0} >> {1}; exit 0' TERM; while :; do sleep 0.05; done"
    script = (f"( {child.format('child-term', log)} ) & c=$!; ( {child.format('left-term', log)} ) & l=$!; "
              f"echo $c $l > {kids}; "
              f"trap 'echo main-term >> {log}; sleep 0.3; echo main-stops-child >> {log}; kill -TERM $c; wait $c; "
              f"echo main-exit >> {log}; exit 0' TERM; "
              "while :; do sleep 0.05; done")
    _fake_replica(monkeypatch, script)
    pool = ReplicaPool([ReplicaSpec(name="s0", engine="sim", config={"model": "m"})])
    sup = Supervisor(pool, SupervisorSettings(run_dir=str(tmp_path)))
    pids: list[int] = []
    try:
        proc, _ = await sup._spawn(pool.slots[0])
        await apoll(lambda: kids.exists() and len(kids.read_text().split()) == 2, 5, what="the children's pids")
        pids = [int(x) for x in kids.read_text().split()]
        await asyncio.sleep(0.2)  # (the traps set)
        await asyncio.wait_for(sup._reap("s0", 5.0), 10)
        assert proc.returncode == 0
        assert log.read_text().split() == ["main-term", "main-stops-child", "child-term", "main-exit", "left-term"]
        assert not any(alive(p) for p in pids)
    finally:
        await sup.close()
        for p in pids:
            if alive(p):
                os.kill(p, signal.SIGKILL)


async def test_the_ipc_dir_of_a_vllm_process_that_never_started_is_removed(monkeypatch) -> None:
    # The directory is made before the process: one whose process was never
    # created (the router closed meanwhile, or creating it failed) is removed
    # all the same, at close() or at the next spawn.
    creating = asyncio.Event()

    async def no_process(*cmd, **kw):
        creating.set()
        if fail:
            raise OSError(11, "Resource temporarily unavailable")
        await asyncio.Event().wait()  # (still being created when the router closes)

    monkeypatch.setattr(asyncio, "create_subprocess_exec", no_process)
    monkeypatch.delenv("VLLM_RPC_BASE_PATH", raising=False)
    run_dir = tempfile.mkdtemp(prefix="fst-")
    pool = ReplicaPool([ReplicaSpec(name="v0", engine="vllm", config={"model": "m"})])
    try:
        fail = False  # close() while its process is being created
        sup = Supervisor(pool, SupervisorSettings(run_dir=run_dir))
        await sup.start()
        await asyncio.wait_for(creating.wait(), 5)
        assert [n for n in os.listdir(run_dir) if n.startswith("ipc-")]
        await asyncio.wait_for(sup.close(), 5)
        assert os.listdir(run_dir) == []

        fail = True  # a spawn that failed, then the next one
        sup = Supervisor(pool, SupervisorSettings(run_dir=run_dir))
        for _ in range(2):
            with pytest.raises(OSError):
                await sup._spawn(pool.slots[0])
            assert [n for n in os.listdir(run_dir) if n.startswith("ipc-")] == [os.path.basename(sup._ipc["v0"])]
        await sup.close()
        assert os.listdir(run_dir) == []
    finally:
        shutil.rmtree(run_dir, ignore_errors=True)


class _Upstream:
    """An upstream client as the supervisor's watch sees it: pings that
    answer, or fail as ``UpstreamClient.ping`` does (``closed`` set)."""

    model = MODEL

    def __init__(self) -> None:
        from replicas.protocol import LoadReport

        self.closed: BaseException | None = None
        self.refused = False
        self.credentials_refused: str | None = None
        self.refusals = 0
        self.check_now = asyncio.Event()
        self.pings = 0
        self.during = None
        self.fail = False
        self.load = LoadReport(0, 0, 0.0)

    async def ping(self, timeout: float):
        from replicas.client import ReplicaDead
        from replicas.protocol import Pong

        self.pings += 1
        if self.during is not None:  # (something that happens while the check is under way)
            during, self.during = self.during, None
            during()
        if self.fail:
            self.closed = ReplicaDead("failed its health check")
            raise self.closed
        return Pong(self.pings, self.load)


async def test_a_refused_upstream_is_checked_at_once_then_chosen_again_or_taken_down() -> None:
    # replicas/upstream.py: a refused connect sets ``refused`` (not chosen)
    # and ``check_now``; the watch pings at once instead of after
    # health_interval: an answer makes it ready again and wakes the streams
    # waiting for a replica, a failure takes it down
    # (events: what sets fairstream_replica_up, 0 while refused)
    pool = ReplicaPool([ReplicaSpec(name="up", url="http://127.0.0.1:9/v1")])
    events: list[tuple[str, bool]] = []
    sup = Supervisor(pool, SupervisorSettings(health_interval=30.0),
                     on_event=lambda event, slot: events.append((event, slot.ready)))
    slot = pool.slots[0]
    client = _Upstream()
    slot.client, slot.state = client, "ready"  # type: ignore[assignment]
    woken: list[int] = []
    watch = asyncio.create_task(sup._watch(slot, client, None))  # type: ignore[arg-type]
    try:
        await apoll(lambda: client.pings == 1, 2, what="the first ping")
        pool.when_ready(lambda: woken.append(1))
        client.refused, client.refusals = True, 1
        client.check_now.set()
        assert not slot.ready  # not chosen meanwhile
        await apoll(lambda: client.pings == 2, 2, what="a ping at once, not after health_interval (30 s)")
        await apoll(lambda: slot.ready, 2, what="the upstream chosen again")
        assert woken == [1] and not client.refused
        assert events == [("refused", False), ("answers", True)]

        def refused_again() -> None:  # a second refusal while the check runs: that check does not clear it
            client.refusals += 1
            client.check_now.set()

        client.refused, client.refusals, client.during = True, client.refusals + 1, refused_again
        client.check_now.set()
        await apoll(lambda: client.pings == 4, 2, what="a second check at once")
        await apoll(lambda: slot.ready, 2, what="the upstream chosen again after the second check")
        assert woken == [1]  # (nobody waited this time)

        client.fail = True
        client.refused = True
        client.check_now.set()
        with pytest.raises(RuntimeError, match="failed its health check"):
            await asyncio.wait_for(watch, 2)  # (down: _supervise restarts it)
        assert not slot.ready
    finally:
        watch.cancel()


async def _models_server(seen: list[tuple[object, str | None]]):
    """An upstream that answers ``/v1/models`` (each request's peer and
    ``Connection`` header into ``seen``): its runner and base URL."""
    from aiohttp import web

    async def models(request: web.Request) -> web.Response:
        seen.append((request.transport.get_extra_info("peername"), request.headers.get("Connection")))
        return web.json_response({"object": "list", "data": [{"id": MODEL, "object": "model"}]})

    app = web.Application()
    app.router.add_get("/v1/models", models)
    runner = web.AppRunner(app)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    port = site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]
    return runner, f"http://127.0.0.1:{port}/v1"


async def test_the_check_after_a_refused_connect_goes_on_a_new_connection() -> None:
    # the control session keeps its connection alive: a check on it would
    # not show whether the upstream (or a proxy before it) takes new ones
    from replicas.upstream_open import open_upstream

    seen: list[tuple[object, str | None]] = []
    runner, url = await _models_server(seen)
    client = await open_upstream("up", ReplicaSpec(name="up", url=url))
    try:
        await client.ping(5)
        await client.ping(5)
        client.refused = True
        await client.ping(5)
    finally:
        await client.close()
        await runner.cleanup()
    (_, *kept), refused = seen[:-1], seen[-1]
    assert len({peer for peer, _ in kept}) == 1  # the session's kept-alive connection
    assert refused[0] not in {peer for peer, _ in seen[:-1]} and refused[1] == "close", seen


async def test_a_remote_replica_that_cannot_be_reached_is_tried_every_reconnect_interval(caplog) -> None:
    # The restart backoff (0.25, 0.5, 1, 2 s ...) is for processes that
    # crash; a replica this router does not start is connected to again at
    # least every reconnect_interval, so one back from its restart is used
    # at once (streams waiting for a replica have failover_wait, 30 s)
    run_dir = tempfile.mkdtemp(prefix="fst-")
    path = f"{run_dir}/r.sock"
    pool = ReplicaPool([ReplicaSpec(name="remote", address="unix:" + path)])
    downs: list[float] = []
    loop = asyncio.get_running_loop()
    sup = Supervisor(pool, SupervisorSettings(health_interval=0.05, backoff_initial=0.25, reconnect_interval=0.3),
                     on_event=lambda event, slot: downs.append(loop.time()) if event == "down" else None)
    server = ReplicaServer("sim", {"model": MODEL, "step_base_ms": 1})
    caplog.set_level("INFO", logger="fairstream.supervisor")
    await sup.start()
    try:
        await asyncio.sleep(2.0)  # nothing there: attempts fail
        assert len(downs) >= 6, downs  # (with the backoff: 4)
        await server.start(socket_path=path)
        back = loop.time()
        await apoll(lambda: pool.slots[0].ready, 3, what="the replica connected once it is back")
        assert loop.time() - back < 0.9  # (with the backoff: 1.75 s)
        warnings = [r for r in caplog.records if "cannot be reached" in r.getMessage()]
        assert len(warnings) == 1, [r.getMessage() for r in warnings]  # one, not one per attempt
        assert f"replica remote at unix:{path} cannot be reached: " in warnings[0].getMessage()  # (where)
        assert pool.slots[0].reconnects == 0  # (failed connects are not reconnects after a loss)

        # it restarts at once: the failed connects before did not count as
        # failures, so the backoff starts again from backoff_initial
        await server.close()
        server = ReplicaServer("sim", {"model": MODEL, "step_base_ms": 1})
        await server.start(socket_path=path)
        back = loop.time()
        await apoll(lambda: not pool.slots[0].ready, 3, what="the lost connection noticed")
        await apoll(lambda: pool.slots[0].ready, 3, what="the replica connected again")
        assert loop.time() - back < 1.2  # (with the failed connects counted: 0.25 x 2^8 s, capped at 30)
    finally:
        await sup.close()
        await server.close()
        shutil.rmtree(run_dir, ignore_errors=True)


async def test_a_remote_replica_that_dies_again_and_again_is_used_again_within_reconnect_interval() -> None:
    # (a url: upstream that died while ready took the restart backoff, which
    # grows with every death within healthy_after: after a few crashes it
    # stayed unused up to 30 s after its return, and streams waiting for it
    # ran out of failover_wait)
    run_dir = tempfile.mkdtemp(prefix="fst-")
    path = f"{run_dir}/r.sock"
    pool = ReplicaPool([ReplicaSpec(name="remote", address="unix:" + path)])
    sup = Supervisor(pool, SupervisorSettings(health_interval=0.05, backoff_initial=0.25, reconnect_interval=0.3))
    server = ReplicaServer("sim", {"model": MODEL, "step_base_ms": 1})
    await server.start(socket_path=path)
    loop = asyncio.get_running_loop()
    await sup.start()
    try:
        await apoll(lambda: pool.slots[0].ready, 5, what="the replica connected")
        for death in range(4):
            await server.close()
            await apoll(lambda: not pool.slots[0].ready, 3, what="its death noticed")
            server = ReplicaServer("sim", {"model": MODEL, "step_base_ms": 1})
            await server.start(socket_path=path)
            back = loop.time()
            await apoll(lambda: pool.slots[0].ready, 5, what="the replica connected again")
            # (with the backoff: 0.25, 0.5, 1, 2 s after each death)
            assert loop.time() - back < 0.9, (death, loop.time() - back)
        assert pool.slots[0].last_error  # (why it went: kept for /admin/replicas)
    finally:
        await sup.close()
        await server.close()
        shutil.rmtree(run_dir, ignore_errors=True)


async def test_only_a_lost_connection_is_a_disconnect_an_error_answer_or_a_stall_keeps_the_backoff() -> None:
    # (the quick reconnect of a replica lost while ready is for a connection
    # that went away; an upstream answering /models with 503, or a replica
    # that stalls, would otherwise be back in the pool every second)
    from types import SimpleNamespace

    from replicas.client import ReplicaDead
    from replicas.pool import ReplicaSlot
    from replicas.supervisor import _Disconnected
    from replicas.upstream_errors import UpstreamFailed

    sup = Supervisor(ReplicaPool([]), SupervisorSettings())
    slot = ReplicaSlot(ReplicaSpec(name="up", url="http://127.0.0.1:9/v1"))
    answered = ReplicaDead("upstream up failed its health check: GET /models: HTTP 503")
    answered.__cause__ = UpstreamFailed("GET /models: HTTP 503")
    with pytest.raises(RuntimeError) as e:
        await sup._watch(slot, SimpleNamespace(closed=answered, refused=False), None)  # type: ignore[arg-type]
    assert not isinstance(e.value, _Disconnected)
    refused = ReplicaDead("upstream up failed its health check: connect refused")
    refused.__cause__ = ConnectionRefusedError(111, "refused")
    for closed in (ReplicaDead("replica up closed the connection"), refused):
        with pytest.raises(_Disconnected):
            await sup._watch(slot, SimpleNamespace(closed=closed, refused=False), None)  # type: ignore[arg-type]


async def test_a_ping_on_a_connection_that_already_closed_fails_at_once(replica_address: str) -> None:
    # (its pong could never come: the reader that would take it has ended;
    # the ping waited for the health timeout instead)
    from replicas.client import ReplicaDead, connect

    client = await connect("r0", replica_address, timeout=5)
    try:
        client._reader.feed_eof()  # (what the replica closing its end delivers)
        await apoll(lambda: client.closed is not None, 5, what="the connection closed")
        with pytest.raises(ReplicaDead):
            await asyncio.wait_for(client.ping(None), 1)
    finally:
        await client.close()


async def test_a_connection_that_closes_as_its_health_check_pings_is_a_disconnect_not_a_stall(
        replica_address: str) -> None:
    """Deterministic replay of a CI failure under CPU load: the replica's EOF
    and the health check's next turn came in one loop iteration, the check
    saw the connection open, the reader then ended, and the ping it had
    started waited health_timeout for a pong that could not come: a stall,
    the restart backoff, the replica unused for 5 s after its return."""
    from replicas.client import connect
    from replicas.supervisor import _Disconnected

    pool = ReplicaPool([ReplicaSpec(name="r0", address=replica_address)])
    sup = Supervisor(pool, SupervisorSettings(health_timeout=2.0))
    client = await connect("r0", replica_address, timeout=5)
    try:
        await client.ping(5)  # (its reader waits for the next frame)
        watch = asyncio.ensure_future(sup._watch(pool.slots[0], client, None))
        # (its EOF wakes the reader after the check's turn, before the ping's)
        client._reader.feed_eof()
        with pytest.raises(_Disconnected):
            await asyncio.wait_for(watch, 1.0)  # (at once, not after the health timeout)
    finally:
        await client.close()


@pytest.mark.parametrize("seen", [None, RuntimeError("unable to perform operation: the handler is closed")])
async def test_a_ping_that_fails_in_any_way_once_its_connection_closed_is_a_disconnect(seen) -> None:
    # (a lost connection is told by the connection, not by whichever error
    # its last ping happened to see: a timeout there took the backoff)
    from replicas.client import ReplicaDead
    from replicas.pool import ReplicaSlot
    from replicas.supervisor import _Disconnected

    class ClosedDuringThePing:
        closed = None
        refused = False
        credentials_refused = None

        async def ping(self, timeout):
            self.closed = ReplicaDead("replica r0 closed the connection")
            if seen is not None:
                raise seen
            await asyncio.Event().wait()  # (no pong comes)

    sup = Supervisor(ReplicaPool([]), SupervisorSettings(health_timeout=0.3))
    slot = ReplicaSlot(ReplicaSpec(name="r0", address="unix:/nonexistent"))
    with pytest.raises(_Disconnected):
        await asyncio.wait_for(sup._watch(slot, ClosedDuringThePing(), None), 3)  # type: ignore[arg-type]


def test_only_a_connect_that_did_not_get_through_counts_as_unreachable() -> None:
    # (an upstream answering 503 or 429 on /models, or a bad handshake,
    # keeps the restart backoff: it is there, and polling it every second
    # would only add load)
    import aiohttp
    import msgspec

    from replicas.client import ReplicaDead, ReplicaRefused
    from replicas.connect_errors import not_reached as _unreachable

    connector_error = aiohttp.ClientConnectorError.__new__(aiohttp.ClientConnectorError)  # (what a url: connect raises)
    for e in (ConnectionRefusedError(111, "refused"), FileNotFoundError(2, "no socket"), TimeoutError(),
              connector_error, ConnectionResetError("closed the connection during the handshake")):
        assert _unreachable(e), e
    import ssl

    cert_error = aiohttp.ClientConnectorCertificateError.__new__(aiohttp.ClientConnectorCertificateError)
    for e in (ReplicaDead("upstream up: GET /models: HTTP 503"), ReplicaRefused("bad secret"),
              msgspec.DecodeError("not JSON"), RuntimeError("process exited"),
              ssl.SSLCertVerificationError("certificate verify failed"), cert_error):
        assert not _unreachable(e), e


async def test_an_upstream_that_closes_before_answering_counts_as_unreachable() -> None:
    # (a tunnel or TCP proxy whose upstream is down takes the connection,
    # reads the request and closes: retried every reconnect_interval, as a
    # refused connect is)
    from replicas.connect_errors import not_reached as _unreachable
    from replicas.upstream_open import open_upstream

    async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await reader.read(4096)
        writer.close()

    server = await asyncio.start_server(handle, "127.0.0.1", 0)
    port = server.sockets[0].getsockname()[1]
    try:
        with pytest.raises(ConnectionResetError) as caught:
            await open_upstream("up", ReplicaSpec(name="up", url=f"http://127.0.0.1:{port}/v1"), timeout=5)
        assert _unreachable(caught.value)
    finally:
        server.close()
        await server.wait_closed()


def _pong_during_a_stall(wait) -> object:
    """A replica (a thread) answers 50 ms after the ping; the router's event
    loop is blocked for 0.6 s from just after the ping, so the answer is in
    the socket when the loop runs again. ``wait(future, 0.3)`` awaits it."""
    import socket
    import threading
    import time

    async def main():
        loop = asyncio.get_running_loop()
        router_end, replica_end = socket.socketpair()
        pong = loop.create_future()

        def readable() -> None:
            loop.remove_reader(router_end)
            pong.set_result(router_end.recv(16))

        loop.add_reader(router_end, readable)
        threading.Timer(0.05, replica_end.send, (b"pong",)).start()
        loop.call_soon(time.sleep, 0.6)  # (the router's own stall)
        try:
            return await wait(pong, 0.3)
        finally:
            router_end.close()
            replica_end.close()

    return main


@pytest.mark.parametrize("loop_factory", ["asyncio", "uvloop"])
def test_a_stall_of_the_router_itself_does_not_count_against_a_ping(loop_factory) -> None:
    import uvloop

    from replicas.health import answered_within

    factory = uvloop.new_event_loop if loop_factory == "uvloop" else asyncio.new_event_loop

    async def plain_timeout(fut, timeout):
        async with asyncio.timeout(timeout):
            return await fut

    # (the premise: a plain timeout blames the replica for the router's stall)
    with asyncio.Runner(loop_factory=factory) as runner, pytest.raises(TimeoutError):
        runner.run(_pong_during_a_stall(plain_timeout)())
    with asyncio.Runner(loop_factory=factory) as runner:
        assert runner.run(_pong_during_a_stall(answered_within)()) == b"pong"


def test_a_ping_that_is_not_answered_times_out_after_the_health_timeout() -> None:
    from replicas.health import answered_within

    async def main():
        loop = asyncio.get_running_loop()
        never = loop.create_future()
        started = loop.time()
        with pytest.raises(TimeoutError):
            await answered_within(never, 0.35)
        assert 0.35 <= loop.time() - started < 1.0
        assert never.cancelled()  # (the ping is not left waiting)

    asyncio.run(main())



def test_a_ping_under_way_when_the_supervisor_stops_is_not_reported_as_never_retrieved() -> None:
    # The router stops (Supervisor.close cancels the watch) while a health
    # ping waits for its pong; closing the connection then fails that ping.
    # It was left running and logged "Task exception was never retrieved".
    import gc

    from replicas.client import ReplicaDead
    from replicas.supervisor import Supervisor, SupervisorSettings

    reported: list = []

    class _Client:
        closed = None
        refused = False
        credentials_refused = None

        def __init__(self, loop) -> None:
            self.pong = loop.create_future()

        async def ping(self, timeout):
            return await self.pong

        def close(self) -> None:  # (as ReplicaClient.close: the pings still waiting fail)
            if not self.pong.done():
                self.pong.set_exception(ReplicaDead("closed by the router"))

    async def main():
        loop = asyncio.get_running_loop()
        loop.set_exception_handler(lambda _loop, ctx: reported.append(ctx))
        sup = Supervisor(ReplicaPool([]), SupervisorSettings(health_timeout=5.0))
        client = _Client(loop)
        watch = loop.create_task(sup._watch(ReplicaSlot(ReplicaSpec(name="r0")), client, None))
        await asyncio.sleep(0.05)  # (its ping waits)
        watch.cancel()
        await asyncio.gather(watch, return_exceptions=True)
        client.close()
        for _ in range(5):
            await asyncio.sleep(0)
        gc.collect()

    asyncio.run(main())
    gc.collect()
    assert [c["message"] for c in reported] == []


def test_a_stall_of_the_routers_own_loop_restarts_the_clock_instead_of_blaming_the_engine() -> None:
    # A router frozen (SIGSTOP) past health_timeout read none of its
    # replica's output meanwhile, which held the engine back; at the first
    # check after it, the engine looked stuck and a healthy replica was
    # restarted (a chaos review).
    from replicas.protocol import LoadReport
    from replicas.health import Progress

    p = Progress(5.0)
    busy = dict(steps=9, reports_steps=True)
    assert not p.stuck(LoadReport(1, 0, 0.0, **busy), 0.0)
    assert not p.stuck(LoadReport(1, 0, 0.0, **busy), 15.0, paused=True)  # the router was stopped 14 s
    assert not p.stuck(LoadReport(1, 0, 0.0, **busy), 19.9)
    assert p.stuck(LoadReport(1, 0, 0.0, **busy), 20.1)  # a real stall is still found, 5 s on


async def test_an_upstream_ready_line_names_its_url_not_a_pid(caplog) -> None:
    # (it said "pid 0": the router has no process of an upstream's)
    runner, url = await _models_server([])
    caplog.set_level("INFO", logger="fairstream.supervisor")
    pool = ReplicaPool([ReplicaSpec(name="up", url=url)])
    sup = Supervisor(pool, SupervisorSettings(health_interval=0.05))
    await sup.start()
    try:
        await apoll(lambda: pool.slots[0].ready, 5, what="the upstream ready")
        lines = [r.getMessage() for r in caplog.records if "ready (model" in r.getMessage()]
        assert lines == [f"replica up ready (model {MODEL}, at {url})"], lines
    finally:
        await sup.close()
        await runner.cleanup()


async def test_a_replica_whose_parent_died_before_it_looked_stops_at_once(monkeypatch) -> None:
    # (started as its router was killed, it found itself a child of init and
    # waited for init to exit: an orphan replica outlived the test run)
    from replicas.server import PARENT_PID_ENV, wait_for_stop

    monkeypatch.setenv(PARENT_PID_ENV, str(os.getppid() + 1_000_000))  # (not this process's parent)
    await asyncio.wait_for(wait_for_stop(True), 3.0)


def test_a_refusal_after_another_failure_is_news_and_is_not_the_503s_reason_meanwhile() -> None:
    # (the refusal stayed until a connect succeeded: an upstream that refused
    # the key, went away and came back refusing was logged at DEBUG only, and
    # while it could not be reached the 503 still blamed the key)
    from replicas.client import KeyRefused

    slot = ReplicaSlot(ReplicaSpec(name="up", url="http://127.0.0.1:9/v1", upstream_model="m"))
    refusal = KeyRefused("upstream up refused the router's credentials (the key in $K): HTTP 401")
    assert slot.refused(refusal) and slot.credentials_refused == str(refusal)
    assert not slot.refused(KeyRefused(str(refusal)))  # (the same again: not logged again)
    slot.failed("Cannot connect to host 127.0.0.1:9")
    assert slot.credentials_refused is None and slot.last_error == "Cannot connect to host 127.0.0.1:9"
    assert slot.refused(KeyRefused(str(refusal)))  # (back, refusing: news)


def test_upstream_model_names_only_a_url_replicas_model() -> None:
    # (a local or address replica's stray upstream_model became its model
    # until it connected: listed in /v1/models, a 404 for its real one)
    assert ReplicaSlot(ReplicaSpec(name="s0", engine="sim", upstream_model="typo")).model != "typo"
    assert ReplicaSlot(ReplicaSpec(name="u0", url="http://127.0.0.1:9/v1", upstream_model="m")).model == "m"


async def test_a_restart_that_fails_for_want_of_descriptors_is_tried_again_within_reconnect_interval(caplog) -> None:
    # (the router out of descriptors, a flood of client connections: the
    # restart's pipes or socket failed with EMFILE, and each failure doubled
    # the backoff: 16 s, a replica down 32 s, longer than the flood. It is
    # the router's want, not the replica's fault: tried again within
    # reconnect_interval, without growing the backoff)
    import errno

    pool = ReplicaPool([ReplicaSpec(name="r0", engine="sim")])
    sup = Supervisor(pool, SupervisorSettings(backoff_initial=0.1, reconnect_interval=0.2))
    loop = asyncio.get_running_loop()
    tries: list[float] = []

    async def run_once(slot: ReplicaSlot) -> None:
        tries.append(loop.time())
        slot.state = "starting"
        if len(tries) <= 8:
            raise OSError(errno.EMFILE, "Too many open files")
        raise RuntimeError("exited with status 1")  # (a failure of its own: the backoff as before)

    sup._run_once = run_once  # type: ignore[method-assign]
    caplog.set_level("WARNING", logger="fairstream.supervisor")
    await sup.start()
    try:
        await apoll(lambda: len(tries) >= 11, 5, what="attempts")
    finally:
        await sup.close()
        await _force_stop(sup)
    gaps = [b - a for a, b in zip(tries, tries[1:])]
    assert max(gaps[:8]) < 0.2 + 0.1, gaps  # (doubling: 0.1, 0.2, 0.4 ... 12.8 s)
    assert gaps[8] < 0.1 + 0.1 and gaps[9] > 0.2 - 0.01, gaps  # (its own failures: from backoff_initial, doubling)
    assert any("out of file descriptors" in r.getMessage() for r in caplog.records), caplog.text
    # (this stand-in starts no process: no attempt of it is a restart of the
    # replica, which its metric and alert count; a want of descriptors was 8)
    assert pool.slots[0].restarts == 0, pool.slots[0].restarts


async def test_a_booting_replica_is_not_restarted_when_the_router_lacks_descriptors_to_connect(tmp_path) -> None:
    # (an EMFILE while connecting to a replica still loading escaped the wait
    # for it: the supervisor reaped the replica and started it again, a whole
    # model load thrown away for each such error)
    import errno

    pool = ReplicaPool([ReplicaSpec(name="r0", engine="sim")])
    sup = Supervisor(pool, SupervisorSettings(run_dir=str(tmp_path)))
    slot = pool.slots[0]
    sock = tmp_path / "r0.sock"
    sock.write_text("")  # (its socket is there: connect is tried)
    proc = types.SimpleNamespace(returncode=None)
    calls = 0

    async def connect(*args, **kwargs):
        nonlocal calls
        calls += 1
        if calls <= 3:
            raise OSError(errno.EMFILE, "Too many open files")
        return "client"

    from replicas import supervisor as supervisor_module

    original = supervisor_module.connect
    supervisor_module.connect = connect
    try:
        assert await sup._connect_when_up(slot, f"unix:{sock}", proc) == "client"
    finally:
        supervisor_module.connect = original
    assert calls == 4


async def test_a_replica_still_booting_is_not_waited_for_once_the_router_closes(tmp_path) -> None:
    # (a cancel lost in a connect that failed in the same turn, ECONNREFUSED
    # on a socket not listening yet, left the wait polling to start_timeout,
    # 180 s, with the router's close waiting on it)
    pool = ReplicaPool([ReplicaSpec(name="r0", engine="sim")])
    sup = Supervisor(pool, SupervisorSettings(run_dir=str(tmp_path)))
    sup._closing = True
    proc = types.SimpleNamespace(returncode=None)
    with pytest.raises(asyncio.CancelledError):
        await asyncio.wait_for(sup._connect_when_up(pool.slots[0], f"unix:{tmp_path}/r0.sock", proc), 1.0)


async def test_a_failing_event_hook_does_not_end_the_supervision_of_its_replica(caplog) -> None:
    # (_on_event and _reap sat outside the attempt's try: the supervise-* task
    # died there, unlogged, and its replica was never tried again)
    run_dir = tempfile.mkdtemp(prefix="fst-")
    pool = ReplicaPool([ReplicaSpec(name="remote", address=f"unix:{run_dir}/r.sock")])
    downs: list[str] = []

    def on_event(event: str, slot: ReplicaSlot) -> None:
        if event == "down":
            downs.append(event)
            if len(downs) == 1:
                raise ValueError("a bug in the hook")

    sup = Supervisor(pool, SupervisorSettings(backoff_initial=0.05, reconnect_interval=0.05), on_event=on_event)
    await sup.start()
    try:
        await apoll(lambda: len(downs) >= 3, 5, what="attempts after the hook failed")
    finally:
        await sup.close()
        shutil.rmtree(run_dir, ignore_errors=True)
    [error] = [r for r in caplog.records if r.levelno >= logging.ERROR]
    assert "remote" in error.getMessage() and error.exc_info[0] is ValueError
