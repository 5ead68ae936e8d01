"""Tenant policy and limits through real routers: reload under load, limit
headers, exact limits across two routers on one Redis, Redis outages."""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import json
import os
import signal
import time

import httpx
import openai
import pytest
import yaml
from websockets.asyncio.client import connect

from router.auth import hash_key
from tests.helpers import ADMIN, DEMO_TENANTS, GOLD, MODEL, RouterProcess, aiter_sse, apoll

KEY_A, KEY_B = "tenant-a-key", "tenant-b-key"


def tenants_yaml(path, *, rpm=0, tpm=0, conc=0, on_limit="reject", extra: str = "", max_tokens=0) -> None:
    doc = {
        "admin_keys": [hash_key(ADMIN)],
        "defaults": {"timeouts": {"queue_wait": 5}},
        "tenants": {
            "a": {"keys": [hash_key(KEY_A)], "on_limit": on_limit,
                  "limits": {"requests_per_minute": rpm, "tokens_per_minute": tpm, "max_concurrent": conc,
                             "max_tokens": max_tokens}},
            "b": {"keys": [hash_key(KEY_B)], "priority": "low"},
        },
    }
    path.write_text(yaml.safe_dump(doc, sort_keys=False) + extra)


def body(max_tokens=16, stream=False, prompt="Le caf"):
    return {"model": MODEL, "prompt": prompt, "max_tokens": max_tokens, "stream": stream, "ignore_eos": True}


def auth(key):
    return {"Authorization": f"Bearer {key}"}


def test_ratelimit_headers_and_429_with_retry_after(tmp_path):
    t = tmp_path / "tenants.yaml"
    tenants_yaml(t, rpm=3, tpm=100000)
    with RouterProcess(tmp_path / "r", tenants=t) as router:
        url = router.base_url + "/v1/completions"
        seen = []
        for _ in range(3):
            r = httpx.post(url, headers=auth(KEY_A), json=body(), timeout=20)
            assert r.status_code == 200, r.text
            seen.append(int(r.headers["x-ratelimit-remaining-requests"]))
            assert r.headers["x-ratelimit-limit-requests"] == "3"
            assert r.headers["x-ratelimit-limit-tokens"] == "100000"
            assert "x-ratelimit-reset-tokens" in r.headers
        assert seen == [2, 1, 0]
        r = httpx.post(url, headers=auth(KEY_A), json=body(), timeout=20)
        assert r.status_code == 429
        err = r.json()["error"]
        assert err["type"] == "rate_limit_error" and "requests per minute" in err["message"]
        # one request refills in 60/3 = 20 s
        assert 15 <= int(r.headers["retry-after"]) <= 21
        assert r.headers["x-ratelimit-remaining-requests"] == "0"
        # tenant b has no limits and is not affected
        assert httpx.post(url, headers=auth(KEY_B), json=body(), timeout=20).status_code == 200


def test_tokens_are_reserved_then_settled_with_real_usage(tmp_path):
    t = tmp_path / "tenants.yaml"
    tenants_yaml(t, tpm=1000)
    with RouterProcess(tmp_path / "r", tenants=t) as router:
        url = router.base_url + "/v1/completions"
        # reserved: 6 prompt bytes + 1 + 300 max_tokens; used: 6 + the few tokens before "coin"
        first = {**body(300), "temperature": 0, "stop": ["coin"]}
        r = httpx.post(url, headers=auth(KEY_A), json=first, timeout=20)
        assert r.status_code == 200
        used = r.json()["usage"]["total_tokens"]
        assert used < 20 and int(r.headers["x-ratelimit-remaining-tokens"]) <= 1000 - 307
        r = httpx.post(url, headers=auth(KEY_A), json=body(10), timeout=20)
        assert r.status_code == 200
        remaining = int(r.headers["x-ratelimit-remaining-tokens"])
        # the first request was settled to its real use; the second reserves 6 + 1 + 10
        assert 1000 - used - 17 <= remaining <= 1000 - 17, remaining
        # a request that can never fit is refused as too large
        r = httpx.post(url, headers=auth(KEY_A), json=body(2000), timeout=20)
        assert r.status_code == 429 and r.json()["error"]["code"] == "tokens_exceed_limit"
        assert "lower max_tokens" in r.json()["error"]["message"]
        # no time to wait names: the SDK is told not to retry (with Retry-After: 60 it waited 2 x 60 s)
        assert r.headers["x-should-retry"] == "false" and "retry-after" not in r.headers, r.headers
        # ... and one whose prompt alone is over the budget says so (max_tokens cannot help)
        r = httpx.post(url, headers=auth(KEY_A), json={**body(1), "prompt": "x" * 1200}, timeout=20)
        assert r.status_code == 429 and "its prompt alone is about" in r.json()["error"]["message"], r.text
        # a chat template may render chat_template_kwargs into the prompt: they count too
        chat = {"model": body(1)["model"], "messages": [{"role": "user", "content": "hi"}], "max_tokens": 1,
                "chat_template_kwargs": {"documents": [{"text": "x" * 1200}]}}
        r = httpx.post(router.base_url + "/v1/chat/completions", headers=auth(KEY_A), json=chat, timeout=20)
        assert r.status_code == 429 and "its prompt alone is about" in r.json()["error"]["message"], r.text


async def test_a_burst_of_short_chats_stays_within_the_token_limit(tmp_path):
    # (the estimate had no room for the chat template's fixed part: 60 chats
    # of "hi" at once were each reserved 11 tokens, used 28, and together
    # 1,680 tokens of a 1,000 a minute limit)
    t = tmp_path / "tenants.yaml"
    tenants_yaml(t, tpm=1000)
    chat = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 1}
    with RouterProcess(tmp_path / "r", tenants=t) as router:
        async with httpx.AsyncClient(base_url=router.base_url, headers=auth(KEY_A), timeout=30) as http:
            started = time.monotonic()
            answers = await asyncio.gather(*(http.post("/v1/chat/completions", json=chat) for _ in range(60)))
            elapsed = time.monotonic() - started
            used = sum(r.json()["usage"]["total_tokens"] for r in answers if r.status_code == 200)
            assert {r.status_code for r in answers} == {200, 429}, [r.text for r in answers][:3]
            assert used <= 1000 + 1000 * elapsed / 60, (used, elapsed)  # the bucket's bound (README)


