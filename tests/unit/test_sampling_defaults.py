"""Sampling fields a client leaves unset: the model's own defaults apply
(vLLM's generation config, as ``vllm serve`` applies them), and an upstream
is sent only what the client set."""

from __future__ import annotations

import json
from types import SimpleNamespace

import pytest

from replicas.engine import EngineError
from replicas.prepare import prepare
from replicas.protocol import (
    UNSET_FREQUENCY_PENALTY,
    UNSET_MIN_P,
    UNSET_PRESENCE_PENALTY,
    UNSET_TEMPERATURE,
    UNSET_TOP_K,
    UNSET_TOP_P,
    SamplingParams,
)
from replicas.sim import ByteTokenizer
from replicas.upstream import UpstreamClient
from replicas.vllm_engine import model_max_tokens, model_sampling_defaults, with_model_defaults
from router.openai_types import ChatRequest, decode_request, to_params


def params(**kw) -> SamplingParams:
    body = {"model": "m", "messages": [{"role": "user", "content": "hi"}], **kw}
    return to_params(decode_request(json.dumps(body).encode(), ChatRequest), 16)


def upstream_body(p: SamplingParams) -> dict:
    return UpstreamClient._body(SimpleNamespace(upstream_model="m", ready=SimpleNamespace(max_model_len=0)),
                                p, [], False, False)  # type: ignore[arg-type]


def test_the_fields_a_client_leaves_unset_are_marked():
    assert params().unset == 127
    assert params(presence_penalty=0.0).unset == 127 & ~UNSET_PRESENCE_PENALTY
    assert params(frequency_penalty=0.5).unset == 127 & ~UNSET_FREQUENCY_PENALTY
    p = params(temperature=0.7, top_k=-1)
    assert not p.unset & UNSET_TEMPERATURE and not p.unset & UNSET_TOP_K and p.unset & UNSET_TOP_P
    assert p.unset & UNSET_MIN_P and not params(min_p=0.0).unset & UNSET_MIN_P


def test_an_upstream_is_sent_what_the_client_set_and_only_that():
    body = upstream_body(params())
    # (temperature was always sent, as 1.0: an upstream vLLM then ignored the model's default)
    assert not {"temperature", "top_p", "top_k", "repetition_penalty", "min_p", "presence_penalty",
                "frequency_penalty"} & set(body), body
    body = upstream_body(params(temperature=0.0, top_p=1.0, top_k=-1, repetition_penalty=1.0, min_p=0.0,
                                presence_penalty=0.0, frequency_penalty=0.0))
    # (values equal to the neutral ones were dropped, so the model's defaults replaced them)
    assert (body["temperature"], body["top_p"], body["top_k"], body["repetition_penalty"], body["min_p"],
            body["presence_penalty"], body["frequency_penalty"]) == (0.0, 1.0, -1, 1.0, 0.0, 0.0, 0.0)
    assert upstream_body(params(min_p=0.05))["min_p"] == 0.05


def test_a_model_default_fills_only_an_unset_field():
    config = SimpleNamespace(get_diff_sampling_param=lambda: {"temperature": 0.6, "top_k": 20, "min_p": 0.1,
                                                              "presence_penalty": 1.5, "frequency_penalty": 0.5,
                                                              "max_tokens": 100, "unknown": 3})
    defaults = model_sampling_defaults(config)
    assert defaults == {"temperature": 0.6, "top_k": 20, "min_p": 0.1, "presence_penalty": 1.5,
                        "frequency_penalty": 0.5, "max_tokens": 100}  # (what the protocol carries)
    assert with_model_defaults(params(), defaults) == (0.6, 1.0, 20, 1.0, 0.1, 1.5, 0.5)
    assert with_model_defaults(params(temperature=1.0, top_k=5, min_p=0.0, presence_penalty=0.0), defaults) == (
        1.0, 1.0, 5, 1.0, 0.0, 0.0, 0.5)
    # a router that does not mark unset fields: every value as sent
    assert with_model_defaults(SamplingParams(), defaults) == (1.0, 1.0, -1, 1.0, 0.0, 0.0, 0.0)
    assert model_sampling_defaults(SimpleNamespace()) == {}  # (a vLLM without the call)
    assert (model_max_tokens(defaults), model_max_tokens({})) == (100, None)


def _engine(default_max_tokens: int | None, max_model_len: int = 64) -> SimpleNamespace:
    return SimpleNamespace(tokenizer=ByteTokenizer(), max_model_len=max_model_len,
                           default_max_tokens=default_max_tokens)


