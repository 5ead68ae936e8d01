"""A failed abort in a healthy vLLM engine is a WARNING (the request may go
on using KV cache, unseen); while the engine closes, or once it died, DEBUG."""

from __future__ import annotations

import asyncio
import logging

from replicas.vllm_engine import VllmEngine, VllmEngineConfig


class _RefusesAbort:
    """vLLM's ``AsyncLLM`` as far as an abort goes: it fails."""

    errored = False

    async def abort(self, req_id: str) -> None:
        raise RuntimeError("abort refused")

    def shutdown(self) -> None:
        pass


async def _abort_logs(caplog, closing: bool) -> list[logging.LogRecord]:
    engine = VllmEngine(VllmEngineConfig(model="m"), lambda *a, **k: None)
    engine._llm = _RefusesAbort()
    engine._tasks[1] = asyncio.get_running_loop().create_task(asyncio.sleep(3600))
    engine._req_ids[1] = "1-0"
    with caplog.at_level(logging.DEBUG, logger="replicas.vllm_engine"):
        engine.abort(1)
        if closing:
            await engine.close()
        else:
            await asyncio.gather(*engine._aborts)
    return [r for r in caplog.records if "abort of 1-0" in r.getMessage()]


async def test_a_failed_abort_in_a_healthy_engine_is_a_warning(caplog) -> None:
    [record] = await _abort_logs(caplog, closing=False)
    assert record.levelno == logging.WARNING and "KV cache" in record.getMessage()


async def test_a_failed_abort_while_the_engine_closes_is_debug(caplog) -> None:
    [record] = await _abort_logs(caplog, closing=True)
    assert record.levelno == logging.DEBUG
