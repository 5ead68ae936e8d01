"""An upstream's stall probe (replicas.upstream_checks): its time limit
counts the wait for a slot, a stall caught while it runs is not cleared by
it, a stall soon after its answer holds the next one back, and its body asks
for no generation."""

from __future__ import annotations

import asyncio
import time

import msgspec
import pytest

from replicas.http11 import HttpPool
from replicas import upstream_checks
from replicas.upstream_checks import Stall, answers_post, probe_body
from replicas.upstream_errors import retry_after_seconds
from tests.unit.test_http11 import Server

REFUSED = b"HTTP/1.1 400 Bad Request\r\nContent-Type: application/json\r\nContent-Length: 2\r\n\r\n{}"


def test_the_probe_asks_for_nothing_to_be_generated():
    # (no prompt: vLLM's 400; n 0: below the API's minimum; max_tokens 1: at most a token where neither is refused)
    assert msgspec.json.decode(probe_body("m")) == {"model": "m", "n": 0, "max_tokens": 1}


async def test_the_wait_for_a_concurrency_slot_counts_in_the_probe_budget():
    # (it waited for a slot with no limit: at the cap, the health check waited, overran, and took the upstream down)
    async def never(path, w, r):
        await asyncio.sleep(3600)

    async with Server(never) as srv:
        pool = HttpPool(srv.url, limit=1)
        held = asyncio.ensure_future(pool.request("POST", "/completions", b"{}"))  # (the one slot, for good)
        await asyncio.sleep(0.05)
        start = time.monotonic()
        assert not await answers_post(pool, "up", "m", 0.3)
        assert time.monotonic() - start < 0.6
        held.cancel()
        await asyncio.gather(held, return_exceptions=True)
        await pool.close()


async def test_a_stall_caught_while_a_probe_runs_is_not_cleared_by_its_answer():
    gate = asyncio.Event()

    async def late_refusal(path, w, r):
        await gate.wait()
        w.write(REFUSED)

    async with Server(late_refusal) as srv:
        pool = HttpPool(srv.url)
        answered = asyncio.Event()
        stall = Stall("up", pool, "m", 5.0, answered.set, "upstream up failed: no response head within 5s")
        stall.probe()
        await asyncio.sleep(0.05)
        stall.probe()  # (one at a time: a second check while it runs starts none)
        stall.caught("upstream up failed: no response head within 5s")  # (a request sent before its answer)
        gate.set()
        await asyncio.sleep(0.1)
        assert stall.why is not None and not answered.is_set()
        assert len(srv.requests) == 1
        stall.probe()  # (the next check's probe, begun after that stall: its answer counts)
        await asyncio.wait_for(answered.wait(), 2)
        assert stall.why is None
        await stall.close()
        await pool.close()


async def test_a_stall_soon_after_an_answered_probe_holds_the_next_probe_back_longer_each_time(monkeypatch):
    # (an upstream whose generation route refuses the probe at once but hangs
    # real requests went back into dispatch at each health check, and each
    # time the next request sent there waited out the head timeout: one lost
    # request every health_interval, for good. Scaled down: hold 0.2 s,
    # doubled up to 0.5 s, a 1 s window, a head timeout of 0.5 s)
    monkeypatch.setattr(upstream_checks, "RELAPSE_HOLD", 0.2)
    monkeypatch.setattr(upstream_checks, "RELAPSE_HOLD_MAX", 0.5)
    monkeypatch.setattr(upstream_checks, "RELAPSE_WINDOW", 1.0)
    head_timeout = 0.5

    async def refuse(path, w, r):
        w.write(REFUSED)
        await w.drain()

    async with Server(refuse) as srv:
        pool = HttpPool(srv.url)
        answered = asyncio.Event()
        stall = Stall("up", pool, "m", head_timeout, answered.set)
        loop = asyncio.get_running_loop()

        async def stall_and_probe(sent: float = 0.0) -> tuple[int, bool, float, float]:
            """A request that got no head, sent ``sent`` s after the last answer
            (None: before it), then a probe at every 'health check' (10 ms) until
            one is answered: (relapses, whether the first check probed, the hold,
            seconds from the stall to the answer)."""
            if sent is not None:
                await asyncio.sleep(sent + head_timeout)  # (its head timeout ends now)
            answered.clear()
            stall.caught("upstream up failed: no response head within 0.5s")
            start, hold = loop.time(), stall.hold()
            stall.probe()
            at_once = stall.probing
            while not answered.is_set():
                stall.probe()
                await asyncio.sleep(0.01)
            return stall.relapses, at_once, hold, loop.time() - start

        assert (await stall_and_probe())[:2] == (0, True) and stall.why is None  # (a first stall: probed at once)
        runs = [await stall_and_probe() for _ in range(3)]  # (each soon after the answer: relapses)
        assert [run[:3] for run in runs] == [(1, False, 0.2), (2, False, 0.4), (3, False, 0.5)]
        assert all(took >= hold - 0.01 for _, _, hold, took in runs), runs  # (no probe sooner)
        assert len(srv.requests) == 4  # (one probe per stall: none started while held)
        # a request sent before the last answer, its head timeout ending after
        # it: that stall's, not a relapse (the count stays, no hold)
        assert (await stall_and_probe(sent=None))[:2] == (3, True)
        # the window counts to the request's sending, not to its stall: sent
        # 0.75 s after the answer, its stall comes 1.25 s after it
        assert (await stall_and_probe(sent=0.75))[:2] == (4, False)
        assert (await stall_and_probe(sent=1.3))[:2] == (0, True)  # (sent past the window: a first stall again)
        stall.relapses = 5000  # (the hold's doubling stops at its cap: 2.0 ** 5000 is an OverflowError)
        assert stall.hold() == 0.5
        await stall.close()
        await pool.close()


@pytest.mark.parametrize("status, answered", [(400, True), (500, True), (502, False), (503, False), (504, False),
                                              (522, False), (524, False)])
async def test_any_answer_of_the_server_counts_a_gateway_s_does_not(status: int, answered: bool):
    # (llama.cpp's server refuses the probe with a 500, "Only one completion
    # choice is allowed": counting every 5xx as no answer kept it stalled for good)
    async def answer(path, w, r):
        w.write(b"HTTP/1.1 %d X\r\nContent-Type: application/json\r\nContent-Length: 2\r\n\r\n{}" % status)
        await w.drain()

    async with Server(answer) as srv:
        pool = HttpPool(srv.url, limit=1)
        try:
            assert await answers_post(pool, "up", "m", 2.0) is answered
        finally:
            await pool.close()


@pytest.mark.parametrize("value, seconds", [(b"7", 7.0), (b"86400", 300.0), (b"1e300", 300.0), (b"-3", 0.0),
                                            (b"Wed, 21 Oct 2015 07:28:00 GMT", 0.0), (None, 0.0)])
def test_an_upstream_s_retry_after_is_taken_up_to_the_pace_s_cap(value, seconds):
    # (the router passes it on in its 503: an upstream's day, or 1e300, went to the clients as it came)
    assert retry_after_seconds(value) == seconds
