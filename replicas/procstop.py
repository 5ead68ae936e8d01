"""The stop of a replica's process and its process group.

A replica runs in a process group of its own (``start_new_session``): its
engine's processes (vLLM's engine core and workers) are in it too. A clean
stop signals the replica's process first and lets it stop them, as vLLM's
own shutdown does; what is left then gets the group's SIGTERM, then SIGKILL.
And a child the router starts stops with it (``die_with_parent``).
"""

from __future__ import annotations

import asyncio
import ctypes
import os
import signal

__all__ = ["GROUP_GRACE", "die_with_parent", "stop_process"]

_PR_SET_PDEATHSIG = 1

GROUP_GRACE = 2.0  # seconds what is left of a replica's process group gets after SIGTERM, before SIGKILL


def die_with_parent() -> None:
    """preexec_fn: the child gets SIGTERM when its parent dies (Linux)."""
    try:
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(_PR_SET_PDEATHSIG, signal.SIGTERM)
    except OSError:
        pass


async def stop_process(proc: asyncio.subprocess.Process, grace: float) -> None:
    """Stop a replica's process and its group. A clean stop SIGTERMs the
    replica's process alone and gives it ``grace`` seconds to stop its
    engine's processes itself (vLLM: its front end stops the engine core,
    which stops its workers; a SIGTERM to the whole group at once killed a
    worker under its engine core, which logged ERROR tracebacks); then what
    is left of the group (the replica did not stop in time, or left
    children) gets SIGTERM and ``GROUP_GRACE`` seconds. Then the group is
    SIGKILLed: at once with ``grace`` 0 (a frozen replica) or a process that
    had exited already (killed: its engine's children outlive it), and
    always last, a sweep."""
    if proc.returncode is None and grace > 0:
        _signal_one(proc.pid, signal.SIGTERM)
        try:
            await asyncio.wait_for(proc.wait(), grace)
        except asyncio.TimeoutError:
            pass
        _signal_group(proc.pid, signal.SIGTERM)
        await _group_gone(proc.pid, GROUP_GRACE)
    _signal_group(proc.pid, signal.SIGKILL)
    await proc.wait()


def _signal_one(pid: int, sig: int) -> None:
    try:
        os.kill(pid, sig)
    except (ProcessLookupError, PermissionError):
        pass


async def _group_gone(pgid: int, timeout: float) -> None:
    """Wait up to ``timeout`` seconds for process group ``pgid`` to have no
    running process left."""
    loop = asyncio.get_running_loop()
    end = loop.time() + timeout
    while loop.time() < end and _group_running(pgid):
        await asyncio.sleep(0.02)


def _group_running(pgid: int) -> bool:
    try:
        os.killpg(pgid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # (none of it is ours to wait for)
        return False
    # A zombie counts for killpg: the children of a replica that exited are
    # init's, which may reap them a second later (a container's init polls).
    try:
        entries = os.scandir("/proc")
    except OSError:
        return True
    with entries:
        for entry in entries:
            if not entry.name.isdigit():
                continue
            try:
                with open(f"/proc/{entry.name}/stat", "rb") as f:
                    fields = f.read().rpartition(b")")[2].split()
            except OSError:  # (gone meanwhile)
                continue
            if len(fields) > 2 and int(fields[2]) == pgid and fields[0] not in (b"Z", b"X"):
                return True
    return False


def _signal_group(pgid: int, sig: int) -> None:
    try:
        os.killpg(pgid, sig)
    except (ProcessLookupError, PermissionError):
        pass
