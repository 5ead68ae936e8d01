"""The router's background loops outlive their own bugs, and a task's death is said.

The long-running loops (resume flushes and claim renewals, the lease keeper,
the policy peers check, the turns subscription) each caught the state
store's outage and nothing else: any other exception (a redis-py error not
wrapped, a reply that does not decode, a bug in a callback) ended the loop
for good, with nothing logged. Leases then expired under running streams,
or resume events piled up unwritten, and only a restart said anything.

* ``KeepGoing``: ``async with`` around one turn of a loop. An exception
  (never a cancel) is logged at ERROR with its traceback, at most once per
  ``LOG_EVERY`` seconds for that loop (those in between are counted in the
  next line: a loop failing at every turn cannot flood the log), and the
  loop goes on after ``BACKOFF`` seconds.
* ``spawn``: a task created with ``report`` as its done-callback, which
  logs its death by an exception at ERROR when it happens (what
  ``KeepGoing`` does not cover: a failure outside the guarded turn).
* ``router.stopping.stop`` logs a failure of the task it stops that
  ``report`` has not logged already (``reported``): one line per failure.
"""

from __future__ import annotations

import asyncio
import logging
import weakref
from collections.abc import Coroutine
from typing import Any, TypeVar

__all__ = ["BACKOFF", "LOG_EVERY", "KeepGoing", "report", "reported", "spawn"]

log = logging.getLogger("fairstream.router")

BACKOFF = 1.0  # seconds a loop waits after a turn that failed (a bug fails again at once)
LOG_EVERY = 60.0  # seconds between two logged failures of one loop

T = TypeVar("T")

_reported: weakref.WeakSet[asyncio.Future] = weakref.WeakSet()


class KeepGoing:
    """``async with guard:`` around each turn of a loop named ``what``:
    an exception in the turn is logged (``log``, rate-limited) and
    suppressed after a ``backoff``; a cancel passes through."""

    __slots__ = ("what", "log", "backoff", "log_every", "_logged", "_unlogged")

    def __init__(self, what: str, logger: logging.Logger = log) -> None:
        self.what = what
        self.log = logger
        self.backoff = BACKOFF
        self.log_every = LOG_EVERY
        self._logged: float | None = None  # loop time of the last logged failure
        self._unlogged = 0  # failures since then, not logged

    async def __aenter__(self) -> KeepGoing:
        return self

    async def __aexit__(self, kind, error, tb) -> bool:
        if not isinstance(error, Exception):  # (none, or a cancel: BaseException)
            return False
        task = asyncio.current_task()
        if task is not None and task.cancelling():
            # (a cancel that met a timeout in the same loop turn came out as
            # that error, redis-py's on 3.11: the loop ends as cancelled)
            raise asyncio.CancelledError() from error
        self.failed(error)
        await asyncio.sleep(self.backoff)  # (a cancel meanwhile ends the loop, as it should)
        return True

    def failed(self, error: BaseException) -> None:
        now = asyncio.get_running_loop().time()
        if self._logged is not None and now - self._logged < self.log_every:
            self._unlogged += 1
            return
        more = f" ({self._unlogged} more failures not logged since the last one)" if self._unlogged else ""
        self.log.error("%s failed%s; going on in %g s", self.what, more, self.backoff, exc_info=error)
        self._logged, self._unlogged = now, 0


def spawn(coro: Coroutine[Any, Any, T], name: str) -> asyncio.Task[T]:
    """``create_task`` on the running loop, with ``report`` as done-callback."""
    task = asyncio.get_running_loop().create_task(coro, name=name)
    task.add_done_callback(report)
    return task


def report(task: asyncio.Future) -> None:
    """Done-callback: log at ERROR, with its traceback, a task's end by an
    exception (a cancel is its owner's doing; a result says nothing)."""
    if task.cancelled():
        return
    error = task.exception()
    if error is not None:
        _reported.add(task)
        name = task.get_name() if isinstance(task, asyncio.Task) else repr(task)
        log.error("background task %s ended for good by an unexpected %s: %s", name, type(error).__name__, error,
                  exc_info=error)


def reported(task: asyncio.Future) -> bool:
    """Whether ``report`` logged the failure of ``task`` already."""
    return task in _reported
