"""vLLM's own ``stop_reason`` reaches the client: the stop token ids it adds
from the model's generation config (Gemma's ``<end_of_turn>``, Llama-3's
128009) are in no request's ``stop_token_ids``, so only vLLM knows that one
of them ended a request, as ``vllm serve`` then says."""

from __future__ import annotations

from types import SimpleNamespace

from replicas.prepare import prepare
from replicas.protocol import FinishReason, SamplingParams
from replicas.sim import ByteTokenizer
from replicas.vllm_engine import VllmEngine, VllmEngineConfig

TOK = ByteTokenizer()
END_OF_TURN = ord("!")  # (a token the request's params do not name as a stop token)


class _FakeLLM:
    """vLLM's ``AsyncLLM.generate`` as far as ``VllmEngine._run`` reads it: DELTA outputs."""

    errored = False

    def __init__(self, *outputs: SimpleNamespace) -> None:
        self.outputs = outputs

    async def generate(self, prompt, sp, req_id):
        for out in self.outputs:
            yield out


def _out(ids: list[int], finish: str | None = None, stop_reason: object = None) -> SimpleNamespace:
    c = SimpleNamespace(token_ids=ids, finish_reason=finish, stop_reason=stop_reason)
    return SimpleNamespace(outputs=[c], finished=finish is not None)


async def _stop_reason(*outputs: SimpleNamespace) -> str | int | None:
    """The stop_reason a replica gives for a request vLLM answered with ``outputs``."""
    engine = SimpleNamespace(max_model_len=100, tokenizer=TOK, default_max_tokens=None)
    _, _, proc = prepare(engine, TOK.encode("x"), SamplingParams(max_tokens=10))  # type: ignore[arg-type]
    vllm = VllmEngine(VllmEngineConfig(model="m"), lambda rid, ids, finish, error, stop_id=None:
                      proc.process(ids, finish, stop_id))
    vllm._vllm = (None, dict, None, RuntimeError)
    vllm._llm = _FakeLLM(*outputs)
    await vllm._run(1, "1-0", [1], None)
    assert proc.finished
    return proc.stop_reason


async def test_a_stop_token_vllm_added_is_the_stop_reason_as_vllm_gives_it():
    # (it was null: the replica knew only the request's own stop_token_ids)
    assert await _stop_reason(_out(TOK.encode("ab")), _out([END_OF_TURN], "stop", END_OF_TURN)) == END_OF_TURN


async def test_only_an_int_stop_reason_is_taken():
    # (EOS and length: None from vLLM; a string would be a stop string vLLM
    # matched, which it does not here: the replica matches them, detokenize=False)
    assert await _stop_reason(_out(TOK.encode("ab") + [END_OF_TURN], "stop")) is None
    assert await _stop_reason(_out(TOK.encode("abc"), "length")) is None
    assert await _stop_reason(_out(TOK.encode("ab") + [END_OF_TURN], "stop", "ab")) is None
    assert await _stop_reason(_out(TOK.encode("ab") + [END_OF_TURN], "stop", True)) is None


def test_the_processor_takes_the_engines_stop_id_for_a_stop_only():
    def reason(finish: FinishReason, stop_id: int | None, **kw) -> str | int | None:
        engine = SimpleNamespace(max_model_len=100, tokenizer=TOK, default_max_tokens=None)
        _, _, proc = prepare(engine, TOK.encode("x"), SamplingParams(max_tokens=10, **kw))  # type: ignore[arg-type]
        proc.process(TOK.encode("ab") + [END_OF_TURN], finish, stop_id)
        return proc.stop_reason

    assert reason(FinishReason.STOP, END_OF_TURN) == END_OF_TURN
    assert reason(FinishReason.LENGTH, END_OF_TURN) is None
    # (a stop string the text before the stop token completes wins, as in vLLM)
    assert reason(FinishReason.STOP, END_OF_TURN, stop=["ab"]) == "ab"