def test_admin_endpoints_need_the_admin_key(tmp_path):
    with RouterProcess(tmp_path / "r") as router:
        for method, path in (("POST", "/admin/reload"), ("GET", "/admin/tenants"), ("GET", "/admin/replicas")):
            assert httpx.request(method, router.base_url + path, timeout=5).status_code == 401
            r = httpx.request(method, router.base_url + path, headers=auth(GOLD), timeout=5)
            assert r.status_code == 403 and r.json()["error"]["code"] == "forbidden"
            assert httpx.request(method, router.base_url + path, headers=auth(ADMIN), timeout=5).status_code == 200
        view = httpx.get(router.base_url + "/admin/tenants", headers=auth(ADMIN), timeout=5).json()
        assert set(view["tenants"]) == {"gold", "silver", "free"}
        text = str(view)
        assert "3fbbe354" not in text  # no key material, not even digests
        assert view["tenants"]["gold"]["policy"]["weight"] == 3.0


def test_admin_tenants_shows_limits_and_timeouts_as_tenants_yaml_has_them(tmp_path):
    # (the view's `limits` held the four timeouts too and it had no `timeouts`:
    # an admin who looked for `timeouts.queue_wait` as the file has it found none)
    with RouterProcess(tmp_path / "r") as router:
        view = httpx.get(router.base_url + "/admin/tenants", headers=auth(ADMIN), timeout=5).json()
    free = view["tenants"]["free"]["policy"]
    assert free.get("timeouts") == {"queue_wait": 10.0, "first_token": 60.0, "stall": 10.0, "total": 600.0}, free
    assert free["limits"] == {"requests_per_minute": 60, "tokens_per_minute": 20000, "max_concurrent": 4,
                              "max_prompt_tokens": 3072, "max_tokens": 256, "max_sockets": 0}


def test_admin_tenants_shows_no_count_for_a_rate_the_tenant_has_no_limit_on(tmp_path):
    # (a limit of 0 is "no limit", and the view said 0.0 available: "used up")
    tenants = tmp_path / "tenants.yaml"
    tenants.write_text(DEMO_TENANTS.read_text().replace(
        "limits: {requests_per_minute: 1200, tokens_per_minute: 1000000,",
        "limits: {requests_per_minute: 0, tokens_per_minute: 0,"))
    with RouterProcess(tmp_path / "r", tenants=tenants) as router:
        view = httpx.get(router.base_url + "/admin/tenants", headers=auth(ADMIN), timeout=5).json()
    gold, free = view["tenants"]["gold"]["usage"], view["tenants"]["free"]["usage"]
    assert gold["requests_available"] is None and gold["tokens_available"] is None, gold
    assert free["requests_available"] == 60 and free["tokens_available"] == 20000, free


def bomb() -> bytes:
    lines = ['a: &a ["x", "x", "x", "x", "x", "x", "x", "x", "x"]']
    for prev, name in zip("abcdefgh", "bcdefghi"):
        lines.append(f"{name}: &{name} [" + ", ".join([f"*{prev}"] * 9) + "]")
    return "\n".join(lines).encode()


async def test_bad_reload_while_20_streams_run_keeps_old_policy(tmp_path):
    t = tmp_path / "tenants.yaml"
    tenants_yaml(t)
    router = RouterProcess(tmp_path / "r", tenants=t, sim={"step_base_ms": 10}).start()
    try:
        async with httpx.AsyncClient(base_url=router.base_url, timeout=60) as client:
            async def stream():
                text, done = [], False
                async with client.stream("POST", "/v1/completions", headers=auth(KEY_A),
                                         json=body(120, stream=True)) as r:
                    assert r.status_code == 200
                    async for ev in aiter_sse(r):
                        if ev.data == "[DONE]":
                            done = True
                        else:
                            d = ev.json()
                            assert "error" not in d, d
                            text.append(d["choices"][0]["text"])
                return done, "".join(text)

            tasks = [asyncio.create_task(stream()) for _ in range(20)]
            await asyncio.sleep(0.3)
            # an admin saves a broken file: a typo'd key on line 5 of the new text
            good = t.read_text()
            broken = good.replace("  timeouts:", "  timeoutz:", 1)
            line = next(i for i, l in enumerate(broken.splitlines(), 1) if "timeoutz" in l)
            t.write_text(broken)
            r = await client.post("/admin/reload", headers=auth(ADMIN))
            assert r.status_code == 422
            assert r.json()["ok"] is False and r.json()["changed"] is False  # nothing took effect
            errors = r.json()["errors"]
            assert errors and f"{t}:{line}: defaults.timeoutz: unknown key" in errors[0]
            # a file saved in Latin-1, and nested YAML aliases (a few hundred bytes
            # that expand to 387 million values): each a 422 that names it
            for raw, says in ((good.encode() + b"# caf\xe9\n", "not UTF-8 text"),
                              (bomb(), "values once YAML aliases are expanded")):
                t.write_bytes(raw)
                r = await client.post("/admin/reload", headers=auth(ADMIN))
                assert r.status_code == 422 and says in r.json()["errors"][0], r.text
            results = await asyncio.gather(*tasks)
            assert all(done for done, _ in results)
            assert all(len(text) > 0 for _, text in results)
            # the old policy still serves; the failure is visible in metrics and the admin view
            r = await client.post("/v1/completions", headers=auth(KEY_A), json=body(4))
            assert r.status_code == 200
            m = await router.ametrics(client)
            assert m.value("fairstream_config_last_reload_successful") == 0
            assert m.value("fairstream_config_reloads_total", result="failure") >= 1
            view = (await client.get("/admin/tenants", headers=auth(ADMIN))).json()
            assert view["version"] == 1 and view["last_reload_errors"]
            # the digest of the file in force (routers sharing Redis compare it), in /ready too
            digest = hashlib.sha256(good.encode()).hexdigest()[:16]
            assert view["digest"] == digest and (await client.get("/ready")).json()["tenants_digest"] == digest
    finally:
        router.stop()


