"""router.largebody and the sliced decode of a large body (router.completions._job).

A large body gets the same request, job, estimate and first error as in one
piece; the loop turns between its slices; large bodies take turns, round
the tenants (``TurnRotation``)."""

from __future__ import annotations

import asyncio
import json
import random
import time
from types import SimpleNamespace
from typing import Any

import pytest

from replicas.protocol import SamplingParams
from router import completions
from router.deadlines import Deadlines, StreamTimeout
from router.errors import ApiError
from router.job import AFFINITY_PREFIX, Job
from router.largebody import LARGE_BODY, SLICE, LargeBodies, TurnRotation, large

MODEL = "m"


def _svc() -> Any:
    pool = SimpleNamespace(models=lambda: {MODEL}, serves=lambda model: model == MODEL, models_unknown=lambda: 0)
    config = SimpleNamespace(default_max_tokens=256, max_body_bytes=8 * 1024 * 1024)
    return SimpleNamespace(pool=pool, config=config, large_bodies=LargeBodies())


def _policy(max_tokens: int = 0, name: str = "t") -> Any:
    return SimpleNamespace(name=name, allows_model=lambda m: True, limits=SimpleNamespace(max_tokens=max_tokens))


def _chat(n: int, **kw: Any) -> dict[str, Any]:
    msgs = [{"role": "user" if i % 2 else "assistant", "content": f"message {i} é"} for i in range(n)]
    return {"model": MODEL, "messages": msgs, "max_tokens": 8, **kw}


def _outcome(body: bytes, chat: bool = True, policy: Any = None) -> tuple:
    """(request fields, job fields, base) or the error's (status, body)."""
    async def run():
        return await completions._job(_svc(), policy or _policy(), body, chat, False, None)

    try:
        req, job, base = asyncio.run(run())
    except ApiError as e:
        return ("error", e.status, e.body())
    return (req, job.messages, job.prompt, job.prompt_token_ids, job.params, job.template_kwargs, base)


def _pad(body: dict[str, Any]) -> bytes:
    """``body`` as JSON, padded past LARGE_BODY with spaces (the same request, large)."""
    raw = json.dumps(body).encode()
    return raw + b" " * max(0, LARGE_BODY - len(raw))


def test_the_threshold() -> None:
    assert not large(LARGE_BODY - 1) and large(LARGE_BODY)


@pytest.mark.parametrize("body", [
    _chat(1), _chat(SLICE), _chat(SLICE + 1), _chat(3 * SLICE + 7, chat_template_kwargs={"x": [1, {"y": 2}]}),
    _chat(0), _chat(5, max_tokens=0), _chat(5, model="other"), _chat(5, stream_options={"include_usage": True}),
    {**_chat(3), "messages": [*_chat(SLICE + 3)["messages"], {"role": "robot", "content": "x"}]},
    {**_chat(3), "messages": [*_chat(2 * SLICE)["messages"], {"role": "user", "content": [{"type": "image"}]}]},
    {**_chat(3), "messages": [*_chat(SLICE)["messages"], {"role": "user"}], "max_tokens": 10**6},
], ids=lambda b: f"{len(b['messages'])}-messages")
def test_a_large_chat_gets_what_it_gets_in_one_piece(body: dict[str, Any]) -> None:
    small = json.dumps(body).encode()
    if large(len(small)):  # (the one-piece path, on the same body: as the router took it before)
        one = asyncio.run(_one_piece(small, True))
    else:
        one = _outcome(small)
    assert _outcome(_pad(body)) == one


async def _one_piece(body: bytes, chat: bool) -> tuple:
    svc, policy = _svc(), _policy()
    cap, default = 0, 256 if chat else completions.COMPLETIONS_DEFAULT_MAX_TOKENS
    try:
        req = completions._decode(body, chat, False)
        completions.check_model(svc, policy, req.model)
        job, base = completions._build(req, completions._params(req, default, cap))
    except ApiError as e:
        return ("error", e.status, e.body())
    return (req, job.messages, job.prompt, job.prompt_token_ids, job.params, job.template_kwargs, base)


@pytest.mark.parametrize("body", [
    {"model": MODEL, "prompt": "x", "stop_token_ids": list(range(40_000))},
    {"model": MODEL, "prompt": list(range(30_000))},
    {"model": MODEL, "prompt": "x", "stop_token_ids": [1, 2, -1]},
    {"model": MODEL, "prompt": [[1, 2], [3]]},
])
def test_a_large_completion_gets_what_it_gets_in_one_piece(body: dict[str, Any]) -> None:
    assert _outcome(_pad(body), chat=False) == asyncio.run(_one_piece(json.dumps(body).encode(), False))


def test_the_loop_turns_between_slices_and_large_bodies_take_turns() -> None:
    body = _pad(_chat(10 * SLICE))
    order: list[str] = []

    async def run() -> int:
        svc = _svc()
        turns = 0
        stop = False

        async def ticker() -> None:
            nonlocal turns
            while not stop:
                turns += 1
                await asyncio.sleep(0)

        async def one(name: str) -> None:
            order.append(f"{name} start")
            await completions._job(svc, _policy(), body, True, False, None)
            order.append(f"{name} end")

        tick = asyncio.create_task(ticker())
        await asyncio.gather(one("a"), one("b"))
        stop = True
        await tick
        return turns

    turns = asyncio.run(run())
    assert turns >= 2 * 10  # (at least one turn per slice of each body)
    assert order == ["a start", "b start", "a end", "b end"]  # (b waited for a's turn to end)


