"""What the operator's signals do to ``fairstream serve``: a second Ctrl-C
(SIGINT) quits at once, yet still stops the replicas, removes the run
directory, tells the running streams why they end and exits with 130; a
SIGHUP (systemd's reload) from the first lines of serve's own code on (the
interpreter's start before them cannot be helped) never kills it."""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx
import pytest
import yaml

from tests.helpers import GOLD, MODEL, STARTUP_WAIT, RouterProcess, aiter_sse, alive, descendants, free_port, poll

AUTH = {"authorization": f"Bearer {GOLD}"}
BODY = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 1000,
        "ignore_eos": True, "stream": True}  # ~20 s at 20 ms a token: outlives everything here
SIM = {"model": MODEL, "seed": 0, "step_base_ms": 20}
HUP = 1 << (signal.SIGHUP - 1)  # its bit in /proc/PID/status's signal masks


async def _stream(base_url: str, started: asyncio.Event) -> list[dict]:
    """The events of one long stream, until it ends or is cut."""
    events: list[dict] = []
    async with httpx.AsyncClient(base_url=base_url, headers=AUTH, timeout=30) as http:
        try:
            async with http.stream("POST", "/v1/chat/completions", json=BODY) as r:
                async for ev in aiter_sse(r):
                    events.append({"done": True} if ev.data == "[DONE]" else ev.json())
                    started.set()
        except httpx.HTTPError as e:  # (cut without a word)
            events.append({"cut": repr(e)})
    return events


def _quiet(log: str) -> None:
    """No ERROR line and no traceback for a stop the operator asked for."""
    errors = [line for line in log.splitlines()
              if '"level":"error"' in line.replace(" ", "").lower() or "Traceback" in line or "CancelledError" in line]
    assert not errors, "\n".join(errors)[-4000:]


async def test_a_second_sigint_quits_at_once_and_cleanly(make_router) -> None:
    # the demo config's shutdown grace (20 s): the second Ctrl-C does not wait it out
    router = make_router(replicas=2, sim={"step_base_ms": 20}, settings={"shutdown_grace": 20})
    replicas = list(router.replica_pids().values())
    run_dirs = list(router.tmpdir.glob("fairstream-*"))
    assert run_dirs, list(router.tmpdir.iterdir())
    started = asyncio.Event()
    stream = asyncio.create_task(_stream(router.base_url, started))
    await asyncio.wait_for(started.wait(), 10)
    router.proc.send_signal(signal.SIGINT)
    await asyncio.sleep(1.0)
    assert router.proc.poll() is None, "the first SIGINT waits for the stream"
    t = time.monotonic()
    router.proc.send_signal(signal.SIGINT)
    events = await asyncio.wait_for(stream, 10)
    code = await asyncio.to_thread(router.proc.wait, 10)
    took = time.monotonic() - t
    log = router.log()
    assert code == 130, (code, log[-3000:])
    assert took < 8, f"the second SIGINT took {took:.1f}s to quit"
    last = events[-1]
    assert last.get("error", {}).get("code") == "router_shutdown", events[-3:]
    assert "forced" in log or "second SIGINT" in log
    _quiet(log)
    assert not [p for p in replicas if alive(p)], "replicas outlived the router"
    assert not [d for d in run_dirs if d.exists()], f"run directory left: {run_dirs}"


def _workers_config(tmp_path: Path, redis_url: str) -> tuple[Path, int]:
    port = free_port()
    path = tmp_path / "router.yaml"
    path.write_text(yaml.safe_dump({
        "host": "127.0.0.1", "port": port, "tenants": str(Path(__file__).resolve().parents[2] / "configs/tenants.yaml"),
        "state": {"backend": "redis", "url": redis_url}, "shutdown_grace": 20,
        "replicas": [{"name": f"sim-{i}", "engine": "sim", "config": SIM} for i in range(2)],
    }))
    return path, port


def _serve(args: list[str], log: Path, tmpdir: str, *, entry: list[str] | None = None,
           preexec_fn=None) -> subprocess.Popen:
    """``fairstream serve`` in a session of its own, as at a terminal (a
    Ctrl-C reaches its whole process group)."""
    with open(log, "ab") as out:
        return subprocess.Popen(
            [*(entry or [sys.executable, "-m", "router.cli"]), "serve", *args],
            stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, start_new_session=True,
            env=dict(os.environ, TMPDIR=tmpdir, PYTHONUNBUFFERED="1"), preexec_fn=preexec_fn,
        )


