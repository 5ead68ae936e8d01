"""vLLM engine throughput with and without the penalties' logits processor.

``SplicedPenalties`` (replicas/vllm_penalties.py) is loaded into every CPU
vLLM replica; with any custom logits processor vLLM hands every request's
output token list to the processors each step. This measures what that
costs when no request is a continuation: 4 concurrent greedy requests of
128 tokens (half with a presence penalty), 4 rounds on one engine; the first
round warms up. Run each kind at least twice, alternating:

    for p in on off on off; do .venv/bin/python ops/vllm_penalties_tput.py $p /tmp/tinymodel; done

Prints one ``RESULT {json}`` line: tokens per second of each round.
"""

from __future__ import annotations

import asyncio
import json
import os
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import replicas.vllm_engine as vllm_engine  # noqa: E402
from replicas.protocol import FinishReason, SamplingParams  # noqa: E402

REQUESTS, TOKENS, ROUNDS = 4, 128, 4


async def measure(load: bool, model_dir: str) -> list[float]:
    if not load:  # (as on a host where the processor does not fit)
        vllm_engine.spliced_penalties_fit = lambda *args: False
    done: dict[int, asyncio.Event] = {}

    def sink(rid: int, ids: list[int], finish: FinishReason, error: str) -> None:
        if finish != FinishReason.NONE:
            done[rid].set()

    engine = vllm_engine.VllmEngine(
        vllm_engine.VllmEngineConfig(model=model_dir, tiny=True, seed=0, max_model_len=2048), sink)
    await engine.start()
    prompt = engine.tokenizer.encode("The quick brown fox")
    rates = []
    try:
        for rnd in range(ROUNDS):
            t0 = time.monotonic()
            rids = [rnd * REQUESTS + i for i in range(REQUESTS)]
            for rid in rids:
                done[rid] = asyncio.Event()
                engine.add(rid, prompt, SamplingParams(max_tokens=TOKENS, temperature=0.0, ignore_eos=True,
                                                       presence_penalty=0.5 if rid % 2 else 0.0))
            await asyncio.gather(*(done[rid].wait() for rid in rids))
            rates.append(round(REQUESTS * TOKENS / (time.monotonic() - t0), 1))
    finally:
        await engine.close()
    return rates


if __name__ == "__main__":
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    if len(sys.argv) != 3 or sys.argv[1] not in ("on", "off"):
        sys.exit("usage: python ops/vllm_penalties_tput.py on|off MODEL_DIR  (see its docstring)")
    on = sys.argv[1] == "on"
    print("RESULT " + json.dumps({"processor": on, "tok_per_s": asyncio.run(measure(on, sys.argv[2]))}), flush=True)
