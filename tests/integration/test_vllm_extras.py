"""vLLM's request extras ``include_stop_str_in_output`` and
``chat_template_kwargs`` as clients of vLLM-backed APIs send them (the openai
SDK's ``extra_body``), through a real router and sim replicas: honoured with
vLLM's semantics, across a failover too, and refused with a 400 naming the
field when malformed."""

from __future__ import annotations

import asyncio
import signal

import openai
import pytest

from tests.helpers import GOLD, MODEL, RouterProcess, apoll

IGNORE_EOS = {"ignore_eos": True}
INCLUDE = {**IGNORE_EOS, "include_stop_str_in_output": True}
KWARGS = {"enable_thinking": False}
PROMPT = "Le caf"
CHAT = [{"role": "user", "content": "Tell me"}]


@pytest.fixture(scope="module")
def client(shared_router: RouterProcess):
    with openai.OpenAI(base_url=shared_router.base_url + "/v1", api_key=GOLD, max_retries=0, timeout=30) as c:
        yield c


def _stop_in(reference: str, at: int) -> tuple[str, str]:
    """A 4-character stop string whose first occurrence is at ``at`` or just
    after, and the text up to and including it."""
    for i in range(at, len(reference) - 4):
        stop = reference[i : i + 4]
        if reference.find(stop) == i:
            return stop, reference[: i + 4]
    raise AssertionError(f"no stop string to pick in {reference!r}")


def _completion(client: openai.OpenAI, stream: bool, **kw) -> tuple[str, str | None]:
    if not stream:
        choice = client.completions.create(model=MODEL, prompt=PROMPT, **kw).choices[0]
        return choice.text, choice.finish_reason
    text, finish = "", None
    with client.completions.create(model=MODEL, prompt=PROMPT, stream=True, **kw) as events:
        for chunk in events:
            for c in chunk.choices:
                text += c.text or ""
                finish = c.finish_reason or finish
    return text, finish


def _chat(client: openai.OpenAI, stream: bool, **kw) -> tuple[str, str | None]:
    if not stream:
        choice = client.chat.completions.create(model=MODEL, messages=CHAT, **kw).choices[0]
        return choice.message.content or "", choice.finish_reason
    text, finish = "", None
    with client.chat.completions.create(model=MODEL, messages=CHAT, stream=True, **kw) as events:
        for chunk in events:
            for c in chunk.choices:
                text += c.delta.content or ""
                finish = c.finish_reason or finish
    return text, finish


@pytest.mark.parametrize("stream", [False, True])
@pytest.mark.parametrize("ask", [_completion, _chat], ids=["completions", "chat"])
def test_include_stop_str_in_output_ends_the_text_with_the_stop_string(client: openai.OpenAI, ask, stream) -> None:
    kw = dict(max_tokens=80, temperature=0)
    reference, _ = ask(client, False, extra_body=IGNORE_EOS, **kw)
    stop, expected = _stop_in(reference, 20)
    assert ask(client, stream, stop=[stop], extra_body=INCLUDE, **kw) == (expected, "stop")
    # without it (or false), the text ends before it, as before
    assert ask(client, stream, stop=[stop], extra_body=IGNORE_EOS, **kw) == (expected[:-4], "stop")
    off = {**IGNORE_EOS, "include_stop_str_in_output": False}
    assert ask(client, stream, stop=[stop], extra_body=off, **kw) == (expected[:-4], "stop")


def test_include_stop_str_in_output_outputs_a_stop_tokens_text_as_vllm(client: openai.OpenAI) -> None:
    # (vLLM's detokenizer leaves a stop token's text out only without it)
    kw = dict(max_tokens=80, temperature=0)
    reference, _ = _completion(client, False, extra_body=IGNORE_EOS, **kw)
    ch = next(c for c in reference[3:] if c.isascii() and c.isalpha())  # (the sim's tokens are bytes)
    stop_at = reference.index(ch, 3)
    extra = {**INCLUDE, "stop_token_ids": [ord(ch)], "min_tokens": 3}
    for stream in (False, True):
        assert _completion(client, stream, extra_body=extra, **kw) == (reference[: stop_at + 1], "stop"), stream


@pytest.mark.parametrize("stream", [False, True])
def test_chat_template_kwargs_reach_the_template(client: openai.OpenAI, stream: bool) -> None:
    # (the sim's template has no variables: they are taken and change
    # nothing, as a Jinja template ignores variables it does not use; that
    # they reach the tokenizer is tests/unit/test_chat_template_kwargs.py's)
    kw = dict(max_tokens=40, temperature=0, stream_options={"include_usage": True} if stream else None)
    plain = _chat(client, stream, extra_body=IGNORE_EOS, **kw)
    assert _chat(client, stream, extra_body={**IGNORE_EOS, "chat_template_kwargs": KWARGS}, **kw) == plain
    r = client.chat.completions.create(model=MODEL, messages=CHAT, max_tokens=4,
                                       extra_body={"chat_template_kwargs": {"documents": [{"text": "x"}]}})
    assert r.choices[0].finish_reason == "length" and r.usage.completion_tokens == 4


