"""``router.stopping.stop``: a task whose cancel was lost still ends, and a
task that will not end does not hold the caller past the limit."""

from __future__ import annotations

import asyncio

from router.stopping import stop


async def test_a_loop_whose_cancel_was_lost_is_cancelled_again() -> None:
    # (on Python 3.11 asyncio.wait_for returns the inner result when the cancel
    # meets it in one loop turn; the policy-peers loop then waited for its next
    # turn, its closer on it, and a router on a port in use never exited)
    turns = 0

    async def loop_that_lost_a_cancel() -> None:
        nonlocal turns
        while True:
            turns += 1
            try:
                await asyncio.sleep(3600)
            except asyncio.CancelledError:
                if turns > 1:
                    raise
                # (the first one lost, as in wait_for; the loop goes on)

    task = asyncio.get_running_loop().create_task(loop_that_lost_a_cancel())
    await asyncio.sleep(0)
    assert await asyncio.wait_for(stop(task), 1.0)
    assert task.cancelled() and turns == 2


async def test_a_task_that_never_ends_is_left_after_the_limit() -> None:
    release = asyncio.Event()

    async def deaf() -> None:
        while not release.is_set():
            try:
                await asyncio.sleep(3600)
            except asyncio.CancelledError:
                pass

    task = asyncio.get_running_loop().create_task(deaf())
    await asyncio.sleep(0)
    loop = asyncio.get_running_loop()
    began = loop.time()
    assert not await stop(task, limit=0.3)
    assert loop.time() - began < 1.0
    release.set()
    task.cancel()
    await asyncio.wait((task,), timeout=1.0)
    assert task.done()


async def test_a_failed_or_finished_task_is_done_at_once() -> None:
    async def fails() -> None:
        raise RuntimeError("boom")

    task = asyncio.get_running_loop().create_task(fails())
    await asyncio.sleep(0)
    assert await stop(task) and await stop(None)


async def test_a_task_ending_in_its_finally_is_not_cut_short() -> None:
    # (a second cancel 50 ms after the first cut a reload's `proc.kill();
    # await proc.wait()`: the parse process killed and never reaped)
    done: list[str] = []

    async def cleans_up() -> None:
        try:
            await asyncio.sleep(3600)
        finally:
            await asyncio.sleep(0.2)  # (a child reaped, a connection given back)
            done.append("cleaned")

    task = asyncio.get_running_loop().create_task(cleans_up())
    await asyncio.sleep(0)
    assert await stop(task)
    assert done == ["cleaned"]
