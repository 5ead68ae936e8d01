"""The router's run directories in the temp dir, and the sweep of those a
killed router left behind.

A router makes ``fairstream-*`` directories under ``tempfile.gettempdir()``:
the supervisor's (local replicas' Unix sockets) and, for ``serve --workers``,
the parent's run and prometheus_client metrics directories. A clean stop
removes them; a SIGKILL or an OOM kill does not, so ``make_run_dir`` writes
an owner marker into each (pid, and the start time from ``/proc/<pid>/stat``
so that a reused pid is not taken for the owner), and ``sweep`` removes the
directories whose owner is dead. It runs where a router makes its first run
directory. It leaves alone whatever it cannot judge: a directory without a
valid marker (older versions, other programs, one still being made), one
of another user, a symlink, and a marker written under another boot (a
reboot with a /tmp that persists, or another host on a shared /tmp) or in
another pid namespace (a container sharing /tmp), where the pid means
another process. Without /proc (macOS) there are no markers and no sweep.

``make_ipc_dir`` makes, in the supervisor's run directory, one directory per
local vLLM replica process for its engine's ZMQ IPC sockets (``IPC_ENV``),
which the supervisor removes when that process stops (or, where a path in
one would be too long for a Unix socket, gives the run directory itself).

This lives in ``replicas/`` beside the supervisor so that both it and
``router.workers`` import it (``replicas`` imports nothing from ``router``).
"""

from __future__ import annotations

import logging
import os
import shutil
import stat
import tempfile

import msgspec

__all__ = ["PREFIX", "MARKER", "IPC_ENV", "Owner", "ProcFs", "make_ipc_dir", "make_run_dir", "sweep"]

log = logging.getLogger("fairstream.rundirs")

PREFIX = "fairstream-"  # every run directory's name starts with it
MARKER = ".fairstream-owner"  # the owner marker's file name inside a run directory
_MARKER_MAX = 4096  # (bytes) a longer file is no marker of ours
# vLLM's V1 engine binds its ZMQ IPC sockets at $VLLM_RPC_BASE_PATH/<uuid4>
# (vllm.utils.network_utils.get_open_zmq_ipc_path; default: the temp dir) and
# removes none when it is killed (nor all of them at a clean stop)
IPC_ENV = "VLLM_RPC_BASE_PATH"
_IPC_PREFIX = "ipc-"
# (bytes) the longest AF_UNIX path (sun_path holds 108 with its NUL), and an
# engine socket's path under an IPC directory: /ipc-XXXXXXXX/ and a uuid4
_UNIX_PATH_MAX = 107
_UUID_LEN = 36
_IPC_SUFFIX = len("/" + _IPC_PREFIX + "XXXXXXXX/") + _UUID_LEN


class Owner(msgspec.Struct, frozen=True):
    """The content of a run directory's marker: the process that made it."""

    pid: int
    start_time: int  # /proc/<pid>/stat field 22: clock ticks after boot
    boot_id: str  # /proc/sys/kernel/random/boot_id: start times count from this boot
    pid_ns: str  # readlink /proc/self/ns/pid: the namespace the pid belongs to


class ProcFs:
    """What the sweep reads of /proc (``root``: a fake tree in tests)."""

    def __init__(self, root: str = "/proc") -> None:
        self.root = root

    def start_time(self, pid: int) -> int | None:
        """Start time of the running process ``pid``; None if there is none
        (a zombie is dead: it only waits for its parent to reap it)."""
        try:
            with open(os.path.join(self.root, str(pid), "stat"), "rb") as f:
                raw = f.read()
        except OSError:  # (no such process; ESRCH while it exits)
            return None
        # comm, field 2, is in parentheses and may hold spaces and ')'
        fields = raw[raw.rindex(b")") + 2 :].split()
        if fields[0] in (b"Z", b"X", b"x"):
            return None
        return int(fields[19])  # field 22, the 20th after comm

    def owner(self, pid: int) -> Owner | None:
        """The marker for the running process ``pid``; None without /proc."""
        start = self.start_time(pid)
        if start is None:
            return None
        try:
            with open(os.path.join(self.root, "sys", "kernel", "random", "boot_id")) as f:
                boot_id = f.read().strip()
            pid_ns = os.readlink(os.path.join(self.root, "self", "ns", "pid"))
        except OSError:
            return None
        return Owner(pid, start, boot_id, pid_ns)


