"""A replica's health checks: pings timed by the router's own event loop,
and whether its engine keeps stepping (used by ``replicas.supervisor``)."""

from __future__ import annotations

import asyncio
from typing import Any

__all__ = ["LOOP_STALL", "PING_TICK", "Progress", "abandon", "answered_within"]

# (s) the step of a health check's clock; a stall of the router's own event
# loop counts as at most two steps (``answered_within``)
PING_TICK = 0.1


async def answered_within(aw, timeout: float) -> Any:
    """``await aw`` (a ping) for at most ``timeout`` seconds in which the
    router's event loop ran; TimeoutError after that. A stretch in which the
    loop itself was blocked (a long synchronous call, the machine swapping)
    counts as at most two ``PING_TICK``s: when the loop runs again its timers
    fire before it reads its sockets, so a plain timeout would blame the
    replica for a pong that came while the router was not listening."""
    loop = asyncio.get_running_loop()
    task = asyncio.ensure_future(aw)
    step = min(PING_TICK, timeout)
    waited = 0.0
    try:
        while True:
            start = loop.time()
            done, _ = await asyncio.wait((task,), timeout=step)
            if done:
                return task.result()
            waited += min(loop.time() - start, 2 * step)
            if waited >= timeout:
                raise TimeoutError
    finally:
        abandon(task)


def abandon(task: asyncio.Future) -> None:
    """Cancel a ping no one will wait for; one already done has its failure
    (say the connection closed meanwhile) retrieved, so that it is not
    reported as never retrieved."""
    if task.done():
        if not task.cancelled():
            task.exception()
        return
    task.cancel()


# a wait between health checks that overruns by this much: the router's own
# event loop was stalled (Progress does not blame the engine for it)
LOOP_STALL = 1.0


class Progress:
    """Whether a replica's engine keeps stepping while it has requests.

    ``stuck`` once an engine with requests in it has taken no step for
    ``limit`` seconds, its first step included (an engine core that freezes
    before it ever stepped, or hangs on its first batch). An engine that
    counts no steps (an OpenAI-compatible upstream) is never stuck."""

    def __init__(self, limit: float) -> None:
        self.limit = limit
        self.steps = 0
        self.since: float | None = None  # (the first report starts the clock)

    def stuck(self, load, now: float, paused: bool = False) -> bool:
        """``paused``: the router's own loop did not run for a while since
        the last report (a long stall, a SIGSTOP); nor did it read the
        replica's output then, which holds the engine back, so the clock
        starts again instead of blaming the engine."""
        counted = load.reports_steps or load.steps  # (an older replica: from its first step)
        if (not counted or load.steps != self.steps or load.running + load.waiting == 0 or self.since is None
                or paused):
            self.steps = load.steps
            self.since = now
            return False
        return now - self.since > self.limit