async def test_a_refused_reload_names_every_error_in_openai_error_shape(tmp_path):
    # (msgspec stops at the first error: an admin fixed one, reloaded, got
    # the next, and so on)
    t = tmp_path / "tenants.yaml"
    tenants_yaml(t)
    router = RouterProcess(tmp_path / "r", tenants=t, replicas=1).start()
    try:
        async with httpx.AsyncClient(base_url=router.base_url, timeout=30) as client:
            doc = yaml.safe_load(t.read_text())
            doc["tenants"]["a"]["limits"]["rpm"] = 5  # a misspelt limit
            doc["tenants"]["b"]["weight"] = "heavy"  # not a number
            doc["tenants"]["c"] = {"keys": ["sk-plain-key"]}  # not a digest (the file's own check)
            t.write_text(yaml.safe_dump(doc, sort_keys=False))
            lines = t.read_text().splitlines()

            def at(text: str) -> int:
                return next(i for i, line in enumerate(lines, 1) if text in line)

            want = [f"{t}:{at('rpm: 5')}: tenants.a.limits.rpm: unknown key",
                    f"{t}:{at('weight: heavy')}: tenants.b.weight: Expected `float | null`, got `str`",
                    f"{t}:{at('sk-plain-key')}: tenants.c.keys.0: must be a SHA-256 hex digest"]
            r = await client.post("/admin/reload", headers=auth(ADMIN))
            assert r.status_code == 422, r.text
            answer = r.json()
            assert (answer["ok"], answer["changed"], answer["version"]) == (False, False, 1)
            errors = answer["errors"]
            assert len(errors) == 3 and all(e.startswith(w) for e, w in zip(errors, want)), errors
            error = answer["error"]  # (OpenAI's shape: what an SDK shows)
            assert (error["type"], error["code"], error["param"]) == ("invalid_request_error", "invalid_config", None)
            assert error["message"].endswith("\n".join(errors)) and "version 1 stays in force" in error["message"]
            view = (await client.get("/admin/tenants", headers=auth(ADMIN))).json()
            assert view["version"] == 1 and view["last_reload_errors"] == errors
            log = router.log()
            assert all(f"keeping version 1: {w}" in log for w in want), log[-3000:]
            # the old policy still serves
            assert (await client.post("/v1/completions", headers=auth(KEY_A), json=body(2))).status_code == 200
    finally:
        router.stop()


async def test_a_refused_reload_names_a_missing_colon_at_its_line_and_a_tiny_weight(tmp_path):
    # (a first key without its ':' was named a line late as "mapping values
    # are not allowed"; a weight of 5e-324 was taken, and that tenant's
    # fair-share counter became infinite: virtual_counter null in /admin/tenants)
    t = tmp_path / "tenants.yaml"
    tenants_yaml(t)
    router = RouterProcess(tmp_path / "r", tenants=t, replicas=1).start()
    try:
        async with httpx.AsyncClient(base_url=router.base_url, timeout=30) as client:
            good = t.read_text()
            lines = good.splitlines(keepends=True)
            at = next(i for i, line in enumerate(lines) if line == "  a:\n")
            t.write_text("".join(lines[:at] + ["  a\n"] + lines[at + 1:]))
            want = f"{t}:{at + 1}: (syntax): a ':' is missing after a key on this line: `a` runs on"
            r = await client.post("/admin/reload", headers=auth(ADMIN))
            assert r.status_code == 422 and r.json()["errors"][0].startswith(want), r.text
            view = (await client.get("/admin/tenants", headers=auth(ADMIN))).json()
            assert view["version"] == 1 and view["last_reload_errors"][0].startswith(want), view
            assert f"keeping version 1: {want}" in router.log(), router.log()[-3000:]
            tenants_yaml(t, extra="")
            doc = yaml.safe_load(t.read_text())
            doc["tenants"]["b"]["weight"] = 5e-324
            t.write_text(yaml.safe_dump(doc, sort_keys=False))
            r = await client.post("/admin/reload", headers=auth(ADMIN))
            assert r.status_code == 422, r.text
            assert r.json()["errors"] == [next(f"{t}:{i}: tenants.b.weight: must be at least 0.001 (weights go from "
                                               "0.001 to 1000: a tenant's share is proportional to its weight)"
                                               for i, line in enumerate(t.read_text().splitlines(), 1)
                                               if "weight" in line)], r.text
    finally:
        router.stop()


async def test_reload_by_file_watch_and_sighup_applies_lowered_limit_at_once(tmp_path):
    t = tmp_path / "tenants.yaml"
    tenants_yaml(t)
    router = RouterProcess(tmp_path / "r", tenants=t, sim={"step_base_ms": 10}).start()
    try:
        async with httpx.AsyncClient(base_url=router.base_url, timeout=60) as client:
            # a long stream in flight across the reload (4 s: the reload's parse
            # starts a process, ~0.2-1 s on a loaded host, after the watch's settling)
            async def long_stream():
                async with client.stream("POST", "/v1/completions", headers=auth(KEY_A),
                                         json=body(400, stream=True)) as r:
                    return [ev.data async for ev in aiter_sse(r)][-1]

            inflight = asyncio.create_task(long_stream())
            await asyncio.sleep(0.2)
            tenants_yaml(t, conc=1)  # watchfiles picks this up
            await apoll(lambda: _version(router) == 2, 10, what="file-watch reload")
            assert (await client.post("/v1/completions", headers=auth(KEY_A), json=body(2))).status_code == 429
            assert await inflight == "[DONE]"  # the running stream was not dropped
            # SIGHUP reloads too (no file event needed: rewrite identical content first)
            tenants_yaml(t, conc=0)
            os.kill(router.pid, signal.SIGHUP)
            await apoll(lambda: _version(router) >= 3, 10, what="SIGHUP reload")
            assert (await client.post("/v1/completions", headers=auth(KEY_A), json=body(2))).status_code == 200
    finally:
        router.stop()