def test_the_affinity_key_of_a_chat_reads_only_its_prefix() -> None:
    def whole(messages: list[dict[str, str]]) -> int | None:  # (what it was: the whole chat joined)
        text = "\x00".join(f"{m.get('role')}:{m.get('content')}" for m in messages)
        return hash(text[:AFFINITY_PREFIX]) if len(text) >= AFFINITY_PREFIX else None

    rng = random.Random(7)
    for _ in range(3000):
        msgs = [{"role": rng.choice(["user", "assistant"]), "content": "x" * rng.choice([0, 1, 100, 505, 506, 511, 512])}
                for _ in range(rng.randint(1, 6))]
        assert Job(MODEL, SamplingParams(max_tokens=1), messages=msgs).affinity_key() == whole(msgs), msgs


def _parts(n: int) -> list[dict[str, str]]:
    return [{"type": "text", "text": f"p{j}"} for j in range(n)]


class _CountingTurns(LargeBodies):
    """``LargeBodies`` that counts the loop turns a body's slices take."""

    def __init__(self) -> None:
        super().__init__()
        self.turns = 0

    async def turn(self) -> None:
        self.turns += 1
        await asyncio.sleep(0)


def _turns(body: bytes) -> int:
    svc = _svc()
    svc.large_bodies = _CountingTurns()
    try:
        asyncio.run(completions._job(svc, _policy(), body, True, False, None))
    except ApiError:
        pass
    return svc.large_bodies.turns


@pytest.mark.parametrize("shape", [
    [{"role": "user", "content": _parts(20 * SLICE)}],  # (one message of many parts)
    [{"role": "user", "content": _parts(20)} for _ in range(SLICE)],  # (many messages of some parts)
    [{"role": "user", "content": _parts(3)} for _ in range(7 * SLICE)],
], ids=["one-message", "2000-messages", "many-messages"])
def test_slices_are_cut_by_content_parts_too(shape: list[dict[str, Any]]) -> None:
    body = {"model": MODEL, "messages": shape, "max_tokens": 8}
    work = sum(1 + len(m["content"]) for m in shape)  # (a message and each of its parts: one unit)
    # (the decode's turn, then one per slice of at most SLICE units)
    assert _turns(_pad(body)) >= work // SLICE
    assert _outcome(_pad(body)) == asyncio.run(_one_piece(json.dumps(body).encode(), True))


@pytest.mark.parametrize("body", [
    {**_chat(3), "messages": [{"role": "user", "content": _parts(2 * SLICE + 5)}]},
    {**_chat(3), "messages": [{"role": "user", "content": [*_parts(2 * SLICE + 5), {"type": "image"}]}]},
    {**_chat(3), "messages": [{"role": "user", "content": _parts(SLICE - 1)}, {"role": "user"}]},
], ids=["parts", "bad-part-past-a-slice", "bad-message-after-parts"])
def test_a_large_chat_of_many_parts_gets_what_it_gets_in_one_piece(body: dict[str, Any]) -> None:
    assert _outcome(_pad(body)) == asyncio.run(_one_piece(json.dumps(body).encode(), True))


def test_large_chat_template_kwargs_are_refused_before_the_messages_are_checked() -> None:
    leaf: Any = [0]
    for _ in range(29):
        leaf = [leaf]
    body = {**_chat(10 * SLICE), "chat_template_kwargs": {"x": [leaf] * 20_000}}
    body["messages"][-1]["role"] = "robot"
    out = _outcome(_pad(body))
    assert out[:2] == ("error", 400) and json.loads(out[2])["error"]["param"] == "chat_template_kwargs", out
    assert _turns(_pad(body)) == 0  # (refused with the decode: no slice of messages was checked)


def test_the_wait_for_the_large_body_turn_ends_at_the_requests_first_token_limit() -> None:
    body = _pad(_chat(3))

    async def run() -> tuple[float, list[str]]:
        svc = _svc()
        order: list[str] = []

        async def one(name: str, first_token: float) -> None:
            try:
                await completions._job(svc, _policy(), body, True, False, None,
                                       deadlines=Deadlines(first_token=first_token))
            except StreamTimeout as e:
                order.append(f"{name} {e.code}")
            else:
                order.append(f"{name} done")

        held = svc.large_bodies.turn_for("t", None)  # (a large body at work)
        await held.__aenter__()
        t0 = time.monotonic()
        early = asyncio.create_task(one("early", 60.0))
        await asyncio.sleep(0)
        late = asyncio.create_task(one("short", 0.2))  # (behind the first in line)
        after = asyncio.create_task(one("after", 60.0))  # (behind the one that leaves)
        await asyncio.wait_for(asyncio.shield(late), 5)
        took = time.monotonic() - t0
        await held.__aexit__(None, None, None)
        await asyncio.wait_for(asyncio.gather(early, after), 5)
        assert not svc.large_bodies.busy() and svc.large_bodies.waiting() == 0
        return took, order

    took, order = asyncio.run(run())
    assert order == ["short first_token_timeout", "early done", "after done"]
    assert 0.15 < took < 2.0  # (at its limit, not when the turn came)


