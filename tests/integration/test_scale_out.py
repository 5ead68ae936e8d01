"""Beyond one machine: two router processes on one Redis in front of four kinds
of replica, with a replica killed mid-stream and a router killed mid-stream.

Each router has two local sim replicas it supervises, the same remote sim
replica over TCP (shared secret) and the same OpenAI-compatible upstream (a
sim serving the OpenAI API with token ids). Every sim shares one seed, so any
replica continues a greedy stream exactly. Clients of the killed router
resume on the other one with Last-Event-ID (the resume buffer is in Redis).
"""

from __future__ import annotations

import asyncio
import os
import signal

import httpx
import pytest
import yaml

from router.auth import hash_key
from tests.helpers import FREE, GOLD, MODEL, SILVER, RouterProcess, aiter_sse, poll, remote_replica_process
from tests.sim_openai import SimOpenAI

SECRET = "scale-out-secret"
SIM = {"model": MODEL, "seed": 0, "step_base_ms": 12}
LIMITED = "limited-tenant-key"
QUEUED = "queued-tenant-key"


@pytest.fixture
def remote_replica(tmp_path):
    with remote_replica_process(tmp_path / "remote.log", "FS_SCALE_SECRET", SECRET, SIM) as (port, _):
        yield port


@pytest.fixture
def upstream(tmp_path):
    server = SimOpenAI(tmp_path, {"step_base_ms": 12}).start()
    yield server
    server.stop()


def _tenants(path) -> None:
    demo = yaml.safe_load(open("configs/tenants.yaml"))
    demo["tenants"]["limited"] = {
        "keys": [hash_key(LIMITED)], "on_limit": "reject", "limits": {"requests_per_minute": 12},
    }
    path.write_text(yaml.safe_dump(demo, sort_keys=False))


def _router(tmp_path, name: str, redis_url: str, remote_port: int, upstream_url: str, tenants) -> RouterProcess:
    replicas = [
        {"name": f"{name}-sim-0", "engine": "sim", "config": SIM},
        {"name": f"{name}-sim-1", "engine": "sim", "config": SIM},
        {"name": "remote", "address": f"127.0.0.1:{remote_port}", "secret_env": "FS_SCALE_SECRET"},
        {"name": "upstream", "url": upstream_url},
    ]
    r = RouterProcess(tmp_path / name, replicas=0, tenants=tenants, settings={
        # (the default timeout: on the 2-core box a router starting beside
        # this test's streams and two other routers met Redis's first answer
        # past 0.5 s and began in an outage, serving with local limits, until
        # a starting router waited for that answer: state.connect_timeout)
        "replicas": replicas, "state": {"backend": "redis", "url": redis_url},
        "health_interval": 0.3, "health_timeout": 2.0, "max_failovers": 6,
    })
    r.replica_names = [x["name"] for x in replicas]
    return r


def _body(n: int) -> dict:
    return {"model": MODEL, "prompt": ["Le caf", "The cluster", "東京の", "Über den"][n % 4], "max_tokens": 160,
            "temperature": 0, "ignore_eos": True, "stream": True}


async def _stream_with_resume(client: httpx.AsyncClient, routers: list[RouterProcess], key: str, n: int,
                              cut: asyncio.Event, comments: list[str]) -> str:
    """Stream from routers[n % 2]; on a broken connection resume on the other router."""
    first = routers[n % 2]
    headers = {"Authorization": f"Bearer {key}"}
    parts: list[str] = []
    last = rid = None
    try:
        async with client.stream("POST", first.base_url + "/v1/completions", json=_body(n), headers=headers) as r:
            assert r.status_code == 200, await r.aread()
            rid = r.headers["x-request-id"]
            async for ev in aiter_sse(r):
                if ev.data == "[DONE]":
                    return "".join(parts)
                d = ev.json()
                assert "error" not in d, d
                parts.append(d["choices"][0]["text"])
                last = ev.id
    except (httpx.RemoteProtocolError, httpx.ReadError):
        pass
    assert cut.is_set(), "only the killed router may break a stream"
    other = routers[(n + 1) % 2]
    async with client.stream("GET", f"{other.base_url}/v1/streams/{rid}",
                             headers={**headers, "Last-Event-ID": last or "0"}) as r:
        assert r.status_code == 200, await r.aread()
        async for ev in aiter_sse(r, comments):
            if ev.data == "[DONE]":
                return "".join(parts)
            d = ev.json()
            assert "error" not in d, d
            parts.append(d["choices"][0]["text"])
    raise AssertionError("resumed stream ended without [DONE]")


