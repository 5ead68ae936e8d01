"""router/estimate.py: the prompt-token estimate admission reserves."""

from __future__ import annotations

from replicas.protocol import SamplingParams
from replicas.sim import ByteTokenizer
from router.estimate import FIRST_GUESS, MAX_FIXED, PER_MESSAGE, PromptEstimates
from router.job import Job


def _chat(*messages: tuple[str, str], model: str = "m") -> Job:
    return Job(model, SamplingParams(max_tokens=1), messages=[{"role": r, "content": c} for r, c in messages])


def test_a_chat_is_estimated_above_what_the_sim_template_makes_of_it_before_and_after_learning() -> None:
    est = PromptEstimates()
    tok = ByteTokenizer()
    chats = [_chat(("user", "hi")), _chat(("system", "be brief"), ("user", "é" * 40)),
             _chat(("assistant", "")), _chat(*[("user", "x")] * 20)]
    for job in chats:  # before any count: the first guess covers the sim's template
        estimate, _ = est.estimate(job)
        assert estimate >= len(tok.chat(job.messages)), job.messages
    first = chats[0]
    estimate, base = est.estimate(first)
    assert base == 2 + PER_MESSAGE and estimate == base + FIRST_GUESS["chat"]
    est.learn(first, base, len(tok.chat(first.messages)))
    assert est.estimate(first)[0] == len(tok.chat(first.messages))  # (learned: exactly what it takes)
    for job in chats[1:]:
        assert est.estimate(job)[0] >= len(tok.chat(job.messages)) - (PER_MESSAGE - 10), job.messages


def test_what_is_learned_is_the_most_any_request_needed_per_model_and_form() -> None:
    est = PromptEstimates()
    job = _chat(("user", "hi"))
    est.learn(job, 18, 40)
    est.learn(job, 18, 30)  # (less: the larger stays)
    assert est.estimate(job)[0] == 18 + 22
    assert est.estimate(_chat(("user", "hi"), model="other"))[0] == 18 + FIRST_GUESS["chat"]
    text = Job("m", SamplingParams(max_tokens=1), prompt="abc")
    assert est.estimate(text) == (3 + FIRST_GUESS["text"], 3)
    ids = Job("m", SamplingParams(max_tokens=1), prompt_token_ids=[1, 2, 3])
    assert est.estimate(ids) == (3, 3)


def test_only_a_short_prompt_without_template_kwargs_teaches() -> None:
    # (bytes overstate a long English text's tokens about 4 times: a 1,006-byte
    # chat counted as 278 tokens taught a fixed part of 0, and "hi" was then
    # reserved 18 tokens for the 28 it takes; kwargs a template renders may
    # count far more than their JSON, and raised every tenant's estimate)
    est = PromptEstimates()
    long = _chat(("user", "word " * 201))
    est.learn(long, est.estimate(long)[1], 278)
    assert est.estimate(_chat(("user", "hi")))[0] == 2 + PER_MESSAGE + FIRST_GUESS["chat"]
    kw = Job("m", SamplingParams(max_tokens=1), messages=[{"role": "user", "content": "hi"}],
             template_kwargs={"tools": [{"name": "x"}]})
    est.learn(kw, est.estimate(kw)[1], 50_000)
    assert est.estimate(_chat(("user", "hi")))[0] == 2 + PER_MESSAGE + FIRST_GUESS["chat"]
    short = _chat(("user", "hi"))
    est.learn(short, est.estimate(short)[1], 10**6)  # (an outlier: at most MAX_FIXED)
    assert est.estimate(short)[0] == 2 + PER_MESSAGE + MAX_FIXED


def test_a_message_s_name_and_tool_call_id_count_and_what_renders_more_than_the_base_teaches_nothing() -> None:
    # (a 6,000-character name rendered into the prompt was neither counted nor
    # kept from teaching: the fixed part took ~1,015 more tokens, for every
    # tenant's chats of that model, for the router's life)
    est = PromptEstimates()
    plain = _chat(("user", "hi"))
    named = Job("m", SamplingParams(max_tokens=1), messages=[
        {"role": "user", "content": "hi", "name": "n" * 6000},
        {"role": "tool", "content": "42", "tool_call_id": "call_1"}])
    estimate, base = est.estimate(named)
    assert base == 2 + 6000 + 2 + len("call_1") + 2 * PER_MESSAGE
    est.learn(named, base, base + 1015)
    one = SamplingParams(max_tokens=1)
    for job in (Job("m", one, messages=[{"role": "user", "content": "hi", "name": "bob"}]),
                Job("m", one, messages=[{"role": "tool", "content": "1", "tool_call_id": "c"}]),
                Job("m", one, messages=[{"role": "user", "content": "hi"}], reasoning_effort="high")):
        est.learn(job, est.estimate(job)[1], 500)
    assert est.estimate(plain)[0] == 2 + PER_MESSAGE + FIRST_GUESS["chat"]
    est.learn(plain, est.estimate(plain)[1], 27)  # (an ordinary chat still teaches)
    assert est.estimate(plain)[0] == 27
