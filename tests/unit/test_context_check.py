"""The router's check of ``max_tokens`` against the model's context
(``router.completions._check_context``): vLLM's 400, before the tenant's
limits, only where no ready replica of the model could take the request."""

from __future__ import annotations

import json
from types import SimpleNamespace

import pytest

from replicas.pool import ReplicaPool
from replicas.protocol import Ready
from replicas.spec import ReplicaSpec
from router.completions import _check_context
from router.errors import BadRequest
from router.openai_types import ChatRequest, decode_request, to_params
from tests.unit.pools import MODEL, ReadyClient


def _pool(*lens: int) -> ReplicaPool:
    """Ready replicas of ``MODEL`` reporting these context lengths (0: one that does not say)."""
    pool = ReplicaPool([ReplicaSpec(name=f"r{i}", address=f"127.0.0.1:{9 + i}") for i in range(len(lens))])
    for slot, n in zip(pool.slots, lens):
        client = ReadyClient()
        client.ready = Ready(1, MODEL, "sim", n, 1, client.ready.features)
        slot.client = client  # type: ignore[assignment]
        slot.state = "ready"
    return pool


def _check(pool: ReplicaPool, default: int = 256, **body) -> None:
    req = decode_request(json.dumps({"model": MODEL, "messages": [{"role": "user", "content": "hi"}],
                                     **body}).encode(), ChatRequest)
    _check_context(SimpleNamespace(pool=pool), req, to_params(req, default))  # type: ignore[arg-type]


def test_max_tokens_over_every_known_context_is_refused():
    with pytest.raises(BadRequest) as e:
        _check(_pool(4096, 2048), max_tokens=8000)
    assert (e.value.code, e.value.param) == ("context_length_exceeded", "max_tokens")
    assert "max_tokens=8000 cannot be greater than max_model_len=4096" in e.value.message
    _check(_pool(4096, 2048), max_tokens=4096)  # (the larger replica may take it)
    _check(_pool(), max_tokens=8000)  # (none ready: the replica's own check, later)


def test_a_replica_of_unknown_context_may_take_more_than_any_known():
    # (an upstream whose /models gives no max_model_len: its context may be
    # larger; it was left out, and max_tokens=8000 refused for a 4096 replica)
    _check(_pool(4096, 0), max_tokens=8000)
    assert _pool(4096, 0).max_model_len(MODEL) == 4096  # (/v1/models: the smallest known)
    assert _pool(4096, 0).max_model_len(MODEL, largest=True) is None


def test_an_unset_max_tokens_is_never_refused_for_the_context():
    # (default_max_tokens 1024 on a model of 512: the replica lowers it to
    # what the context leaves; the router's 400 named a field never sent,
    # and with only min_tokens set called the default "min_tokens=1024")
    _check(_pool(512), default=1024)
    _check(_pool(512), default=1024, min_tokens=5)
    with pytest.raises(BadRequest) as e:
        _check(_pool(512), default=1024, max_completion_tokens=600)
    assert e.value.param == "max_completion_tokens"


def test_a_min_tokens_over_every_known_context_is_refused_though_max_tokens_is_unset():
    # (min_tokens raises the unset limit with it: over the whole context it
    # can never run, and vLLM's server refuses it; it was lowered in silence)
    with pytest.raises(BadRequest) as e:
        _check(_pool(512), default=256, min_tokens=600)
    assert (e.value.code, e.value.param) == ("context_length_exceeded", "min_tokens")
    assert "min_tokens=600 cannot be greater than max_model_len=512" in e.value.message
