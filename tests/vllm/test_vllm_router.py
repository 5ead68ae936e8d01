"""The router in front of two real vLLM (CPU) replicas with the tiny model.

Streams through the official openai SDK, aborts on client disconnect, and
survives a replica killed (SIGKILL) or frozen (SIGSTOP) mid-stream: greedy
streams equal their uninterrupted reference token for token, and the
supervisor brings the replica back into service.
"""

from __future__ import annotations

import asyncio
import os
import signal

import httpx
import openai
import pytest
import yaml

from replicas.cpubind import BIND_ENV, core_lists
from tests.helpers import ADMIN, DEMO_TENANTS, GOLD, RouterProcess, aiter_sse, apoll, cpu_set, descendants, poll
from tests.vllm.support import ENGINE_SOCKET, engine_sockets

pytestmark = pytest.mark.vllm

MODEL = "tiny-llama"
# Each replica's vLLM worker on cores of its own (the supervisor's binding,
# replicas.cpubind: "0" and "1" on 2 cores; test_each_replica_s_workers_run_on_
# cores_of_their_own checks it): with vLLM's "auto" binding both workers
# share core 0, and with a busy spin-wait between steps on each side one
# replica's streams got no token for up to 31 s while the other's ran
# (README, ops/vllm_binding_gaps.py). Those waits, past the tenant's stall
# limit, moved healthy streams and had the supervisor restart a healthy
# replica, and a restart takes 55-117 s of both cores here: the chaos tests
# failed in CI. With a core each, gaps of up to ~11 s remain on 2 cores:
# hence the stall limit of 20 s.
# health_timeout 45: a busy front end can miss pings for several seconds; a
# frozen replica's streams move on the tenant's stall limit (20 s) before the
# supervisor restarts it. failover_wait 150: a stream whose replicas are all
# restarting waits for one (a vLLM start takes up to ~2 minutes on this box).
SETTINGS = {"health_interval": 0.5, "health_timeout": 45.0, "max_failovers": 4, "restart_backoff_max": 1.0,
            "failover_wait": 150.0}
STALL = 20
FIRST_TOKEN = 180


@pytest.fixture(scope="module")
def vllm_router(tmp_path_factory, tiny_model):
    workdir = tmp_path_factory.mktemp("vllm_router")
    config = {"model": tiny_model, "served_name": MODEL, "seed": 0, "max_model_len": 8192, "kv_cache_gib": 0.5}
    replicas = [
        {"name": f"vllm-{i}", "engine": "vllm", "config": config, "start_timeout": 300,
         "env": {"VLLM_CPU_KVCACHE_SPACE": "1", "OMP_NUM_THREADS": "1"}}
        for i in range(2)
    ]
    tenants = yaml.safe_load(DEMO_TENANTS.read_text())
    tenants["defaults"]["limits"]["max_tokens"] = 0  # long generations outlast the test's reads
    tenants["defaults"]["timeouts"].update(stall=STALL, first_token=FIRST_TOKEN)
    (workdir / "tenants.yaml").write_text(yaml.safe_dump(tenants))
    r = RouterProcess(workdir, replicas=0, settings={**SETTINGS, "replicas": replicas},
                      tenants=workdir / "tenants.yaml", start_timeout=400)
    r.replica_names = ["vllm-0", "vllm-1"]
    r.start()
    yield r
    r.stop(timeout=60)


def _wait_all_ready(router: RouterProcess) -> None:
    poll(lambda: httpx.get(router.base_url + "/ready", timeout=2).json()["replicas"] ==
         dict.fromkeys(router.replica_names, "ready"), 300, what="both vllm replicas ready")


def _greedy(max_tokens=48):
    return {"model": MODEL, "prompt": "The cluster hums", "max_tokens": max_tokens, "temperature": 0,
            "ignore_eos": True}