async def test_a_reload_that_renames_the_priority_classes_spares_a_request_waiting_in_its_line(tmp_path):
    # A request waiting for its tenant's concurrency slot holds the old
    # snapshot's class name ("normal"); looked up in the new file's classes
    # once admitted, it was a 500, and its lease was never given back: the
    # tenant stayed at its concurrency limit until the router restarted.
    t = tmp_path / "tenants.yaml"
    async with _one_running_one_waiting(tmp_path, t) as (router, client, first, waiting):
        doc = yaml.safe_load(t.read_text())
        doc["priority_classes"] = ["p0", "p1", "p2"]
        doc["defaults"]["priority"] = "p1"
        doc["tenants"]["b"]["priority"] = "p2"
        t.write_text(yaml.safe_dump(doc, sort_keys=False))
        await apoll(lambda: _version(router) == 2, 10, what="the reload")
        assert (await first).status_code == 200
        r = await waiting
        assert r.status_code == 200, r.text
        # the slot came back: the tenant's next request is served at once
        r = await client.post("/v1/completions", headers=auth(KEY_A), json=body(2))
        assert r.status_code == 200, r.text
        tenants = (await client.get("/admin/tenants", headers=auth(ADMIN))).json()
        assert tenants["tenants"]["a"]["usage"]["active_streams"] == 0, tenants


async def test_a_reload_that_raises_a_limit_admits_the_requests_already_waiting(tmp_path):
    # (a waiting request kept the limits it arrived with: raising
    # max_concurrent to clear a backlog let it in only when the stream ahead ended)
    t = tmp_path / "tenants.yaml"
    async with _one_running_one_waiting(tmp_path, t) as (router, client, first, waiting):
        doc = yaml.safe_load(t.read_text())
        doc["tenants"]["a"]["limits"]["max_concurrent"] = 2
        t.write_text(yaml.safe_dump(doc, sort_keys=False))
        r = await asyncio.wait_for(waiting, 10)
        assert r.status_code == 200, r.text
        assert not first.done()  # (in beside it, not after it)
        assert (await first).status_code == 200


async def test_a_reload_that_removes_a_tenant_refuses_its_waiting_requests(tmp_path):
    # (requests keep the snapshot they started with: one waiting in the
    # removed tenant's line was admitted after the removal and streamed all
    # its tokens, up to queue_wait later. Running streams go on.)
    t = tmp_path / "tenants.yaml"
    async with _one_running_one_waiting(tmp_path, t) as (router, client, first, waiting):
        doc = yaml.safe_load(t.read_text())
        del doc["tenants"]["a"]
        t.write_text(yaml.safe_dump(doc, sort_keys=False))
        r = await asyncio.wait_for(waiting, 10)
        assert r.status_code == 401, r.text
        assert "was removed from the tenant policy" in r.json()["error"]["message"]
        # (logged and counted as unauthorized under its tenant: its key was refused, not its request)
        line = await apoll(lambda: next((x for x in router.records("fairstream.request")
                                         if x["request_id"] == r.headers["x-request-id"]), None), 10, what="its line")
        assert line["outcome"] == "unauthorized" and line["tenant"] == "a" and line["status"] == 401, line
        assert not first.done()  # (refused at the reload, not when the slot freed)
        assert (await first).status_code == 200  # the running stream went on
        r = await client.post("/v1/completions", headers=auth(KEY_A), json=body(2))
        assert r.status_code == 401, r.text
        assert "tenant a removed by the reload: 1 waiting requests refused (401)" in router.log()


@pytest.mark.parametrize("store", ["memory", "redis"])
@pytest.mark.parametrize("conc", [1, 2])
async def test_a_reload_to_on_limit_reject_refuses_the_waiting_requests_it_would_refuse(tmp_path, conc, store,
                                                                                       request):
    # (a waiting request picked up the new limits and queue_wait but not
    # on_limit: switched to reject to shed load, the tenant's line went on
    # waiting and its requests were served seconds later). Each asks once,
    # as a new request would now: admitted if its limits pass, else the
    # reject 429, headers and all. They ask in the line's order: with conc 2
    # the one slot goes to the head (on Redis they asked together, and the
    # slot went to whichever ask Redis answered first).
    t = tmp_path / "tenants.yaml"
    settings = ({"state": {"backend": "redis", "url": request.getfixturevalue("redis_server").url}}
                if store == "redis" else None)
    async with _one_running_one_waiting(tmp_path, t, 600, settings) as (router, client, first, waiting):
        second = asyncio.create_task(client.post("/v1/completions", headers=auth(KEY_A), json=body(4)))
        await apoll(lambda: _waiting(router, "a") == 2, 10, what="two in the tenant's line")
        doc = yaml.safe_load(t.read_text())
        doc["tenants"]["a"]["on_limit"] = "reject"
        doc["tenants"]["a"]["limits"]["max_concurrent"] = conc
        doc["tenants"]["a"]["limits"]["requests_per_minute"] = 1000  # (for x-ratelimit-*-requests headers)
        t.write_text(yaml.safe_dump(doc, sort_keys=False))
        got = await asyncio.wait_for(asyncio.gather(waiting, second), 3)
        assert not first.done()  # (refused at the reload, not when the slot freed)
        assert [r.status_code for r in got] == ([429, 429] if conc == 1 else [200, 429]), [r.text for r in got]
        refused = got[-1]
        assert refused.json()["error"]["code"] == "rate_limit_exceeded", refused.text
        assert float(refused.headers["retry-after"]) > 0
        assert refused.headers["x-ratelimit-limit-requests"] == "1000"
        assert _waiting(router, "a") == 0
        assert (await first).status_code == 200  # the running stream went on


