"""Exercise ``VllmEngine`` on the tiny model; print one ``RESULT {json}`` line.

Run by ``test_vllm_engine.py`` in a subprocess (vLLM spawns processes, so the
engine must start under the ``__main__`` guard). Also usable by hand:

    python tests/vllm/run_vllm_engine.py /tmp/tinymodel
"""

from __future__ import annotations

import asyncio
import json
import os
import sys
import time
from pathlib import Path

# Runnable as a plain script from any directory.
sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from replicas.engine import EngineError  # noqa: E402
from replicas.protocol import UNSET_TOP_K, FinishReason, SamplingParams  # noqa: E402
from replicas.tinymodel import ensure_tiny_model  # noqa: E402
from replicas.vllm_engine import VllmEngine, VllmEngineConfig  # noqa: E402
from tests.vllm.support import engine_sockets  # noqa: E402

MAX_TOKENS = 16


class Collector:
    """Sink that records every call per request."""

    def __init__(self) -> None:
        self.tokens: dict[int, list[int]] = {}
        self.finish: dict[int, FinishReason] = {}
        self.errors: dict[int, str] = {}
        self.calls: dict[int, int] = {}
        self.done: dict[int, asyncio.Event] = {}

    def expect(self, rid: int) -> None:
        self.tokens[rid] = []
        self.calls[rid] = 0
        self.done[rid] = asyncio.Event()

    def __call__(self, rid: int, ids: list[int], finish: FinishReason, error: str,
                 stop_id: int | None = None) -> None:  # (replicas.engine.OutputSink)
        assert rid not in self.finish, f"output for {rid} after its finish"
        self.tokens[rid].extend(ids)
        self.calls[rid] += 1
        if finish != FinishReason.NONE:
            self.finish[rid] = finish
            self.errors[rid] = error
            self.done[rid].set()