def _serve_workers(tmp_path: Path, redis_url: str) -> tuple[subprocess.Popen, str, str]:
    """``serve --workers 2`` on a free port: (the process, its base URL, its TMPDIR)."""
    config, port = _workers_config(tmp_path, redis_url)
    tmpdir = tempfile.mkdtemp(prefix="fst-")
    proc = _serve(["--config", str(config), "--workers", "2"], tmp_path / "router.log", tmpdir)
    return proc, f"http://127.0.0.1:{port}", tmpdir


def _ready(base_url: str) -> bool:
    try:
        return httpx.get(base_url + "/ready", timeout=2).status_code == 200
    except httpx.HTTPError:
        return False


def _reap(proc: subprocess.Popen, kids: list[int]) -> list[int]:
    """Kill whatever of ``proc`` and ``kids`` still runs; return those that did."""
    left = [p for p in kids if alive(p)]
    for pid in [*left, *([proc.pid] if proc.poll() is None else [])]:
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    proc.wait(10)
    return left


@pytest.mark.parametrize("to", ["group", "parent"])
async def test_a_second_sigint_quits_workers_at_once_and_cleanly(to, tmp_path, redis_server) -> None:
    # "group": Ctrl-C at a terminal, to every process of the foreground
    # group (the workers too, one of them maybe still starting: it quits
    # quietly); "parent": `kill -INT`, to serve alone
    proc, base, tmpdir = _serve_workers(tmp_path, redis_server.url)
    kids: list[int] = []
    try:
        poll(lambda: _ready(base), STARTUP_WAIT, what="workers ready")
        kids = descendants(proc.pid)
        assert list(Path(tmpdir).glob("fairstream-*"))
        started = asyncio.Event()
        stream = asyncio.create_task(_stream(base, started))
        await asyncio.wait_for(started.wait(), 10)
        interrupt = (lambda: os.killpg(proc.pid, signal.SIGINT)) if to == "group" else (
            lambda: proc.send_signal(signal.SIGINT))
        interrupt()
        await asyncio.sleep(1.0)
        assert proc.poll() is None, "the first Ctrl-C waits for the stream"
        t = time.monotonic()
        interrupt()
        events = await asyncio.wait_for(stream, 10)
        code = await asyncio.to_thread(proc.wait, 10)
        took = time.monotonic() - t
        log = (tmp_path / "router.log").read_text()
        assert code == 130, (code, log[-3000:])
        assert took < 8, f"the second SIGINT took {took:.1f}s to quit"
        assert events[-1].get("error", {}).get("code") == "router_shutdown", events[-3:]
        _quiet(log)
        # (the parent's forward read as a third SIGINT where Ctrl-C reached the workers too)
        assert "SIGINT again" not in log, log[-3000:]
        poll(lambda: not any(alive(p) for p in kids), 5, what="workers and replicas to exit")
        assert not list(Path(tmpdir).iterdir()), list(Path(tmpdir).iterdir())
    finally:
        left = _reap(proc, kids)
        subprocess.run(["rm", "-rf", tmpdir], check=False)
    assert not left


def _hup_state(pid: int) -> str | None:
    """"ignored", "caught" or "default": what SIGHUP does to the process now (None: it is gone)."""
    try:
        with open(f"/proc/{pid}/status") as f:
            fields = dict(line.split(":", 1) for line in f if ":" in line)
    except (FileNotFoundError, ProcessLookupError):
        return None
    if int(fields["SigIgn"], 16) & HUP:
        return "ignored"
    return "caught" if int(fields["SigCgt"], 16) & HUP else "default"


@pytest.mark.parametrize("command", ["serve", "check-config", "hash-key", None])
def test_serve_ignores_sighup_from_the_entry_points_import(command) -> None:
    # the console script and ``python -m router.cli`` both import router.cli
    # first: for serve its first lines ignore SIGHUP, before argparse, the
    # replica command's imports (asyncio, msgspec) and the version's lookup
    # (~0.1 s, in which a SIGHUP killed it); the other commands, and a
    # program that imports it, keep the default (a terminal's hangup ends them)
    code = ("import signal, sys; import router.cli; "
            "print(signal.getsignal(signal.SIGHUP) is signal.SIG_IGN, 'asyncio' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code, *([command] if command else [])], capture_output=True,
                         text=True, timeout=30)
    assert out.stdout.split() == [str(command == "serve"), "False"], out


