"""A router on Redis when Redis is slow at its start, or restarts under it.

A real redis-server on a free port, real router and sim replica processes.
Another router's admissions are made with the router's own ``RedisStore``
(what a second router process would send), and the tests read Redis through
it too: what every router sharing it sees.
"""

from __future__ import annotations

import asyncio
import uuid

import httpx
import yaml

from router.auth import hash_key
from router.state import AdmitRequest
from router.state.redis_store import RedisStore
from tests.helpers import MODEL, RouterProcess, aiter_sse, apoll

LIMITED = "redis-state-limited-key"
SOLO = "redis-state-solo-key"


def _tenants(path) -> None:
    demo = yaml.safe_load(open("configs/tenants.yaml"))
    demo["tenants"]["limited"] = {"keys": [hash_key(LIMITED)], "on_limit": "reject",
                                  "limits": {"requests_per_minute": 2}}
    demo["tenants"]["solo"] = {"keys": [hash_key(SOLO)], "on_limit": "reject", "limits": {"max_concurrent": 1}}
    path.write_text(yaml.safe_dump(demo, sort_keys=False))


def _request(key: str, *, max_tokens: int = 2, stream: bool = False) -> dict:
    return {"headers": {"Authorization": f"Bearer {key}"},
            "json": {"model": MODEL, "prompt": "The cluster", "max_tokens": max_tokens, "stream": stream,
                     "ignore_eos": True}}


async def test_a_router_started_while_redis_does_not_answer_waits_for_its_answer(tmp_path, redis_server) -> None:
    # (a router started beside busy streams on a 2-core box met Redis's
    # first answer past the 0.5 s timeout, began in a fail-open outage and
    # served a tenant limited to 12 requests a minute with local limits: 24
    # of 24 admitted. Here Redis answers nothing for the first seconds.)
    tenants = tmp_path / "tenants.yaml"
    _tenants(tenants)
    other = RedisStore(redis_server.url)  # another router has used up 'limited' in Redis
    try:
        for _ in range(2):
            taken = AdmitRequest(rpm=2, tpm=0, max_concurrent=0, cost_tokens=0, lease_id=uuid.uuid4().hex,
                                 lease_ttl=30.0)
            assert (await other.admit("limited", taken)).ok
    finally:
        await other.close()
    # (connect_timeout: longer than this router's start on a slow machine)
    router = RouterProcess(tmp_path / "r", replicas=1, tenants=tenants, settings={
        "state": {"backend": "redis", "url": redis_server.url, "connect_timeout": 30.0}})
    redis_server.pause()
    starting = asyncio.create_task(asyncio.to_thread(router.start))
    try:
        async with httpx.AsyncClient(timeout=30) as client:
            async def ready() -> httpx.Response | None:
                try:
                    r = await client.get(router.base_url + "/ready")
                except httpx.HTTPError:
                    return None
                return r if r.json()["replicas"].get("sim-0") == "ready" else None

            await apoll(lambda: router.port and ready(), 30, what="the router's replica to be ready")
            request = asyncio.create_task(client.post(router.base_url + "/v1/completions", **_request(LIMITED)))
            await asyncio.sleep(1.0)
            # a request while Redis has not answered waits for its answer
            assert not request.done(), f"answered: {request.result().status_code} {request.result().text}"
            # its replica is ready, the router is not: Redis has not answered yet
            r = await client.get(router.base_url + "/ready")
            assert r.status_code == 503, r.text
            assert r.json()["state_store"] == {"backend": "redis", "healthy": False, "connecting": True}
            redis_server.resume()
            await starting  # (ready now)
            got = await request
            assert got.status_code == 429, got.text  # counted in Redis, where 'limited' had none left
            assert "requests per minute" in got.json()["error"]["message"], got.text
            r = await client.get(router.base_url + "/ready")
            assert r.status_code == 200 and r.json()["state_store"]["healthy"] is True
        log = router.log()
        assert "unavailable" not in log and "answered after" in log, log[-3000:]
    finally:
        redis_server.resume()
        if not starting.done():
            await asyncio.gather(starting, return_exceptions=True)
        router.stop()


async def test_a_redis_restart_gets_the_leases_of_running_streams_back_at_once(tmp_path, redis_server) -> None:
    # (a Redis restarted without persistence lost every lease, and the
    # routers added theirs back at their next renewal, every 10 s: for up
    # to 10 s a tenant of max_concurrent 1 was admitted again and again)
    tenants = tmp_path / "tenants.yaml"
    _tenants(tenants)
    shared = RedisStore(redis_server.url)  # (what every router sees)
    with RouterProcess(tmp_path / "r", replicas=1, tenants=tenants, sim={"step_base_ms": 20},
                       settings={"state": {"backend": "redis", "url": redis_server.url}}) as router:
        url = router.base_url + "/v1/completions"
        async with httpx.AsyncClient(timeout=30) as client:
            async with client.stream("POST", url, **_request(SOLO, max_tokens=1000, stream=True)) as stream:
                assert stream.status_code == 200
                events = aiter_sse(stream)
                await anext(events)  # (running: its lease is in Redis)
                refused = await client.post(url, **_request(SOLO))
                assert refused.status_code == 429, refused.text
                await asyncio.sleep(1.0)  # (the router has seen this Redis's generation)
                redis_server.kill()
                redis_server.restart()  # (empty)

                async def lease_back() -> bool:
                    return (await shared.usage("solo", rpm=0, tpm=0)).active_streams == 1

                await apoll(lease_back, 2.5, interval=0.1, what="the running stream's lease back in Redis")
                refused = await client.post(url, **_request(SOLO))
                assert refused.status_code == 429, refused.text
                assert "concurrent streams" in refused.json()["error"]["message"], refused.text
                # its resume buffer went with the data: a resume says why it finds none
                rid = stream.headers["x-request-id"]
                lost = await client.get(f"{router.base_url}/v1/streams/{rid}", headers=_request(SOLO)["headers"])
                assert lost.status_code == 404, lost.text
                assert "lost when the state store restarted without its data" in lost.json()["error"]["message"]
    await shared.close()
    assert "adding back those of this router's 1 streams" in router.log()