async def test_two_routers_one_redis_four_replica_kinds(tmp_path, redis_server, remote_replica, upstream,
                                                        monkeypatch):
    monkeypatch.setenv("FS_SCALE_SECRET", SECRET)
    tenants = tmp_path / "tenants.yaml"
    _tenants(tenants)
    a = _router(tmp_path, "a", redis_server.url, remote_replica, upstream.url, tenants).start()
    b = _router(tmp_path, "b", redis_server.url, remote_replica, upstream.url, tenants).start()
    try:
        async with httpx.AsyncClient(timeout=60, limits=httpx.Limits(max_connections=100)) as client:
            refs = {}
            for n in range(4):
                r = await client.post(b.base_url + "/v1/completions", json={**_body(n), "stream": False},
                                      headers={"Authorization": f"Bearer {GOLD}"})
                refs[n] = r.json()["choices"][0]["text"]
            cut = asyncio.Event()
            keys = [GOLD, SILVER, FREE]
            # free is limited to 4 concurrent streams: give it 2 per router
            jobs = [(keys[i % 3], n) for n in range(12) for i in range(3) if not (i == 2 and n >= 4)]
            comments: list[str] = []
            tasks = [asyncio.create_task(_stream_with_resume(client, [a, b], key, n, cut, comments))
                     for key, n in jobs]
            await asyncio.sleep(0.6)
            a.kill_replica("a-sim-0")  # a replica dies mid-stream
            await asyncio.sleep(0.5)
            cut.set()
            os.kill(a.pid, signal.SIGKILL)  # a whole router dies mid-stream
            texts = await asyncio.gather(*tasks)
            for (key, n), text in zip(jobs, texts):
                assert text == refs[n % 4], (key, n)
            # while the killed router's claims ran out (up to 10 s), the resumes said they were waiting
            assert comments and set(comments) == {": waiting for the stream"}, comments
            mb = await b.ametrics(client)
            assert mb.value("fairstream_stream_resumes_total", default=0, tenant="gold") >= 1
            assert mb.value("fairstream_streams_lost_total") == 0

            # limits stay exact across routers: 12 requests/min for `limited`, however they are spread
            async def one(base):
                r = await client.post(base + "/v1/completions", headers={"Authorization": f"Bearer {LIMITED}"},
                                      json={"model": MODEL, "prompt": "x", "max_tokens": 2})
                return r.status_code

            c = _router(tmp_path, "c", redis_server.url, remote_replica, upstream.url, tenants).start()
            try:
                assert (await client.get(c.base_url + "/ready")).json()["state_store"]["healthy"]
                codes = await asyncio.gather(*[one(r.base_url) for _ in range(15) for r in (b, c)])
            finally:
                c.stop()
            assert codes.count(200) == 12 and codes.count(429) == 18, codes
    finally:
        a.stop(check=False)  # killed: its local replicas exit by themselves (checked below)
        assert not a.wait_replicas_gone(10), "replicas of the killed router outlived it"
        b.stop()


async def test_routers_on_one_redis_with_different_tenants_files_say_so(tmp_path, redis_server) -> None:
    # (each admits with its own file's limits against the shared buckets:
    # two files silently meant two limits on one bucket)
    first, second = tmp_path / "a.yaml", tmp_path / "b.yaml"
    _tenants(first)
    demo = yaml.safe_load(first.read_text())
    demo["tenants"]["limited"]["limits"]["requests_per_minute"] = 100
    second.write_text(yaml.safe_dump(demo, sort_keys=False))
    settings = {"state": {"backend": "redis", "url": redis_server.url}}
    with RouterProcess(tmp_path / "a", replicas=1, tenants=first, settings=settings) as a, \
            RouterProcess(tmp_path / "b", replicas=1, tenants=second, settings=settings) as b:
        def differ(r: RouterProcess) -> dict:
            return httpx.get(r.base_url + "/ready", timeout=5).json()["tenants_differ"]

        b_digest = httpx.get(b.base_url + "/ready", timeout=5).json()["tenants_digest"]
        got = poll(lambda: differ(a), 25, what="router a to see b's other file")
        assert list(got.values()) == [b_digest], got
        assert a.metrics().value("fairstream_tenants_files_differ") == 1
        # (logged once it lasted two checks: routers reloading one file a moment apart are not a difference)
        poll(lambda: "tenants.yaml differs between routers sharing the state store" in a.log(), 25,
             what="router a's error")
        second.write_text(first.read_text())  # the same file on both: b reloads it (file watch)
        poll(lambda: not differ(a) and not differ(b), 30, what="both routers to see the same file")
        assert a.metrics().value("fairstream_tenants_files_differ") == 0


