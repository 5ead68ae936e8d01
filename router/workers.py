"""``fairstream serve --workers N``: several router processes on one port.

The parent process owns the replicas: its supervisor starts the local ones,
health-checks and restarts them, exactly as a single router does. It then
starts N worker processes; each is a complete router (HTTP, auth, limits,
queues, failover, resume) that reaches every replica as a remote one (local
replicas through their Unix sockets) and binds the same port with
SO_REUSEPORT, so the kernel spreads connections over the workers. Workers
share rate limits, leases and resume buffers through Redis, which is why
``state.backend: redis`` is required; each has its own scheduler, so
priorities and fair-share weights order the requests within one worker
(the kernel spreads connections evenly, so over all of them roughly).
Metrics run in prometheus-client's multiprocess mode: any worker's /metrics
shows the sum over all of them.

The parent restarts a worker that dies and stops everything on SIGTERM or
SIGINT; workers and replicas also exit when the parent dies.
"""

from __future__ import annotations

import asyncio
import errno
import logging
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import msgspec

from replicas.pool import ReplicaPool, ReplicaSlot
from replicas.rundirs import make_run_dir, sweep
from replicas.procstop import die_with_parent
from replicas.supervisor import Supervisor, SupervisorSettings
from router.config import FORCE_SIGNAL, SHUTDOWN_MARGIN, RouterConfig

__all__ = ["serve_workers", "worker_config"]

log = logging.getLogger("fairstream.workers")

# a worker that exits sooner than this after its start is restarted after a
# doubling wait (up to restart_backoff_max), not at once
WORKER_SETTLE = 10.0
# how long the parent waits for a worker it SIGKILLed before it gives up on it
KILL_WAIT = 5.0


def worker_config(config: RouterConfig, run_dir: str) -> RouterConfig:
    """The config a worker runs: local replicas become Unix-socket addresses
    of the processes the parent supervises."""
    replicas = []
    for spec in config.replicas:
        if spec.local:
            # (gpu and env are the parent's process's, not the worker's connection's)
            spec = msgspec.structs.replace(spec, address=f"unix:{run_dir}/{spec.name}.sock", gpu=None, env={})
        replicas.append(spec)
    return msgspec.structs.replace(config, replicas=replicas)


def serve_workers(config: RouterConfig, tenants: Path, host: str, port: int, workers: int,
                  log_args: list[str]) -> int:
    if config.state.backend != "redis":
        print(
            "fairstream serve: --workers needs `state: {backend: redis}` in router.yaml, so that the "
            "workers share rate limits, leases and resume buffers.",
            file=sys.stderr,
        )
        return 1
    if port == 0:
        print("fairstream serve: --workers needs a fixed port (each worker would get its own)", file=sys.stderr)
        return 1
    try:
        holder = hold_port(host, port)
    except OSError as e:
        print(f"fairstream serve: cannot listen on {host}:{port}: {e}", file=sys.stderr)
        return 3  # (as a single router: uvicorn's startup failure)
    sweep()  # the run and metrics dirs of routers that were killed
    metrics_dir = make_run_dir("fairstream-metrics-")
    os.environ["PROMETHEUS_MULTIPROC_DIR"] = metrics_dir
    run_dir = make_run_dir()
    try:
        import uvloop

        return uvloop.run(_parent(config, tenants, host, port, workers, run_dir, log_args))
    finally:
        holder.close()
        shutil.rmtree(metrics_dir, ignore_errors=True)
        shutil.rmtree(run_dir, ignore_errors=True)


def _worker_preexec() -> None:
    """In a worker, before it runs: it exits with the parent, and starts
    with SIGHUP ignored (an ignored signal stays ignored across exec) until
    its router installs its reload handler, so that a reload while it starts
    does not kill it."""
    die_with_parent()
    signal.signal(signal.SIGHUP, signal.SIG_IGN)