@pytest.mark.parametrize("extra, says", [
    ({"chat_template_kwargs": ["enable_thinking"]}, "Expected `object | null`, got `array`"),
    ({"chat_template_kwargs": "enable_thinking=false"}, "Expected `object | null`, got `str`"),
    ({"chat_template_kwargs": {"tokenize": True}}, "must not set tokenize"),
    ({"chat_template_kwargs": {"seed": 2**64}}, "out of the 64-bit range"),
    ({"include_stop_str_in_output": "yes"}, "Expected `bool | null`, got `str`"),
])
def test_malformed_extras_are_a_400_naming_the_field(client: openai.OpenAI, extra, says) -> None:
    for stream in (False, True):
        with pytest.raises(openai.BadRequestError) as e:
            client.chat.completions.create(model=MODEL, messages=CHAT, max_tokens=4, stream=stream, extra_body=extra)
        (name,) = extra
        assert (e.value.status_code, e.value.param, e.value.type) == (400, name, "invalid_request_error"), e.value
        assert says in e.value.message, e.value.message


def test_chat_template_kwargs_on_a_completion_is_an_unknown_field(client: openai.OpenAI) -> None:
    # (vLLM takes them on chat requests only)
    with pytest.raises(openai.BadRequestError) as e:
        client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=4, extra_body={"chat_template_kwargs": KWARGS})
    assert e.value.param == "chat_template_kwargs" and "Unrecognized request argument" in e.value.message


async def test_both_survive_a_replica_killed_mid_stream(make_router) -> None:
    router: RouterProcess = make_router(replicas=2, sim={"step_base_ms": 10})
    kw = dict(max_tokens=200, temperature=0)
    async with openai.AsyncOpenAI(base_url=router.base_url + "/v1", api_key=GOLD, max_retries=0, timeout=60) as c:
        chat_extra = {"chat_template_kwargs": KWARGS}
        ref_completion = (await c.completions.create(model=MODEL, prompt=PROMPT, extra_body=IGNORE_EOS, **kw)
                          ).choices[0].text
        ref_chat = (await c.chat.completions.create(model=MODEL, messages=CHAT, extra_body={**IGNORE_EOS, **chat_extra},
                                                    **kw)).choices[0].message.content or ""
        stops = [_stop_in(ref_completion, 120), _stop_in(ref_chat, 120)]
        got: list[list[str]] = [[], []]
        finishes: list[str | None] = [None, None]

        async def completion() -> None:
            events = await c.completions.create(model=MODEL, prompt=PROMPT, stream=True, stop=[stops[0][0]],
                                                extra_body=INCLUDE, **kw)
            async for chunk in events:
                for ch in chunk.choices:
                    got[0].append(ch.text or "")
                    finishes[0] = ch.finish_reason or finishes[0]

        async def chat() -> None:
            events = await c.chat.completions.create(model=MODEL, messages=CHAT, stream=True, stop=[stops[1][0]],
                                                     extra_body={**INCLUDE, **chat_extra}, **kw)
            async for chunk in events:
                for ch in chunk.choices:
                    got[1].append(ch.delta.content or "")
                    finishes[1] = ch.finish_reason or finishes[1]

        tasks = [asyncio.create_task(completion()), asyncio.create_task(chat())]
        try:
            await apoll(lambda: all(len("".join(g)) >= 40 for g in got) or any(t.done() for t in tasks),
                        20, what="both streams to be under way")
            assert not any(t.done() for t in tasks), "a stream ended before the replica was killed"
            m = await router.ametrics()
            inflight = {n: m.value("fairstream_replica_inflight_requests", replica=n) for n in ("sim-0", "sim-1")}
            victim = max(inflight, key=inflight.get)
            router.kill_replica(victim, signal.SIGKILL)
            await asyncio.wait_for(asyncio.gather(*tasks), 30)
        finally:
            for t in tasks:
                t.cancel()
        m = await router.ametrics()
    assert ["".join(g) for g in got] == [expected for _, expected in stops]
    assert finishes == ["stop", "stop"]
    assert m.value("fairstream_failovers_total", replica=victim) >= 1
    assert m.value("fairstream_streams_lost_total") == 0