async def test_a_request_refused_by_a_reload_to_reject_gets_a_new_requests_429(tmp_path):
    # (the same error, Retry-After and x-ratelimit-* headers as a request
    # arriving after the reload gets)
    t = tmp_path / "tenants.yaml"
    async with _one_running_one_waiting(tmp_path, t, 600) as (router, client, first, waiting):
        doc = yaml.safe_load(t.read_text())
        doc["tenants"]["a"]["on_limit"] = "reject"
        doc["tenants"]["a"]["limits"]["requests_per_minute"] = 1000
        t.write_text(yaml.safe_dump(doc, sort_keys=False))
        refused = await asyncio.wait_for(waiting, 3)
        new = await client.post("/v1/completions", headers=auth(KEY_A), json=body(2))
        assert refused.status_code == new.status_code == 429, (refused.text, new.text)
        assert refused.json()["error"]["code"] == new.json()["error"]["code"] == "rate_limit_exceeded"
        assert refused.json()["error"]["type"] == new.json()["error"]["type"]
        why = [r.json()["error"]["message"].split(" Please")[0] for r in (refused, new)]  # (less the time)
        assert why[0] == why[1], why
        assert 0 < float(refused.headers["retry-after"]) and 0 < float(new.headers["retry-after"])
        assert {h for h in refused.headers if h.startswith("x-ratelimit")} == \
            {h for h in new.headers if h.startswith("x-ratelimit")} != set()
        assert not first.done()
        first.cancel()  # (its client goes: the stream's end is not what this test is about)


async def test_a_router_whose_reload_switches_to_reject_leaves_the_shared_line_at_once(tmp_path, redis_server):
    # Two routers on one Redis, the tenant's line shared: router A's head
    # waits first in the store's line, router B's behind it. A's file
    # switches the tenant to reject: A's waiting request asks as a new
    # request would, outside the store's line, and gets its 429. Its place
    # there must go with it (asked outside the line, neither the ask nor
    # the 429 takes it out), so when the running stream ends B's request is
    # admitted at once, not held back by a place nobody holds.
    async with _two_routers_one_line(tmp_path, redis_server) as (ra, rb, ta, client, first):
        on_a = asyncio.create_task(client.post(ra.base_url + "/v1/completions", headers=auth(KEY_A), json=body(4)))
        await apoll(lambda: _waiting(ra, "a") == 1, 10, what="A's head")
        await asyncio.sleep(0.3)  # (A's head is in the store's line before B's)
        on_b = asyncio.create_task(client.post(rb.base_url + "/v1/completions", headers=auth(KEY_A), json=body(4)))
        await apoll(lambda: _waiting(rb, "a") == 1, 10, what="B's head")
        doc = yaml.safe_load(ta.read_text())
        doc["tenants"]["a"]["on_limit"] = "reject"
        ta.write_text(yaml.safe_dump(doc, sort_keys=False))
        r = await asyncio.wait_for(on_a, 5)
        assert r.status_code == 429, r.text
        assert not on_b.done()
        first.cancel()  # the stream's client goes: its slot frees
        ended = asyncio.get_running_loop().time()
        r = await asyncio.wait_for(on_b, 10)
        took = asyncio.get_running_loop().time() - ended
        assert r.status_code == 200, r.text
        # (a place left in the store's line holds B's head back for about 2.25 s)
        assert took < 1.2, took


async def test_a_reload_to_reject_admits_a_waiting_request_another_routers_line_is_ahead_of(tmp_path, redis_server):
    # Router B's head waits first in the store's line, router A's behind it.
    # A's file switches the tenant to reject and allows two streams: A's
    # waiting request asks as a new request there would, and a new request
    # under reject takes no place in any line: its limits pass, it is
    # admitted. (Asked in the store's line, it was refused behind B's head,
    # a 429 "on its line" that no request arriving then would get.) B's
    # file still allows one stream: its head waits on.
    async with _two_routers_one_line(tmp_path, redis_server) as (ra, rb, ta, client, first):
        on_b = asyncio.create_task(client.post(rb.base_url + "/v1/completions", headers=auth(KEY_A), json=body(4)))
        await apoll(lambda: _waiting(rb, "a") == 1, 10, what="B's head")
        await asyncio.sleep(0.3)  # (B's head is in the store's line before A's)
        on_a = asyncio.create_task(client.post(ra.base_url + "/v1/completions", headers=auth(KEY_A), json=body(4)))
        await apoll(lambda: _waiting(ra, "a") == 1, 10, what="A's head")
        doc = yaml.safe_load(ta.read_text())
        doc["tenants"]["a"]["on_limit"] = "reject"
        doc["tenants"]["a"]["limits"]["max_concurrent"] = 2
        ta.write_text(yaml.safe_dump(doc, sort_keys=False))
        r = await asyncio.wait_for(on_a, 5)
        assert r.status_code == 200, r.text
        assert not on_b.done() and _waiting(rb, "a") == 1
        first.cancel()
        assert (await asyncio.wait_for(on_b, 10)).status_code == 200


