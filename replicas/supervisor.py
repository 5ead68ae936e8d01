"""Starts, watches and restarts replicas; owns their processes and connections.

One task per slot runs the slot's life cycle: start the process (local), connect
(remote) or open an HTTP client (``url`` upstream), wait for readiness, health-check
with pings, and on death restart with exponential backoff (a replica it does not
start, while it cannot be reached: connect again every ``reconnect_interval`` at
most). ``close()`` ends every task and process. Local replicas also die with the
router: the child gets PR_SET_PDEATHSIG and watches its parent pid.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import os
import shutil
import sys
import time
from collections.abc import Callable

from replicas.client import KeyRefused, ReplicaClient, ReplicaRefused, connect
from replicas.connect_errors import not_reached, out_of_descriptors
from replicas.cpubind import BIND_ENV, core_lists, workers
from replicas.health import LOOP_STALL, Progress, abandon, answered_within
from replicas.logs import REPLICA_ERROR_FILE_ENV, REPLICA_NAME_ENV
from replicas.pool import ReplicaPool, ReplicaSlot
from replicas.procstop import die_with_parent, stop_process
from replicas.protocol import FEATURES, Feature
from replicas.rundirs import IPC_ENV, make_ipc_dir, make_run_dir, sweep
from replicas.server import PARENT_PID_ENV
from replicas.spec import ReplicaSpec
from replicas.upstream_errors import UpstreamFailed

__all__ = ["Supervisor", "SupervisorSettings"]

log = logging.getLogger("fairstream.supervisor")

UNREACHABLE_LOG_EVERY = 30.0  # (s) between warnings about a replica that still cannot be reached


class SupervisorSettings:
    def __init__(
        self,
        *,
        health_interval: float = 1.0,
        health_timeout: float = 5.0,
        backoff_initial: float = 0.5,
        backoff_max: float = 30.0,
        healthy_after: float = 30.0,
        reconnect_interval: float = 1.0,
        run_dir: str | None = None,
    ) -> None:
        self.health_interval = health_interval
        self.health_timeout = health_timeout
        self.backoff_initial = backoff_initial
        self.backoff_max = backoff_max
        self.healthy_after = healthy_after
        # longest wait between attempts to reach a replica this router does
        # not start (remote, url) while it cannot be reached
        self.reconnect_interval = reconnect_interval
        self.run_dir = run_dir


STOP_GRACE = 10.0  # seconds a replica gets to stop after SIGTERM


class _Disconnected(RuntimeError):
    """A ready replica's connection went away (closed, reset, or an
    upstream's health check that could not connect), as opposed to one that
    answered with an error or stalled."""


class _Stalled(RuntimeError):
    """The replica answered no ping within the health timeout."""


def _exited(proc: asyncio.subprocess.Process, run_dir: str | None, name: str, when: str = "") -> RuntimeError:
    """A local replica exited: its status, and why (``replicas.logs.write_error_file``, beside its socket)."""
    why = ""
    with contextlib.suppress(OSError, TypeError), open(os.path.join(run_dir, f"{name}.sock.error")) as f:
        why = ": " + f.read().strip()
    return RuntimeError(f"process exited with code {proc.returncode}{when}{why if why != ': ' else ''}")



class Supervisor:
    def __init__(
        self,
        pool: ReplicaPool,
        settings: SupervisorSettings | None = None,
        on_event: Callable[[str, ReplicaSlot], None] | None = None,
    ) -> None:
        self.pool = pool
        self.settings = settings or SupervisorSettings()
        # "spawned", "ready", "down" ("unspawned": a local one that got no
        # process, not a restart); an upstream's "refused" (a connect
        # refused: not chosen until a check answers) and "answers" (it did)
        self._on_event = on_event or (lambda event, slot: None)
        self._tasks: list[asyncio.Task[None]] = []
        self._procs: dict[str, asyncio.subprocess.Process] = {}
        # Where local replicas' sockets go: the settings' run_dir, or one made
        # when the first local replica starts (a router with none, e.g. a
        # --workers worker, makes none: nothing to leave behind if killed).
        self._run_dir: str | None = self.settings.run_dir
        # each running local vLLM replica's directory for its engine's IPC
        # sockets, in the run dir: removed when its process stops (_reap)
        self._ipc: dict[str, str] = {}
        self._closing = False
        self._cores: dict[str, str] | None = None  # each local vLLM replica's BIND_ENV, when one starts

    async def start(self) -> None:
        loop = asyncio.get_running_loop()
        for slot in self.pool.slots:
            self._tasks.append(loop.create_task(self._supervise(slot), name=f"supervise-{slot.name}"))

    async def wait_ready(self, timeout: float, minimum: int = 1) -> bool:
        """Wait until ``minimum`` replicas are ready; False on timeout."""
        loop = asyncio.get_running_loop()
        end = loop.time() + timeout
        while loop.time() < end:
            if sum(1 for s in self.pool.slots if s.ready) >= minimum:
                return True
            await asyncio.sleep(0.05)
        return False

    async def close(self) -> None:
        self._closing = True
        for t in self._tasks:
            t.cancel()
        for t in self._tasks:
            try:
                await t
            except asyncio.CancelledError:
                pass
            except Exception:  # noqa: BLE001 - the others stop all the same; a bug is not dropped unsaid
                log.exception("replica supervision task %s had failed", t.get_name())
        self._tasks.clear()
        await asyncio.gather(*(self._reap(name) for name in list(self._procs)))
        for name in list(self._ipc):  # (one whose process did not start)
            self._drop_ipc(name)
        if self.settings.run_dir is None and self._run_dir is not None:  # made here
            shutil.rmtree(self._run_dir, ignore_errors=True)

    # -- life cycle --------------------------------------------------------

    async def _supervise(self, slot: ReplicaSlot) -> None:
        s = self.settings
        failures = 0
        unreachable = 0  # attempts in a row that could not reach a replica this router does not start
        warned = starved_warned = 0.0
        loop = asyncio.get_running_loop()
        while not self._closing:
            started = loop.time()
            grace = None
            missed = False  # this attempt could not reach it
            lost = False  # a replica the router does not start, lost while it was ready
            repeated = False  # refused as at the last attempt
            starved = False  # the router was out of descriptors
            try:
                await self._run_once(slot)
            except asyncio.CancelledError:
                raise
            except ReplicaRefused as e:
                repeated = not slot.refused(e)  # (logged once, not at each try, until it changes or connects)
                log.log(logging.DEBUG if repeated else logging.ERROR, "replica %s: %s", slot.name, e)
            except Exception as e:  # noqa: BLE001 - any failure means restart
                why = str(e) or type(e).__name__  # (a TimeoutError says nothing of itself)
                slot.failed(why)
                # (not a stall nor an error answer: those keep the backoff, or a
                # replica that answers and then stalls would be back every second)
                lost = not slot.spec.local and isinstance(e, _Disconnected)
                if not slot.spec.local and slot.state == "starting" and not_reached(e):
                    # Not there (restarting, or its host is down): try again
                    # every reconnect_interval at most, and say so every
                    # UNREACHABLE_LOG_EVERY seconds, not at every attempt.
                    missed = True
                    unreachable += 1
                    if unreachable == 1 or loop.time() - warned >= UNREACHABLE_LOG_EVERY:
                        warned = loop.time()
                        log.warning("replica %s at %s cannot be reached: %s (attempt %d; trying again at least "
                                    "every %gs)", slot.name, slot.spec.url or slot.spec.address, why, unreachable,
                                    s.reconnect_interval)
                elif out_of_descriptors(e):
                    # (the doubling backoff kept a replica down for 16 s and
                    # more after a flood of connections that lasted less)
                    starved = True
                    if loop.time() - starved_warned >= UNREACHABLE_LOG_EVERY:
                        starved_warned = loop.time()
                        log.warning("replica %s failed: %s (the router is out of file descriptors: trying again at "
                                    "least every %gs)", slot.name, why, s.reconnect_interval)
                else:
                    log.warning("replica %s failed: %s", slot.name, why)
                if isinstance(e, _Stalled):
                    grace = 0.0  # it answers nothing (frozen, hung): a graceful stop would only hold it longer
            if not missed:
                unreachable = 0
            # down (and said so) before its process is stopped, which may take the grace;
            # a local one that never got a process (no descriptor to start it) is not restarted
            spawned = (slot.name in self._procs or not slot.spec.local) and not self._closing
            slot.state = "down"
            self._tell("down" if spawned else "unspawned", slot)  # (stopping: no restart either)
            try:
                await self._reap(slot.name, grace)  # (a close() meanwhile stops it too: still in _procs)
            except Exception:  # noqa: BLE001 - a bug must not end this replica's supervision for good
                log.exception("replica %s: stopping its process failed", slot.name)
            if self._closing:
                return
            if loop.time() - started > s.healthy_after:
                failures = 0
            if missed:
                # (a failed connect costs little: the backoff, meant for a
                # crashing process or a replica that answers with errors,
                # would keep a replica that is back unused for up to
                # backoff_max, and streams waiting for it past their
                # failover wait; nor do failed connects count as failures
                # or restarts of the replica)
                delay = min(s.backoff_max, s.reconnect_interval, s.backoff_initial * (2 ** min(unreachable - 1, 30)))
            else:
                delay = min(s.backoff_max, s.backoff_initial * (2 ** min(failures, 30)))
                if lost or starved:
                    # (its process, not the router's, restarts it, and a connect
                    # that fails costs little: the first one within
                    # reconnect_interval, so it is used again within that of
                    # its return, however often it died before; or the
                    # router's want of descriptors, which is no failure of it)
                    delay = min(delay, s.reconnect_interval)
                if not starved:
                    failures += 1
                if slot.spec.local:
                    slot.restarts += spawned
                else:  # (not restarted by the router: its own supervisor does that, if anything)
                    slot.reconnects += 1
            log.log(logging.DEBUG if unreachable > 1 or repeated or starved else logging.INFO,
                    "replica %s: %s in %.1fs (%s)",
                    slot.name, "restarting" if slot.spec.local else "connecting again", delay,
                    f"restart {slot.restarts}" if slot.spec.local else f"reconnect {slot.reconnects}")
            await asyncio.sleep(delay)

    def _tell(self, event: str, slot: ReplicaSlot) -> None:
        """``on_event``; its failure is logged and is no failure of the replica (nor ends its supervision)."""
        try:
            self._on_event(event, slot)
        except Exception:  # noqa: BLE001 - the router's bug, not the replica's
            log.exception("replica %s: the router's handler of its %r event failed", slot.name, event)

    async def _run_once(self, slot: ReplicaSlot) -> None:
        slot.state = "starting"
        proc = None
        why: Exception | None = None
        try:
            if slot.spec.url is not None:
                # An OpenAI-compatible server (docs/upstreams.md); pings are GET /models.
                from replicas.upstream_open import open_upstream

                client = await open_upstream(slot.name, slot.spec, timeout=10,
                                             head_timeout=self.settings.health_timeout,
                                             stalling=getattr(slot.client, "stalling", None))
            elif slot.spec.local:
                proc, address = await self._spawn(slot)
                client = await self._connect_when_up(slot, address, proc)
            else:
                # (silence: a ping's interval and two of its timeouts, so the replica
                # drops the streams of a connection the router has lost, as the router does)
                client = await connect(slot.name, slot.spec.address or "", secret=self._secret(slot), timeout=10,
                                       silence=self.settings.health_interval + 2 * self.settings.health_timeout)
            if self._closing:
                # (connected as the router stops: on Python 3.11 a cancel that
                # meets the connect's answer in one loop turn is lost in its
                # wait_for; not ready, nor "failed" once its watch sees close)
                await client.close()
                return
            slot.client = client
            # (a stall of its last connection or process says nothing of this one; but an upstream's generation
            # route that sent no response head is its server's: still out of dispatch until its probe is answered)
            slot.stalled_at = time.monotonic() if getattr(client, "stalling", None) else None
            slot.state = "ready"
            if isinstance(slot.connected(), KeyRefused):
                log.warning("upstream %s takes the router's credentials again", slot.name)
            where = f"pid {client.ready.pid}" if client.ready.pid else f"at {slot.spec.url or slot.spec.address}"
            log.info("replica %s ready (model %s, %s)", slot.name, client.model, where)
            missing = FEATURES & ~client.ready.features
            if missing:  # (an older version: a rolling upgrade)
                log.warning("replica %s does not take %s (an older fairstream): requests that set them go to "
                            "the replicas that do", slot.name, Feature(missing).names())
            self._tell("ready", slot)
            self.pool.notify_ready()  # streams waiting to fail over continue here
            await self._watch(slot, client, proc)
        except Exception as e:
            why = e  # (its streams' failovers say this, not only "closed by the router")
            raise
        finally:
            if slot.client is not None:
                await slot.client.close(why)
            # (its process, if any, is stopped by _supervise, or by close on a cancel)

    async def _watch(self, slot: ReplicaSlot, client: ReplicaClient, proc) -> None:
        """Return when the replica is dead, disconnected or stops answering pings. A local replica's
        exit is noticed at once, not at the next ping: its engine's children may hold the connection
        open after it died (forked with its sockets), so no EOF would tell the router."""
        s = self.settings
        exited = asyncio.ensure_future(proc.wait()) if proc is not None else None
        progress = Progress(s.health_timeout)
        paused = False  # (the last wait between checks overran: the router's loop stalled)
        loop = asyncio.get_running_loop()
        check_now: asyncio.Event | None = getattr(client, "check_now", None)  # (an upstream's)
        ping: asyncio.Future | None = None
        stalls = asyncio.Event()
        slot.ping_now = stalls.set
        stall_checks = asyncio.ensure_future(self._check_stalls(slot, client, stalls))
        try:
            while client.closed is None and not self._closing:
                refused, refusals = client.refused, getattr(client, "refusals", 0)
                unauthorized = client.credentials_refused  # (an upstream's 401/403, until its probe passes)
                if refused or unauthorized:  # not chosen until a check clears it (fairstream_replica_up 0 meanwhile)
                    if unauthorized:
                        slot.failed(unauthorized)  # (why /admin/replicas shows it down)
                    self._tell("refused", slot)
                sent = time.monotonic()  # (a stall caught after this is not cleared by its pong)
                ping = asyncio.ensure_future(answered_within(client.ping(None), s.health_timeout))
                done, _ = await asyncio.wait({ping, exited} - {None}, return_when=asyncio.FIRST_COMPLETED)
                if exited is not None and exited in done:
                    abandon(ping)
                    raise _exited(proc, self._run_dir, slot.name)
                try:
                    pong = ping.result()
                except Exception as e:  # (closed meanwhile: lost, whichever error its ping saw: a timeout too)
                    if isinstance(e, ConnectionError) or client.closed is not None:
                        break
                    if isinstance(e, TimeoutError):
                        raise _Stalled(f"no pong within {s.health_timeout}s (stalled)") from None
                    raise
                if refused and client.refusals == refusals:  # (refused before this check, not since: it answers)
                    client.refused = False
                    log.info("replica %s answers its health check after a refused connection", slot.name)
                back = self._answered(slot, sent)
                if back or (refused and not client.refused) or (unauthorized and not client.credentials_refused):
                    self._tell("answers", slot)
                    self.pool.notify_ready()
                if progress.stuck(pong.load, loop.time(), paused):
                    # (its front end answers, its engine does not: a frozen vLLM engine core)
                    raise _Stalled(f"its engine took no step for {s.health_timeout}s with "
                                   f"{pong.load.running + pong.load.waiting} requests in it (stalled)")
                rest = loop.time()
                if exited is not None:
                    done, _ = await asyncio.wait({exited}, timeout=s.health_interval)
                    if done:
                        raise _exited(proc, self._run_dir, slot.name)
                elif check_now is not None:  # until the next check, or one asked for now
                    if not check_now.is_set():
                        with contextlib.suppress(TimeoutError):
                            await asyncio.wait_for(check_now.wait(), s.health_interval)
                    check_now.clear()
                else:
                    await asyncio.sleep(s.health_interval)
                paused = loop.time() - rest > s.health_interval + LOOP_STALL
            closed = client.closed
            if closed is not None and isinstance(closed.__cause__, UpstreamFailed):
                raise RuntimeError(str(closed))  # (it answered /models with an error: it is there)
            raise _Disconnected(str(closed))
        finally:
            slot.ping_now = None
            stall_checks.cancel()
            if exited is not None:
                exited.cancel()
            if ping is not None:  # (under way when this watch ended: the router stops)
                abandon(ping)

    async def _check_stalls(self, slot: ReplicaSlot, client: ReplicaClient, stalls: asyncio.Event) -> None:
        """Ping the replica at once each time a stream's stall limit catches
        it (``stalls``, set by ``ReplicaPool.caught_stalling``), beside the
        regular checks, whose ping may be in flight for seconds on a busy
        front end and whose next one comes ``health_interval`` after: the
        pong puts a replica merely slow for one stream back in dispatch one
        round trip after the stall. A frozen one never answers; the regular
        check's ``health_timeout`` alone decides to kill it."""
        while True:
            await stalls.wait()
            stalls.clear()
            sent = time.monotonic()
            try:
                await answered_within(client.ping(None), self.settings.health_timeout)
            except Exception:  # noqa: BLE001 - no answer: the regular check tells why (lost, stalled, ...)
                continue
            if self._answered(slot, sent):
                self._tell("answers", slot)
                self.pool.notify_ready()

    @staticmethod
    def _answered(slot: ReplicaSlot, sent: float) -> bool:
        """It answered a ping sent at ``sent``: whether that put it back in dispatch after a stall."""
        back = slot.answered(sent)
        if back:
            log.info("replica %s answers its health check after it stalled a stream: chosen again", slot.name)
        return back

    async def _spawn(self, slot: ReplicaSlot) -> tuple[asyncio.subprocess.Process, str]:
        spec = slot.spec
        if self._run_dir is None:
            # (synchronous: once, before the first replica starts, and quick: a listing
            # of the temp dir and the removal of what a killed router left there)
            sweep()
            self._run_dir = make_run_dir()
        path = os.path.join(self._run_dir, f"{spec.name}.sock")
        for stale in (path, path + ".error"):
            with contextlib.suppress(FileNotFoundError):
                os.unlink(stale)
        env = self._env(spec)
        self._drop_ipc(spec.name)  # (a spawn that failed before its process ran)
        if spec.engine == "vllm" and IPC_ENV not in env:  # (unless its env, or the router's, sets it)
            # its engine's sockets in a directory of its own, removed when it stops: not left in /tmp
            ipc = make_ipc_dir(self._run_dir)
            if ipc is None:
                log.warning("replica %s: the run dir %s is too long a path for vLLM's IPC sockets in it; they "
                            "go in the temp dir", spec.name, self._run_dir, extra={"replica": spec.name})
            else:
                env[IPC_ENV], own = ipc
                if own:
                    self._ipc[spec.name] = env[IPC_ENV]
        env["FAIRSTREAM_REPLICA_SECRET"] = self._secret(slot)
        env[REPLICA_ERROR_FILE_ENV] = path + ".error"  # (why it failed: _exited)
        env[PARENT_PID_ENV] = str(os.getpid())  # (--exit-with-parent: a parent gone before it looked)
        cmd = [sys.executable, "-m", "replicas", "--engine", spec.engine, "--socket", path,
               "--config-json", json.dumps(spec.config), "--exit-with-parent"]
        # Its own process group, so that stopping it also stops what the
        # engine spawned (vLLM's EngineCore and workers), even after a SIGKILL.
        proc = await asyncio.create_subprocess_exec(
            *cmd, env=env, stdout=sys.stderr, preexec_fn=die_with_parent, start_new_session=True
        )
        self._procs[spec.name] = proc
        slot.pid = proc.pid
        self._tell("spawned", slot)
        return proc, "unix:" + path

    def _env(self, spec: ReplicaSpec) -> dict[str, str]:
        """A local replica's environment: the router's, the spec's ``env``, its GPU, and for vLLM
        its CPU workers' cores (``replicas.cpubind``)."""
        env = dict(os.environ)
        env.update(spec.env)
        if spec.gpu is not None:
            env["CUDA_VISIBLE_DEVICES"] = str(spec.gpu)
        env[REPLICA_NAME_ENV] = spec.name  # on its log lines
        if spec.engine == "vllm" and spec.gpu is None and BIND_ENV not in env:
            if self._cores is None:
                local = [s.spec for s in self.pool.slots if s.spec.local and s.spec.engine == "vllm"
                         and s.spec.gpu is None and BIND_ENV not in s.spec.env]
                lists = core_lists(sorted(os.sched_getaffinity(0)), [workers(s.config) for s in local])
                self._cores = {s.name: cores for s, cores in zip(local, lists)}
            env[BIND_ENV] = self._cores[spec.name]
            log.info("replica %s: vLLM's CPU workers on cores %s (%s; set it in the replica's env to choose)",
                     spec.name, env[BIND_ENV], BIND_ENV, extra={"replica": spec.name})
        return env

    async def _connect_when_up(self, slot: ReplicaSlot, address: str, proc) -> ReplicaClient:
        loop = asyncio.get_running_loop()
        end = loop.time() + slot.spec.start_timeout
        path = address[5:]
        while True:
            if self._closing:  # (its cancel may have been lost in a connect that failed meanwhile)
                raise asyncio.CancelledError
            if proc.returncode is not None:
                raise _exited(proc, self._run_dir, slot.name, " while starting")
            if os.path.exists(path):
                try:
                    return await connect(slot.name, address, secret=self._secret(slot), timeout=10)
                except (ConnectionError, FileNotFoundError, asyncio.TimeoutError):
                    pass
                except OSError as e:  # (the router out of descriptors: a restart would waste its boot)
                    if not out_of_descriptors(e):
                        raise
            if loop.time() > end:
                raise RuntimeError(f"not ready within {slot.spec.start_timeout}s")
            await asyncio.sleep(0.1)

    def _secret(self, slot: ReplicaSlot) -> str:
        return os.environ.get(slot.spec.secret_env, "") if slot.spec.secret_env else ""

    async def _reap(self, name: str, grace: float | None = None) -> None:
        """Stop replica ``name``'s process, if any, and remove what its engine left (``_stop_process``)."""
        proc = self._procs.get(name)
        if proc is not None:
            await self._stop_process(proc, grace)
            self._procs.pop(name, None)
        self._drop_ipc(name)

    def _drop_ipc(self, name: str) -> None:
        """Remove replica ``name``'s IPC directory: the sockets its engine bound, which no exit removes
        when the engine is killed (the sweep of a killed router's run dir removes the rest)."""
        path = self._ipc.pop(name, None)
        if path is not None:
            shutil.rmtree(path, ignore_errors=True)

    async def _stop_process(self, proc: asyncio.subprocess.Process, grace: float | None = None) -> None:
        """``stop_process`` with ``STOP_GRACE`` unless ``grace`` is given."""
        await stop_process(proc, STOP_GRACE if grace is None else grace)
