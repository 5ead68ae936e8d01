"""Test helpers: a real router process with sim replicas, and what tests need around it.

``RouterProcess`` writes a router.yaml into a test directory, runs
``fairstream serve`` on a free loopback port, waits for ``/ready``, and on
``stop()`` checks that every replica child it started is gone (no leaked
processes). Process inspection reads ``/proc`` directly (psutil is not a
dependency). Everything that waits polls with a deadline; nothing sleeps as
an assertion.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import AsyncIterator, Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar

import httpx
import msgspec
import yaml
from prometheus_client.parser import text_string_to_metric_families

from router.auth import hash_key

__all__ = [
    "read_request",
    "ROOT",
    "DEMO_TENANTS",
    "MODEL",
    "GOLD",
    "SILVER",
    "FREE",
    "ADMIN",
    "write_tenants",
    "holding_stream",
    "RouterProcess",
    "MetricsSnapshot",
    "SseEvent",
    "aiter_sse",
    "parse_sse",
    "free_port",
    "ProcStat",
    "proc_stat",
    "cmdline",
    "children",
    "descendants",
    "alive",
    "cpu_seconds",
    "poll",
    "apoll",
]

ROOT = Path(__file__).resolve().parents[1]
DEMO_TENANTS = ROOT / "configs" / "tenants.yaml"
MODEL = "fairstream-sim"
GOLD, SILVER, FREE, ADMIN = "fs-demo-gold", "fs-demo-silver", "fs-demo-free", "fs-demo-admin"

T = TypeVar("T")
# How long a test waits for a process it started to come up (a router's /ready, a
# replica's "ready on", workers). Only a failing start waits this long, so it is
# generous: on a host loaded well past its cores (CI neighbours, parallel test
# workers) a router's start was seen to take over 20 s. Not a bound on behaviour.
STARTUP_WAIT = 60.0
_CLK_TCK = os.sysconf("SC_CLK_TCK")


# -- polling -----------------------------------------------------------------


def poll(fn: Callable[[], T], timeout: float, *, interval: float = 0.05, what: str = "condition") -> T:
    """Call ``fn`` until it returns something truthy; return that. Fail after ``timeout`` s."""
    end = time.monotonic() + timeout
    last: Any = None
    while True:
        last = fn()
        if last:
            return last
        if time.monotonic() >= end:
            raise AssertionError(f"timed out after {timeout}s waiting for {what} (last value: {last!r})")
        time.sleep(interval)


async def apoll(fn: Callable[[], Any], timeout: float, *, interval: float = 0.05, what: str = "condition") -> Any:
    """``poll`` for coroutines: ``fn`` may be sync or return an awaitable."""
    end = time.monotonic() + timeout
    last: Any = None
    while True:
        last = fn()
        if asyncio.iscoroutine(last):
            last = await last
        if last:
            return last
        if time.monotonic() >= end:
            raise AssertionError(f"timed out after {timeout}s waiting for {what} (last value: {last!r})")
        await asyncio.sleep(interval)


# -- /proc -------------------------------------------------------------------


@dataclass(frozen=True)
class ProcStat:
    pid: int
    state: str
    ppid: int
    start_time: int  # clock ticks after boot; with pid, identifies one process
    cpu_ticks: int  # utime + stime


def proc_stat(pid: int) -> ProcStat | None:
    """Parsed ``/proc/<pid>/stat``, or None if there is no such process."""
    try:
        raw = Path(f"/proc/{pid}/stat").read_text()
    except (FileNotFoundError, ProcessLookupError, PermissionError):
        return None
    # comm is in parentheses and may itself contain spaces or ')'.
    rest = raw[raw.rindex(")") + 2 :].split()
    # fields after comm: state(3) ppid(4) ... utime(14) stime(15) ... starttime(22)
    return ProcStat(pid, rest[0], int(rest[1]), int(rest[19]), int(rest[11]) + int(rest[12]))


def cpu_seconds(pid: int) -> float:
    """User + system CPU seconds ``pid`` has used so far."""
    st = proc_stat(pid)
    if st is None:
        raise ProcessLookupError(pid)
    return st.cpu_ticks / _CLK_TCK


def children(pid: int) -> list[int]:
    """Direct children of ``pid``: ``/proc/<pid>/task/*/children`` when the
    kernel has it (CONFIG_PROC_CHILDREN), else a scan of ``/proc/*/stat``."""
    task_dir = Path(f"/proc/{pid}/task")
    files = list(task_dir.glob("*/children")) if task_dir.exists() else []
    if files:
        out: set[int] = set()
        for f in files:
            try:
                out.update(int(x) for x in f.read_text().split())
            except FileNotFoundError:
                pass
        return sorted(out)
    kids = []
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            st = proc_stat(int(entry))
            if st is not None and st.ppid == pid:
                kids.append(st.pid)
    return sorted(kids)


def descendants(pid: int) -> list[int]:
    out: list[int] = []
    todo = children(pid)
    while todo:
        p = todo.pop()
        out.append(p)
        todo.extend(children(p))
    return out


def cpu_lists(cores: str) -> list[list[int]]:
    """vLLM's reading of a ``VLLM_CPU_OMP_THREADS_BIND`` list: ``"0-2,5|6"``
    -> [[0, 1, 2, 5], [6]] (one list per worker)."""
    out = []
    for part in cores.split("|"):
        ids: list[int] = []
        for r in part.split(","):
            a, _, b = r.partition("-")
            ids.extend(range(int(a), int(b or a) + 1))
        out.append(ids)
    return out


def cpu_set(cores: str) -> set[int]:
    """The cores of a CPU list (``"0-2,5"`` -> {0, 1, 2, 5}; also an affinity's)."""
    return {c for ids in cpu_lists(cores) for c in ids}


def alive(pid: int, start_time: int | None = None) -> bool:
    """True if ``pid`` runs (a zombie counts as dead), and, when given, is
    still the process that started at ``start_time`` (pids get reused)."""
    st = proc_stat(pid)
    if st is None or st.state in ("Z", "X", "x"):
        return False
    return start_time is None or st.start_time == start_time


def cmdline(pid: int) -> list[str]:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().decode(errors="replace").split("\0")[:-1]
    except (FileNotFoundError, ProcessLookupError):
        return []


async def read_request(reader, bodies: list[bytes] | None = None) -> bytes:
    """One HTTP/1.1 request off a loopback test server's ``StreamReader``:
    its head (the body, by its content-length, is read and dropped, or
    appended to ``bodies``)."""
    head = await reader.readuntil(b"\r\n\r\n")
    length = 0
    for line in head.split(b"\r\n"):
        if line.lower().startswith(b"content-length:"):
            length = int(line.split(b":")[1])
    body = await reader.readexactly(length)
    if bodies is not None:
        bodies.append(body)
    return head


@contextlib.asynccontextmanager
async def loopback_http(answer: Callable[[bytes, bytes, asyncio.StreamWriter], Any]) -> AsyncIterator[int]:
    """A loopback HTTP/1.1 test server (a fake upstream): for each request of
    a kept-alive connection, ``await answer(head, body, writer)`` writes the
    response (returning False ends the connection). Yields its port."""
    async def serve(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            while True:
                bodies: list[bytes] = []
                head = await read_request(reader, bodies)
                if await answer(head, bodies[0], writer) is False:
                    return
                await writer.drain()
        except (asyncio.IncompleteReadError, ConnectionError, asyncio.CancelledError):
            pass  # (the client closed, or the test ended)
        finally:
            writer.close()

    server = await asyncio.start_server(serve, "127.0.0.1", 0)
    try:
        yield server.sockets[0].getsockname()[1]
    finally:
        server.close()


def wait_or_dump(proc: subprocess.Popen, within: float) -> int | None:
    """``proc``'s exit code within ``within`` seconds; else None, once it has
    had SIGABRT (PYTHONFAULTHANDLER: a router prints every thread's stack to
    its log before it dies) and, 2 s later, SIGKILL."""
    try:
        return proc.wait(within)
    except subprocess.TimeoutExpired:
        proc.send_signal(signal.SIGABRT)
        try:
            proc.wait(2)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(5)
        return None


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@contextlib.contextmanager
def remote_replica_process(log_path: Path, secret_env: str, secret: str, config: dict[str, Any],
                           command: list[str] | None = None) -> Iterator[tuple[int, subprocess.Popen[bytes]]]:
    """``fairstream replica --listen`` (the sim engine with ``config``) on a
    free loopback port, its secret in ``secret_env``: (port, process), up;
    stopped (SIGTERM, then SIGKILL) on exit. A port taken meanwhile by
    another process (the race of ``free_port``) is tried again on another.
    ``command``: what runs the replica's command line instead of
    ``python -m replicas``."""
    proc: subprocess.Popen[bytes] | None = None
    try:
        for attempt in range(3):
            port = free_port()
            log_path.write_bytes(b"")
            with open(log_path, "ab") as log:
                proc = subprocess.Popen(
                    [*(command or [sys.executable, "-m", "replicas"]), "--engine", "sim",
                     "--listen", f"127.0.0.1:{port}", "--secret-env", secret_env,
                     "--config-json", msgspec.json.encode(config).decode()],
                    env=dict(os.environ, **{secret_env: secret}), stdout=log, stderr=subprocess.STDOUT,
                )
            poll(lambda: b"ready on" in log_path.read_bytes() or proc.poll() is not None, STARTUP_WAIT,
                 what="remote replica up")
            if proc.poll() is None:
                break
            if attempt == 2 or b"in use" not in log_path.read_bytes():
                raise AssertionError(f"remote replica exited: {log_path.read_text(errors='replace')[-2000:]}")
        yield port, proc
    finally:
        if proc is not None:
            if proc.poll() is None:
                proc.terminate()
            try:
                proc.wait(10)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()


# -- metrics -----------------------------------------------------------------


class MetricsSnapshot:
    """One scrape of ``/metrics``."""

    def __init__(self, text: str) -> None:
        self.text = text
        self.samples: list[tuple[str, dict[str, str], float]] = []
        for family in text_string_to_metric_families(text):
            for s in family.samples:
                self.samples.append((s.name, dict(s.labels), s.value))

    def names(self) -> set[str]:
        return {name for name, _, _ in self.samples}

    def value(self, name: str, default: float | None = None, **labels: str) -> float:
        """Sum of the samples of ``name`` whose labels include ``labels``.

        Raises KeyError when there is none, unless ``default`` is given."""
        found = [v for n, lab, v in self.samples if n == name and all(lab.get(k) == w for k, w in labels.items())]
        if not found:
            if default is not None:
                return default
            raise KeyError(f"no sample {name}{labels or ''} in /metrics")
        return sum(found)


# -- SSE ---------------------------------------------------------------------


@dataclass
class SseEvent:
    id: str | None
    data: str

    def json(self) -> Any:
        return msgspec.json.decode(self.data)

    @property
    def number(self) -> int | None:
        """The event's sequence number: the ``id`` up to its first ``-``
        (the router may append the stream position, ``N-T-C``)."""
        return None if self.id is None else int(self.id.split("-", 1)[0])


def _events(lines: Iterator[str]) -> Iterator[SseEvent]:
    event_id: str | None = None
    data: list[str] = []
    for line in lines:
        if line == "":
            if data:
                yield SseEvent(event_id, "\n".join(data))
            event_id, data = None, []
        elif line.startswith("id:"):
            event_id = line[3:].strip()
        elif line.startswith("data:"):
            data.append(line[5:].lstrip(" ") if line[5:6] == " " else line[5:])
    if data:
        yield SseEvent(event_id, "\n".join(data))


def parse_sse(text: str) -> list[SseEvent]:
    return list(_events(iter(text.split("\n"))))


async def aiter_sse(response: httpx.Response, comments: list[str] | None = None) -> AsyncIterator[SseEvent]:
    """Events of a streamed httpx response, as they arrive (comment lines,
    which clients skip, go to ``comments`` if given).

    Leaving an ``async for`` over this early closes the HTTP connection as
    soon as the generator is collected (a client disconnect); to pause a
    stream, keep the iterator and call ``__anext__``."""
    event_id: str | None = None
    data: list[str] = []
    async for line in response.aiter_lines():
        if line == "":
            if data:
                yield SseEvent(event_id, "\n".join(data))
            event_id, data = None, []
        elif line.startswith("id:"):
            event_id = line[3:].strip()
        elif line.startswith("data:"):
            data.append(line[6:] if line[5:6] == " " else line[5:])
        elif line.startswith(":") and comments is not None:
            comments.append(line)
    if data:
        yield SseEvent(event_id, "\n".join(data))


# -- the router --------------------------------------------------------------


class RouterProcess:
    """A real ``fairstream serve`` with ``replicas`` local sim replicas.

    ``sim`` overrides SimConfig fields of every replica (e.g. ``step_base_ms``);
    ``settings`` overrides top-level router.yaml fields (e.g. ``max_body_bytes``).
    """

    def __init__(
        self,
        workdir: Path,
        *,
        replicas: int = 2,
        sim: dict[str, Any] | None = None,
        settings: dict[str, Any] | None = None,
        tenants: Path = DEMO_TENANTS,
        start_timeout: float = STARTUP_WAIT,
        args: list[str] | None = None,
    ) -> None:
        self.workdir = Path(workdir)
        self.args = list(args or [])  # more `fairstream serve` arguments
        self.workdir.mkdir(parents=True, exist_ok=True)
        self.replica_names = [f"sim-{i}" for i in range(replicas)]
        config: dict[str, Any] = {
            "host": "127.0.0.1",
            "tenants": str(Path(tenants).resolve()),
            "restart_backoff_max": 2.0,
            # what runs when a test stops the router ends within this (stop() waits 15 s)
            "shutdown_grace": 3.0,
            "replicas": [
                {"name": name, "engine": "sim", "config": {"model": MODEL, "seed": 0, **(sim or {})}}
                for name in self.replica_names
            ],
        }
        config.update(settings or {})
        self.config = config
        self.config_path = self.workdir / "router.yaml"
        self.config_path.write_text(yaml.safe_dump(config, sort_keys=False))
        self.log_path = self.workdir / "router.log"
        self.start_timeout = start_timeout
        self.port = 0
        self.proc: subprocess.Popen[bytes] | None = None
        # The supervisor's run dir (replica sockets) goes under a short private
        # TMPDIR (Unix socket paths are limited to 107 bytes), made by start().
        self.tmpdir: Path | None = None
        self._seen: dict[int, int] = {}  # replica pid -> start time, every replica seen
        self.leftovers: list[str] = []

    # -- life cycle ----------------------------------------------------------

    @property
    def base_url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    @property
    def pid(self) -> int:
        assert self.proc is not None, "router not started"
        return self.proc.pid

    def start(self, *, all_ready: bool = True, serving: bool = False) -> RouterProcess:
        """Start the router and wait until it is ready (``all_ready``: every
        replica too); ``serving``: until it answers ``/health`` only (for a
        router whose replicas are not meant to become ready)."""
        if self.tmpdir is None:
            self.tmpdir = Path(tempfile.mkdtemp(prefix="fst-"))
        for attempt in range(3):
            self.port = free_port()
            env = dict(os.environ, TMPDIR=str(self.tmpdir), PYTHONUNBUFFERED="1", PYTHONFAULTHANDLER="1")
            with open(self.log_path, "ab") as log:
                self.proc = subprocess.Popen(
                    [sys.executable, "-c", "from router.cli import main; main()", "serve",
                     "--config", str(self.config_path), "--host", "127.0.0.1", "--port", str(self.port),
                     *self.args],
                    cwd=self.workdir, env=env, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                )
            try:
                self.wait_ready(self.start_timeout, all_replicas=all_ready, serving=serving)
                self.replica_pids()  # remember the first generation of replicas
                return self
            except AssertionError:
                if self.proc.poll() is not None and "address already in use" in self.log() and attempt < 2:
                    continue  # lost the race for the free port
                self.stop(check=False)
                raise
        raise AssertionError("unreachable")

    def wait_ready(self, timeout: float = STARTUP_WAIT, *, all_replicas: bool = True,
                   serving: bool = False) -> dict[str, Any]:
        def check() -> dict[str, Any] | None:
            if self.proc is not None and self.proc.poll() is not None:
                raise AssertionError(f"router exited with {self.proc.returncode}:\n{self.log()[-3000:]}")
            try:
                r = httpx.get(self.base_url + ("/health" if serving else "/ready"), timeout=2)
            except httpx.HTTPError:
                return None
            if r.status_code != 200:
                return None
            body = r.json()
            if serving:
                return body or {"serving": True}
            if all_replicas and any(body["replicas"].get(n) != "ready" for n in self.replica_names):
                return None
            return body

        return poll(check, timeout, interval=0.05, what=f"/ready on {self.base_url} ({self.log_path})")

    def stop(self, timeout: float = 15.0, *, check: bool = True) -> None:
        """SIGTERM the router (SIGABRT for a stack dump, then SIGKILL, after
        ``timeout``), then check that no replica process it started outlived it.
        With ``check``, a hang or a leaked process fails (after cleaning up)."""
        proc = self.proc
        if proc is None:
            return
        problems: list[str] = []
        if proc.poll() is None:
            self._remember(descendants(proc.pid))
            proc.send_signal(signal.SIGTERM)
            if wait_or_dump(proc, timeout) is None:
                problems.append(f"router did not exit within {timeout}s of SIGTERM; log tail:\n{self.log()[-4000:]}")
        self.proc = None
        # What the router left in its TMPDIR (the supervisor's run dir, sockets).
        tmpdir = self.tmpdir
        self.leftovers = sorted(str(p.relative_to(tmpdir)) for p in tmpdir.rglob("*")) if tmpdir else []
        leaked = self.wait_replicas_gone(5.0)
        if leaked:
            problems.append(f"replica processes outlived the router: {leaked}\n{self.log()[-2000:]}")
        self._kill_survivors()
        if tmpdir is not None:
            shutil.rmtree(tmpdir, ignore_errors=True)
            self.tmpdir = None
        if problems and check:
            raise AssertionError("\n".join(problems))

    def wait_replicas_gone(self, timeout: float) -> list[int]:
        """Wait until every replica process seen so far has exited; return the ones left."""
        end = time.monotonic() + timeout
        while True:
            left = [p for p, t in self._seen.items() if alive(p, t)]
            if not left or time.monotonic() >= end:
                return left
            time.sleep(0.05)

    def _kill_survivors(self) -> None:
        for p, t in self._seen.items():
            if alive(p, t):
                try:
                    os.kill(p, signal.SIGKILL)
                except ProcessLookupError:
                    pass

    def _remember(self, pids: list[int]) -> None:
        for p in pids:
            st = proc_stat(p)
            if st is not None:
                self._seen.setdefault(p, st.start_time)

    def __enter__(self) -> RouterProcess:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop(check=exc[0] is None)

    def log(self) -> str:
        try:
            return self.log_path.read_text(errors="replace")
        except FileNotFoundError:
            return ""

    def records(self, logger: str | None = None) -> list[dict[str, Any]]:
        """The log's JSON lines (those of ``logger``), parsed; lines that are
        not JSON (a replica engine's own output) are skipped."""
        out = []
        for line in self.log().splitlines():
            if line.startswith("{"):
                try:
                    rec = msgspec.json.decode(line)
                except msgspec.DecodeError:
                    continue  # (a line being written)
                if logger is None or rec.get("logger") == logger:
                    out.append(rec)
        return out

    # -- replicas --------------------------------------------------------------

    def replica_pids(self) -> dict[str, int]:
        """Replica processes the router runs now, by replica name."""
        out: dict[str, int] = {}
        for p in children(self.pid):
            if not alive(p):
                continue
            args = cmdline(p)
            if "replicas" not in args or "--socket" not in args:
                continue
            sock = args[args.index("--socket") + 1]
            out[Path(sock).stem] = p
        self._remember(list(out.values()))
        return out

    def wait_replica_pid(self, name: str, *, other_than: int | None = None, timeout: float = 15.0) -> int:
        return poll(
            lambda: (p := self.replica_pids().get(name)) is not None and p != other_than and p,
            timeout, what=f"a replica process for {name} other than {other_than}",
        )

    def kill_replica(self, name: str, sig: int = signal.SIGKILL) -> int:
        pid = self.replica_pids()[name]
        os.kill(pid, sig)
        return pid

    # -- HTTP ----------------------------------------------------------------

    def metrics(self) -> MetricsSnapshot:
        r = httpx.get(self.base_url + "/metrics", timeout=5)
        r.raise_for_status()
        return MetricsSnapshot(r.text)

    async def ametrics(self, client: httpx.AsyncClient | None = None) -> MetricsSnapshot:
        if client is None:
            async with httpx.AsyncClient(timeout=5) as c:
                r = await c.get(self.base_url + "/metrics")
        else:
            r = await client.get(self.base_url + "/metrics")
        r.raise_for_status()
        return MetricsSnapshot(r.text)

    def running(self, replica: str) -> float:
        """Running requests ``replica`` last reported (``fairstream_replica_running_requests``)."""
        return self.metrics().value("fairstream_replica_running_requests", replica=replica)

    def inflight(self, replica: str) -> float:
        """Requests the router has on ``replica`` (``fairstream_replica_inflight_requests``)."""
        return self.metrics().value("fairstream_replica_inflight_requests", replica=replica)


@contextlib.asynccontextmanager
async def holding_stream(client: httpx.AsyncClient, headers: dict[str, str], body: dict) -> AsyncIterator[None]:
    """A streamed ``/v1/completions`` of ``body`` held open while inside
    (its first bytes have come when the block starts), cancelled at its end:
    a tenant's stream that keeps a replica's slot or its concurrency busy."""
    started = asyncio.Event()

    async def hold() -> None:
        async with client.stream("POST", "/v1/completions", headers=headers, json=body) as r:
            assert r.status_code == 200, await r.aread()
            async for _ in r.aiter_bytes():
                started.set()

    holder = asyncio.create_task(hold())
    try:
        await asyncio.wait_for(started.wait(), 10)
        yield
    finally:
        holder.cancel()
        await asyncio.gather(holder, return_exceptions=True)


def write_tenants(path: Path, tenants: dict[str, Any]) -> Path:
    """A tenants file at ``path`` of ``tenants`` (their keys hashed by the
    caller) with ``ADMIN`` as its admin key."""
    path.write_text(yaml.safe_dump({"admin_keys": [hash_key(ADMIN)], "tenants": tenants}, sort_keys=False))
    return path