def test_openai_sdk_streams_chat_and_completions(vllm_router):
    client = openai.OpenAI(base_url=vllm_router.base_url + "/v1", api_key=GOLD, max_retries=0)
    assert MODEL in [m.id for m in client.models.list().data]
    chunks, usage = [], None
    for ch in client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "hello"}], max_tokens=24, stream=True,
        stream_options={"include_usage": True}, extra_body={"ignore_eos": True},
    ):
        if ch.choices:
            chunks.append(ch.choices[0].delta.content or "")
        else:
            usage = ch.usage
    assert len(chunks) >= 2  # streamed, not one blob (tokens coalesce when the client lags)
    assert usage.completion_tokens == 24 and usage.prompt_tokens > 0
    g = _greedy(16)
    r = client.completions.create(model=g["model"], prompt=g["prompt"], max_tokens=16, temperature=0,
                                  extra_body={"ignore_eos": True})
    assert r.usage.completion_tokens == 16 and r.choices[0].finish_reason == "length"


def test_vllm_extras_include_the_stop_string_and_reach_the_chat_template(vllm_router):
    client = openai.OpenAI(base_url=vllm_router.base_url + "/v1", api_key=GOLD, max_retries=0)
    g = _greedy(40)
    text = client.completions.create(model=MODEL, prompt=g["prompt"], max_tokens=40, temperature=0,
                                     extra_body={"ignore_eos": True}).choices[0].text
    stop = text[12:15]  # three characters the greedy output has
    cut = text[:text.index(stop)]
    for include, want in ((False, cut), (True, cut + stop)):
        parts = [ch.choices[0].text for ch in client.completions.create(
            model=MODEL, prompt=g["prompt"], max_tokens=40, temperature=0, stop=[stop], stream=True,
            extra_body={"ignore_eos": True, "include_stop_str_in_output": include}) if ch.choices]
        assert "".join(parts) == want, include
    chat = {"model": MODEL, "messages": [{"role": "user", "content": "hello"}], "max_tokens": 8, "temperature": 0}
    usual = client.chat.completions.create(**chat)

    def kwargs(**kw):
        return client.chat.completions.create(**chat, extra_body={"chat_template_kwargs": kw})

    # a variable the template does not use changes nothing; one it uses does
    # (the tiny template reads bos_token, which a kwarg overrides as in
    # vLLM's server: two more byte tokens after the special one); and
    # add_generation_prompt is vLLM's own field, which wins over the kwarg
    same, other, own = kwargs(enable_thinking=False), kwargs(bos_token="<s>ab"), kwargs(add_generation_prompt=False)
    assert same.choices[0].message.content == usual.choices[0].message.content
    assert same.usage.prompt_tokens == usual.usage.prompt_tokens
    assert other.usage.prompt_tokens == usual.usage.prompt_tokens + 2
    assert own.usage.prompt_tokens == usual.usage.prompt_tokens


async def test_disconnect_aborts_on_the_vllm_replica(vllm_router):
    # about 20 s on the tiny model here if nothing aborts it (much longer
    # streams made a vLLM replica miss its health checks on this box)
    max_tokens = 8000
    before = await vllm_router.ametrics()
    cancelled0 = before.value("fairstream_requests_total", 0.0, tenant="gold", outcome="cancelled")
    completion0 = before.value("fairstream_tokens_total", 0.0, tenant="gold", direction="completion")
    names = vllm_router.replica_names

    async def replicas(metric):
        m = await vllm_router.ametrics()
        return {n: m.value(metric, replica=n) for n in names}

    async with httpx.AsyncClient(base_url=vllm_router.base_url, timeout=120) as client:
        async with client.stream("POST", "/v1/completions", headers={"Authorization": f"Bearer {GOLD}"},
                                 json={**_greedy(max_tokens), "stream": True}) as r:
            assert r.status_code == 200, await r.aread()
            events = aiter_sse(r)
            for _ in range(2):  # events come from a replica: it runs there
                await events.__anext__()
            # leave at once: on this 2-core box two vLLM workers can starve the
            # test process for 10-20 s, so a metrics poll here may only return
            # after the whole generation has ended
            await events.aclose()
        await apoll(lambda: _all_zero(replicas("fairstream_replica_inflight_requests")), 30,
                    what="router in-flight drops")
        await apoll(lambda: _all_zero(replicas("fairstream_replica_running_requests")), 30,
                    what="vLLM running count drops")
    # the request ended by the disconnect, not by running to max_tokens
    after = await vllm_router.ametrics()
    assert after.value("fairstream_requests_total", tenant="gold", outcome="cancelled") == cancelled0 + 1
    assert 2 <= after.value("fairstream_tokens_total", tenant="gold", direction="completion") - completion0 < max_tokens


