"""resume_http._waiting_until_first under Litestar's (anyio) cancellation,
which cancels the streaming task again on every loop turn."""

from __future__ import annotations

import asyncio
from contextlib import aclosing

import anyio

from router.resume_http import _waiting_until_first


async def test_a_client_leaving_while_the_continuation_waits_is_a_clean_cancel() -> None:
    cleaned = []

    async def continuation():  # _continue: waiting for admission / its first token
        try:
            await asyncio.sleep(10)
            yield b"data: x\n\n"
        except BaseException:
            await asyncio.sleep(0.05)  # its cleanup awaits (pieces.aclose, admission.finish)
            cleaned.append(True)
            raise

    async def take_over():
        async with aclosing(continuation()) as chunks:
            async for chunk in _waiting_until_first(chunks):
                yield chunk

    errors = []

    async def stream():  # litestar's ASGIStreamingResponse: iterate in a task group
        try:
            async for _ in take_over():
                pass
        except BaseException as e:
            errors.append(e)
            raise

    try:
        async with anyio.create_task_group() as tg:
            tg.start_soon(stream)
            await asyncio.sleep(0.1)
            tg.cancel_scope.cancel()  # the client disconnected
    except BaseException as e:  # (what litestar's Stream would raise to uvicorn)
        errors.append(e)
    await asyncio.sleep(0.2)
    assert cleaned  # (the continuation's own cleanup ran, in its task)
    assert all(isinstance(e, asyncio.CancelledError) for e in errors), errors
