"""Sampling fields a client leaves unset: the model's own defaults apply
(vLLM's generation config, as ``vllm serve`` applies them), and an upstream
is sent only what the client set."""

from __future__ import annotations

import json
from types import SimpleNamespace

from replicas.protocol import UNSET_MIN_P, UNSET_TEMPERATURE, UNSET_TOP_K, UNSET_TOP_P, SamplingParams
from replicas.upstream import UpstreamClient
from replicas.vllm_engine import model_sampling_defaults, with_model_defaults
from router.openai_types import ChatRequest, decode_request, to_params


def params(**kw) -> SamplingParams:
    body = {"model": "m", "messages": [{"role": "user", "content": "hi"}], **kw}
    return to_params(decode_request(json.dumps(body).encode(), ChatRequest), 16)


def upstream_body(p: SamplingParams) -> dict:
    return UpstreamClient._body(SimpleNamespace(upstream_model="m"), p, [], False, False)  # type: ignore[arg-type]


def test_the_fields_a_client_leaves_unset_are_marked():
    assert params().unset == 31
    p = params(temperature=0.7, top_k=-1)
    assert not p.unset & UNSET_TEMPERATURE and not p.unset & UNSET_TOP_K and p.unset & UNSET_TOP_P
    assert p.unset & UNSET_MIN_P and not params(min_p=0.0).unset & UNSET_MIN_P


def test_an_upstream_is_sent_what_the_client_set_and_only_that():
    body = upstream_body(params())
    # (temperature was always sent, as 1.0: an upstream vLLM then ignored the model's default)
    assert not {"temperature", "top_p", "top_k", "repetition_penalty", "min_p"} & set(body), body
    body = upstream_body(params(temperature=0.0, top_p=1.0, top_k=-1, repetition_penalty=1.0, min_p=0.0))
    # (values equal to the neutral ones were dropped, so the model's defaults replaced them)
    assert (body["temperature"], body["top_p"], body["top_k"], body["repetition_penalty"], body["min_p"]) == (
        0.0, 1.0, -1, 1.0, 0.0)
    assert upstream_body(params(min_p=0.05))["min_p"] == 0.05


def test_a_model_default_fills_only_an_unset_field():
    config = SimpleNamespace(get_diff_sampling_param=lambda: {"temperature": 0.6, "top_k": 20, "min_p": 0.1,
                                                              "max_tokens": 100})
    defaults = model_sampling_defaults(config)
    assert defaults == {"temperature": 0.6, "top_k": 20, "min_p": 0.1}  # (what the protocol carries)
    assert with_model_defaults(params(), defaults) == (0.6, 1.0, 20, 1.0, 0.1)
    assert with_model_defaults(params(temperature=1.0, top_k=5, min_p=0.0), defaults) == (1.0, 1.0, 5, 1.0, 0.0)
    # a router that does not mark unset fields: every value as sent
    assert with_model_defaults(SamplingParams(), defaults) == (1.0, 1.0, -1, 1.0, 0.0)
    assert model_sampling_defaults(SimpleNamespace()) == {}  # (a vLLM without the call)