def make_run_dir(prefix: str = PREFIX, proc: ProcFs | None = None, tmp: str | None = None) -> str:
    """``tempfile.mkdtemp(prefix=prefix)`` with this process's owner marker
    in it (none without /proc: such a directory is never swept)."""
    path = tempfile.mkdtemp(prefix=prefix, dir=tmp)
    owner = (proc or ProcFs()).owner(os.getpid())
    if owner is not None:
        # written whole or not at all: a sweep never reads half a marker
        part = os.path.join(path, MARKER + ".part")
        with open(part, "wb") as f:
            f.write(msgspec.json.encode(owner))
        os.replace(part, os.path.join(path, MARKER))
    return path


def make_ipc_dir(run_dir: str) -> tuple[str, bool] | None:
    """Where one vLLM engine's IPC sockets go, and whether that directory is
    its own (to remove when its process stops): a new directory in
    ``run_dir``; else, where a socket's path in one would be longer than a
    Unix socket path can be (the engine would fail to start), ``run_dir``
    itself if one fits there (removed with the run dir: at the router's
    stop, or by the sweep of a killed router's); else None (the engine's
    default, the temp dir, where nothing removes them)."""
    size = len(os.fsencode(run_dir))
    if size + _IPC_SUFFIX <= _UNIX_PATH_MAX:
        return tempfile.mkdtemp(prefix=_IPC_PREFIX, dir=run_dir), True
    if size + 1 + _UUID_LEN <= _UNIX_PATH_MAX:
        return run_dir, False
    return None


def sweep(tmp: str | None = None, proc: ProcFs | None = None) -> int:
    """Remove the run directories in ``tmp`` (the temp dir) whose owner is
    dead; return how many. Never raises for a directory it cannot read or
    that vanishes meanwhile (another router sweeping, its owner stopping)."""
    proc = proc or ProcFs()
    tmp = tmp or tempfile.gettempdir()
    here = proc.owner(os.getpid())
    if here is None:  # no /proc: nothing to judge a marker by
        return 0
    try:
        names = [n for n in os.listdir(tmp) if n.startswith(PREFIX)]
    except OSError as e:
        log.warning("cannot list %s for stale run directories: %s", tmp, e)
        return 0
    removed = 0
    for name in names:
        path = os.path.join(tmp, name)
        owner = _marker(path)
        if owner is None or owner.boot_id != here.boot_id or owner.pid_ns != here.pid_ns:
            continue
        if proc.start_time(owner.pid) == owner.start_time:
            continue  # its owner runs
        # (rmtree refuses a symlink and removes by file descriptor, so a
        # swap of the checked directory for a symlink removes nothing else)
        shutil.rmtree(path, ignore_errors=True)
        if not os.path.lexists(path):
            removed += 1
    if removed:
        log.info("removed %d run director%s left in %s by routers that died", removed,
                 "y" if removed == 1 else "ies", tmp)
    return removed


def _marker(path: str) -> Owner | None:
    """The owner in ``path``'s marker, if ``path`` is a directory (not a
    symlink) of this user with a valid marker (a regular file of this user)."""
    uid = os.getuid()
    try:
        dfd = os.open(path, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW)
    except OSError:  # a symlink, not a directory, gone, not ours to read
        return None
    try:
        if os.fstat(dfd).st_uid != uid:
            return None
        # (O_NONBLOCK: a FIFO in its place must not hang the router's start)
        fd = os.open(MARKER, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK, dir_fd=dfd)
        try:
            st = os.fstat(fd)
            if not stat.S_ISREG(st.st_mode) or st.st_uid != uid or st.st_size > _MARKER_MAX:
                return None
            raw = os.read(fd, _MARKER_MAX + 1)
        finally:
            os.close(fd)
    except OSError:
        return None
    finally:
        os.close(dfd)
    try:
        owner = msgspec.json.decode(raw, type=Owner)
    except msgspec.DecodeError:
        return None
    return owner if owner.pid > 0 else None
