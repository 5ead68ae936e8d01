"""Ending the router's own background tasks at shutdown: ``stop``.

A single ``task.cancel()`` followed by an unbounded ``await task`` held a
router that could not bind its port for good (1 start in ~30, ignoring
SIGTERM and SIGINT): on Python 3.11 a cancel can be swallowed where it meets
a result or a timeout of the same loop turn (``asyncio.wait_for`` returns
the inner result; redis-py turns some into its own timeout errors), and a
``while True`` loop then runs on as if nothing had happened, its closer
waiting on it. So ``stop`` cancels once, gives the task ``STOP_CLEANUP`` to
end (its own ``finally`` blocks: a child process killed and reaped, a
connection given back, which a second cancel would cut short), then cancels
again at every ``STOP_TICK`` (the next await of such a loop ends it), and
gives up after ``STOP_LIMIT`` with a warning rather than hold the rest of
the shutdown. A task that swallowed every one of those cancels would still
hold the process's exit (asyncio's runner cancels what is left once more
and waits for it): none of the router's does, a lost cancel being a single
one; the orchestrator's kill is the bound then.

A task that had ended by an exception (not a cancel) is logged at ERROR with
its traceback, unless ``router.background.report`` logged it when it
happened: a loop that died of a bug says so at the latest at shutdown.
"""

from __future__ import annotations

import asyncio
import logging

from router.background import reported

__all__ = ["STOP_CLEANUP", "STOP_LIMIT", "STOP_TICK", "stop"]

log = logging.getLogger("fairstream.router")

STOP_CLEANUP = 0.5  # seconds a cancelled task gets before it is cancelled again
STOP_TICK = 0.05  # seconds between two cancels of a task that runs on after that
STOP_LIMIT = 2.0  # seconds ``stop`` waits for a task at most


async def stop(task: asyncio.Future | None, limit: float = STOP_LIMIT) -> bool:
    """Cancel ``task`` until it has ended, for at most ``limit`` seconds;
    whether it ended. Its result is dropped; a failure (not a cancel) is
    logged, once (``router.background``). A cancel of the caller itself is
    not held up either: it ends the wait at once and propagates."""
    if task is None:
        return True
    loop = asyncio.get_running_loop()
    end = loop.time() + limit
    tick = min(STOP_CLEANUP, limit)
    while not task.done():
        task.cancel()
        left = end - loop.time()
        if left <= 0:
            log.warning("task %s did not end within %gs of its cancel: left running", _name(task), limit)
            return False
        await asyncio.wait((task,), timeout=min(tick, left))
        tick = STOP_TICK
    if not task.cancelled():
        error = task.exception()  # (retrieved: not reported again as never retrieved)
        if error is not None and not reported(task):
            log.error("task %s had ended by an unexpected %s: %s", _name(task), type(error).__name__, error,
                      exc_info=error)
    return True


def _name(task: asyncio.Future) -> str:
    return task.get_name() if isinstance(task, asyncio.Task) else repr(task)