def hold_port(host: str, port: int) -> socket.socket:
    """Check that nothing listens on ``host:port`` and hold it for the
    workers: a socket bound without SO_REUSEPORT fails on a port any other
    socket holds (the workers' SO_REUSEPORT binds would not: a second
    ``serve --workers`` on the same port would silently share it), and the
    returned socket, bound with SO_REUSEPORT and never listening, makes a
    later check fail the same way while it lets the workers bind."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    with socket.socket(family, socket.SOCK_STREAM) as probe:
        probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # (a closed router's TIME_WAITs)
        probe.bind((host, port))
    for reuse_addr in (False, True):
        holder = socket.socket(family, socket.SOCK_STREAM)
        holder.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
        if reuse_addr:
            # (the probe bound: nothing else holds the port but the TIME_WAITs
            # of a closed server without SO_REUSEPORT, which a bind without
            # SO_REUSEADDR conflicts with)
            holder.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            holder.bind((host, port))
            if reuse_addr:  # (bound: off again, or a later check would bind beside it)
                holder.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 0)
            return holder
        except OSError as e:
            holder.close()
            if reuse_addr or e.errno != errno.EADDRINUSE:
                raise
    raise AssertionError("unreachable")


async def _parent(config: RouterConfig, tenants: Path, host: str, port: int, n: int, run_dir: str,
                  log_args: list[str]) -> int:
    local = [s for s in config.replicas if s.local]
    pool = ReplicaPool(local)
    # The parent restarts the local replicas, so it counts their restarts (the
    # workers see them as remote ones and only reconnect); /metrics sums it in.
    # (prometheus-client picks its multiprocess values when first imported:
    # after PROMETHEUS_MULTIPROC_DIR is set.)
    from router.metrics import Metrics

    metrics = Metrics()
    metrics.declare((s.name for s in local), {})

    def on_event(event: str, slot: ReplicaSlot) -> None:
        if event == "down":
            metrics.replica_restarts.labels(slot.name).inc()

    supervisor = Supervisor(
        pool,
        SupervisorSettings(
            health_interval=config.health_interval,
            health_timeout=config.health_timeout,
            backoff_max=config.restart_backoff_max,
            reconnect_interval=config.reconnect_interval,
            run_dir=run_dir,
        ),
        on_event=on_event,
    )
    # (signals first: a SIGHUP, systemd's reload, or a SIGTERM while the
    # replicas start must not kill the parent with its default action)
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    interrupted: list[bool] = []  # (Ctrl-C: exit 130, as a single router does; SIGTERM: 0)
    forced: list[bool] = []
    procs: dict[int, subprocess.Popen[bytes]] = {}
    told: set[int] = set()  # (the pids of the workers sent SIGTERM)

    def terminate(p: subprocess.Popen[bytes]) -> None:
        """SIGTERM to ``p`` unless it had it."""
        if p.poll() is None and p.pid not in told:
            told.add(p.pid)
            p.terminate()

    def on_stop(sig: int) -> None:
        if sig == signal.SIGINT and stop.is_set():
            # a second SIGINT: the workers quit at once too. Not by a SIGINT
            # of the parent's: Ctrl-C at a terminal reaches them itself (one
            # more read as a third), and a worker with a SIGTERM and a SIGINT
            # both pending runs SIGINT's handler first (Python goes by signal
            # number) and takes it for a first one, which drains. FORCE_SIGNAL
            # forces a worker's stop whatever it had before (router.server).
            for p in list(procs.values()):
                terminate(p)
                if p.poll() is None:
                    p.send_signal(FORCE_SIGNAL)
            if not forced:
                forced.append(True)
                log.warning("a second SIGINT forced the stop: the workers end their requests now")
            return
        interrupted.append(sig == signal.SIGINT)
        stop.set()

    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, on_stop, sig)

    def forward_hup() -> None:  # (workers not started yet read the file when they start)
        for p in procs.values():
            if p.poll() is None:
                p.send_signal(signal.SIGHUP)

    loop.add_signal_handler(signal.SIGHUP, forward_hup)
    await supervisor.start()
    try:
        if local:
            ready = asyncio.ensure_future(supervisor.wait_ready(config.ready_timeout, minimum=1))
            stopped = asyncio.ensure_future(stop.wait())
            await asyncio.wait((ready, stopped), return_when=asyncio.FIRST_COMPLETED)
            stopped.cancel()
            ready.cancel()
            if not stop.is_set() and not ready.result():
                log.error("no local replica became ready within %.0fs", config.ready_timeout)
        cfg_path = Path(run_dir) / "worker.json"
        cfg_path.write_bytes(msgspec.json.encode(worker_config(config, run_dir)))
        cmd = [
            sys.executable, "-m", "router.worker", "--config-file", str(cfg_path), "--tenants", str(tenants),
            "--host", host, "--port", str(port), *log_args,
        ]
        started: dict[int, float] = {}
        backoff: dict[int, float] = {}
        respawn_at: dict[int, float] = {}

        async def spawn(i: int) -> None:
            # (subprocess.Popen, not the loop's: uvloop's children start with
            # every signal reset, the SIGHUP that _worker_preexec ignores too)
            procs[i] = subprocess.Popen(cmd, preexec_fn=_worker_preexec)
            started[i] = time.monotonic()
            log.info("worker %d started (pid %d)", i, procs[i].pid)

        for i in range(n):
            if not stop.is_set():
                await spawn(i)
        while not stop.is_set():
            now = time.monotonic()
            for i, p in list(procs.items()):
                if p.poll() is not None and i not in respawn_at:
                    from prometheus_client import multiprocess

                    multiprocess.mark_process_dead(p.pid)
                    # one that dies soon after it started (a tenants file
                    # broken since, say) is started again ever later
                    quick = now - started[i] < WORKER_SETTLE
                    backoff[i] = min(max(backoff.get(i, 0.0) * 2, 0.5), config.restart_backoff_max) if quick else 0.0
                    respawn_at[i] = now + backoff[i]
                    log.warning("worker %d (pid %d) exited with %s; restarting%s", i, p.pid, p.returncode,
                                f" in {backoff[i]:.1f}s" if backoff[i] else "")
            for i, at in list(respawn_at.items()):
                if at <= now:
                    del respawn_at[i]
                    await spawn(i)
            try:
                await asyncio.wait_for(stop.wait(), 0.5)
            except asyncio.TimeoutError:
                pass
    finally:
        for p in procs.values():
            terminate(p)
        # the workers have their shutdown grace for the requests in flight (all
        # at once), then end them
        until = time.monotonic() + config.shutdown_grace + SHUTDOWN_MARGIN + 5
        while any(p.poll() is None for p in procs.values()) and time.monotonic() < until:
            await asyncio.sleep(0.05)
        for p in procs.values():
            if p.poll() is None:
                p.kill()
        for p in procs.values():
            try:
                p.wait(KILL_WAIT)
            except subprocess.TimeoutExpired:  # stuck in the kernel (D state): the replicas still stop
                log.error("worker pid %d did not exit %.0fs after SIGKILL; leaving it", p.pid, KILL_WAIT)
        await supervisor.close()
    return 130 if interrupted[:1] == [True] else 0