async def _scrape(router):
    """/metrics, or None when it did not answer within its 5 s (while six
    streams start, the vLLM workers can starve the router or this process
    for seconds on a 2-core box)."""
    try:
        return await router.ametrics()
    except httpx.TimeoutException:
        return None


async def _busy_replicas(router):
    """(replicas with streams in flight, the scrape) once some replica has
    streams; None until then or when /metrics did not answer."""
    m = await _scrape(router)
    if m is None:
        return None
    busy = [n for n in router.replica_names if m.value("fairstream_replica_inflight_requests", replica=n) > 0]
    return (busy, m) if busy else None


async def _frozen_with_streams(router, victim: str, failovers0: float):
    """Whether the frozen ``victim`` held streams: still in flight on it, or
    already moved off it by the stall limit (a failover it counted since the
    freeze). A one-item tuple (truthy either way); None when /metrics did
    not answer."""
    m = await _scrape(router)
    if m is None:
        return None
    busy = m.value("fairstream_replica_inflight_requests", replica=victim) > 0
    moved = m.value("fairstream_failovers_total", default=0.0, replica=victim) > failovers0
    return (busy or moved,)


async def _freeze_a_busy_replica(router, client, start_streams) -> tuple[str, int, list[asyncio.Task]]:
    """Start streams and SIGSTOP a replica that held some of them once it
    was frozen. Returns the replica's name, its pid and the stream tasks.

    Seeing streams on a replica and then signalling it is a race: on this box
    a /metrics or /admin/replicas answer can take seconds, and the streams may
    have ended by the time the signal lands (no failover to assert). A frozen
    replica cannot finish a stream, so streams seen on it after the freeze,
    or moved off it by the tenant's stall limit (STALL; the check after the
    freeze may take longer than that to answer), were still there when the
    real signal came. When they were not, or the streams all ended before
    any scrape saw them, the attempt is checked and repeated with new
    streams (waiting for streams that have ended cannot succeed)."""
    for _ in range(3):
        # (read each time: an earlier attempt's replica may have been
        # restarted meanwhile, with a new pid)
        pids = await apoll(lambda: _pids_when_all_ready(client), 300, interval=0.5, what="both replicas ready")
        tasks = start_streams()

        async def busy_or_ended():
            if all(t.done() for t in tasks):
                return ([], None)  # truthy: no replica busy, the streams all ended unseen
            return await _busy_replicas(router)

        busy, m = await apoll(busy_or_ended, 120, what="streams on a replica")
        if busy:
            victim = busy[0]
            failovers0 = m.value("fairstream_failovers_total", default=0.0, replica=victim)
            os.kill(pids[victim], signal.SIGSTOP)
            await asyncio.sleep(0.5)  # bytes it sent before the freeze reach the router
            (held,) = await apoll(lambda: _frozen_with_streams(router, victim, failovers0), 30,
                                  what="a /metrics answer")
            if held:
                return victim, pids[victim], tasks
            os.kill(pids[victim], signal.SIGCONT)  # its streams ended first: try again
        await asyncio.gather(*tasks)  # these ended undisturbed; a failed one fails here
    raise AssertionError("no replica still had streams in flight once frozen, in 3 attempts")


async def _admin_replicas(client: httpx.AsyncClient) -> list[dict]:
    r = await client.get("/admin/replicas", headers={"Authorization": f"Bearer {ADMIN}"}, timeout=30)
    return r.json()["replicas"]


async def _pids_when_all_ready(client: httpx.AsyncClient) -> dict[str, int] | None:
    try:
        replicas = await _admin_replicas(client)
    except httpx.TimeoutException:
        return None  # (a starved router or test process: ask again)
    return {x["name"]: x["pid"] for x in replicas} if all(x["state"] == "ready" for x in replicas) else None


