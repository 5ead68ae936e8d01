"""A replica a stream's stall limit caught producing nothing (a frozen
process: SIGSTOP) is out of dispatch, ``stalled``, until it answers a health
check sent after the stall; the health timeout alone decides to kill it."""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import time
from collections.abc import Iterator
from typing import Any

import httpx

from tests.helpers import ADMIN, RouterProcess, aiter_sse, apoll
from tests.integration.test_timeouts import auth, completion, write_tenants


async def _replica_rows(router: RouterProcess, http: httpx.AsyncClient) -> dict[str, dict[str, Any]]:
    r = await http.get(router.base_url + "/admin/replicas", headers=auth(ADMIN))
    assert r.status_code == 200, r.text
    return {row["name"]: row for row in r.json()["replicas"]}


@contextlib.contextmanager
def _thawed_and_stopped(router: RouterProcess) -> Iterator[list[int]]:
    """The process groups the test froze (the list it yields) are thawed,
    and the router stopped, however the test ends."""
    stopped: list[int] = []
    try:
        yield stopped
    finally:
        for pid in stopped:
            try:
                os.killpg(pid, signal.SIGCONT)
            except ProcessLookupError:
                pass
        router.stop()


async def _freeze_the_busy_replica(router: RouterProcess, http: httpx.AsyncClient,
                                   stopped: list[int]) -> tuple[str, int]:
    """SIGSTOP the process group of the replica running the one stream (kill
    -STOP -<pgid>, as the chaos test did); its name and pid."""
    m = await router.ametrics(http)
    inflight = {n: m.value("fairstream_replica_inflight_requests", replica=n) for n in router.replica_names}
    victim = max(inflight, key=inflight.get)
    assert inflight[victim] == 1, inflight
    pid = router.replica_pids()[victim]
    assert os.getpgid(pid) == pid  # (its own process group)
    os.killpg(pid, signal.SIGSTOP)
    stopped.append(pid)
    return victim, pid


async def test_a_replica_caught_stalling_gets_no_new_request_until_it_answers_a_ping(tmp_path) -> None:
    # (a chaos test with vLLM: once the stall limit had moved its stream off
    # the frozen replica, that one was still "ready" with nothing in flight,
    # the least loaded, so the next request went to it and waited for the
    # health timeout, 45 s there)
    tenants = write_tenants(tmp_path / "tenants.yaml", {"stall": 1.0})
    # health_timeout 30: the supervisor does not kill the frozen replica during the test
    router = RouterProcess(tmp_path / "r", replicas=2, tenants=tenants, sim={"step_base_ms": 10},
                           settings={"health_interval": 0.2, "health_timeout": 30}).start()
    with _thawed_and_stopped(router) as stopped:
        body = completion(300, stream=True, prompt="東京の")
        async with httpx.AsyncClient(base_url=router.base_url, headers=auth(), timeout=30) as http:
            reference = (await http.post("/v1/completions", json={**body, "stream": False})).json()
            parts: list[str] = []
            errors: list[Any] = []
            done = False
            async with http.stream("POST", "/v1/completions", json=body) as r:
                assert r.status_code == 200
                events = aiter_sse(r)
                while len("".join(parts)) < 20:
                    parts.append((await events.__anext__()).json()["choices"][0]["text"])
                victim, pid = await _freeze_the_busy_replica(router, http, stopped)

                async def moved() -> bool:
                    return (await router.ametrics(http)).value("fairstream_failovers_total", 0.0, replica=victim) >= 1

                await apoll(moved, 15, what="the stall limit to move the stream")
                row = (await _replica_rows(router, http))[victim]
                assert (row["state"], row["ready"], row["inflight"]) == ("stalled", False, 0), row
                assert (await http.get("/ready")).json()["replicas"][victim] == "stalled"
                m = await router.ametrics(http)
                assert m.value("fairstream_replica_up", replica=victim) == 0
                assert m.value("fairstream_replica_stalled", replica=victim) == 1
                # new requests go to the replica that answers, not to the frozen one
                for i in range(4):
                    short = await http.post("/v1/completions", json=completion(4, stream=False, prompt=f"x{i}"),
                                            timeout=8)
                    assert short.status_code == 200, short.text
                async for ev in events:
                    if ev.data == "[DONE]":
                        done = True
                        break
                    d = ev.json()
                    if "error" in d:
                        errors.append(d["error"])
                        continue
                    parts.append(d["choices"][0]["text"])
            assert errors == [] and done, errors
            assert "".join(parts) == reference["choices"][0]["text"]
            # it is back at its first pong after the stall; never killed for it
            os.killpg(pid, signal.SIGCONT)
            stopped.clear()

            async def back() -> bool:
                return (await _replica_rows(router, http))[victim]["state"] == "ready"

            await apoll(back, 10, what=f"{victim} ready again once it answers a ping")
            m = await router.ametrics(http)
            assert m.value("fairstream_replica_stalled", replica=victim) == 0
            assert m.value("fairstream_replica_up", replica=victim) == 1
            assert m.value("fairstream_replica_restarts_total", 0.0, replica=victim) == 0
            assert router.replica_pids()[victim] == pid
            log = router.log()
            assert f"replica {victim} stalled a stream" in log and f"replica {victim} answers its health check" in log


async def test_a_replica_caught_stalling_is_pinged_at_once_and_back_at_its_pong(tmp_path) -> None:
    # (the mark was cleared only by a regular health check sent after the
    # stall: up to health_interval later, plus a ping already in flight; a
    # tenant with a tight stall limit could so take a replica out of dispatch
    # for every tenant. Now the supervisor pings it at once: a replica that is
    # alive is back one round trip after the stall, a frozen one stays out)
    tenants = write_tenants(tmp_path / "tenants.yaml", {"stall": 0.5})
    # health_interval 10: no regular check comes during the test (its first is at the connection)
    router = RouterProcess(tmp_path / "r", replicas=2, tenants=tenants, sim={"step_base_ms": 10},
                           settings={"health_interval": 10, "health_timeout": 30}).start()
    with _thawed_and_stopped(router) as stopped:
        async with httpx.AsyncClient(base_url=router.base_url, headers=auth(), timeout=30) as http:
            async with http.stream("POST", "/v1/completions", json=completion(300, stream=True, prompt="東京の")) as r:
                assert r.status_code == 200
                events = aiter_sse(r)
                await events.__anext__()
                victim, pid = await _freeze_the_busy_replica(router, http, stopped)

                async def stalled() -> bool:
                    return (await _replica_rows(router, http))[victim]["state"] == "stalled"

                await apoll(stalled, 10, what="the stall limit to mark the replica")
                # frozen: the ping sent at the stall gets no answer, and it stays out
                await asyncio.sleep(1.0)
                assert (await _replica_rows(router, http))[victim]["state"] == "stalled"
                os.killpg(pid, signal.SIGCONT)
                stopped.clear()
                thawed = time.monotonic()

                async def back() -> bool:
                    return (await _replica_rows(router, http))[victim]["state"] == "ready"

                # alive again: it answers that ping, well within health_interval
                await apoll(back, 2, what=f"{victim} ready again at its pong to the ping sent at the stall")
                assert time.monotonic() - thawed < 2
                async for ev in events:
                    if ev.data == "[DONE]":
                        break
                    assert "error" not in ev.json(), ev.data
            assert router.replica_pids()[victim] == pid  # (never restarted for it)
