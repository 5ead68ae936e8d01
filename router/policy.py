"""The live tenant policy and its reloads.

``PolicyRegistry`` holds one immutable ``PolicySnapshot`` (tenants, effective
policies, key index). A reload validates the new file whole and swaps the
reference: requests in flight keep the snapshot they started with, new
requests see the new one at once (but for what belongs to the tenant rather
than to a request: requests waiting for their limits ask with the new
limits, ``Admission.follow``, and the fair-share order of the queued ones
follows the tenant's new weight and class, ``Scheduler.follow``). A bad file keeps the old snapshot and
records why. Reloads come from file changes (watchfiles), SIGHUP and
``POST /admin/reload``; the registry owns the watcher task.
"""

from __future__ import annotations

import asyncio
import errno
import hashlib
import logging
import signal
import time
from collections.abc import Callable
from pathlib import Path

import msgspec

from router.auth import KeyIndex
from router.background import spawn
from router.stopping import stop
from router.configfile import ConfigError, load_yaml, read_text
from router.tenants import TenantPolicy, TenantsFile
from router.tenants_parse import ParseUnavailable, decode, parse_elsewhere

__all__ = ["PolicySnapshot", "PolicyRegistry", "ReloadResult"]

log = logging.getLogger("fairstream.policy")
logging.getLogger("watchfiles").setLevel(logging.WARNING)  # it logs every change at INFO

SETTLE = 0.2  # the watcher reads the file once it has not changed for this long
SETTLE_MAX = 2.0  # (or this long after the change it saw, for a file written on and on)
# A reload that failed for a reason of the moment (the open-file limit, the
# parse process killed) is tried again on its own, after 1, 2, 4, 8 and 16 s
# (about half a minute), then left to the next change, SIGHUP or POST /admin/reload.
RETRY_FIRST = 1.0
RETRIES = 5
_PASSING = {errno.EMFILE, errno.ENFILE, errno.ENOMEM, errno.EAGAIN, errno.EINTR}


class PolicySnapshot:
    __slots__ = ("file", "tenants", "keys", "loaded_at", "version", "digest")

    def __init__(self, file: TenantsFile, version: int, text: str = "") -> None:
        self.file = file
        self.tenants: dict[str, TenantPolicy] = file.policies()
        self.keys = KeyIndex(file)
        self.loaded_at = time.time()
        self.version = version  # (this process's count of reloads)
        # the file's own fingerprint: routers sharing a state store must show
        # the same one (each admits with its own limits against shared buckets)
        self.digest = hashlib.sha256(text.encode()).hexdigest()[:16]


class ReloadResult(msgspec.Struct):
    """What a reload did: ``ok`` (the file is valid and in force), the
    ``version`` in force, the ``errors`` (``file:line: key: reason``) and
    whether a new policy took effect (``changed``: false when the file was
    unchanged or invalid). ``ok`` false with ``changed`` true: the new
    policy is in force, but what follows it failed part way (``_swap``)."""

    ok: bool
    version: int
    errors: list[str] = []
    changed: bool = True


