"""Each local vLLM replica's CPU workers get cores of their own
(``replicas.cpubind``), and the supervisor hands them over unless the
operator chose."""

from __future__ import annotations

import os

from hypothesis import given
from hypothesis import strategies as st

from replicas.cpubind import BIND_ENV, core_lists, id_list, workers
from replicas.pool import ReplicaPool
from replicas.spec import ReplicaSpec
from replicas.supervisor import Supervisor
from tests.helpers import cpu_lists


def test_two_replicas_on_two_cores_get_one_each_and_more_cores_leave_one_free() -> None:
    assert core_lists([0, 1], [1, 1]) == ["0", "1"]  # (what the vLLM tests measured best on 2 cores)
    assert core_lists([0, 1], [1]) == ["0"]  # (as vLLM's auto: one core kept free)
    assert core_lists(range(16), [1, 1]) == ["0-7", "8-14"]
    assert core_lists([4, 5, 6, 7, 8], [2, 1]) == ["4-5|6", "7"]  # (tensor parallel 2: a list per worker)
    assert core_lists([0], [1, 1]) == ["0", "0"]  # (too few: shared)
    assert core_lists([0, 2, 3], [1, 1, 1, 1]) == ["0", "2", "3", "0"]
    assert id_list([7, 0, 1, 2, 5, 8]) == "0-2,5,7-8"


def test_a_replicas_worker_count_is_its_parallel_sizes() -> None:
    assert workers({"model": "m"}) == 1
    assert workers({"extra": {"tensor_parallel_size": 2, "pipeline_parallel_size": 2}}) == 4
    assert workers({"extra": {"data_parallel_size": 3, "max_num_seqs": 8}}) == 3


@given(st.sets(st.integers(0, 63), min_size=1, max_size=24), st.lists(st.integers(1, 4), min_size=1, max_size=6))
def test_every_worker_gets_cores_and_none_shares_while_there_are_enough(cpus: set[int], ranks: list[int]) -> None:
    lists = [cpu_lists(s) for s in core_lists(sorted(cpus), ranks)]
    assert [len(per) for per in lists] == ranks
    every = [ids for per in lists for ids in per]
    assert all(ids and set(ids) <= cpus for ids in every)
    if len(cpus) > sum(ranks):
        used = [c for ids in every for c in ids]
        assert len(used) == len(set(used)) == len(cpus) - 1 and max(cpus) not in used
        assert max(map(len, every)) - min(map(len, every)) <= 1  # (even shares)
    elif len(cpus) == sum(ranks):
        assert sorted(c for ids in every for c in ids) == sorted(cpus)


def test_the_supervisor_binds_local_vllm_replicas_unless_told(monkeypatch) -> None:
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: {0, 1, 2, 3, 4})
    monkeypatch.delenv(BIND_ENV, raising=False)
    pool = ReplicaPool([
        ReplicaSpec(name="v0", engine="vllm", config={"model": "m"}),
        ReplicaSpec(name="s0", engine="sim", config={"model": "m"}),
        ReplicaSpec(name="far", engine="vllm", address="10.0.0.7:9000"),  # (not started here)
        ReplicaSpec(name="v1", engine="vllm", config={"model": "m"}),
        ReplicaSpec(name="v2", engine="vllm", config={"model": "m"}, env={BIND_ENV: "nobind"}),
        ReplicaSpec(name="g0", engine="vllm", config={"model": "m"}, gpu=0),  # (on a GPU: no share)
    ])
    sup = Supervisor(pool)
    assert sup._env(pool.slots[0].spec)[BIND_ENV] == "0-1"  # (v2 chose its own: v0 and v1 share the rest)
    assert sup._env(pool.slots[3].spec)[BIND_ENV] == "2-3"
    assert sup._env(pool.slots[4].spec)[BIND_ENV] == "nobind"  # the replica's env wins
    assert BIND_ENV not in sup._env(pool.slots[1].spec)  # (a sim replica)
    assert BIND_ENV not in sup._env(pool.slots[5].spec)
    monkeypatch.setenv(BIND_ENV, "auto")  # so does the router's environment
    assert Supervisor(pool)._env(pool.slots[0].spec)[BIND_ENV] == "auto"