async def test_each_replica_s_workers_run_on_cores_of_their_own(vllm_router):
    # (vLLM's own "auto" binding put both replicas' workers on core 0 here)
    async with httpx.AsyncClient(base_url=vllm_router.base_url) as client:
        pids = await apoll(lambda: _pids_when_all_ready(client), 300, what="both vllm replicas ready")
    assert BIND_ENV not in os.environ, "the test's own environment chose the binding"
    expected = core_lists(sorted(os.sched_getaffinity(0)), [1, 1])
    bound = {}
    for name, pid in sorted(pids.items()):
        with open(f"/proc/{pid}/environ", "rb") as f:
            env = dict(kv.split(b"=", 1) for kv in f.read().split(b"\0") if b"=" in kv)
        bound[name] = env[BIND_ENV.encode()].decode()
        # the threads vLLM pinned (its OpenMP workers), in the replica's processes
        pinned: set[int] = set()
        for p in descendants(pid):
            try:
                tasks = os.listdir(f"/proc/{p}/task")
            except FileNotFoundError:
                continue
            for t in tasks:
                try:
                    with open(f"/proc/{p}/task/{t}/status") as f:
                        allowed = next(x for x in f if x.startswith("Cpus_allowed_list:")).split()[1]
                except (FileNotFoundError, StopIteration):
                    continue
                if cpu_set(allowed) != set(os.sched_getaffinity(0)):
                    pinned |= cpu_set(allowed)
        assert pinned == cpu_set(bound[name]), (name, pinned, bound[name])
    assert list(bound.values()) == expected
    assert not cpu_set(bound["vllm-0"]) & cpu_set(bound["vllm-1"])
    lines = [r["msg"] for r in vllm_router.records("fairstream.supervisor") if BIND_ENV in r["msg"]]
    assert any("vllm-0" in m and f"cores {expected[0]} " in m for m in lines), lines


async def _all_zero(values):
    return all(v == 0 for v in (await values).values())


# presence and frequency penalties, which vLLM counts over a request's
# output: the continuation counts the tokens delivered before the splice too
PENALTIES = {"presence_penalty": 1.5, "frequency_penalty": 1.0, "repetition_penalty": 1.2}


# SIGKILL / SIGSTOP: the replica process; "engine": vLLM's engine core under
# it dies (as when the OOM killer picks it) while the replica process lives
@pytest.mark.parametrize("sig,extra", [(signal.SIGKILL, {}), (signal.SIGSTOP, {}), ("engine", {}),
                                       (signal.SIGKILL, PENALTIES)],
                         ids=["SIGKILL", "SIGSTOP", "engine", "SIGKILL-penalties"])
async def test_replica_death_mid_stream_is_token_exact(vllm_router, sig, extra):
    # both replicas up and serving before the chaos
    _wait_all_ready(vllm_router)
    headers = {"Authorization": f"Bearer {GOLD}"}
    async with httpx.AsyncClient(base_url=vllm_router.base_url, headers=headers, timeout=300) as client:
        body = {**_greedy(3000), **extra}
        ref = (await client.post("/v1/completions", json=body)).json()["choices"][0]["text"]
        if extra:  # the penalties change this output
            plain = (await client.post("/v1/completions", json=_greedy(200))).json()["choices"][0]["text"]
            assert not ref.startswith(plain)

        async def stream():
            parts = []
            async with client.stream("POST", "/v1/completions", json={**body, "stream": True}) as r:
                assert r.status_code == 200, (r.status_code, (await r.aread())[:500])
                async for ev in aiter_sse(r):
                    if ev.data == "[DONE]":
                        return "".join(parts)
                    d = ev.json()
                    assert "error" not in d, d
                    parts.append(d["choices"][0]["text"])
            raise AssertionError("stream ended without [DONE]")

        victim, pid, tasks = await _freeze_a_busy_replica(
            vllm_router, client, lambda: [asyncio.create_task(stream()) for _ in range(6)])
        if sig == "engine":
            for child in descendants(pid):
                os.kill(child, signal.SIGKILL)
            os.kill(pid, signal.SIGCONT)  # the replica finds its engine dead and exits
        elif sig != signal.SIGSTOP:
            os.kill(pid, sig)  # dies mid-stream; SIGSTOP leaves it frozen
        texts = await asyncio.gather(*tasks)
        assert all(t == ref for t in texts)
        m = await vllm_router.ametrics(client)
        assert m.value("fairstream_failovers_total", replica=victim) >= 1
        assert m.value("fairstream_streams_lost_total") == 0
    # the supervisor restarts it and it serves again
    poll(lambda: httpx.get(vllm_router.base_url + "/ready", timeout=2).json()["replicas"][victim] == "ready",
         300, interval=0.5, what=f"{victim} restarted")