@contextlib.asynccontextmanager
async def _two_routers_one_line(tmp_path, redis_server):
    """Routers A and B on one Redis, each with its own copy of tenants.yaml
    (tenant ``a`` runs one stream at a time and queues up to 20 s):
    (A, B, A's file, a client, a long stream of ``a`` running on A as a
    task, whose client goes when it is cancelled); the routers stop after."""
    settings = {"state": {"backend": "redis", "url": redis_server.url}}
    ta, tb = tmp_path / "a.yaml", tmp_path / "b.yaml"
    for t in (ta, tb):
        tenants_yaml(t, conc=1, on_limit="queue")
        doc = yaml.safe_load(t.read_text())
        doc["defaults"]["timeouts"]["queue_wait"] = 20
        t.write_text(yaml.safe_dump(doc, sort_keys=False))
    ra = RouterProcess(tmp_path / "ra", tenants=ta, settings=settings, sim={"step_base_ms": 10}).start()
    rb = RouterProcess(tmp_path / "rb", tenants=tb, settings=settings, sim={"step_base_ms": 10})
    try:
        rb.start()
        async with httpx.AsyncClient(timeout=60) as client:
            started = asyncio.Event()

            async def running():
                async with client.stream("POST", ra.base_url + "/v1/completions", headers=auth(KEY_A),
                                         json=body(2000, stream=True)) as r:
                    assert r.status_code == 200
                    async for _ in r.aiter_bytes():
                        started.set()

            first = asyncio.create_task(running())
            try:
                await asyncio.wait_for(started.wait(), 10)
                yield ra, rb, ta, client, first
            finally:
                first.cancel()
                await asyncio.gather(first, return_exceptions=True)
    finally:
        ra.stop()
        rb.stop()


async def test_a_reload_that_removes_a_tenant_takes_its_series_out_of_metrics(tmp_path):
    # (they stayed exported until the router restarted: about 100 series per
    # tenant name ever removed or renamed, /metrics growing without bound)
    t = tmp_path / "tenants.yaml"
    async with _one_running_one_waiting(tmp_path, t) as (router, client, first, waiting):
        r = await client.post("/v1/completions", headers=auth(KEY_B), json=body(2))
        assert r.status_code == 200, r.text
        m = await router.ametrics(client)
        assert m.value("fairstream_admission_waiting", tenant="a") == 1
        b_before = _series(m, "b")
        assert _series(m, "a") and b_before
        doc = yaml.safe_load(t.read_text())
        del doc["tenants"]["a"]
        t.write_text(yaml.safe_dump(doc, sort_keys=False))
        assert (await asyncio.wait_for(waiting, 10)).status_code == 401  # (it waited in a's line: the gauge was 1)
        # (its series go a batch per loop turn, Metrics.retire_gradually: a scrape
        # built in a thread meanwhile may still read a family not yet walked)

        async def a_gone() -> bool:
            return _series(await router.ametrics(client), "a") == set()

        await apoll(a_gone, 5, what="a's series gone")
        # the stream running across the reload ends: its counts bring back no series
        assert (await first).status_code == 200
        m = await router.ametrics(client)
        assert _series(m, "a") == set()
        assert _series(m, "b") == b_before
        assert m.value("fairstream_requests_total", tenant="b", outcome="ok") == 1


def _series(m, tenant: str) -> set[tuple[str, tuple[tuple[str, str], ...]]]:
    """The series of ``tenant`` in a scrape (name and labels)."""
    return {(name, tuple(sorted(labels.items()))) for name, labels, _ in m.samples if labels.get("tenant") == tenant}


@contextlib.asynccontextmanager
async def _one_running_one_waiting(tmp_path, tenants, first_tokens: int = 200, settings: dict | None = None):
    """A router (with router.yaml ``settings``, if any) whose tenant ``a``
    (its file written at ``tenants``) runs one stream at a time: (router,
    client, a stream of ``first_tokens`` running (10 ms each), a request
    waiting behind it in the tenant's line) as tasks; the router stops
    after."""
    tenants_yaml(tenants, conc=1, on_limit="queue")
    router = RouterProcess(tmp_path / "r", tenants=tenants, settings=settings, sim={"step_base_ms": 10}).start()
    try:
        async with httpx.AsyncClient(base_url=router.base_url, timeout=60) as client:
            first = asyncio.create_task(client.post("/v1/completions", headers=auth(KEY_A), json=body(first_tokens)))
            await apoll(lambda: router.inflight("sim-0") + router.inflight("sim-1") == 1, 10, what="the first")
            waiting = asyncio.create_task(client.post("/v1/completions", headers=auth(KEY_A), json=body(4)))
            await apoll(lambda: _waiting(router, "a") == 1, 10, what="the second in the tenant's line")
            yield router, client, first, waiting
    finally:
        router.stop()


def _waiting(router, tenant: str) -> int:
    tenants = httpx.get(router.base_url + "/admin/tenants", headers=auth(ADMIN), timeout=5).json()["tenants"]
    return tenants[tenant]["usage"]["waiting_for_limits"] if tenant in tenants else -1


def _version(router) -> int:
    return httpx.get(router.base_url + "/admin/tenants", headers=auth(ADMIN), timeout=5).json()["version"]


def test_a_request_right_after_a_stream_ends_finds_its_lease_free_on_redis(tmp_path, redis_server):
    """The official SDK sends the next request as soon as it reads
    ``[DONE]``: with ``max_concurrent: 1`` and ``on_limit: reject`` that
    request must not find the stream before it still holding the lease. (On
    Redis the lease used to be released after the last byte: about half of
    such requests got 429.)"""
    t = tmp_path / "tenants.yaml"
    tenants_yaml(t, conc=1)
    settings = {"state": {"backend": "redis", "url": redis_server.url}}
    with RouterProcess(tmp_path / "r", tenants=t, settings=settings) as router, \
            openai.OpenAI(base_url=router.base_url + "/v1", api_key=KEY_A, max_retries=0, timeout=20) as client:
        refused = []
        for i in range(30):
            try:
                if i % 2:
                    stream = client.chat.completions.create(
                        model=MODEL, messages=[{"role": "user", "content": "Le caf"}], max_tokens=4, stream=True,
                        stream_options={"include_usage": True})
                else:
                    stream = client.completions.create(model=MODEL, prompt="Le caf", max_tokens=4, stream=True)
                assert [c for c in stream]
            except openai.RateLimitError as e:
                refused.append((i, e.message))
        assert refused == []


