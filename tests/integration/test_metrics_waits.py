"""What a real router's /metrics shows of a tenant's first failures and of
waits that did not end in a dispatch (an observability tester's findings).

* the series the alerts and the dashboard depend on are exported at 0 per
  tenant before its first request: a tenant's first failures are an
  ``increase()`` (a series born at 3 counted 0, and FairstreamRequestsFailing
  never fired for a new tenant);
* ``fairstream_queue_wait_seconds`` and ``fairstream_admission_wait_seconds``
  observe every wait when it ends, a 503 ``queue_timeout``, a 429 after the
  admission line's ``queue_wait`` and a client that left included (they
  observed only the requests that got through: ~5 ms p99 for a tenant whose
  requests waited 1 s and were refused);
* a request refused for its key has a ``duration_s`` in its log line, as
  every ``fairstream.request`` line has.
"""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
import yaml

from router.auth import hash_key
from tests.helpers import ADMIN, MODEL, RouterProcess, apoll, holding_stream, poll

HOLD = "waits-hold-key"  # tenant a: one stream at a time, waits in its line for 1 s
QUEUE = "waits-queue-key"  # tenant q: waits for a replica for 1 s
FAILURES = ("unavailable", "timeout_first_token", "timeout_total", "lost", "error")


def _tenants(path: Path) -> Path:
    doc: dict[str, Any] = {
        "admin_keys": [hash_key(ADMIN)],
        "tenants": {
            "a": {"keys": [hash_key(HOLD)], "on_limit": "queue", "limits": {"max_concurrent": 1},
                  "timeouts": {"queue_wait": 1}},
            "q": {"keys": [hash_key(QUEUE)], "timeouts": {"queue_wait": 1}},
        },
    }
    path.write_text(yaml.safe_dump(doc, sort_keys=False))
    return path


def _body(max_tokens: int, stream: bool = False) -> dict[str, Any]:
    return {"model": MODEL, "prompt": "hi", "max_tokens": max_tokens, "stream": stream, "ignore_eos": True}


@pytest.fixture(scope="module")
def router(tmp_path_factory) -> Iterator[RouterProcess]:
    """One replica that takes one request at a time (a stream of tenant a holds it)."""
    tmp = tmp_path_factory.mktemp("waits")
    settings = {"replicas": [{"name": "sim-0", "engine": "sim", "max_concurrency": 1,
                              "config": {"model": MODEL, "seed": 0, "step_base_ms": 2}}]}
    with RouterProcess(tmp / "r", replicas=1, tenants=_tenants(tmp / "tenants.yaml"), settings=settings) as r:
        yield r


def test_the_series_alerts_and_panels_need_are_at_0_before_a_tenant_s_first_request(router) -> None:
    m = router.metrics()
    for tenant in ("a", "q"):
        for endpoint in ("chat", "completions"):
            for outcome in FAILURES:
                assert m.value("fairstream_requests_total", -1.0, tenant=tenant, endpoint=endpoint,
                               outcome=outcome) == 0, (tenant, endpoint, outcome)
        for direction in ("prompt", "completion"):
            assert m.value("fairstream_tokens_total", -1.0, tenant=tenant, direction=direction) == 0
        assert m.value("fairstream_admission_waiting", -1.0, tenant=tenant) == 0
    assert not [n for n in m.names() if n.endswith("_created")], "prometheus-client's _created series"


async def test_every_wait_is_observed_however_it_ends(router) -> None:
    async with httpx.AsyncClient(base_url=router.base_url, timeout=30) as client:
        before = await router.ametrics(client)
        # (a stream of ~6 s of tokens holds the replica; cancelled at the block's end)
        async with holding_stream(client, {"authorization": f"Bearer {HOLD}"}, _body(3000, stream=True)):
            async def post(key: str) -> httpx.Response:
                return await client.post("/v1/completions", headers={"authorization": f"Bearer {key}"},
                                         json=_body(2))

            async def left(key: str) -> None:  # a client that leaves after 0.3 s of waiting
                try:
                    await asyncio.wait_for(post(key), 0.3)
                except TimeoutError:
                    return
                raise AssertionError("answered within 0.3 s")

            timed_out, refused, _, _ = await asyncio.gather(post(QUEUE), post(HOLD), left(QUEUE), left(HOLD))
            assert timed_out.status_code == 503 and timed_out.json()["error"]["code"] == "queue_timeout"
            assert refused.status_code == 429, refused.text

        def grew(m, name: str, **labels: str) -> float:
            return m.value(name, 0.0, **labels) - before.value(name, 0.0, **labels)

        async def settled():
            m = await router.ametrics(client)
            done = (grew(m, "fairstream_queue_wait_seconds_count", tenant="q") >= 2
                    and grew(m, "fairstream_admission_wait_seconds_count", tenant="a") >= 2)
            return m if done else None

        m = await apoll(settled, 5, what="both tenants' waits observed")
        # q waited for a replica twice: 1 s (the 503), 0.3 s (left)
        assert grew(m, "fairstream_queue_wait_seconds_count", tenant="q") == 2
        assert grew(m, "fairstream_queue_wait_seconds_bucket", tenant="q", le="0.75") == 1
        # (loosely: the 503's wait is 1 s less the time before the queue, the other's 0.3 s as the
        # client counts it; the buckets above already tell the long wait from the short one)
        assert grew(m, "fairstream_queue_wait_seconds_sum", tenant="q") >= 0.9
        assert grew(m, "fairstream_requests_total", tenant="q", endpoint="completions", outcome="unavailable") == 1
        # a waited for its limit twice: 1 s (the 429), 0.3 s (left); its stream got the replica at once
        assert grew(m, "fairstream_admission_wait_seconds_count", tenant="a") == 2
        assert grew(m, "fairstream_admission_wait_seconds_bucket", tenant="a", le="0.75") == 1
        assert grew(m, "fairstream_admission_wait_seconds_sum", tenant="a") >= 0.9  # (as above)
        assert grew(m, "fairstream_queue_wait_seconds_count", tenant="a") == 1


def test_a_request_refused_for_its_key_logs_its_duration(router) -> None:
    bad = httpx.post(router.base_url + "/v1/completions", headers={"authorization": "Bearer no-such-key"},
                     json=_body(2), timeout=10)
    assert bad.status_code == 401
    line = poll(lambda: next((r for r in router.records("fairstream.request")
                              if r["request_id"] == bad.headers["x-request-id"]), None), 10, what="the 401's line")
    assert line["outcome"] == "unauthorized" and line["duration_s"] == 0, line