QUEUED_AUTH = {"Authorization": f"Bearer {QUEUED}"}


def _queueing_routers(tmp_path, redis_url: str, names: tuple[str, ...], *, concurrent: int, depth: int,
                      queue_wait: float, step_ms: int) -> list[RouterProcess]:
    """Routers (not started) on one Redis, one sim replica each, whose
    tenant ``queued`` (key QUEUED) waits in line over ``concurrent`` streams."""
    tenants = tmp_path / "tenants.yaml"
    demo = yaml.safe_load(open("configs/tenants.yaml"))
    demo["tenants"]["queued"] = {
        "keys": [hash_key(QUEUED)], "on_limit": "queue", "queue_depth": depth,
        "limits": {"max_concurrent": concurrent}, "timeouts": {"queue_wait": queue_wait},
    }
    tenants.write_text(yaml.safe_dump(demo, sort_keys=False))
    settings = {"state": {"backend": "redis", "url": redis_url}}
    return [RouterProcess(tmp_path / name, replicas=1, sim={"step_base_ms": step_ms}, tenants=tenants,
                          settings=settings) for name in names]


def _queued_request(max_tokens: int) -> dict:
    return {"model": MODEL, "prompt": "The cluster", "max_tokens": max_tokens, "stream": True}


async def test_a_tenants_line_is_shared_by_the_routers_on_one_redis(tmp_path, redis_server) -> None:
    """``on_limit: queue`` with one concurrent stream: three clients keep
    one router's line busy while two requests wait on the other. Each line
    was per router, and the busy router's head (woken at once by its own
    streams' ends) took every slot that freed before the quiet router's head
    looked again: the quiet router's requests waited out ``queue_wait`` and
    got 429s. Now the routers take turns."""
    busy, quiet = _queueing_routers(tmp_path, redis_server.url, ("busy", "quiet"), concurrent=1, depth=8,
                                    queue_wait=12, step_ms=10)
    body, headers = _queued_request(20), QUEUED_AUTH
    with busy, quiet:
        stop = asyncio.Event()
        served = {"busy": 0}

        async def client(http: httpx.AsyncClient) -> None:
            while not stop.is_set():
                r = await http.post(busy.base_url + "/v1/completions", json=body, headers=headers)
                assert r.status_code == 200, r.text
                served["busy"] += 1

        async def waiting(http: httpx.AsyncClient) -> tuple[int, float]:
            t0 = asyncio.get_running_loop().time()
            r = await http.post(quiet.base_url + "/v1/completions", json=body, headers=headers)
            assert "data: [DONE]" in r.text or r.status_code != 200, r.text
            return r.status_code, asyncio.get_running_loop().time() - t0

        async with httpx.AsyncClient(timeout=30) as http:
            clients = [asyncio.create_task(client(http)) for _ in range(3)]
            try:
                await asyncio.sleep(1.0)  # (the busy router's line is full by now)
                assert served["busy"] >= 2
                got = await asyncio.gather(waiting(http), waiting(http))
            finally:
                stop.set()
                await asyncio.gather(*clients)
        assert [status for status, _ in got] == [200, 200], got
        # each waited for about a turn or two of a stream (~0.3 s each), not for queue_wait
        assert max(took for _, took in got) < 6.0, got
        assert served["busy"] >= 4  # (and the busy router's clients were served too)


async def test_a_tenants_line_split_over_routers_keeps_its_throughput(tmp_path, redis_server) -> None:
    """Closed-loop clients of one ``on_limit: queue`` tenant (two streams at
    once) on one router, then split over two. The store's line handed the
    turn between routers only at the heads' 0.25 s polls: split, the tenant
    got about a sixth of its throughput (a review: 159 streams in 20 s
    against 1014), its slots idle while requests waited. The routers now
    hear a turn through Redis (a lease released, tokens given back, a
    request that leaves the line) and their heads ask at once."""
    a, b = _queueing_routers(tmp_path, redis_server.url, ("a", "b"), concurrent=2, depth=16, queue_wait=20,
                             step_ms=5)
    body, headers = _queued_request(8), QUEUED_AUTH
    with a, b:
        async def served(routers: list[RouterProcess], seconds: float) -> int:
            stop = asyncio.Event()
            done = [0]

            async def client(http: httpx.AsyncClient, router: RouterProcess) -> None:
                while not stop.is_set():
                    r = await http.post(router.base_url + "/v1/completions", json=body, headers=headers)
                    assert r.status_code == 200, r.text
                    done[0] += 1

            async with httpx.AsyncClient(timeout=30) as http:
                tasks = [asyncio.create_task(client(http, r)) for r in routers]
                await asyncio.sleep(seconds)
                stop.set()
                await asyncio.gather(*tasks)
            return done[0]

        await served([a] * 6, 1.0)  # (warm: connections, replicas)
        one = await served([a] * 6, 3.0)
        split = await served([a] * 3 + [b] * 3, 3.0)
        assert split >= 0.6 * one, (split, one)