async def main(model_dir: str) -> dict:
    res: dict = {}
    sink = Collector()
    # A model whose generation config has a sampling default (top_k 1:
    # greedy), which vLLM applies to the fields a request leaves unset
    ensure_tiny_model(model_dir)
    gen = Path(model_dir) / "generation_config.json"
    gen.write_text(json.dumps({**json.loads(gen.read_text()), "do_sample": True, "top_k": 1}))
    cfg = VllmEngineConfig(model=model_dir, tiny=True, seed=0, max_model_len=2048)
    engine = VllmEngine(cfg, sink)
    t0 = time.monotonic()
    await engine.start()
    res["start_s"] = round(time.monotonic() - t0, 2)
    # the ZMQ IPC sockets this process and the engine's (EngineCore, workers) hold
    sockets = engine_sockets(os.getpid())
    tok = engine.tokenizer
    try:
        # --- tokenizer
        text = "naïve café 世界 🎉"
        ids = tok.encode(text)
        res["roundtrip"] = tok.decode(ids) == text
        snow = tok.encode("世")
        res["split_char"] = [len(snow), tok.decode(snow[:2])]
        hi = [{"role": "user", "content": "hi"}]
        res["chat_len"] = len(tok.chat(hi))
        # chat_template_kwargs: the template's variables, under vLLM's own fields (add_generation_prompt)
        res["chat_kwargs"] = [tok.chat(hi, {"enable_thinking": False}) == tok.chat(hi),
                              len(tok.chat(hi, {"add_generation_prompt": False})) == res["chat_len"]]
        try:
            tok.chat(hi, {"tokenize": True})
            res["chat_kwargs_refused"] = "accepted"
        except EngineError as e:
            res["chat_kwargs_refused"] = str(e)
        res["eos"] = tok.eos_token_id

        greedy = SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True)
        prompts = [tok.encode(p) for p in ("Hello, world", "The quick brown fox", "ünïcödé ✓")]

        # --- concurrent greedy requests; rid 4 repeats rid 1's prompt
        batch = {1: prompts[0], 2: prompts[1], 3: prompts[2], 4: prompts[0]}
        t0 = time.monotonic()
        for rid, p in batch.items():
            sink.expect(rid)
            engine.add(rid, p, greedy)
        res["load_busy"] = list(msgspec_tuple(engine.load()))
        await asyncio.wait_for(asyncio.gather(*(sink.done[r].wait() for r in batch)), 120)
        res["batch_s"] = round(time.monotonic() - t0, 3)
        res["batch_counts"] = {r: len(sink.tokens[r]) for r in batch}
        res["batch_finish"] = {r: sink.finish[r].name for r in batch}
        res["batch_errors"] = {r: sink.errors[r] for r in batch}
        res["batch_calls"] = {r: sink.calls[r] for r in batch}
        res["same_twice"] = sink.tokens[1] == sink.tokens[4]
        res["tokens_1"] = sink.tokens[1]
        res["text_1"] = tok.decode(sink.tokens[1])

        # --- same request again, alone (different batch composition)
        sink.expect(5)
        engine.add(5, prompts[0], greedy)
        await asyncio.wait_for(sink.done[5].wait(), 60)
        res["same_alone"] = sink.tokens[5] == sink.tokens[1]

        # --- failover resume: prompt + first 5 tokens, the rest must match
        sink.expect(6)
        resume = SamplingParams(max_tokens=MAX_TOKENS - 5, temperature=0.0, ignore_eos=True)
        engine.add(6, prompts[0] + sink.tokens[1][:5], resume)
        await asyncio.wait_for(sink.done[6].wait(), 60)
        res["resume_tokens"] = sink.tokens[6]
        res["resume_exact"] = sink.tokens[6] == sink.tokens[1][5:]
        res["resume_finish"] = sink.finish[6].name

        # --- abort a long request mid-stream
        sink.expect(7)
        engine.add(7, prompts[1], SamplingParams(max_tokens=1500, temperature=0.0, ignore_eos=True))
        t0 = time.monotonic()
        while len(sink.tokens[7]) < 8 and time.monotonic() - t0 < 60:
            await asyncio.sleep(0.01)
        res["abort_load_before"] = list(msgspec_tuple(engine.load()))
        engine.abort(7)
        at_abort = len(sink.tokens[7])
        res["abort_load_after"] = list(msgspec_tuple(engine.load()))
        await asyncio.sleep(1.0)
        res["abort_no_more_output"] = len(sink.tokens[7]) == at_abort and 7 not in sink.finish
        # a rid may be reused right after its abort
        sink.expect(7)
        engine.add(7, prompts[2], greedy)
        await asyncio.wait_for(sink.done[7].wait(), 60)
        res["reuse_after_abort"] = [len(sink.tokens[7]), sink.finish[7].name]
        await asyncio.sleep(0.5)
        # vLLM's own scheduler stats (not clamped by our in-flight count)
        raw = engine._load
        res["raw_sched_after"] = [raw.running, raw.waiting, raw.kv_usage, raw.steps]
        res["load_idle"] = list(msgspec_tuple(engine.load()))

        # --- errors
        try:
            engine.add(8, [1] * 5000, greedy)
            res["too_long"] = "accepted"
        except EngineError as e:
            res["too_long"] = f"EngineError: {e}"
        sink.expect(9)
        engine.add(9, [1, 2, 99999], greedy)
        await asyncio.wait_for(sink.done[9].wait(), 60)
        res["bad_token"] = [sink.finish[9].name, sink.errors[9][:200]]

        # --- stop token ids end a request with STOP
        sink.expect(10)
        stop_at = sink.tokens[1][3]
        engine.add(10, prompts[0], SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0,
                                                  stop_token_ids=[stop_at]))
        await asyncio.wait_for(sink.done[10].wait(), 60)
        res["stop_token"] = [sink.tokens[10], sink.finish[10].name,
                             sink.tokens[1][: sink.tokens[1].index(stop_at) + 1]]

        # --- the model's sampling defaults fill only the fields a request left unset
        res["model_defaults"] = engine._defaults
        sampled = {"max_tokens": MAX_TOKENS, "temperature": 1.0, "seed": 1, "ignore_eos": True}
        sink.expect(11)
        engine.add(11, prompts[0], SamplingParams(**sampled, unset=UNSET_TOP_K))  # top_k: the model's, 1
        sink.expect(12)
        engine.add(12, prompts[0], SamplingParams(**sampled))  # top_k -1, set by the client: no limit
        await asyncio.wait_for(asyncio.gather(sink.done[11].wait(), sink.done[12].wait()), 60)
        res["default_top_k_greedy"] = sink.tokens[11] == sink.tokens[1]
        res["explicit_top_k_sampled"] = sink.tokens[12] != sink.tokens[1]

        # --- throughput: 4 concurrent x 64 tokens
        many = SamplingParams(max_tokens=64, temperature=0.0, ignore_eos=True)
        t0 = time.monotonic()
        for rid in range(20, 24):
            sink.expect(rid)
            engine.add(rid, prompts[rid % 3], many)
        await asyncio.wait_for(asyncio.gather(*(sink.done[r].wait() for r in range(20, 24))), 300)
        dt = time.monotonic() - t0
        res["throughput"] = {"tokens": 256, "seconds": round(dt, 3), "tok_per_s": round(256 / dt, 1)}
        long = sink.tokens[21]  # prompts[0], 64 tokens
        res["long_counts"] = [len(sink.tokens[r]) for r in range(20, 24)]
        res["long_same_twice"] = sink.tokens[20] == sink.tokens[23]
        res["long_prefix_matches_16"] = long[:MAX_TOKENS] == sink.tokens[1]

        # --- resume the 64-token run at several points, concurrently
        splits = (1, 17, 40, 63)
        for k in splits:
            rid = 100 + k
            sink.expect(rid)
            engine.add(rid, prompts[0] + long[:k],
                       SamplingParams(max_tokens=64 - k, temperature=0.0, ignore_eos=True))
        await asyncio.wait_for(asyncio.gather(*(sink.done[100 + k].wait() for k in splits)), 120)
        res["resume_splits"] = {k: sink.tokens[100 + k] == long[k:] for k in splits}

        # --- penalties over the output across a splice: the continuation says
        # how many of its prompt's tokens are its own output (``generated``),
        # concurrently with a request without penalties in the same batch
        penal = {"temperature": 0.0, "ignore_eos": True, "presence_penalty": 1.5, "frequency_penalty": 1.0,
                 "repetition_penalty": 1.2}
        sink.expect(200)
        engine.add(200, prompts[1], SamplingParams(max_tokens=48, **penal))
        await asyncio.wait_for(sink.done[200].wait(), 120)
        penalized = sink.tokens[200]
        res["penalized_changes_output"] = penalized != sink.tokens[22][:48]  # prompts[1], no penalties
        cuts = (1, 12, 30, 47)
        for k in cuts:
            sink.expect(200 + k)
            engine.add(200 + k, prompts[1] + penalized[:k], SamplingParams(max_tokens=48 - k, **penal), k)
            # the same continuation as vLLM alone would count it: from the splice on
            sink.expect(300 + k)
            engine.add(300 + k, prompts[1] + penalized[:k], SamplingParams(max_tokens=48 - k, **penal))
        sink.expect(299)
        engine.add(299, prompts[0] + long[:17], SamplingParams(max_tokens=64 - 17, temperature=0.0, ignore_eos=True))
        rids = [200 + k for k in cuts] + [300 + k for k in cuts] + [299]
        await asyncio.wait_for(asyncio.gather(*(sink.done[r].wait() for r in rids)), 300)
        res["penalty_splits"] = {k: sink.tokens[200 + k] == penalized[k:] for k in cuts}
        res["penalty_splits_uncounted"] = {k: sink.tokens[300 + k] == penalized[k:] for k in cuts}
        res["penalty_neighbour_exact"] = sink.tokens[299] == long[17:]
    finally:
        res["engine_sockets"] = sorted(sockets | engine_sockets(os.getpid()))
        t0 = time.monotonic()
        await engine.close()
        res["close_s"] = round(time.monotonic() - t0, 2)
    return res


def msgspec_tuple(load) -> tuple:
    return (load.running, load.waiting, round(load.kv_usage, 4))


if __name__ == "__main__":
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    out = asyncio.run(main(sys.argv[1]))
    print("RESULT " + json.dumps(out, ensure_ascii=False), flush=True)
