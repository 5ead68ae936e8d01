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
        SamplingParams(max_tokens=80, temperature=0.8, seed=1234, top_k=3, top_p=0.9, ignore_eos=True),
        SamplingParams(max_tokens=80, temperature=0.8, seed=1234, top_p=0.9, min_p=0.2, ignore_eos=True),
    ],
    ids=["greedy", "seeded", "seeded-top-k-p", "seeded-min-p"],
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


# -- top_k / top_p / min_p -------------------------------------------------
#
# The sim's model ranks a context's candidates as: the greedy token (drawn with
# the greedy key) first, then the others by count, highest first, ties by token
# id. min_p keeps the greedy token and the others whose count exceeds min_p
# times the highest count; top_k keeps the first k; top_p the fewest of those
# whose counts reach top_p of their mass. ``_kept`` rebuilds that set from the
# counts ``next`` draws from, independently of ``next_within``'s bisects.

top_ks = st.one_of(st.just(-1), st.integers(0, 40))
top_ps = st.one_of(st.just(1.0), st.floats(1e-9, 1.0))
min_ps = st.one_of(st.just(0.0), st.just(1.0), st.floats(0.0, 1.0))


def _counts(chain: _Chain, ctx: list[int], allow_eos: bool) -> dict[int, int]:
    toks, cum = chain._entry(ctx)[:2]
    counts = {t: c - (cum[i - 1] if i else 0) for i, (t, c) in enumerate(zip(toks, cum))}
    if not allow_eos:
        counts.pop(EOS, None)
    return counts


def _kept(chain: _Chain, ctx: list[int], greedy_key: int, allow_eos: bool, top_k: int, top_p: float,
          min_p: float = 0.0) -> list[int]:
    counts = _counts(chain, ctx, allow_eos)
    greedy = chain.next(ctx, greedy_key, allow_eos)
    ranked = [greedy] + sorted((t for t in counts if t != greedy), key=lambda t: (-counts[t], t))
    if min_p > 0.0:  # (vLLM applies it first; it and top_k both keep a prefix)
        top = max(counts.values())
        ranked = [greedy] + [t for t in ranked[1:] if counts[t] > min_p * top]
    if top_k > 0:
        ranked = ranked[:top_k]
    if top_p < 1.0:
        target, mass = top_p * sum(counts[t] for t in ranked), 0
        for m, t in enumerate(ranked, 1):
            mass += counts[t]
            if mass >= target:
                ranked = ranked[:m]
                break
    return ranked


@given(contexts, keys, keys, st.booleans(), top_ks, top_ps, min_ps)
def test_next_within_draws_only_kept_candidates(
    ctx: list[int], key: int, greedy_key: int, allow_eos: bool, top_k: int, top_p: float, min_p: float
) -> None:
    chain = _chain()
    tok = chain.next_within(ctx, key, greedy_key, allow_eos, top_k, top_p, min_p)
    if not _counts(chain, ctx, allow_eos):
        assert tok == chain.next(ctx, key, allow_eos)  # a paragraph end that may not end
        return
    kept = _kept(chain, ctx, greedy_key, allow_eos, top_k, top_p, min_p)
    assert tok in kept
    if len(kept) == len(_counts(chain, ctx, allow_eos)):
        assert tok == chain.next(ctx, key, allow_eos), "keeping every candidate must not change the draw"


@given(contexts, keys, keys, st.booleans(), st.floats(1.0, 1e6))
def test_top_k_1_and_tiny_top_p_are_greedy(ctx: list[int], key: int, greedy_key: int, allow_eos: bool, k: float) -> None:
    chain = _chain()
    greedy = chain.next(ctx, greedy_key, allow_eos)
    assert chain.next_within(ctx, key, greedy_key, allow_eos, 1, 1.0) == greedy
    assert chain.next_within(ctx, key, greedy_key, allow_eos, -1, 1e-6) == greedy
    assert chain.next_within(ctx, key, greedy_key, allow_eos, int(k), 1e-6) == greedy


@given(contexts, keys, keys, st.booleans(), top_ks, top_ps)
def test_min_p_1_is_greedy_and_min_p_0_changes_nothing(
    ctx: list[int], key: int, greedy_key: int, allow_eos: bool, top_k: int, top_p: float
) -> None:
    # (min_p=1 keeps only the model's most likely token: vLLM's greedy token;
    # in the sim that is the greedy draw, even where others tie its count)
    chain = _chain()
    assert chain.next_within(ctx, key, greedy_key, allow_eos, top_k, top_p, 1.0) == chain.next(
        ctx, greedy_key, allow_eos)
    assert chain.next_within(ctx, key, greedy_key, allow_eos, top_k, top_p, 0.0) == chain.next_within(
        ctx, key, greedy_key, allow_eos, top_k, top_p)