def test_the_models_max_new_tokens_limits_a_request_that_sets_no_max_tokens():
    # vLLM's server (get_max_tokens): the least of the context's remainder and
    # the model's max_new_tokens, for a request that sets none; one that does keeps its own
    prompt = [1] * 10

    def max_tokens(p: SamplingParams, engine: SimpleNamespace) -> int:
        return prepare(engine, prompt, p)[1].max_tokens  # type: ignore[arg-type]

    assert max_tokens(params(), _engine(5)) == 5  # (the router's default: 16)
    assert max_tokens(params(), _engine(None)) == 16
    assert max_tokens(params(), _engine(100)) == 16  # (never above the router's default or the tenant's cap)
    assert max_tokens(params(), _engine(100, max_model_len=20)) == 10  # (the context's remainder)
    assert max_tokens(params(max_tokens=12), _engine(5)) == 12
    # a resumed stream counts from the same limit on any replica of the model
    ids, p, _ = prepare(_engine(5), prompt, params(), [7, 7])  # type: ignore[arg-type]
    assert (len(ids), p.max_tokens) == (12, 3)
    # ... and one that made more than that default where it did not apply (an
    # upstream, the sim, an older replica) ends at its prefix, for `length`:
    # this refused ("max_tokens already reached by the resumed prefix"), and
    # the stream ended on an error after its failover
    ids, p, _ = prepare(_engine(5), prompt, params(), [7] * 6)  # type: ignore[arg-type]
    assert (len(ids), p.max_tokens) == (16, 0)
    # a limit the client set is the client's, as before
    with pytest.raises(EngineError, match="already reached"):
        prepare(_engine(5), prompt, params(max_tokens=5), [7] * 6)  # type: ignore[arg-type]


def test_an_unset_max_tokens_over_the_whole_context_is_lowered_not_refused():
    # (the router's default, 1024 as the tenant's cap, on a model of 64
    # tokens: vLLM's context remainder. The check against the whole context
    # ran first and refused it, for a field the client never sent)
    prompt = [1] * 10
    p = to_params(decode_request(json.dumps({"model": "m", "messages": [{"role": "user", "content": "hi"}]}).encode(),
                                 ChatRequest), 1024)
    assert prepare(_engine(None), prompt, p)[1].max_tokens == 54  # type: ignore[arg-type]
    with pytest.raises(EngineError, match="maximum context length is 64"):
        prepare(_engine(None), prompt, params(max_tokens=1024))  # type: ignore[arg-type]


def test_a_min_tokens_over_the_whole_context_is_refused_though_max_tokens_is_unset():
    # (min_tokens raised the unset limit over the context: the room clamp
    # lowered it without a word, where vLLM's server refuses it)
    prompt = [1] * 10
    p = to_params(decode_request(json.dumps({"model": "m", "min_tokens": 100, "messages": [
        {"role": "user", "content": "hi"}]}).encode(), ChatRequest), 16)
    assert p.max_tokens_default and p.min_tokens == 100
    with pytest.raises(EngineError, match="maximum context length is 64"):
        prepare(_engine(None), prompt, p)  # type: ignore[arg-type]


def test_a_resumed_prefix_under_the_models_default_keeps_min_tokens_within_it():
    # (an unset max_tokens, with min_tokens 12 over the model's default 5; its first replica applied no such default and made 3: vLLM would
    # refuse min_tokens 9 over max_tokens 2 and end the stream on an error)
    prompt = [1] * 10
    p = params(min_tokens=12)
    assert p.max_tokens_default and (p.max_tokens, p.min_tokens) == (16, 12)
    _, out, _ = prepare(_engine(5), prompt, p, [7] * 3)  # type: ignore[arg-type]
    assert (out.max_tokens, out.min_tokens) == (2, 2)


def test_an_upstream_is_sent_an_unset_max_tokens_within_its_context():
    # (the router's default over an upstream's whole context: vLLM's server
    # refused it with a 400 naming max_tokens, a field the client never sent)
    def sent(p: SamplingParams, known: int) -> int:
        upstream = SimpleNamespace(upstream_model="m", ready=SimpleNamespace(max_model_len=known))
        return UpstreamClient._body(upstream, p, [], False, False)["max_tokens"]  # type: ignore[arg-type]

    assert sent(params(), 8) == 8  # (the default, 16, over a context of 8)
    assert sent(params(), 0) == 16  # (an upstream whose /models gives no length: as before)
    assert sent(params(max_tokens=12), 8) == 12  # (the client's own: its 400 is the upstream's, as from vLLM)