async def test_a_replica_whose_engine_core_freezes_is_restarted(vllm_router):
    # vLLM's engine core frozen (SIGSTOP) behind a front end that still
    # answers pings: running streams move on the tenant's stall limit; new
    # requests dispatched to it used to wait out first_token and get a
    # 504, the replica 'ready' for good. Now the supervisor sees its engine
    # take no step with requests in it for health_timeout (45 s here) and
    # restarts it; the requests move to the other replica.
    _wait_all_ready(vllm_router)
    headers = {"Authorization": f"Bearer {GOLD}"}
    async with httpx.AsyncClient(base_url=vllm_router.base_url, headers=headers, timeout=200) as client:
        ref, victim = await _reference(vllm_router, client)
        m = await vllm_router.ametrics(client)
        restarts0 = m.value("fairstream_replica_restarts_total", default=0.0, replica=victim)
        await _freeze_engine_core(vllm_router, client, victim, await _pid(client, victim), ref, restarts0)


async def _reference(vllm_router, client: httpx.AsyncClient) -> tuple[str, str]:
    """The greedy reference text, and the replica that served it: prefix
    affinity sends the same prompt there again (at most AFFINITY_SLACK more
    loaded than the other), so a test that freezes that one has requests in
    it. (Freezing the first replica listed, as before, depended on where the
    reference had gone.)"""
    r = await client.post("/v1/completions", json=_greedy(32))
    assert r.status_code == 200, r.text
    rid = r.headers["x-request-id"]
    # (the request's log line is written as it settles, which may be just after its response)
    line = poll(lambda: next((rec for rec in vllm_router.records("fairstream.request") if rec.get("request_id") == rid),
                             None), 10, what="the reference request's log line")
    return r.json()["choices"][0]["text"], line["replica"]


async def _pid(client: httpx.AsyncClient, name: str) -> int:
    return next(r["pid"] for r in await _admin_replicas(client) if r["name"] == name)


async def _freeze_engine_core(vllm_router, client: httpx.AsyncClient, victim: str, pid: int, ref: str,
                              restarts_before: float) -> None:
    """Freeze the engine core under replica process ``pid`` (its front end
    still answers pings) while 4 greedy requests run (the prompt ``victim``
    served: affinity sends them there): they all complete with ``ref``'s
    text (moved off the frozen replica), and the supervisor restarts it as
    stuck. Then wait for it to serve again."""
    frozen = descendants(pid)
    for child in frozen:
        os.kill(child, signal.SIGSTOP)
    try:
        results = await asyncio.gather(*(client.post("/v1/completions", json=_greedy(32)) for _ in range(4)))
        assert [r.status_code for r in results] == [200] * 4, [r.text for r in results]
        assert all(r.json()["choices"][0]["text"] == ref for r in results)
        m = await vllm_router.ametrics(client)
        # (restarted as stuck: some of the requests were in its engine)
        assert m.value("fairstream_replica_restarts_total", replica=victim) > restarts_before
    finally:
        for child in frozen:
            try:
                os.kill(child, signal.SIGCONT)
            except ProcessLookupError:
                pass
    poll(lambda: httpx.get(vllm_router.base_url + "/ready", timeout=2).json()["replicas"][victim] == "ready",
         300, interval=0.5, what=f"{victim} restarted")