@pytest.mark.parametrize(("top_k", "top_p", "min_p"), [
    (2, 1.0, 0.0), (5, 1.0, 0.0), (-1, 0.5, 0.0), (8, 0.6, 0.0), (38, 1.0, 0.0), (-1, 0.999, 0.0),
    (-1, 1.0, 0.3), (5, 1.0, 0.5), (-1, 0.6, 0.1), (-1, 1.0, 1e-9),
])
@pytest.mark.parametrize("greedy_key", [0, 1207959552, 3355443200], ids=["g-rank27", "g-rank3", "g-rank0"])
def test_next_within_draws_kept_candidates_in_proportion_to_their_counts(
    top_k: int, top_p: float, min_p: float, greedy_key: int
) -> None:
    """Keys spread evenly over the 32 bits the draw uses hit each kept candidate
    in proportion to its count, as an unrestricted draw does over all of them.
    The greedy keys make the greedy token the 28th, 4th and 1st by count."""
    chain, ctx = _chain(), [32]
    counts = _counts(chain, ctx, True)
    assert len(counts) == 38
    kept = _kept(chain, ctx, greedy_key, True, top_k, top_p, min_p)
    mass, n = sum(counts[t] for t in kept), 1 << 14
    seen: dict[int, int] = {}
    for j in range(n):
        tok = chain.next_within(ctx, j << 18, greedy_key, True, top_k, top_p, min_p)
        seen[tok] = seen.get(tok, 0) + 1
    assert set(seen) == set(kept)
    for t in kept:
        assert abs(seen[t] - n * counts[t] / mass) <= 1


async def test_top_k_1_or_min_p_1_is_greedy_at_any_temperature() -> None:
    """Reported: temperature 1, top_k 1 gave three different texts in three runs."""
    ids = ByteTokenizer().encode("The ")
    greedy, _ = await _generate(ids, SamplingParams(max_tokens=60, temperature=0.0, ignore_eos=True))
    for params in [
        SamplingParams(max_tokens=60, temperature=1.0, top_k=1, ignore_eos=True),
        SamplingParams(max_tokens=60, temperature=2.0, top_k=1, seed=7, ignore_eos=True),
        SamplingParams(max_tokens=60, temperature=1.0, top_p=1e-6, ignore_eos=True),
        SamplingParams(max_tokens=60, temperature=1.3, top_k=20, top_p=1e-6, seed=3, ignore_eos=True),
        SamplingParams(max_tokens=60, temperature=1.0, min_p=1.0, ignore_eos=True),
        SamplingParams(max_tokens=60, temperature=1.7, min_p=1.0, top_k=9, top_p=0.95, seed=11, ignore_eos=True),
    ]:
        for _ in range(3):
            assert (await _generate(ids, params))[0] == greedy, params


async def test_every_seed_samples() -> None:
    ids = ByteTokenizer().encode("The ")
    greedy, _ = await _generate(ids, SamplingParams(max_tokens=60, temperature=0.0, ignore_eos=True))
    for seed in (-1, 0, 1):
        sampled = SamplingParams(max_tokens=60, temperature=1.0, seed=seed, ignore_eos=True)
        assert (await _generate(ids, sampled))[0] != greedy, seed


async def test_top_k_top_p_and_min_p_narrow_what_seeds_can_produce() -> None:
    """After " " the chain has dozens of candidates: unrestricted seeds spread
    over many of them, top_k=2 over at most two, a small top_p or a large
    min_p over a few."""
    ids = ByteTokenizer().encode(" ")

    async def first_tokens(**kw: object) -> set[int]:
        return {(await _generate(ids, SamplingParams(max_tokens=1, seed=s, **kw)))[0][0] for s in range(60)}

    free = await first_tokens()
    assert len(free) > 8
    assert len(await first_tokens(top_k=2)) == 2
    assert 1 < len(await first_tokens(top_p=0.3)) < len(free) // 2
    # min_p 0.5: the counts above half the top's 35 (t 35, a 23, s 20), and the greedy token
    greedy = (await _generate(ids, SamplingParams(max_tokens=1, temperature=0.0)))[0][0]
    assert 1 < len(halved := await first_tokens(min_p=0.5)) and halved <= set(b"tas") | {greedy}


async def test_a_restriction_that_keeps_every_candidate_changes_nothing() -> None:
    ids = ByteTokenizer().encode(" ")
    base = SamplingParams(max_tokens=100, temperature=0.9, seed=42, ignore_eos=True)
    free, _ = await _generate(ids, base)
    wide, _ = await _generate(ids, SamplingParams(**{**_fields(base), "top_k": 1000, "top_p": 1.0}))
    assert wide == free
    narrow, _ = await _generate(ids, SamplingParams(**{**_fields(base), "top_k": 2}))
    assert narrow != free
    assert (await _generate(ids, SamplingParams(**{**_fields(base), "min_p": 0.0})))[0] == free
    assert (await _generate(ids, SamplingParams(**{**_fields(base), "min_p": 0.2})))[0] != free
