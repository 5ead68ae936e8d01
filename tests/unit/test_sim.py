"""The sim engine is deterministic in its context, so a generation resumed from
prompt + generated tokens (a failover) continues with exactly the same tokens."""

from __future__ import annotations

import asyncio
from importlib import resources

import pytest
from hypothesis import given
from hypothesis import strategies as st

from replicas.protocol import FinishReason, SamplingParams
from replicas.sim import EOS, ORDER, ByteTokenizer, SimConfig, SimEngine, _chain, _Chain

contexts = st.lists(st.integers(0, 257), max_size=3 * ORDER)
keys = st.integers(-(2**63), 2**63 - 1)


@pytest.fixture(scope="module")
def fresh_chain() -> _Chain:
    return _Chain(resources.files("replicas").joinpath("corpus.txt").read_text("utf-8"))


@given(contexts, keys, st.booleans())
def test_chain_next_is_a_pure_function_of_its_arguments(ctx: list[int], key: int, allow_eos: bool) -> None:
    chain = _chain()
    before = list(ctx)
    a = chain.next(ctx, key, allow_eos)
    assert ctx == before, "next() must not modify the context"
    assert chain.next(list(ctx), key, allow_eos) == a
    assert 0 <= a <= EOS
    if not allow_eos:
        assert a != EOS


@given(contexts, keys, st.booleans())
def test_a_freshly_built_chain_agrees(fresh_chain: _Chain, ctx: list[int], key: int, allow_eos: bool) -> None:
    """Another replica process builds its own chain from the corpus: same answers."""
    assert fresh_chain.next(ctx, key, allow_eos) == _chain().next(ctx, key, allow_eos)


@given(st.lists(st.integers(0, 257), max_size=20), st.lists(st.integers(0, 257), min_size=ORDER, max_size=ORDER),
       keys)
def test_chain_next_only_sees_the_last_order_tokens(head: list[int], tail: list[int], key: int) -> None:
    chain = _chain()
    assert chain.next(head + tail, key, True) == chain.next(tail, key, True)


async def _generate(prompt: list[int], params: SamplingParams, *, seed: int = 0) -> tuple[list[int], FinishReason]:
    out: list[int] = []
    done: asyncio.Future[FinishReason] = asyncio.get_running_loop().create_future()

    def sink(rid: int, new: list[int], finish: FinishReason, error: str) -> None:
        out.extend(new)
        if finish != FinishReason.NONE and not done.done():
            done.set_result(finish)

    engine = SimEngine(SimConfig(seed=seed, step_base_ms=0, step_per_seq_ms=0, step_per_prefill_token_ms=0), sink)
    await engine.start()
    try:
        engine.add(1, prompt, params)
        finish = await asyncio.wait_for(done, 10)
    finally:
        await engine.close()
    return out, finish


@pytest.mark.parametrize(
    "params",
    [
        SamplingParams(max_tokens=80, temperature=0.0, ignore_eos=True),
        SamplingParams(max_tokens=80, temperature=1.0, seed=1234, ignore_eos=True),
    ],
    ids=["greedy", "seeded"],
)
@pytest.mark.parametrize("prompt", ["東京の", "Le caf", "The "])
async def test_generation_resumed_from_any_point_continues_identically(params: SamplingParams, prompt: str) -> None:
    ids = ByteTokenizer().encode(prompt)
    full, finish = await _generate(ids, params)
    assert finish == FinishReason.LENGTH and len(full) == 80
    assert (await _generate(ids, params)) == (full, finish), "same request, same tokens"
    for k in (1, 2, 17, 40, 79):
        rest, _ = await _generate(ids + full[:k], SamplingParams(**{**_fields(params), "max_tokens": 80 - k}))
        assert rest == full[k:], f"resume after {k} tokens diverged"


def _fields(p: SamplingParams) -> dict:
    return {f: getattr(p, f) for f in p.__struct_fields__}
