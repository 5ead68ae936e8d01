"""A request that comes before the replicas have told the router their
models (a router that just started, an ``address``/``url`` replica not
reached yet) is a 503 to retry, as the README promises ("until /ready says
200, requests get 503 no_replica_available"), not a 404 model_not_found,
which clients do not retry."""

from __future__ import annotations

from types import SimpleNamespace

import msgspec
import pytest

from replicas.pool import ReplicaPool
from replicas.sim import SimConfig
from replicas.spec import ReplicaSpec
from router.completions import check_model
from router.errors import NotFound, ReplicaUnavailable
from tests.unit.pools import queueing_policy


def svc_of(*specs: ReplicaSpec) -> SimpleNamespace:
    return SimpleNamespace(pool=ReplicaPool(list(specs)))


def test_a_local_sim_replica_without_a_model_in_its_config_serves_the_sim_default() -> None:
    svc = svc_of(ReplicaSpec(name="sim-0", engine="sim", config={"seed": 0}))
    assert svc.pool.models() == [SimConfig().model]
    # known before the replica is ready: it passes here, and the scheduler answers 503 until one is
    check_model(svc, queueing_policy("t"), SimConfig().model)  # type: ignore[arg-type]
    with pytest.raises(NotFound):
        check_model(svc, queueing_policy("t"), "no-such-model")  # type: ignore[arg-type]


def test_a_request_before_an_address_replica_connected_is_a_503_not_a_404() -> None:
    svc = svc_of(ReplicaSpec(name="far", address="127.0.0.1:9"))
    with pytest.raises(ReplicaUnavailable) as e:
        check_model(svc, queueing_policy("t"), "whatever-it-serves")  # type: ignore[arg-type]
    assert e.value.code == "no_replica_available" and e.value.headers["retry-after"] == "1"


def test_a_model_the_tenant_may_not_use_stays_a_404() -> None:
    svc = svc_of(ReplicaSpec(name="far", address="127.0.0.1:9"))
    policy = msgspec.structs.replace(queueing_policy("t"), models=["only-this"])
    with pytest.raises(NotFound):
        check_model(svc, policy, "another")  # type: ignore[arg-type]
