"""/admin/replicas says why a local replica failed, not only its exit status."""

from __future__ import annotations

import httpx

from tests.helpers import ADMIN, RouterProcess, poll


def test_a_replica_that_cannot_start_says_why_in_admin_replicas(tmp_path):
    # a vllm replica whose model directory does not exist fails before it
    # imports vLLM; /admin/replicas said only "process exited with code 1
    # while starting", the reason being in the replica's own log line only
    missing = tmp_path / "no-such-model"
    r = RouterProcess(tmp_path / "r", replicas=1, settings={"replicas": [
        {"name": "sim-0", "engine": "sim", "config": {"model": "fairstream-sim", "seed": 0}},
        {"name": "bad", "engine": "vllm", "config": {"model": str(missing)}},
    ]})
    with r as router:
        def why():
            rows = httpx.get(router.base_url + "/admin/replicas", headers={"Authorization": f"Bearer {ADMIN}"},
                             timeout=5).json()["replicas"]
            return next(x for x in rows if x["name"] == "bad")["last_error"]
        poll(lambda: why() is not None, 20, what="the bad replica's failure")
        err = why()
        assert "exited with code 1 while starting" in err, err
        assert f"model directory {missing} does not exist" in err, err