async def _hup_from_the_start(proc: subprocess.Popen, base_url: str) -> list[str]:
    """SIGHUP ``proc`` as soon as it leaves SIGHUP's default action behind,
    then every 10 ms until it serves; the states SIGHUP found."""
    seen: list[str] = []
    deadline = time.monotonic() + STARTUP_WAIT
    while time.monotonic() < deadline:
        state = _hup_state(proc.pid)
        if state is None or proc.poll() is not None:
            break
        if state != "default":
            proc.send_signal(signal.SIGHUP)
            if not seen or seen[-1] != state:
                seen.append(state)
            if state == "caught" and await asyncio.to_thread(_ready, base_url):
                break
            await asyncio.sleep(0.01)
        else:
            await asyncio.sleep(0.0005)
    return seen


@pytest.mark.parametrize("entry", ["module", "script"])
async def test_sighup_while_the_router_starts_does_not_kill_it(entry, tmp_path) -> None:
    r = RouterProcess(tmp_path / "r", replicas=1, sim={"step_base_ms": 1})
    port = free_port()
    command = [sys.executable, "-m", "router.cli"] if entry == "module" else [str(Path(sys.executable).parent / "fairstream")]
    tmpdir = tempfile.mkdtemp(prefix="fst-")
    proc = _serve(["--config", str(r.config_path), "--port", str(port)], tmp_path / "router.log", tmpdir,
                  entry=command)
    base = f"http://127.0.0.1:{port}"
    kids: list[int] = []
    try:
        seen = await _hup_from_the_start(proc, base)
        log = (tmp_path / "router.log").read_text()
        assert proc.poll() is None, (proc.returncode, seen, log[-3000:])
        assert seen == ["ignored", "caught"], seen
        poll(lambda: _ready(base), STARTUP_WAIT, what="the router ready")
        kids = descendants(proc.pid)
        async with httpx.AsyncClient(base_url=base, headers=AUTH, timeout=30) as http:
            r = await http.post("/v1/chat/completions", json={**BODY, "max_tokens": 3, "stream": False})
            assert r.status_code == 200, r.text
        proc.send_signal(signal.SIGTERM)
        assert await asyncio.to_thread(proc.wait, 15) in (0, -signal.SIGTERM)
    finally:
        left = _reap(proc, kids)
        subprocess.run(["rm", "-rf", tmpdir], check=False)
    assert not left


async def test_sighup_while_workers_start_does_not_kill_them(tmp_path, redis_server) -> None:
    proc, base, tmpdir = _serve_workers(tmp_path, redis_server.url)
    kids: list[int] = []
    try:
        seen = await _hup_from_the_start(proc, base)
        log = (tmp_path / "router.log").read_text()
        assert proc.poll() is None, (proc.returncode, seen, log[-3000:])
        assert seen[0] == "ignored", seen
        poll(lambda: _ready(base), STARTUP_WAIT, what="workers ready")
        kids = descendants(proc.pid)
        # the workers got the parent's SIGHUPs as they started: none died of one
        assert "exited with" not in log, log[-3000:]
        workers = [p for p in kids if "router.worker" in open(f"/proc/{p}/cmdline").read()]
        poll(lambda: all(_hup_state(p) == "caught" for p in workers), 20, what="the workers' reload handlers")
        assert len(workers) == 2, workers
        proc.send_signal(signal.SIGTERM)
        assert await asyncio.to_thread(proc.wait, 30) == 0
    finally:
        left = _reap(proc, kids)
        subprocess.run(["rm", "-rf", tmpdir], check=False)
    assert not left



def test_sigint_exits_130_when_serve_started_with_sigint_ignored(tmp_path) -> None:
    # (a non-interactive shell starts what it puts in the background with
    # SIGINT ignored; uvicorn raised the signal again under that, to no
    # effect, and serve exited 0 after a `kill -INT`)
    port = free_port()
    config = tmp_path / "router.yaml"
    config.write_text(yaml.safe_dump({
        "host": "127.0.0.1", "port": port, "tenants": str(Path(__file__).resolve().parents[2] / "configs/tenants.yaml"),
        "replicas": [{"name": "sim-0", "engine": "sim", "config": SIM}],
    }))
    tmpdir = tempfile.mkdtemp(prefix="fst-")
    proc = _serve(["--config", str(config)], tmp_path / "router.log", tmpdir,
                  preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_IGN))
    kids: list[int] = []
    try:
        poll(lambda: _ready(f"http://127.0.0.1:{port}"), STARTUP_WAIT, what="router ready")
        kids = descendants(proc.pid)
        proc.send_signal(signal.SIGINT)
        assert proc.wait(30) == 130, (tmp_path / "router.log").read_text()[-3000:]
    finally:
        left = _reap(proc, kids)
        subprocess.run(["rm", "-rf", tmpdir], check=False)
    assert not left
