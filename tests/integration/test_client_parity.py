"""What the openai SDKs, curl and httpx found through a real router:

* a non-streamed request that fails after its generation started (a total
  timeout, a generation lost) carries its ``x-request-id`` and the
  ``x-ratelimit-*`` headers of its admission, as every other answer does;
  a total timeout says ``x-should-retry: false`` (the SDK sends it once);
* ``OPTIONS`` answers carry an ``x-request-id``; ``HEAD`` works on the GET
  routes that only read (a resume's is a 405: its GET runs a generation);
* bodies vLLM's server takes: a UTF-8 BOM, whole numbers written as floats;
  one 400 naming the field for an unpaired surrogate escape; a sim replica
  refuses token ids outside its vocabulary as vLLM does.
"""

from __future__ import annotations

import asyncio
import json
import signal
from pathlib import Path

import httpx
import openai
import pytest
import yaml

from router.auth import hash_key
from tests.helpers import ADMIN, GOLD, MODEL, RouterProcess, apoll

KEY = "parity-tenant-key"
LIMITS = {"requests_per_minute": 1000, "tokens_per_minute": 1_000_000}
CHAT_BODY = {"model": MODEL, "messages": [{"role": "user", "content": "hello"}]}
PATHS = {"chat": ("/v1/chat/completions", CHAT_BODY), "completions": ("/v1/completions", {"model": MODEL,
                                                                                          "prompt": "hello"})}


def tenants(path: Path, timeouts: dict[str, float] | None = None) -> Path:
    doc = {"admin_keys": [hash_key(ADMIN)],
           "tenants": {"t": {"keys": [hash_key(KEY)], "limits": LIMITS, "timeouts": timeouts or {}}}}
    path.write_text(yaml.safe_dump(doc, sort_keys=False))
    return path


def admitted_headers(r: httpx.Response) -> None:
    """The headers every answer to an admitted request carries."""
    assert len(r.headers.get("x-request-id", "")) == 24, dict(r.headers)
    assert r.headers["x-ratelimit-limit-requests"] == "1000", dict(r.headers)
    assert "x-ratelimit-remaining-tokens" in r.headers, dict(r.headers)


# -- errors after the generation started -------------------------------------------------


@pytest.mark.parametrize("endpoint", ["chat", "completions"])
async def test_a_non_streamed_total_timeout_has_its_headers_and_says_not_to_retry(make_router, tmp_path,
                                                                                  endpoint) -> None:
    # 300 tokens at >= 20 ms a step: >= 6 s of generation against a 1.5 s limit
    router = make_router(replicas=1, tenants=tenants(tmp_path / "t.yaml", {"total": 1.5}),
                         sim={"step_base_ms": 20})
    path, body = PATHS[endpoint]
    async with httpx.AsyncClient(base_url=router.base_url, timeout=20,
                                 headers={"authorization": f"Bearer {KEY}"}) as http:
        r = await http.post(path, json={**body, "max_tokens": 300, "ignore_eos": True})
        assert r.status_code == 504, r.text
        assert r.json()["error"]["code"] == "total_timeout"
        admitted_headers(r)
        assert r.headers["x-should-retry"] == "false"
    # the SDK (2 retries by default) sends it once
    async with openai.AsyncOpenAI(base_url=router.base_url + "/v1", api_key=KEY, timeout=20) as client:
        with pytest.raises(openai.APIStatusError) as info:
            await client.chat.completions.create(model=MODEL, messages=CHAT_BODY["messages"], max_tokens=300,
                                                 extra_body={"ignore_eos": True})
    assert info.value.status_code == 504 and info.value.request_id
    m = await router.ametrics()
    assert m.value("fairstream_requests_total", tenant="t", outcome="timeout_total") == 2


async def test_a_non_streamed_generation_lost_after_its_first_token_has_its_headers(make_router, tmp_path) -> None:
    router = make_router(replicas=1, tenants=tenants(tmp_path / "t.yaml"), sim={"step_base_ms": 20},
                         settings={"failover_wait": 0})
    async with httpx.AsyncClient(base_url=router.base_url, timeout=30,
                                 headers={"authorization": f"Bearer {KEY}"}) as http:
        task = asyncio.create_task(http.post("/v1/completions", json={
            "model": MODEL, "prompt": "The ", "max_tokens": 1000, "ignore_eos": True}))

        async def producing() -> bool:
            m = await router.ametrics(http)
            return m.value("fairstream_replica_inflight_requests", 0.0, replica="sim-0") >= 1

        await apoll(producing, 10, what="the request to run")
        await asyncio.sleep(0.5)  # (its first tokens came: 20 ms a step)
        router.kill_replica("sim-0", signal.SIGKILL)
        r = await asyncio.wait_for(task, 15)
    assert r.status_code == 500, r.text
    err = r.json()["error"]
    assert err["code"] == "stream_lost" and "could not be resumed" in err["message"], err
    admitted_headers(r)
    router.wait_ready(15)


# -- OPTIONS and HEAD ----------------------------------------------------------------------


PREFLIGHT = {"origin": "https://app.example.com", "access-control-request-method": "POST"}


@pytest.mark.parametrize("headers", [{}, PREFLIGHT], ids=["plain", "preflight"])
def test_options_answers_carry_a_request_id(shared_router: RouterProcess, headers) -> None:
    r = httpx.options(shared_router.base_url + "/v1/chat/completions", headers=headers, timeout=10)
    assert r.status_code == 204, r.text
    assert len(r.headers.get("x-request-id", "")) == 24, dict(r.headers)