def test_the_turns_go_round_the_tenants_with_bodies_waiting() -> None:
    r: TurnRotation[str] = TurnRotation()
    for w in ("a2", "a3", "a4"):  # (while a1 has the turn)
        r.join("a", w)
    r.join("b", "b1")
    r.join("c", "c1")
    r.join("b", "b2")
    served = []
    ended = "a"
    while (nxt := r.next(ended)) is not None:
        ended, w = nxt
        served.append(w)
    # (a's turn ended: b, c, then a; each tenant first come first served)
    assert served == ["b1", "c1", "a2", "b2", "a3", "a4"]
    assert r.tenants() == [] and len(r) == 0  # (nothing kept of a tenant with no body waiting)


def test_a_tenant_new_to_the_rotation_goes_to_its_back() -> None:
    r: TurnRotation[str] = TurnRotation()
    r.join("a", "a2")
    r.join("b", "b1")
    assert r.next("a") == ("b", "b1")
    r.join("c", "c1")
    r.join("b", "b2")  # (b's turn is under way: it is back in, behind a and c)
    assert r.tenants() == ["a", "c", "b"]
    assert [r.next(t) for t in ("b", "a", "c")] == [("a", "a2"), ("c", "c1"), ("b", "b2")]
    assert r.next("b") is None


def test_a_body_that_leaves_the_line_leaves_no_trace() -> None:
    r: TurnRotation[str] = TurnRotation()
    r.join("a", "a1")
    r.join("b", "b1")
    r.join("a", "a2")
    r.leave("a", "a1")
    r.leave("a", "a1")  # (twice: no-op)
    r.leave("z", "z1")  # (never in it: no-op)
    assert r.tenants() == ["a", "b"] and len(r) == 2
    r.leave("a", "a2")
    assert r.tenants() == ["b"]
    assert r.next(None) == ("b", "b1") and r.next("b") is None


def test_one_tenants_backlog_does_not_hold_up_another_tenants_body() -> None:
    async def run() -> list[str]:
        bodies = LargeBodies()
        order: list[str] = []

        async def one(tenant: str, name: str) -> None:
            async with bodies.turn_for(tenant, None):
                order.append(name)
                for _ in range(3):  # (its slices)
                    await bodies.turn()

        a = [asyncio.create_task(one("a", f"a{i}")) for i in range(6)]
        await asyncio.sleep(0)  # (a0 has the turn, a1-a5 wait)
        b = asyncio.create_task(one("b", "b0"))
        await asyncio.gather(*a, b)
        assert not bodies.busy() and bodies.waiting() == 0
        return order

    assert asyncio.run(run()) == ["a0", "b0", "a1", "a2", "a3", "a4", "a5"]


def test_a_body_whose_turn_came_as_it_was_cancelled_passes_the_turn_on() -> None:
    async def run() -> list[str]:
        bodies = LargeBodies()
        order: list[str] = []

        async def one(tenant: str, name: str) -> None:
            async with bodies.turn_for(tenant, None):
                order.append(name)

        held = bodies.turn_for("a", None)
        await held.__aenter__()
        gone = asyncio.create_task(one("b", "b0"))
        waiting = asyncio.create_task(one("b", "b1"))
        cancelled = asyncio.create_task(one("c", "c0"))
        other = asyncio.create_task(one("d", "d0"))
        await asyncio.sleep(0)  # (all four wait)
        cancelled.cancel()  # (cancelled while waiting: it leaves the line)
        await held.__aexit__(None, None, None)  # (the turn passes to b0 ...)
        gone.cancel()  # (... which is cancelled before it runs: it passes the turn on)
        await asyncio.gather(gone, cancelled, return_exceptions=True)
        await asyncio.gather(waiting, other)
        assert not bodies.busy() and bodies.waiting() == 0
        return order

    assert asyncio.run(run()) == ["d0", "b1"]


@pytest.mark.parametrize("kwargs, code", [
    ([1], None), ("s", None), ({"a": "1e400"}, None), ({"x": "y" * 20_000}, "chat_template_kwargs_too_large"),
], ids=["array", "string", "out-of-range", "too-large"])
def test_chat_template_kwargs_that_cannot_be_decoded_are_refused_before_the_model_is_checked(kwargs, code) -> None:
    # (as before they were kept raw: with the body, large or not)
    body = {**_chat(3), "model": "other", "max_tokens": 10**6, "chat_template_kwargs": kwargs}
    raw = json.dumps(body).encode().replace(b'"1e400"', b"1e400")  # (a number no float holds)
    for out in (_outcome(raw), _outcome(raw + b" " * LARGE_BODY)):
        assert out[:2] == ("error", 400), out
        err = json.loads(out[2])["error"]
        assert err["param"].startswith("chat_template_kwargs") and err["code"] == code, err
