"""router/deadlines.py on its own: which limit applies (``Deadlines``) and
the stall limit the ``Watchdog`` keeps while tokens flow.

(A mutation audit: measuring the stall from the run's start, not from the
last token, or failing when the timer fired before a limit the tokens had
moved, passed every unit test.)"""

from __future__ import annotations

import asyncio
import time

from router.deadlines import Deadlines, Stalled, StreamTimeout, Watchdog
from tests.helpers import apoll


def test_the_total_limit_applies_when_it_comes_first_or_with_the_other() -> None:
    dl = Deadlines(first_token=5.0, stall=2.0, total=10.0, start=100.0)
    assert dl.or_total(105.0, "first_token") == (105.0, "first_token")
    assert dl.or_total(None, "stall") == (110.0, "total")
    assert dl.or_total(111.0, "stall") == (110.0, "total")
    # a tie is the total's: the request is over, a failover for a stall would only time out again
    assert dl.or_total(110.0, "stall") == (110.0, "total")
    assert Deadlines(stall=2.0, start=100.0).or_total(None, "stall") == (None, "stall")


class Collector:
    """What the watchdog fails: records when, and with what."""

    def __init__(self) -> None:
        self.failed: list[tuple[float, BaseException]] = []

    def fail(self, e: BaseException) -> None:
        self.failed.append((time.monotonic(), e))


async def test_the_stall_limit_runs_from_the_last_token() -> None:
    # (tokens 0.1 s apart for 1.6 s, twice the stall limit: no stall; then a
    # stall 0.8 s after the last one. A loaded machine delays a token by less
    # than the 0.7 s it would take to look like a stall)
    col = Collector()
    dog = Watchdog(Deadlines(stall=0.8), col, False, "r0")
    try:
        began = time.monotonic()
        while time.monotonic() - began < 1.6:
            await asyncio.sleep(0.1)
            dog.token(time.monotonic())
            assert not col.failed, "a stall while tokens came"
        last = dog.last_token
        await apoll(lambda: col.failed, 5, what="the stall")
    finally:
        dog.cancel()
    [(at, e)] = col.failed
    assert isinstance(e, Stalled) and "r0" in str(e), e
    assert 0.8 <= at - last < 0.8 + 1.0, at - last


async def test_a_first_token_limit_ends_a_run_with_no_output() -> None:
    col = Collector()
    began = time.monotonic()
    dog = Watchdog(Deadlines(first_token=0.3, stall=5.0, start=began), col, False, "r0")
    try:
        await apoll(lambda: col.failed, 5, what="the first-token timeout")
    finally:
        dog.cancel()
    [(at, e)] = col.failed
    assert isinstance(e, StreamTimeout) and e.which == "first_token" and at - began >= 0.3