@pytest.mark.parametrize("usage", [False, True], ids=["done", "usage"])
async def test_a_request_right_after_a_stream_ends_finds_its_lease_free_in_memory(tmp_path, usage):
    """The same on the default in-process store, with the async SDK (fast
    enough to send the next request in the loop turn after ``[DONE]``).
    The lease was released by the request's task after the tail went out,
    from the reader's callback: 10-30% of such requests got 429."""
    t = tmp_path / "tenants.yaml"
    tenants_yaml(t, conc=1)
    with RouterProcess(tmp_path / "r", tenants=t) as router:
        async with openai.AsyncOpenAI(base_url=router.base_url + "/v1", api_key=KEY_A, max_retries=0,
                                      timeout=20) as client:
            refused = []
            for i in range(60):
                try:
                    stream = await client.completions.create(
                        model=MODEL, prompt="Le caf", max_tokens=2, stream=True,
                        **({"stream_options": {"include_usage": True}} if usage else {}))
                    assert [c async for c in stream]
                except openai.RateLimitError as e:
                    refused.append((i, e.message))
        assert refused == []


async def test_a_websocket_request_right_after_done_finds_its_lease_free_on_redis(tmp_path, redis_server):
    """The same over ``/v1/ws``: the next request goes as soon as ``done``
    arrives. (With a tokens-per-minute limit the settlement is two round
    trips, settle and release, which the next request's admission overtook.)"""
    t = tmp_path / "tenants.yaml"
    tenants_yaml(t, conc=1, tpm=10**6)
    settings = {"state": {"backend": "redis", "url": redis_server.url}}
    with RouterProcess(tmp_path / "r", tenants=t, settings=settings) as router:
        url = router.base_url.replace("http://", "ws://") + "/v1/ws"
        async with connect(url, additional_headers=auth(KEY_A), proxy=None, open_timeout=10) as ws:
            ends = []
            for i in range(30):
                await ws.send(json.dumps({"type": "chat.completions.create", "id": f"r{i}", "body": {
                    "model": MODEL, "messages": [{"role": "user", "content": "Le caf"}], "max_tokens": 4}}))
                while True:
                    msg = json.loads(await asyncio.wait_for(ws.recv(), 20))
                    if msg.get("done") or "error" in msg:
                        ends.append(msg.get("error", {}).get("code", "done"))
                        break
        assert ends == ["done"] * 30


async def test_two_routers_on_one_redis_admit_exactly_the_limit(tmp_path, redis_server):
    t = tmp_path / "tenants.yaml"
    tenants_yaml(t, rpm=10)
    settings = {"state": {"backend": "redis", "url": redis_server.url}}
    r1 = RouterProcess(tmp_path / "r1", tenants=t, settings=settings).start()
    r2 = RouterProcess(tmp_path / "r2", tenants=t, settings=settings).start()
    try:
        async with httpx.AsyncClient(timeout=30) as client:
            async def one(base):
                r = await client.post(base + "/v1/completions", headers=auth(KEY_A), json=body(2))
                return r.status_code

            codes = await asyncio.gather(*[one(r.base_url) for _ in range(20) for r in (r1, r2)])
        assert codes.count(200) == 10, codes
        assert codes.count(429) == 30
    finally:
        r1.stop()
        r2.stop()


@pytest.mark.parametrize("mode", ["open", "closed"])
async def test_redis_killed_mid_run(tmp_path, redis_server, mode):
    t = tmp_path / "tenants.yaml"
    tenants_yaml(t, rpm=1000)
    settings = {"state": {"backend": "redis", "url": redis_server.url, "on_outage": mode, "timeout": 0.3}}
    router = RouterProcess(tmp_path / "r", tenants=t, settings=settings).start()
    try:
        async with httpx.AsyncClient(base_url=router.base_url, timeout=30) as client:
            assert (await client.post("/v1/completions", headers=auth(KEY_A), json=body(2))).status_code == 200
            redis_server.kill()
            r = await client.post("/v1/completions", headers=auth(KEY_A), json=body(2))
            ready = await client.get("/ready")
            m = await router.ametrics(client)
            assert m.value("fairstream_state_store_up") == 0
            # (the admission's call failed, or a background call found it down
            # first: the lease keeper's look at the store's generation, made
            # idle too, or the policy peers')
            assert m.value("fairstream_state_store_errors_total") >= 1
            if mode == "open":
                assert r.status_code == 200, r.text
                assert ready.status_code == 200 and ready.json()["state_store"]["healthy"] is False
            else:
                assert r.status_code == 503 and r.json()["error"]["code"] == "state_store_unavailable"
                assert ready.status_code == 503
            # logged once per outage, not per request
            for _ in range(3):
                await client.post("/v1/completions", headers=auth(KEY_A), json=body(2))
            assert router.log().count("state store redis unavailable") == 1
            redis_server.restart()
            await apoll(lambda: _store_up(router), 15, what="state store reconnect")
            assert (await client.post("/v1/completions", headers=auth(KEY_A), json=body(2))).status_code == 200
    finally:
        router.stop()


def _store_up(router) -> bool:
    return router.metrics().value("fairstream_state_store_up") == 1


