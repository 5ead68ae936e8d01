"""Processes the benchmark starts, and what /proc says about them.

Every process runs in its own session (process group), so ``Proc.stop``
ends exactly the tree it started. CPU and memory come from ``/proc``:
``utime + stime`` of the process and every live descendant (plus the reaped
children's ``cutime + cstime``), and the sum of their ``VmRSS``.
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import time
import urllib.error
import urllib.request
from pathlib import Path

__all__ = ["Proc", "free_port", "tree_pids", "cpu_seconds", "rss_bytes", "wait_http", "http_json", "loadavg"]

_TCK = os.sysconf("SC_CLK_TCK")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def loadavg() -> float:
    return float(Path("/proc/loadavg").read_text().split()[0])


class Proc:
    """One started process (and its group), its log file and its stats."""

    def __init__(self, name: str, cmd: list[str], log: Path, env: dict[str, str] | None = None,
                 cwd: str | None = None) -> None:
        self.name = name
        self.cmd = cmd
        self.log = log
        full_env = dict(os.environ)
        if env:
            full_env.update(env)
        self._logf = open(log, "ab")
        self.popen = subprocess.Popen(cmd, stdout=self._logf, stderr=subprocess.STDOUT, env=full_env, cwd=cwd,
                                      start_new_session=True, stdin=subprocess.DEVNULL)
        self.pid = self.popen.pid

    def alive(self) -> bool:
        return self.popen.poll() is None

    def pids(self) -> list[int]:
        return tree_pids(self.pid)

    def cpu(self) -> float:
        return cpu_seconds(self.pid)

    def sys_cpu(self) -> float:
        return cpu_seconds(self.pid, system_only=True)

    def rss(self) -> int:
        return rss_bytes(self.pids())

    def stop(self, timeout: float = 8.0) -> None:
        """SIGTERM the process group, SIGKILL it after ``timeout``; never raises."""
        if self.popen.poll() is None:
            self._signal(signal.SIGTERM)
            try:
                self.popen.wait(timeout)
            except subprocess.TimeoutExpired:
                self._signal(signal.SIGKILL)
                try:  # a process with thousands of sockets can take a while to go
                    self.popen.wait(60)
                except subprocess.TimeoutExpired:
                    print(f"warning: {self.name} (pid {self.pid}) still alive after SIGKILL", flush=True)
        self._signal(signal.SIGKILL)  # stragglers of the group (children of a dead leader)
        if not self._logf.closed:
            self._logf.close()

    def _signal(self, sig: int) -> None:
        try:
            os.killpg(self.pid, sig)
        except (ProcessLookupError, PermissionError):
            pass

    def tail(self, n: int = 20) -> str:
        try:
            lines = self.log.read_text(errors="replace").splitlines()
        except OSError:
            return ""
        return "\n".join(lines[-n:])


def _stat(pid: int) -> list[str] | None:
    try:
        raw = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    # comm may contain spaces and parentheses: split after the last ')'
    return raw[raw.rfind(")") + 2 :].split()


def tree_pids(root: int) -> list[int]:
    """``root`` and all its live descendants."""
    children: dict[int, list[int]] = {}
    for entry in os.scandir("/proc"):
        if not entry.name.isdigit():
            continue
        st = _stat(int(entry.name))
        if st is None:
            continue
        children.setdefault(int(st[1]), []).append(int(entry.name))
    out = [root]
    i = 0
    while i < len(out):
        out.extend(children.get(out[i], ()))
        i += 1
    return out


def cpu_seconds(root: int, system_only: bool = False) -> float:
    """User + system CPU seconds of ``root``, its live descendants and its
    reaped children; ``system_only``: the kernel's part alone (system calls,
    and on loopback the TCP work of delivering what they write)."""
    total = 0
    for pid in tree_pids(root):
        st = _stat(pid)
        if st is None:
            continue
        # fields after comm: state(0) ppid(1) ... utime(11) stime(12) cutime(13) cstime(14)
        total += int(st[12]) if system_only else int(st[11]) + int(st[12])
        if pid == root:
            total += int(st[14]) if system_only else int(st[13]) + int(st[14])
    return total / _TCK


def rss_bytes(pids: list[int]) -> int:
    total = 0
    for pid in pids:
        try:
            for line in Path(f"/proc/{pid}/status").read_text().splitlines():
                if line.startswith("VmRSS:"):
                    total += int(line.split()[1]) * 1024
                    break
        except OSError:
            continue
    return total


def http_json(url: str, data: bytes | None = None, timeout: float = 5.0, headers: dict[str, str] | None = None):
    req = urllib.request.Request(url, data=data, headers=headers or {"content-type": "application/json"})
    with urllib.request.urlopen(req, timeout=timeout) as r:
        return r.status, r.read()


def wait_http(url: str, timeout: float, proc: Proc | None = None, headers: dict[str, str] | None = None) -> bool:
    """Poll ``url`` until it answers 200 (False on timeout or if ``proc`` died)."""
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        if proc is not None and not proc.alive():
            return False
        try:
            status, _ = http_json(url, timeout=2.0, headers=headers)
            if status == 200:
                return True
        except (urllib.error.URLError, OSError, ConnectionError):
            pass
        time.sleep(0.2)
    return False