async def test_an_engine_core_frozen_before_its_first_step_is_restarted(vllm_router):
    # A replica just (re)started, whose engine core freezes before it ever
    # took a step (as one that hangs on its first batch): its front end still
    # answers pings, and it used to count as "reports no steps" (steps 0),
    # ready for good while every request sent to it waited out first_token.
    # Now its first step is waited for like any other (health_timeout).
    _wait_all_ready(vllm_router)
    headers = {"Authorization": f"Bearer {GOLD}"}
    admin = {"Authorization": f"Bearer {ADMIN}"}
    async with httpx.AsyncClient(base_url=vllm_router.base_url, headers=headers, timeout=200) as client:
        ref, victim = await _reference(vllm_router, client)
        old_pid = await _pid(client, victim)
        os.kill(old_pid, signal.SIGKILL)  # a fresh engine: the supervisor starts it again

        async def fresh_and_ready():
            r = await client.get("/admin/replicas", headers=admin)
            now = next(x for x in r.json()["replicas"] if x["name"] == victim)
            return now["state"] == "ready" and now["pid"] != old_pid and now

        pid = (await apoll(fresh_and_ready, 300, interval=0.5, what=f"{victim} started again"))["pid"]
        m = await vllm_router.ametrics(client)
        await _freeze_engine_core(vllm_router, client, victim, pid, ref,
                                  m.value("fairstream_replica_restarts_total", replica=victim))


def _ipc_dir(pid: int) -> str:
    """Where replica process ``pid``'s engine binds its IPC sockets (its VLLM_RPC_BASE_PATH)."""
    with open(f"/proc/{pid}/environ", "rb") as f:
        env = dict(v.split(b"=", 1) for v in f.read().split(b"\0") if b"=" in v)
    return env[b"VLLM_RPC_BASE_PATH"].decode()


async def test_a_killed_replica_s_engine_leaves_no_ipc_sockets(vllm_router):
    # vLLM's engine binds its ZMQ IPC sockets at $VLLM_RPC_BASE_PATH/<uuid4>
    # and removes none when killed (nor all of them at a clean stop): each
    # killed or restarted replica left ~7 in /tmp for good, and ~200 piled up
    # on the test machine. Each replica process now gets a directory of its
    # own in the router's run dir, removed when it stops. (The router's TMPDIR
    # here is the test's own, RouterProcess: what is in it is this router's.)
    _wait_all_ready(vllm_router)
    tmpdir = vllm_router.tmpdir
    victim, other = vllm_router.replica_names
    async with httpx.AsyncClient(base_url=vllm_router.base_url, timeout=30) as client:
        old = await _pid(client, victim)
        held = engine_sockets(old)  # (the sockets the victim's engine has bound: its own)
        assert held and all(p.startswith(f"{tmpdir}/") for p in held), held  # (not in /tmp)
        old_dir = _ipc_dir(old)
        os.kill(old, signal.SIGKILL)  # (its engine core and worker: the supervisor kills its process group)

        async def fresh_and_ready():
            now = next(r for r in await _admin_replicas(client) if r["name"] == victim)
            return now["state"] == "ready" and now["pid"] != old and now

        new = (await apoll(fresh_and_ready, 300, interval=0.5, what=f"{victim} started again"))["pid"]
        dirs = {_ipc_dir(new), _ipc_dir(await _pid(client, other))}
    left = sorted(p for p in held if os.path.lexists(p))
    assert left == [], f"{len(left)} of the killed replica's {len(held)} engine sockets are left: {left}"
    assert not os.path.exists(old_dir)
    # every engine socket in the router's temp dir lies in a running replica
    # process's own directory (run last in the module, this also sees what the
    # replicas killed and restarted by the chaos tests above left)
    assert len(dirs) == 2
    sockets = [p for p in tmpdir.rglob("*") if ENGINE_SOCKET.fullmatch(p.name)]
    assert [str(p) for p in sockets if str(p.parent) not in dirs] == []
