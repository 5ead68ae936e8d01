"""Prefix affinity: requests sharing a long prompt prefix go to the same replica."""

from __future__ import annotations


import httpx

from tests.helpers import GOLD, MODEL, RouterProcess, poll

SYSTEM = "You are the cluster's assistant. " * 40  # > 512 characters, shared by every request


def _replicas(router: RouterProcess) -> dict[str, str]:
    return {rec["request_id"]: rec.get("replica") for rec in router.records("fairstream.request")}


def test_shared_prefix_sticks_to_one_replica_short_prompts_spread(tmp_path):
    with RouterProcess(tmp_path / "r", replicas=3) as router:
        url = router.base_url + "/v1/chat/completions"
        ids_long, ids_short = [], []
        with httpx.Client(timeout=20, headers={"Authorization": f"Bearer {GOLD}"}) as c:
            for i in range(12):
                body = {"model": MODEL, "max_tokens": 2, "messages": [
                    {"role": "system", "content": SYSTEM}, {"role": "user", "content": f"question {i}"}]}
                ids_long.append(c.post(url, json=body).headers["x-request-id"])
            for i in range(24):
                body = {"model": MODEL, "max_tokens": 2, "messages": [{"role": "user", "content": f"q{i}"}]}
                ids_short.append(c.post(url, json=body).headers["x-request-id"])
        seen = poll(lambda: (r := _replicas(router)) and all(i in r for i in ids_long + ids_short) and r,
                    10, what="request log lines")
        assert len({seen[i] for i in ids_long}) == 1  # all on the replica that has the prefix
        assert len({seen[i] for i in ids_short}) >= 2  # no affinity: p2c spreads them