class PolicyRegistry:
    def __init__(self, path: Path, on_reload: Callable[[bool, bool], None] | None = None) -> None:
        self.path = Path(path)
        # (one read: the text compared at start() is the text in force; None:
        # a text whose reload failed part way, which a reload applies again)
        self._text: str | None = read_text(self.path)
        file, _ = load_yaml(self.path, TenantsFile, self._text)  # a bad file at start is fatal
        self.current = PolicySnapshot(file, 1, self._text)
        self.last_errors: list[str] = []
        # on_reload(ok, changed): after each reload that read the file (changed: a new policy is in force)
        self._on_reload = on_reload or (lambda ok, changed: None)
        self._watch: asyncio.Task[None] | None = None
        self._signalled: set[asyncio.Task[ReloadResult]] = set()  # reloads SIGHUP started
        self._stop = asyncio.Event()
        self._one_at_a_time = asyncio.Lock()
        self.retry_first = RETRY_FIRST
        self._retry: asyncio.Task[None] | None = None  # the next try of a reload that failed for the moment
        self._retries = 0  # (tries in a row that failed for the moment)

    async def reload(self) -> ReloadResult:
        """Re-read the file; swap on success, keep the old policy on failure.
        The file is read in a thread and parsed in a child process
        (``router.tenants_parse``): a large one (or one that takes long to
        reject) does not hold up the streams meanwhile."""
        async with self._one_at_a_time:
            try:
                text = await asyncio.to_thread(read_text, self.path)
                if text == self._text:
                    self._no_retry()
                    if self.last_errors:  # put back as it was after a failed reload: valid, and nothing changed
                        self._restored()
                    return ReloadResult(True, self.current.version, changed=False)
                answer = await parse_elsewhere(self.path, text)
                # (the structs, its policies and key index in a thread: ~60 ms for 5,000 tenants)
                snapshot = await asyncio.to_thread(_snapshot, answer, self.path, self.current.version + 1, text)
            except ConfigError as e:
                if _for_the_moment(e):
                    self._try_again()
                else:
                    self._no_retry()
                return self._failed(e.errors)
            except Exception as e:  # noqa: BLE001 - a bug: the old policy stays, and the reload says so
                log.exception("tenant policy reload of %s failed unexpectedly", self.path)
                self._no_retry()
                return self._failed([f"{self.path}: the reload failed: {type(e).__name__}: {e} (see the log)"])
            self._no_retry()
            return self._swap(snapshot, text)

    def _no_retry(self) -> None:
        """This reload's outcome owes nothing to the moment: no retry waits
        (one would only read the same file again), and the tries count anew."""
        self._retries = 0
        task, self._retry = self._retry, None
        if task is not None and task is not asyncio.current_task():
            task.cancel()

    def _try_again(self) -> None:
        task = self._retry
        if self._stop.is_set() or self._retries >= RETRIES or (
                task is not None and not task.done() and task is not asyncio.current_task()):
            return  # (one waits already; or this is the last try)
        delay = self.retry_first * 2 ** self._retries
        self._retries += 1
        log.warning("tenant policy reload failed for the moment; trying again in %g s (try %d of %d)",
                    delay, self._retries, RETRIES)
        # (held until it is done, reload included: ``close`` cancels it wherever it is)
        self._retry = spawn(self._reload_after(delay), "policy-retry")

    async def _reload_after(self, delay: float) -> None:
        await asyncio.sleep(delay)
        await self.reload()

    def _swap(self, snapshot: PolicySnapshot, text: str) -> ReloadResult:
        """Put ``snapshot`` in force, then the hook (metrics, the queues'
        follow, removed tenants' requests refused, sockets rechecked). The
        snapshot stays in force if the hook fails (requests see it already;
        what the hook did is not undone): the reload is then reported as
        applied part way, in its result, ``last_errors`` (the admin view)
        and the log, and the same file reloaded again is applied again."""
        self.current = snapshot
        self._text = None
        self.last_errors = []
        version = snapshot.version
        log.info("tenant policy reloaded from %s (version %d, digest %s, %d tenants)",
                 self.path, version, snapshot.digest, len(snapshot.tenants))
        try:
            self._on_reload(True, True)
        except Exception:  # noqa: BLE001 - told, never lost: the new policy is in force, its follow-up is not whole
            self.last_errors = [f"{self.path}: version {version} is in force, but applying it failed part way "
                                f"(see the log); reload it again (POST /admin/reload, SIGHUP) once the cause is fixed"]
            log.exception("tenant policy version %d is in force, but applying it failed part way: reload it again "
                          "once the cause is fixed", version)
            return ReloadResult(False, version, self.last_errors)
        self._text = text
        return ReloadResult(True, version)

    def _tell(self, ok: bool, changed: bool) -> None:
        """The reload hook, where no new policy came in force; its failure is logged, never lost."""
        try:
            self._on_reload(ok, changed)
        except Exception:  # noqa: BLE001 - the reload's outcome is told all the same
            log.exception("the tenant policy reload hook failed (version %d)", self.current.version)

    def _restored(self) -> None:
        self.last_errors = []
        log.info("tenant policy file %s is valid again, the same as version %d: nothing changed",
                 self.path, self.current.version)
        self._tell(True, False)

    def _failed(self, errors: list[str]) -> ReloadResult:
        self.last_errors = errors
        for line in errors:
            log.error("tenant policy reload failed, keeping version %d: %s", self.current.version, line)
        self._tell(False, False)
        return ReloadResult(False, self.current.version, errors, changed=False)

    async def start(self) -> None:
        loop = asyncio.get_running_loop()
        try:
            loop.add_signal_handler(signal.SIGHUP, self._reload_soon)
        except (NotImplementedError, RuntimeError, ValueError):
            log.warning("SIGHUP reload unavailable on this platform")
        self._watch = spawn(self._watch_file(), "policy-watch")
        # A change (or a SIGHUP) between the first read and now, before the
        # handler and the watcher were in, would be lost for good: read again.
        await self.reload()

    def _reload_soon(self) -> None:
        task = spawn(self.reload(), "policy-reload")
        self._signalled.add(task)
        task.add_done_callback(self._signalled.discard)

    async def close(self) -> None:
        self._stop.set()
        signalled = list(self._signalled) + ([self._retry] if self._retry is not None else [])
        await asyncio.gather(*(stop(task) for task in signalled))
        try:
            if asyncio.get_running_loop().remove_signal_handler(signal.SIGHUP):
                # (that set the default action back: a reload asked for while
                # the router stops must not kill it before its replicas stop)
                signal.signal(signal.SIGHUP, signal.SIG_IGN)
        except (NotImplementedError, RuntimeError, ValueError):
            pass
        await stop(self._watch)

    async def _settled(self) -> None:
        """Wait until the file has not changed for ``SETTLE`` seconds (at most
        ``SETTLE_MAX``): a save in several writes is read whole. (watchfiles
        cannot say: it keeps one entry per path, so a second write of the
        same file in its batch does not hold the batch back.)"""
        loop = asyncio.get_running_loop()
        until = loop.time() + SETTLE_MAX
        last = await asyncio.to_thread(_stat, self.path)
        while loop.time() < until:
            await asyncio.sleep(SETTLE)
            now = await asyncio.to_thread(_stat, self.path)
            if now == last:
                return
            last = now

    async def _watch_file(self) -> None:
        from watchfiles import awatch

        # Watch the directory: editors replace files by rename, and
        # Kubernetes ConfigMaps swap a symlink. A symlink to a file in another
        # directory: that one too (an edit there changes nothing here).
        directory = self.path.parent
        while not self._stop.is_set():
            target = self.path.resolve()
            dirs = [directory]
            if target.parent != directory and not _configmap_data(directory, target):
                dirs.append(target.parent)  # (another directory, or one below this)
            wanted = {self.path.name, target.name}

            def relevant(change, path: str, wanted=wanted) -> bool:
                # only our file (or a ConfigMap's ..data swap), never e.g. a
                # log file written next to it
                name = Path(path).name
                return name in wanted or name.startswith("..")

            try:
                # (not recursive: a link into /etc or $HOME must not watch all below it)
                async for _changes in awatch(*dirs, stop_event=self._stop, debounce=200, step=50,
                                             watch_filter=relevant, recursive=False):
                    await self._settled()
                    await self.reload()
                    if self.path.resolve() != target:
                        break  # (the link points elsewhere now: watch there)
            except (OSError, RuntimeError) as e:
                log.warning("watching %s failed (%s); retrying", ", ".join(map(str, dirs)), e)
                await asyncio.sleep(1.0)
            except Exception:  # noqa: BLE001 - a bug must not end live reload for good
                log.exception("watching %s failed; retrying", ", ".join(map(str, dirs)))
                await asyncio.sleep(1.0)


def _for_the_moment(error: ConfigError) -> bool:
    """The reload failed for a reason of the moment, not for the file's text:
    the parse process could not run, or the file could not be read for want
    of file descriptors or memory."""
    cause = error.__cause__
    return isinstance(error, ParseUnavailable) or (isinstance(cause, OSError) and cause.errno in _PASSING)


def _snapshot(answer: bytes, path: Path, version: int, text: str) -> PolicySnapshot:
    return PolicySnapshot(decode(answer, path), version, text)


def _stat(path: Path) -> tuple[int, int, int] | None:
    """What changes when the file (the one a link points to) is written or replaced."""
    try:
        st = path.stat()
    except OSError:
        return None
    return st.st_ino, st.st_size, st.st_mtime_ns


def _configmap_data(directory: Path, target: Path) -> bool:
    """``target`` is in a Kubernetes ConfigMap's ``..<timestamp>`` directory
    under ``directory`` (its ``..data`` link's swap shows in ``directory``)."""
    try:
        first = target.relative_to(directory).parts[0]
    except (ValueError, IndexError):
        return False
    return first.startswith("..")
