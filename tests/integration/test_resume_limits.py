"""What a resume costs a tenant: one request of its ``requests_per_minute``.

A replay of a finished stream generates nothing, but it is a request the
router serves (the whole buffer again, its log line): without a charge a
tenant held to a few requests a minute could replay its streams as fast as
its connections allow (a review: 60 a second from a 60/min tenant, the other
tenants' longest gap between events 17 -> 213 ms)."""

from __future__ import annotations

import httpx
import yaml

from router.auth import hash_key
from tests.helpers import ADMIN, MODEL, RouterProcess

KEY = "resume-limits-tenant"
RPM = 3


def test_resumes_take_from_the_tenants_requests_per_minute(tmp_path) -> None:
    tenants = tmp_path / "tenants.yaml"
    tenants.write_text(yaml.safe_dump({
        "admin_keys": [hash_key(ADMIN)],
        "tenants": {"a": {"keys": [hash_key(KEY)], "on_limit": "reject",
                          "limits": {"requests_per_minute": RPM}}},
    }, sort_keys=False))
    with RouterProcess(tmp_path / "r", replicas=1, tenants=tenants) as router:
        auth = {"Authorization": f"Bearer {KEY}"}
        with httpx.Client(base_url=router.base_url, headers=auth, timeout=20) as http:
            r = http.post("/v1/completions", json={"model": MODEL, "prompt": "Le caf", "max_tokens": 8,
                                                   "stream": True})
            assert r.status_code == 200, r.text
            rid = r.headers["x-request-id"]
            statuses = []
            for _ in range(RPM + 2):
                replay = http.get(f"/v1/streams/{rid}", headers={"Last-Event-ID": "0"})
                statuses.append(replay.status_code)
                if replay.status_code == 429:
                    err = replay.json()["error"]
                    assert err["code"] == "rate_limit_exceeded", err
                    assert float(replay.headers["retry-after"]) > 0, replay.headers
                    assert replay.headers["x-ratelimit-limit-requests"] == str(RPM)
            # the stream took one request; the bucket (3, refilling one per 20 s) has room for two replays
            assert statuses[:RPM - 1] == [200] * (RPM - 1), statuses
            assert statuses[RPM - 1:] == [429] * 3, statuses
            # the POST form of a resume is charged alike
            post = http.post("/v1/completions", json={}, headers={"Last-Event-ID": "0", "X-Resume-Request-Id": rid})
            assert post.status_code == 429, post.text
            limited = router.metrics().value("fairstream_rate_limited_total", tenant="a", limit="requests")
            assert limited == 4, limited