async def test_a_tenant_at_its_limit_resumes_the_stream_of_a_router_that_died(tmp_path, redis_server) -> None:
    # The killed router's lease for the stream stays in Redis for its TTL
    # (30 s). The continuation takes that lease instead of a new one: it
    # was refused ("rate_limit_exceeded, try again in 1s") until the TTL ran out.
    tenants = tmp_path / "tenants.yaml"
    demo = yaml.safe_load(open("configs/tenants.yaml"))
    demo["tenants"]["one"] = {"keys": [hash_key(LIMITED)], "on_limit": "reject", "limits": {"max_concurrent": 1}}
    tenants.write_text(yaml.safe_dump(demo, sort_keys=False))
    settings = {"state": {"backend": "redis", "url": redis_server.url}}
    a = RouterProcess(tmp_path / "a", replicas=1, tenants=tenants, settings=settings, sim=SIM).start()
    b = RouterProcess(tmp_path / "b", replicas=1, tenants=tenants, settings=settings, sim=SIM).start()
    headers = {"Authorization": f"Bearer {LIMITED}"}
    try:
        async with httpx.AsyncClient(timeout=60) as client:
            body = {**_body(0), "max_tokens": 120}
            ref = (await client.post(b.base_url + "/v1/completions", json={**body, "stream": False},
                                     headers=headers)).json()["choices"][0]["text"]
            assert await _killed_and_resumed(client, a, b, body, headers, 10) == ref
            # it held the dead router's slot, and gave it back: the tenant's one stream is free again
            r = await client.post(b.base_url + "/v1/completions", json={**body, "stream": False}, headers=headers)
            assert r.status_code == 200, r.text
    finally:
        a.stop(check=False)
        b.stop()


async def test_a_refused_continuation_does_not_hide_the_lease_of_a_router_that_died_before_it(
        tmp_path, redis_server) -> None:
    # A stream's routers die one after another (a, then b, which continued
    # it), each with an event its client has and the buffer lacks. c's
    # continuation claims it and is refused. Two defects:
    # - c's claim had recorded c's lease, which never came to exist, in place
    #   of b's, which stays in Redis for its TTL (30 s): d's continuation
    #   replaced the leases of a and c only, b's counted, and the tenant at
    #   its one stream was refused until b's lease ran out;
    # - c had padded the buffer for the event it lacked before it was
    #   refused: d took the placeholder for that event and sent its text
    #   again ("siix").
    one = {"keys": [hash_key(LIMITED)], "on_limit": "reject", "limits": {"max_concurrent": 1}}
    demo = yaml.safe_load(open("configs/tenants.yaml"))
    files = {}
    # (no token limit where the stream runs: a, b and d keep no reservation,
    # which c's continuation would take over and need no tokens of its own)
    for name, limits in (("normal", {"tokens_per_minute": 0}), ("tight", {"tokens_per_minute": 40})):
        files[name] = tmp_path / f"{name}.yaml"
        demo["tenants"]["one"] = {**one, "limits": {**one["limits"], **limits}}
        files[name].write_text(yaml.safe_dump(demo, sort_keys=False))
    settings = {"state": {"backend": "redis", "url": redis_server.url}}
    # (c runs a tenants file where the continuation's tokens are over the tenant's whole budget: refused)
    a, b, c, d = (RouterProcess(tmp_path / n, replicas=1, tenants=files["tight" if n == "c" else "normal"],
                                settings=settings, sim=SIM).start() for n in "abcd")
    headers = {"Authorization": f"Bearer {LIMITED}"}
    body = {**_body(0), "max_tokens": 120}
    parts: list[str] = []

    last = ""  # the client's last event id

    async def relay(r: httpx.Response, events: int | None) -> str:
        """Texts of ``r`` into ``parts``, up to ``events`` of them in all
        (None: to the end); the error that ended it, if one did."""
        nonlocal last
        async for ev in aiter_sse(r):
            if ev.data == "[DONE]":
                break
            data = ev.json()
            if "error" in data:
                return "error: " + data["error"]["message"]
            parts.append(data["choices"][0]["text"])
            last = ev.id
            if events is not None and len(parts) >= events:
                break
        return ""

    try:
        async with httpx.AsyncClient(timeout=60) as client:
            ref = (await client.post(d.base_url + "/v1/completions", json={**body, "stream": False},
                                     headers=headers)).json()["choices"][0]["text"]
            async with client.stream("POST", a.base_url + "/v1/completions", json=body, headers=headers) as r:
                rid = r.headers["x-request-id"]
                await relay(r, 10)
                os.kill(a.pid, signal.SIGKILL)
            resume = f"/v1/streams/{rid}"
            async with client.stream("GET", b.base_url + resume, headers={**headers, "Last-Event-ID": last}) as r:
                await relay(r, 20)
                os.kill(b.pid, signal.SIGKILL)
            async with client.stream("GET", c.base_url + resume, headers={**headers, "Last-Event-ID": last}) as r:
                refused = await relay(r, None)
            assert refused.startswith("error: ") and "token" in refused, refused
            async with client.stream("GET", d.base_url + resume, headers={**headers, "Last-Event-ID": last}) as r:
                end = await relay(r, None)
            assert not end.startswith("error: "), end
            assert "".join(parts) == ref
    finally:
        a.stop(check=False)
        b.stop(check=False)
        c.stop()
        d.stop()