@pytest.mark.parametrize("stream", [False, True])
def test_a_token_id_prompt_the_replica_refuses_takes_no_tokens(tmp_path, stream):
    # A prompt of token ids longer than the model's context is refused by the
    # replica (400 context_length_exceeded) before anything runs. Its ids'
    # count was settled as used all the same (a text prompt's is not): three
    # such mistakes took a tenant's whole tokens_per_minute, and its next
    # valid requests waited (or got 429) for up to a minute.
    t = tmp_path / "tenants.yaml"
    tenants_yaml(t, tpm=20000)
    with RouterProcess(tmp_path / "r", tenants=t) as router:
        url = router.base_url + "/v1/completions"
        long_ids = {"model": MODEL, "prompt": list(range(6000)), "max_tokens": 4, "stream": stream}
        for _ in range(4):  # (6,004 reserved each: four of them, settled as used, are 24,016 of 20,000)
            r = httpx.post(url, headers=auth(KEY_A), json=long_ids, timeout=20)
            assert r.status_code == 400 and r.json()["error"]["code"] == "context_length_exceeded", r.text
            # (its headers showed its reservation taken, though it was given back)
            assert int(r.headers["x-ratelimit-remaining-tokens"]) >= 20000 - 100, r.headers
        r = httpx.post(url, headers=auth(KEY_A), json=body(4), timeout=20)
        assert r.status_code == 200, r.text
        assert int(r.headers["x-ratelimit-remaining-tokens"]) >= 20000 - 100, r.headers


@pytest.mark.parametrize("stream", [False, True])
def test_a_prompt_over_max_prompt_tokens_takes_no_tokens(tmp_path, stream):
    # limits.max_prompt_tokens refuses a prompt on its real count (first
    # delta: 400 prompt_too_long). "A request its limits refuse takes
    # nothing", but its prompt (and first token) was settled as used: four
    # such mistakes took a tenant's whole tokens_per_minute, and its next
    # valid request got a 429 for the better part of a minute.
    t = tmp_path / "tenants.yaml"
    tenants_yaml(t, tpm=3000, extra="")
    doc = yaml.safe_load(t.read_text())
    doc["tenants"]["a"]["limits"]["max_prompt_tokens"] = 100
    t.write_text(yaml.safe_dump(doc, sort_keys=False))
    with RouterProcess(tmp_path / "r", tenants=t) as router:
        url = router.base_url + "/v1/completions"
        long_prompt = {**body(4, stream=stream), "prompt": "Le café " * 100}  # (~900 tokens)
        for _ in range(4):
            r = httpx.post(url, headers=auth(KEY_A), json=long_prompt, timeout=20)
            assert r.status_code == 400 and r.json()["error"]["code"] == "prompt_too_long", r.text
            # (its headers showed its reservation taken, though it was given back)
            assert int(r.headers["x-ratelimit-remaining-tokens"]) >= 3000 - 100, r.headers
        r = httpx.post(url, headers=auth(KEY_A), json=body(4), timeout=20)
        assert r.status_code == 200, r.text
        assert int(r.headers["x-ratelimit-remaining-tokens"]) >= 3000 - 100, r.headers


@pytest.mark.parametrize("stream", [False, True])
def test_max_tokens_over_the_context_is_a_400_before_the_tenants_token_budget(tmp_path, stream):
    # max_tokens=500000 on a model of 2,048 tokens for a tenant of 400,000
    # tokens a minute can never run, whatever the budget: vLLM's 400
    # context_length_exceeded naming max_tokens. It was the budget's 429
    # tokens_exceed_limit ("lower max_tokens"), as the budget was checked first.
    t = tmp_path / "tenants.yaml"
    tenants_yaml(t, tpm=400000)
    with RouterProcess(tmp_path / "r", tenants=t, replicas=1, sim={"max_model_len": 2048}) as router:
        client = openai.OpenAI(base_url=router.base_url + "/v1", api_key=KEY_A, max_retries=0)
        for name in ("max_tokens", "max_completion_tokens"):
            with pytest.raises(openai.BadRequestError) as e:
                client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "hi"}],
                                               stream=stream, **{name: 500000})
            assert (e.value.code, e.value.param) == ("context_length_exceeded", name), e.value
            assert "maximum context length is 2048 tokens" in e.value.message
            assert f"{name}=500000 cannot be greater than max_model_len=2048" in e.value.message
        with pytest.raises(openai.BadRequestError) as e:
            client.completions.create(model=MODEL, prompt="hi", max_tokens=2049, stream=stream)
        assert (e.value.code, e.value.param) == ("context_length_exceeded", "max_tokens"), e.value
        # (nothing was reserved: the tenant's whole budget is left)
        r = httpx.post(router.base_url + "/v1/completions", headers=auth(KEY_A), json=body(4), timeout=20)
        assert r.status_code == 200 and int(r.headers["x-ratelimit-remaining-tokens"]) >= 400000 - 100, r.text


@pytest.mark.parametrize("stream", [False, True])
def test_an_unset_max_tokens_over_the_context_is_lowered_not_refused(tmp_path, stream):
    # default_max_tokens 4096 lowered by the tenant's cap to 1024, on a model
    # of 512 tokens: a request that set no max_tokens gets what the context
    # leaves after its prompt, as from vLLM. It was the router's 400
    # "max_tokens=1024 cannot be greater than max_model_len=512", naming a
    # field the client never sent (and, past the router, the replica's own).
    t = tmp_path / "tenants.yaml"
    tenants_yaml(t, max_tokens=1024)
    with RouterProcess(tmp_path / "r", tenants=t, replicas=1, sim={"max_model_len": 512},
                       settings={"default_max_tokens": 4096}) as router:
        client = openai.OpenAI(base_url=router.base_url + "/v1", api_key=KEY_A, max_retries=0)
        messages = [{"role": "user", "content": "hi"}]
        for extra in ({}, {"min_tokens": 5}):
            out = client.chat.completions.create(model=MODEL, messages=messages, stream=stream,
                                                 extra_body={"ignore_eos": True, **extra},
                                                 **({"stream_options": {"include_usage": True}} if stream else {}))
            usage = [c for c in out if c.usage][-1].usage if stream else out.usage
            assert usage.prompt_tokens + usage.completion_tokens == 512, usage
        # a max_tokens the client set is still refused over the context
        with pytest.raises(openai.BadRequestError) as e:
            client.chat.completions.create(model=MODEL, messages=messages, stream=stream, max_tokens=600)
        assert (e.value.code, e.value.param) == ("context_length_exceeded", "max_tokens"), e.value