def test_head_on_the_get_routes(shared_router: RouterProcess) -> None:
    admin = {"authorization": f"Bearer {ADMIN}"}
    for path, headers in (("/v1/models", {"authorization": f"Bearer {GOLD}"}), ("/admin/tenants", admin),
                          ("/admin/replicas", admin)):
        get = httpx.get(shared_router.base_url + path, headers=headers, timeout=10)
        head = httpx.head(shared_router.base_url + path, headers=headers, timeout=10)
        assert (head.status_code, head.content) == (200, b""), (path, head.status_code)
        assert head.headers["content-type"] == get.headers["content-type"], path
    # a resume's GET admits and runs a generation: no HEAD there, and the GET's message says why
    r = httpx.head(shared_router.base_url + "/v1/streams/abc", headers={"authorization": f"Bearer {GOLD}"},
                   timeout=10)
    assert r.status_code == 405 and len(r.headers["x-request-id"]) == 24, dict(r.headers)


# -- parsing as vLLM's server parses -----------------------------------------------------------


def _post(router: RouterProcess, path: str, content: bytes) -> httpx.Response:
    return httpx.post(router.base_url + path, content=content, timeout=30,
                      headers={"authorization": f"Bearer {GOLD}", "content-type": "application/json"})


def test_a_body_with_a_utf8_bom_is_taken(shared_router: RouterProcess) -> None:
    body = json.dumps({**CHAT_BODY, "max_tokens": 3}).encode()
    r = _post(shared_router, "/v1/chat/completions", b"\xef\xbb\xbf" + body)
    assert r.status_code == 200, r.text
    assert r.json()["usage"]["completion_tokens"] <= 3


@pytest.mark.parametrize("text, tokens", [("3.0", 3), ("1e1", 10), ("4.00", 4)])
def test_integer_fields_take_whole_numbers_written_as_floats(shared_router: RouterProcess, text, tokens) -> None:
    body = json.dumps({**CHAT_BODY, "seed": 7, "ignore_eos": True, "max_tokens": 0})
    r = _post(shared_router, "/v1/chat/completions", body.replace('"max_tokens": 0', f'"max_tokens": {text}')
              .replace('"seed": 7', '"seed": 7.0').encode())
    assert r.status_code == 200, r.text
    assert r.json()["usage"]["completion_tokens"] == tokens


@pytest.mark.parametrize("field, value, param", [("max_tokens", "3.5", "max_tokens"),
                                                 ("stop_token_ids", "[1, 2.5]", "stop_token_ids[1]")])
def test_a_fractional_number_in_an_integer_field_is_a_precise_400(shared_router: RouterProcess, field, value,
                                                                   param) -> None:
    body = json.dumps({**CHAT_BODY, field: None}).replace(f'"{field}": null', f'"{field}": {value}')
    r = _post(shared_router, "/v1/chat/completions", body.encode())
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["param"] == param, err
    assert err["message"] == f"Invalid value for '{param}': a number with a fractional part is not an integer.", err


@pytest.mark.parametrize("content", ["hi \\ud83d", "\\ud83d hi", "\\ude00", "x\\ud83d\\u0041"])
def test_an_unpaired_surrogate_escape_is_one_400_naming_its_field(shared_router: RouterProcess, content) -> None:
    body = '{"model": "%s", "messages": [{"role": "user", "content": "%s"}], "max_tokens": 3}' % (MODEL, content)
    r = _post(shared_router, "/v1/chat/completions", body.encode())
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert (err["code"], err["param"]) == ("invalid_json", "messages[0].content"), err
    escape = "\\ude00" if content == "\\ude00" else "\\ud83d"
    assert err["message"].startswith(f"The request body is not valid JSON: 'messages[0].content' holds the unpaired "
                                     f"UTF-16 surrogate escape {escape}, which encodes no character"), err


@pytest.mark.parametrize("tail, param", [('}], "metadata": {"\\ud83d": "x"}}', "metadata.\\ud83d"),
                                         (', "\\ud83d": 1}]}', "messages[0].\\ud83d")])
def test_a_key_holding_an_unpaired_surrogate_escape_is_a_400_naming_it(shared_router: RouterProcess, tail,
                                                                       param) -> None:
    # (the key itself was the param: no UTF-8 for it, so a text/plain 500)
    body = '{"model": "%s", "messages": [{"role": "user", "content": "hi"%s' % (MODEL, tail)
    r = _post(shared_router, "/v1/chat/completions", body.encode())
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert (err["code"], err["param"]) == ("invalid_json", param), err
    assert err["message"].startswith(f"The request body is not valid JSON: '{param}' holds the unpaired "), err


def test_an_escaped_backslash_before_u_is_text(shared_router: RouterProcess) -> None:
    body = '{"model": "%s", "messages": [{"role": "user", "content": "a \\\\ud83d"}], "max_tokens": 2}' % MODEL
    assert _post(shared_router, "/v1/chat/completions", body.encode()).status_code == 200


@pytest.mark.parametrize("token", [4294967295, 258])
def test_token_ids_outside_the_sim_vocabulary_are_refused_as_vllm_refuses_them(shared_router: RouterProcess,
                                                                                token) -> None:
    body = json.dumps({"model": MODEL, "prompt": [1, token, 2], "max_tokens": 3}).encode()
    r = _post(shared_router, "/v1/completions", body)
    assert r.status_code == 400, r.text
    assert r.json()["error"]["message"] == f"Token id {token} is out of vocabulary", r.json()
    # the largest id of the vocabulary is taken
    ok = _post(shared_router, "/v1/completions",
               json.dumps({"model": MODEL, "prompt": [1, 257], "max_tokens": 3}).encode())
    assert ok.status_code == 200, ok.text