async def test_a_continuation_takes_over_the_token_reservation_of_a_router_that_died(tmp_path, redis_server) -> None:
    # A stream reserves its estimated prompt + max_tokens (43 tokens here) at
    # admission and settles it when it ends; a router killed mid-stream never
    # settles it. The continuation on the other router reserved its own
    # remaining tokens on top, so the tenant paid the rest of the stream
    # twice, and with 60 tokens a minute it was refused ("rate_limit_exceeded
    # ... on tokens per minute. Please try again in 1.84s") though the dead
    # router's reservation held the whole stream. It takes that reservation over.
    tenants = tmp_path / "tenants.yaml"
    demo = yaml.safe_load(open("configs/tenants.yaml"))
    demo["tenants"]["tight"] = {"keys": [hash_key(LIMITED)], "on_limit": "reject",
                                "limits": {"tokens_per_minute": 60}}
    tenants.write_text(yaml.safe_dump(demo, sort_keys=False))
    settings = {"state": {"backend": "redis", "url": redis_server.url}}
    a = RouterProcess(tmp_path / "a", replicas=1, tenants=tenants, settings=settings, sim=SIM).start()
    b = RouterProcess(tmp_path / "b", replicas=1, tenants=tenants, settings=settings, sim=SIM).start()
    headers = {"Authorization": f"Bearer {LIMITED}"}
    body = {"model": MODEL, "prompt": "ab", "max_tokens": 40, "temperature": 0, "ignore_eos": True, "stream": True}
    try:
        async with httpx.AsyncClient(timeout=60) as client:
            ref = (await client.post(b.base_url + "/v1/completions", json={**body, "stream": False},
                                     headers={"Authorization": f"Bearer {GOLD}"})).json()["choices"][0]["text"]
            assert await _killed_and_resumed(client, a, b, body, headers, 11) == ref
    finally:
        a.stop(check=False)
        b.stop()


async def _killed_and_resumed(client: httpx.AsyncClient, a: RouterProcess, b: RouterProcess, body: dict,
                              headers: dict[str, str], events: int) -> str:
    """The text of ``body`` streamed on router ``a``, SIGKILLed after
    ``events`` events, then resumed on ``b`` from the last one."""
    parts: list[str] = []
    async with client.stream("POST", a.base_url + "/v1/completions", json=body, headers=headers) as r:
        assert r.status_code == 200, await r.aread()
        rid = r.headers["x-request-id"]
        sse = aiter_sse(r)
        for _ in range(events):
            ev = await sse.__anext__()
            parts.append(ev.json()["choices"][0]["text"])
        os.kill(a.pid, signal.SIGKILL)
    async with client.stream("GET", f"{b.base_url}/v1/streams/{rid}",
                             headers={**headers, "Last-Event-ID": ev.id}) as r:
        assert r.status_code == 200, await r.aread()
        async for ev in aiter_sse(r):
            if ev.data == "[DONE]":
                break
            d = ev.json()
            assert "error" not in d, d
            parts.append(d["choices"][0]["text"])
    return "".join(parts)
