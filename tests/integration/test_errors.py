"""Bad requests get OpenAI-shaped errors with the right status and the field named;
health, readiness and metrics endpoints; failures stay isolated from healthy streams."""

from __future__ import annotations

import asyncio
import contextlib
import gzip
import json
import socket
import time
import zlib
from typing import Any

import httpx
import openai
import pytest

from tests.helpers import ADMIN, GOLD, MODEL, RouterProcess, aiter_sse, poll

MAX_BODY = 64 * 1024
SHARED_ROUTER = {"settings": {"max_body_bytes": MAX_BODY}}
AUTH = {"authorization": f"Bearer {GOLD}"}
CHAT = "/v1/chat/completions"
COMPLETIONS = "/v1/completions"
CONTEXT_MESSAGE = "maximum context length is 4096 tokens"  # SimConfig.max_model_len default


def chat_body(**kw: Any) -> dict[str, Any]:
    return {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4, **kw}


def post(router: RouterProcess, path: str, *, headers: dict[str, str] | None = AUTH, **kw: Any) -> httpx.Response:
    return httpx.post(router.base_url + path, headers=headers, timeout=30, **kw)


def error_of(r: httpx.Response, status: int) -> dict[str, Any]:
    """The ``error`` object of an OpenAI-shaped error response with ``status``."""
    assert r.status_code == status, (r.status_code, r.text)
    assert r.headers["content-type"].startswith("application/json")
    body = r.json()
    assert set(body) == {"error"}, body
    err = body["error"]
    assert set(err) >= {"message", "type", "param", "code"}, err
    assert isinstance(err["message"], str) and err["message"]
    return err


@pytest.fixture(scope="module")
def client(shared_router: RouterProcess):
    with openai.OpenAI(base_url=shared_router.base_url + "/v1", api_key=GOLD, max_retries=0, timeout=30) as c:
        yield c


# -- request validation ---------------------------------------------------------


@pytest.mark.parametrize("path", [CHAT, COMPLETIONS])
def test_bad_json(shared_router: RouterProcess, path: str) -> None:
    err = error_of(post(shared_router, path, content=b'{"model": "x",'), 400)
    assert err["type"] == "invalid_request_error"
    assert err["code"] == "invalid_json"


def test_empty_body(shared_router: RouterProcess) -> None:
    err = error_of(post(shared_router, CHAT, content=b""), 400)
    assert err["type"] == "invalid_request_error"
    assert err["code"] == "invalid_json"  # (as for any body that is not a JSON object)


def test_json_that_is_not_an_object(shared_router: RouterProcess) -> None:
    err = error_of(post(shared_router, CHAT, content=b"[1, 2]"), 400)
    assert "None" not in err["message"]
    assert "object" in err["message"]


@pytest.mark.parametrize(
    ("body", "param"),
    [
        (chat_body(bogus=1), "bogus"),
        (chat_body(stream_options={"include_usage": True, "bogus": 1}), "stream_options.bogus"),
    ],
)
def test_unknown_field_is_named(shared_router: RouterProcess, body: dict, param: str) -> None:
    err = error_of(post(shared_router, CHAT, json=body), 400)
    assert err["param"] == param
    assert param in err["message"]


def test_n_above_one_is_rejected(shared_router: RouterProcess) -> None:
    err = error_of(post(shared_router, CHAT, json=chat_body(n=2)), 400)
    assert err["param"] == "n"
    # n=1 is the neutral value: accepted
    assert post(shared_router, CHAT, json=chat_body(n=1)).status_code == 200


def test_n_below_one_and_a_bad_metadata_value_are_invalid_values_named(shared_router: RouterProcess) -> None:
    # (n 0 was "'n' is not supported"; a bad metadata value was named `metadata[...]`)
    err = error_of(post(shared_router, CHAT, json=chat_body(n=0)), 400)
    assert err["param"] == "n" and err["code"] is None and err["message"] == "'n' must be at least 1; got 0.", err
    err = error_of(post(shared_router, CHAT, json=chat_body(metadata={"ok": "x", "a": 1})), 400)
    assert err["param"] == "metadata.a" and "metadata.a" in err["message"], err


@pytest.mark.parametrize(
    ("path", "body", "param"),
    [
        (CHAT, chat_body(max_tokens="ten"), "max_tokens"),
        (CHAT, chat_body(messages="hi"), "messages"),
        (CHAT, chat_body(messages=[{"role": "user", "content": 5}]), "messages[0].content"),
        (CHAT, chat_body(stream="yes"), "stream"),
        (COMPLETIONS, {"model": MODEL, "prompt": "x", "temperature": "hot"}, "temperature"),
        (COMPLETIONS, {"model": MODEL, "prompt": "x", "stop": 3}, "stop"),
        (COMPLETIONS, {"model": 7, "prompt": "x"}, "model"),
    ],
)
def test_wrong_type_names_the_field(shared_router: RouterProcess, path: str, body: dict, param: str) -> None:
    err = error_of(post(shared_router, path, json=body), 400)
    assert err["param"] == param
    assert param in err["message"]


@pytest.mark.parametrize(
    ("body", "param"),
    [
        ({"model": MODEL, "prompt": "x", "temperature": 5}, "temperature"),
        ({"model": MODEL, "prompt": "x", "max_tokens": 0}, "max_tokens"),
        ({"model": MODEL}, "prompt"),
        ({"model": MODEL, "prompt": []}, "prompt"),
    ],
)
def test_bad_value_names_the_field(shared_router: RouterProcess, body: dict, param: str) -> None:
    err = error_of(post(shared_router, COMPLETIONS, json=body), 400)
    assert err["param"] == param


BIG = 2**64  # one past what the replica protocol (msgpack) can carry


@pytest.mark.parametrize(("path", "body", "param"), [
    (CHAT, chat_body(seed=BIG), "seed"),
    (CHAT, chat_body(top_k=-BIG), "top_k"),
    (CHAT, chat_body(max_tokens=BIG), "max_tokens"),
    (CHAT, chat_body(stop_token_ids=[1, BIG]), "stop_token_ids[1]"),
    (COMPLETIONS, {"model": MODEL, "prompt": [1, BIG], "max_tokens": 4}, "prompt"),
])
def test_integers_too_large_for_the_replica_protocol_are_400_and_leave_nothing_behind(
        shared_router: RouterProcess, path: str, body: dict, param: str) -> None:
    # (they were a 500 after dispatch, and each one kept a replica slot for
    # good: a few dozen locked every tenant out)
    for _ in range(3):
        assert error_of(post(shared_router, path, json=body), 400)["param"] == param
    m = shared_router.metrics()
    assert all(m.value("fairstream_replica_inflight_requests", replica=n) == 0 for n in shared_router.replica_names)
    assert post(shared_router, CHAT, json=chat_body()).status_code == 200


def test_json_nested_too_deeply_is_400(shared_router: RouterProcess) -> None:
    body = chat_body()
    raw = json.dumps(body)[:-1] + ', "prediction": ' + '{"a":' * 5000 + "1" + "}" * 5000 + "}"
    err = error_of(post(shared_router, CHAT, content=raw, headers={**AUTH, "content-type": "application/json"}), 400)
    assert err["code"] == "invalid_json" and "nested too deeply" in err["message"]


@pytest.mark.parametrize("role", ["system", "developer", "user", "tool"])
def test_message_without_content_is_400(shared_router: RouterProcess, role: str) -> None:
    messages = [{"role": "user", "content": "hi"}, {"role": role}]
    err = error_of(post(shared_router, CHAT, json=chat_body(messages=messages)), 400)
    assert err["param"] == "messages[1].content"
    assert "messages[1].content" in err["message"]


@pytest.mark.parametrize("part, param, says", [
    ({"type": "text"}, "messages[0].content[1].text", "Missing required parameter"),
    ({"type": "image_url", "image_url": {"url": "http://x"}}, "messages[0].content[1].type", "'image_url'"),
])
def test_bad_content_part_names_what_is_wrong(shared_router: RouterProcess, part: dict, param: str, says: str) -> None:
    messages = [{"role": "user", "content": [{"type": "text", "text": "hi"}, part]}]
    err = error_of(post(shared_router, CHAT, json=chat_body(messages=messages)), 400)
    assert err["param"] == param and says in err["message"], err


def test_content_parts_of_text_are_joined(shared_router: RouterProcess) -> None:
    messages = [{"role": "user", "content": [{"type": "text", "text": "hi"}, {"type": "text", "text": " there"}]}]
    assert post(shared_router, CHAT, json=chat_body(messages=messages)).status_code == 200


def test_stream_options_need_stream(shared_router: RouterProcess) -> None:
    body = chat_body(stream_options={"include_usage": True})
    assert error_of(post(shared_router, CHAT, json=body), 400)["param"] == "stream_options"
    assert error_of(post(shared_router, CHAT, json={**body, "stream": False}), 400)["param"] == "stream_options"


def test_empty_prompt_is_400(shared_router: RouterProcess) -> None:
    err = error_of(post(shared_router, COMPLETIONS, json={"model": MODEL, "prompt": "", "max_tokens": 2}), 400)
    assert err["param"] == "prompt"


def test_assistant_turn_may_have_no_content(shared_router: RouterProcess) -> None:
    messages = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": None},
                {"role": "user", "content": "again"}]
    assert post(shared_router, CHAT, json=chat_body(messages=messages)).status_code == 200


def test_unknown_model_is_404(shared_router: RouterProcess) -> None:
    err = error_of(post(shared_router, CHAT, json=chat_body(model="gpt-nope")), 404)
    assert err["code"] == "model_not_found"
    assert err["param"] == "model"
    assert "gpt-nope" in err["message"]


@pytest.mark.parametrize("stream", [False, True])
def test_prompt_longer_than_the_context_is_400(shared_router: RouterProcess, stream: bool) -> None:
    body = {"model": MODEL, "prompt": "x" * 5000, "max_tokens": 16, "stream": stream}
    err = error_of(post(shared_router, COMPLETIONS, json=body), 400)
    assert CONTEXT_MESSAGE in err["message"]
    assert err["type"] == "invalid_request_error"
    # OpenAI's code, which clients look for to shorten the conversation (it was null)
    assert (err["code"], err["param"]) == ("context_length_exceeded", "prompt"), err
    err = error_of(post(shared_router, CHAT, json=chat_body(messages=[{"role": "user", "content": "x" * 5000}],
                                                            stream=stream)), 400)
    assert CONTEXT_MESSAGE in err["message"]
    assert (err["code"], err["param"]) == ("context_length_exceeded", "messages"), err


def test_max_tokens_is_lowered_to_what_the_context_leaves_not_a_400(make_router) -> None:
    # vLLM's OpenAI server takes an unset max_tokens as the context's
    # remainder. The router's default (256 for a chat, 16 for a completion)
    # is lowered by the replica to what the prompt leaves; it was a 400
    # quoting tokens the client never asked for.
    router = make_router(replicas=1, sim={"max_model_len": 512})
    for path, body in ((CHAT, {"messages": [{"role": "user", "content": "x" * 400}]}),  # (+ the chat template's)
                       (COMPLETIONS, {"prompt": "x" * 500})):
        r = post(router, path, json={"model": MODEL, "ignore_eos": True, **body})
        assert r.status_code == 200, r.text
        usage, choice = r.json()["usage"], r.json()["choices"][0]
        assert usage["prompt_tokens"] + usage["completion_tokens"] == 512, usage
        assert choice["finish_reason"] == "length"
        # the client's own max_tokens too, as vLLM 0.32 does; over the whole context it is a 400
        r = post(router, path, json={"model": MODEL, "max_tokens": 100, "ignore_eos": True, **body})
        assert r.status_code == 200 and sum(r.json()["usage"][k] for k in ("prompt_tokens", "completion_tokens")) \
            == 512, r.text
        err = error_of(post(router, path, json={"model": MODEL, "max_tokens": 513, **body}), 400)
        assert "maximum context length is 512 tokens" in err["message"]


def test_a_completion_without_max_tokens_gets_16_as_openai_and_vllm_give(shared_router: RouterProcess) -> None:
    r = post(shared_router, COMPLETIONS, json={"model": MODEL, "prompt": "hi", "ignore_eos": True})
    assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 16, r.text
    r = post(shared_router, CHAT, json={**chat_body(ignore_eos=True), "max_tokens": None})
    assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 256, r.text  # (default_max_tokens)


def _client_errors(router: RouterProcess) -> float:
    return router.metrics().value("fairstream_requests_total", 0.0, tenant="gold", endpoint="completions",
                                  outcome="client_error")


def test_body_over_the_limit_is_413(shared_router: RouterProcess) -> None:
    before = _client_errors(shared_router)
    body = {"model": MODEL, "prompt": "x" * (MAX_BODY + 10)}
    err = error_of(post(shared_router, COMPLETIONS, json=body), 413)
    assert err["type"] == "invalid_request_error"
    assert _client_errors(shared_router) == before + 1  # (counted and logged as the tenant's: it was neither)


def test_chunked_body_over_the_limit_is_413(shared_router: RouterProcess) -> None:
    """Without a Content-Length the limit must hold while the body streams in."""

    def chunks():
        yield b'{"model": "fairstream-sim", "prompt": "'
        for _ in range(MAX_BODY // 4096 + 2):
            yield b"x" * 4096
        yield b'"}'

    before = _client_errors(shared_router)
    error_of(post(shared_router, COMPLETIONS, content=chunks()), 413)
    assert _client_errors(shared_router) == before + 1


def _head_only(router: RouterProcess, head: str) -> tuple[bytes, bool]:
    """Send a request head that announces a body (``Expect: 100-continue``)
    and no body; return what the router answers and whether it then closed
    the connection (rather than waiting for the body)."""
    sock = socket.create_connection(("127.0.0.1", router.port), timeout=10)
    try:
        sock.sendall(head.encode())
        answer = b""
        while b"\r\n\r\n" not in answer:
            answer += sock.recv(65536)
        head_part, _, rest = answer.partition(b"\r\n\r\n")
        length = int(next(line.split(b":")[1] for line in head_part.split(b"\r\n")
                          if line.lower().startswith(b"content-length:")))
        while len(rest) < length:
            rest += sock.recv(65536)
        try:
            closed = sock.recv(1) == b""
        except ConnectionResetError:
            closed = True
        return head_part + b"\r\n\r\n" + rest, closed
    finally:
        sock.close()


@pytest.mark.parametrize("key, status", [(None, 401), (GOLD, 413)], ids=["no-key", "over-the-limit"])
def test_a_refused_body_is_neither_asked_for_nor_read(shared_router: RouterProcess, key: str | None,
                                                      status: int) -> None:
    # A request without a key, or announcing a body over max_body_bytes, is
    # refused before its body is read: no "100 Continue", and the connection
    # is closed after the refusal. Before, the router answered 100 Continue,
    # read the body (200 MB from a client with no key) and kept the
    # connection open.
    auth = f"Authorization: Bearer {key}\r\n" if key else ""
    size = 200_000_000 if key is None else MAX_BODY + 1
    answer, closed = _head_only(shared_router, f"POST {COMPLETIONS} HTTP/1.1\r\nHost: x\r\n{auth}"
                                               f"Content-Type: application/json\r\nContent-Length: {size}\r\n"
                                               "Expect: 100-continue\r\n\r\n")
    assert answer.startswith(b"HTTP/1.1 %d " % status), answer[:200]
    assert b"100 Continue" not in answer and b"connection: close" in answer.lower(), answer[:400]
    assert closed, "the connection stayed open"
    body = json.loads(answer.partition(b"\r\n\r\n")[2])
    assert body["error"]["code"] == ("request_too_large" if key else "missing_api_key"), body


@pytest.mark.parametrize("path", [COMPLETIONS + "/", "/admin/reload"])
def test_a_refusal_on_the_other_routes_does_not_read_the_body_either(shared_router: RouterProcess,
                                                                      path: str) -> None:
    # (the Litestar routes: a trailing-slash completion, admin calls. Their
    # 401 came with the connection kept alive, so uvicorn read the rest of
    # the body, however long, to find the next request)
    answer, closed = _head_only(shared_router, f"POST {path} HTTP/1.1\r\nHost: x\r\n"
                                               "Content-Type: application/json\r\nContent-Length: 200000000\r\n"
                                               "Expect: 100-continue\r\n\r\n")
    assert answer.startswith(b"HTTP/1.1 401 "), answer[:200]
    assert b"100 Continue" not in answer and b"connection: close" in answer.lower(), answer[:400]
    assert closed, "the connection stayed open"


def test_a_trailing_slash_path_takes_compressed_bodies_and_the_size_limit(shared_router: RouterProcess) -> None:
    # /v1/chat/completions/ is served by the Litestar route, not the fast
    # path: it ignored Content-Encoding (a gzip body was "not valid JSON")
    raw = json.dumps(chat_body()).encode()
    r = post(shared_router, CHAT + "/", content=gzip.compress(raw),
             headers={**AUTH, "content-type": "application/json", "content-encoding": "gzip"})
    assert r.status_code == 200, r.text
    assert r.json()["usage"]["completion_tokens"] == 4
    body = {"model": MODEL, "prompt": "x" * (MAX_BODY + 10)}
    assert error_of(post(shared_router, COMPLETIONS + "/", json=body), 413)["code"] == "request_too_large"


def test_body_just_under_the_limit_is_accepted(shared_router: RouterProcess) -> None:
    # A long but legal body: 413 must not trigger early. 3000 prompt tokens fit the context.
    body = {"model": MODEL, "prompt": "x" * 3000, "max_tokens": 2, "user": "u" * (MAX_BODY - 3200)}
    r = post(shared_router, COMPLETIONS, json=body)
    assert r.status_code == 200, r.text


@pytest.mark.parametrize("coding", ["gzip", "deflate", "deflate-raw"])
def test_compressed_bodies_are_decoded(shared_router: RouterProcess, coding: str) -> None:
    raw = json.dumps(chat_body()).encode()
    if coding == "gzip":
        data = gzip.compress(raw)
    else:
        c = zlib.compressobj(wbits=zlib.MAX_WBITS if coding == "deflate" else -zlib.MAX_WBITS)
        data = c.compress(raw) + c.flush()
    r = post(shared_router, CHAT, content=data,
             headers={**AUTH, "content-type": "application/json", "content-encoding": coding.split("-")[0]})
    assert r.status_code == 200, r.text
    assert r.json()["usage"]["completion_tokens"] == 4


def test_bad_compressed_bodies(shared_router: RouterProcess) -> None:
    def send(data: bytes, coding: str) -> httpx.Response:
        return post(shared_router, CHAT, content=data,
                    headers={**AUTH, "content-type": "application/json", "content-encoding": coding})

    raw = json.dumps(chat_body()).encode()
    err = error_of(send(raw, "br"), 415)
    assert err["code"] == "unsupported_content_encoding" and "'br'" in err["message"]
    assert error_of(send(raw, "gzip"), 400)["code"] == "invalid_body"  # not gzip data at all
    assert "truncated" in error_of(send(gzip.compress(raw)[:-12], "gzip"), 400)["message"]
    # a small body that inflates past max_body_bytes
    assert error_of(send(gzip.compress(b" " * (MAX_BODY + 1)), "gzip"), 413)["code"] == "request_too_large"
    assert send(raw, "identity").status_code == 200
    # gzip members one after another make one body; data after a deflate stream is refused
    half = len(raw) // 2
    assert send(gzip.compress(raw[:half]) + gzip.compress(raw[half:]), "gzip").status_code == 200
    c = zlib.compressobj()
    assert error_of(send(c.compress(raw) + c.flush() + b"junk", "deflate"), 400)["code"] == "invalid_body"
    # thousands of empty members would cost the event loop seconds: a few are taken, not more
    many = gzip.compress(raw) + gzip.compress(b"") * 2000
    assert error_of(send(many, "gzip"), 400)["code"] == "invalid_body"
    # the key is checked first: nobody without one makes the router inflate anything
    r = post(shared_router, CHAT, content=gzip.compress(b" " * (MAX_BODY + 1)),
             headers={"authorization": "Bearer nope", "content-encoding": "gzip"})
    error_of(r, 401)
    # a refused body is logged and counted like any bad request (it has a request id)
    assert send(raw, "br").headers.get("x-request-id")


# -- authentication -------------------------------------------------------------


@pytest.mark.parametrize("path", [CHAT, COMPLETIONS])
def test_missing_key_is_401(shared_router: RouterProcess, path: str) -> None:
    err = error_of(post(shared_router, path, headers=None, json=chat_body()), 401)
    assert err["type"] == "invalid_request_error"


@pytest.mark.parametrize("header", ["Bearer sk-not-a-key-1234", "Bearer", "Basic Zm9vOmJhcg==", GOLD])
def test_bad_key_is_401(shared_router: RouterProcess, header: str) -> None:
    err = error_of(post(shared_router, CHAT, headers={"authorization": header}, json=chat_body()), 401)
    assert "sk-not-a-key-1234" not in err["message"], "the key must not be echoed back"


def test_models_needs_a_key(shared_router: RouterProcess) -> None:
    error_of(httpx.get(shared_router.base_url + "/v1/models", timeout=10), 401)


def test_admin_key_cannot_call_inference(shared_router: RouterProcess) -> None:
    error_of(post(shared_router, CHAT, headers={"authorization": f"Bearer {ADMIN}"}, json=chat_body()), 403)


def test_unknown_path_and_method(shared_router: RouterProcess) -> None:
    error_of(httpx.get(shared_router.base_url + "/v1/nothing", headers=AUTH, timeout=10), 404)
    error_of(httpx.get(shared_router.base_url + COMPLETIONS, headers=AUTH, timeout=10), 405)
    # the WebSocket endpoint without an upgrade (README, the WebSocket entry, says so)
    err = error_of(httpx.get(shared_router.base_url + "/v1/ws", headers=AUTH, timeout=10), 405)
    assert err["message"].startswith("/v1/ws takes WebSocket connections only"), err  # (not "Method GET ...")


def test_errors_echo_a_header_or_path_clipped(shared_router: RouterProcess) -> None:
    """A value the client sent, echoed in an error, is clipped as a model
    name is: a 40 KB Content-Encoding or path came back whole."""
    junk = "x" * 40_000
    r = post(shared_router, CHAT, headers={**AUTH, "content-type": "application/json", "content-encoding": junk},
             json=chat_body())
    err = error_of(r, 415)
    assert len(err["message"]) < 400 and "(40002 characters)" in err["message"], err["message"][:200]
    err = error_of(httpx.get(shared_router.base_url + "/" + junk, headers=AUTH, timeout=10), 404)
    assert len(err["message"]) < 400 and "(40001 characters)" in err["message"], err["message"][:200]


@pytest.mark.parametrize("path", ["/health", "/ready", "/metrics", "/v1/models", f"/v1/models/{MODEL}"])
def test_head_answers_like_get_without_a_body(shared_router: RouterProcess, path: str) -> None:
    """(load balancers' health checks use HEAD)"""
    get = httpx.get(shared_router.base_url + path, headers=AUTH, timeout=10)
    head = httpx.head(shared_router.base_url + path, headers=AUTH, timeout=10)
    assert head.status_code == get.status_code == 200
    assert head.content == b"" and head.headers["content-type"] == get.headers["content-type"]
    # and the server is fine afterwards: the same connection serves the next request
    with httpx.Client(base_url=shared_router.base_url, headers=AUTH, timeout=10) as c:
        assert c.head(path).status_code == 200 and c.get("/health").status_code == 200


# -- the same through the SDK ----------------------------------------------------


def test_sdk_authentication_error(shared_router: RouterProcess) -> None:
    with openai.OpenAI(base_url=shared_router.base_url + "/v1", api_key="sk-wrong", max_retries=0) as c:
        with pytest.raises(openai.AuthenticationError) as e:
            c.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "x"}])
    assert e.value.status_code == 401


def test_sdk_permission_denied_for_admin_key(shared_router: RouterProcess) -> None:
    with openai.OpenAI(base_url=shared_router.base_url + "/v1", api_key=ADMIN, max_retries=0) as c:
        with pytest.raises(openai.PermissionDeniedError):
            c.completions.create(model=MODEL, prompt="x")


@pytest.mark.parametrize("stream", [False, True])
def test_sdk_bad_request_error(client: openai.OpenAI, stream: bool) -> None:
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "x"}], n=2, stream=stream)
    assert e.value.param == "n"
    with pytest.raises(openai.BadRequestError) as e:
        client.completions.create(model=MODEL, prompt="x" * 5000, stream=stream)
    assert CONTEXT_MESSAGE in e.value.message and e.value.code == "context_length_exceeded"


def test_sdk_not_found_error(client: openai.OpenAI) -> None:
    with pytest.raises(openai.NotFoundError) as e:
        client.chat.completions.create(model="no-such-model", messages=[{"role": "user", "content": "x"}])
    assert e.value.code == "model_not_found"


def test_sdk_retrieves_a_model(client: openai.OpenAI) -> None:
    m = client.models.retrieve(MODEL)
    assert (m.id, m.object) == (MODEL, "model")
    # ids may contain slashes (org/name): still one model, here an unknown one
    with pytest.raises(openai.NotFoundError) as e:
        client.models.retrieve("org/no-such-model")
    assert e.value.code == "model_not_found"
    assert "org/no-such-model" in e.value.message


def test_model_needs_a_key(shared_router: RouterProcess) -> None:
    error_of(httpx.get(shared_router.base_url + f"/v1/models/{MODEL}", timeout=10), 401)


def test_sdk_unknown_argument(client: openai.OpenAI) -> None:
    with pytest.raises(openai.BadRequestError) as e:
        client.completions.create(model=MODEL, prompt="x", extra_body={"frobnicate": True})
    assert e.value.param == "frobnicate"


# -- health, readiness, metrics -----------------------------------------------------


def test_health(shared_router: RouterProcess) -> None:
    r = httpx.get(shared_router.base_url + "/health", timeout=5)
    assert r.status_code == 200
    assert r.json()["status"] == "ok"


def test_ready_lists_the_replicas(shared_router: RouterProcess) -> None:
    r = httpx.get(shared_router.base_url + "/ready", timeout=5)
    assert r.status_code == 200
    body = r.json()
    assert body["ready"] is True
    assert body["replicas"] == {"sim-0": "ready", "sim-1": "ready"}


def test_metrics_can_require_the_admin_key(make_router) -> None:
    router = make_router(replicas=1, settings={"metrics_require_admin_key": True})
    url = router.base_url + "/metrics"
    error_of(httpx.get(url, timeout=10), 401)
    error_of(httpx.get(url, headers=AUTH, timeout=10), 403)  # a tenant's key
    r = httpx.get(url, headers={"authorization": f"Bearer {ADMIN}"}, timeout=10)
    assert r.status_code == 200 and "fairstream_requests_total" in r.text


def test_metrics_after_traffic(shared_router: RouterProcess, client: openai.OpenAI) -> None:
    before = shared_router.metrics()
    ok0 = before.value("fairstream_requests_total", 0.0, tenant="gold", outcome="ok")
    bad0 = before.value("fairstream_requests_total", 0.0, tenant="gold", outcome="client_error")
    with client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "x"}], max_tokens=40, stream=True,
        extra_body={"ignore_eos": True},
    ) as s:
        for _ in s:
            pass
    with pytest.raises(openai.BadRequestError):
        client.completions.create(model=MODEL, prompt="x", n=3)
    after = shared_router.metrics()
    assert "text/plain" in httpx.get(shared_router.base_url + "/metrics").headers["content-type"]
    assert after.value("fairstream_requests_total", tenant="gold", outcome="ok") == ok0 + 1
    assert after.value("fairstream_requests_total", tenant="gold", outcome="client_error") == bad0 + 1
    assert after.value("fairstream_time_to_first_token_seconds_count", tenant="gold") >= 1
    # 40 tokens need at least 3 events (at most chunk_tokens per event): >= 2 gaps
    assert after.value("fairstream_inter_token_latency_seconds_count", tenant="gold") >= 2
    assert after.value("fairstream_tokens_total", tenant="gold", direction="completion") >= 40
    for name in ("sim-0", "sim-1"):
        assert after.value("fairstream_replica_up", replica=name) == 1
    # the streams are over: nothing is left in flight, by the router's count and the replicas' reports
    # (a report lags by its interval)
    def idle():
        m = shared_router.metrics()
        return all(m.value("fairstream_replica_running_requests", replica=n) == 0
                   and m.value("fairstream_replica_inflight_requests", replica=n) == 0 for n in ("sim-0", "sim-1"))
    poll(idle, 10, what="no request left in flight")


# -- isolation -------------------------------------------------------------------


async def test_failed_requests_do_not_break_a_concurrent_stream(shared_router: RouterProcess) -> None:
    base = shared_router.base_url
    body = {"model": MODEL, "prompt": "Le caf", "max_tokens": 200, "temperature": 0, "ignore_eos": True}
    async with httpx.AsyncClient(base_url=base, headers=AUTH, timeout=30) as http:
        reference = (await http.post(COMPLETIONS, json=body)).json()["choices"][0]["text"]

        async def healthy_stream() -> tuple[str, str | None]:
            text, finish = [], None
            async with http.stream("POST", COMPLETIONS, json={**body, "stream": True}) as r:
                assert r.status_code == 200
                async for ev in aiter_sse(r):
                    if ev.data == "[DONE]":
                        break
                    choice = ev.json()["choices"][0]
                    text.append(choice["text"])
                    finish = choice["finish_reason"] or finish
            return "".join(text), finish

        async def abandoned_stream() -> None:
            async with http.stream("POST", COMPLETIONS, json={**body, "stream": True}) as r:
                async for _ in r.aiter_lines():
                    break  # leave after the first line: the client disconnects

        async def failures() -> list[int]:
            statuses = []
            for _ in range(3):
                for kw in (
                    {"content": b"{not json"},
                    {"json": {**body, "model": "missing"}},
                    {"json": {**body, "prompt": "x" * 5000}},
                    {"json": {**body, "prompt": "x" * (MAX_BODY + 1)}},
                    {"json": {**body, "n": 2}},
                    {"json": body, "headers": {"authorization": "Bearer nope"}},
                ):
                    statuses.append((await http.post(COMPLETIONS, **kw)).status_code)
                await abandoned_stream()
            return statuses

        stream_task = asyncio.create_task(healthy_stream())
        statuses = await failures()
        text, finish = await asyncio.wait_for(stream_task, 30)
    assert sorted(set(statuses)) == [400, 401, 404, 413]
    assert finish == "length"
    assert text == reference
    assert (await shared_router.ametrics()).value("fairstream_streams_lost_total") == 0


# -- connections that never finish a request ------------------------------------------------


def _raw(router: RouterProcess) -> socket.socket:
    return socket.create_connection(("127.0.0.1", router.port), timeout=10)


def _answer(sock) -> bytes:
    """What the router sent before closing the connection."""
    out = b""
    while chunk := sock.recv(65536):
        out += chunk
    return out


def test_connections_that_do_not_finish_their_request_in_time_are_closed(tmp_path) -> None:
    # (uvicorn sets no limit on a request's head: an idle or trickling
    # connection was held for good, and 20,000 of them took every fd)
    settings = {"header_timeout": 1.0, "body_timeout": 1.0}
    with RouterProcess(tmp_path / "r", replicas=1, settings=settings, sim={"step_base_ms": 10}) as router:
        idle = _raw(router)  # sends nothing at all
        trickle = _raw(router)  # a slowloris: a header byte now and then
        trickle.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\n")
        body = _raw(router)  # a head, then less body than it announced
        body.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer " + GOLD.encode()
                     + b"\r\nContent-Type: application/json\r\nContent-Length: 100\r\n\r\n{\"model\"")
        for _ in range(3):
            trickle.sendall(b"X")
            time.sleep(0.3)
        for sock, says, code in ((idle, b"request head", b"header_timeout"),
                                 (trickle, b"request head", b"header_timeout"),
                                 (body, b"request body", b"body_timeout")):
            answer = _answer(sock)
            assert answer.startswith(b"HTTP/1.1 408 ") and says in answer, answer
            # in OpenAI's error shape, as every other error (it was plain text)
            assert b"content-type: application/json" in answer and b'"code":"%s"' % code in answer, answer
            sock.close()
        big = _raw(router)
        big.sendall(b"GET /health HTTP/1.1\r\nHost: x\r\nX-Big: " + b"a" * 70000 + b"\r\n\r\n")
        answer = _answer(big)
        assert answer.startswith(b"HTTP/1.1 431 ") and b'"code":"header_too_large"' in answer, answer
        big.close()
        # a stream that outlasts both limits is not cut (they end with its request's body)
        r = httpx.post(router.base_url + CHAT, headers=AUTH, timeout=30,
                       json=chat_body(max_tokens=200, stream=True, ignore_eos=True))
        assert r.status_code == 200 and r.text.rstrip().endswith("data: [DONE]")
        assert r.elapsed.total_seconds() > 1.0


def test_a_trickled_body_gets_a_408_by_body_total_timeout_and_a_slow_steady_one_is_served(tmp_path) -> None:
    # body_timeout counts between two reads only: a body trickled a byte a
    # second was never answered (500 such connections, all open 35 s on)
    settings = {"body_timeout": 1.0, "body_total_timeout": 4.0}
    with RouterProcess(tmp_path / "r", replicas=1, settings=settings, sim={"step_base_ms": 1}) as router:
        def head(length: int) -> bytes:
            return (b"POST " + CHAT.encode() + b" HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer " + GOLD.encode()
                    + b"\r\nContent-Type: application/json\r\nContent-Length: %d\r\n\r\n" % length)

        # an honest large body over a slow, steady link: ~330 KB (JSON's own
        # whitespace, a prompt any tenant may send) in 2 s, past body_timeout
        # in all, within the total
        body = b"{" + b" " * 330_000 + json.dumps(chat_body(max_tokens=3)).encode()[1:]
        honest = _raw(router)
        honest.sendall(head(len(body)))
        for i in range(0, len(body), len(body) // 20 + 1):
            time.sleep(0.1)
            honest.sendall(body[i:i + len(body) // 20 + 1])

        slow = _raw(router)
        slow.sendall(head(1000) + b'{"model"')
        slow.settimeout(0.3)
        t0, answer = time.monotonic(), b""
        while not answer and time.monotonic() - t0 < 10:
            with contextlib.suppress(OSError):
                slow.sendall(b" ")  # (whitespace: JSON that is never done)
            with contextlib.suppress(TimeoutError):
                answer = slow.recv(65536)
        took = time.monotonic() - t0
        slow.settimeout(10)
        answer += _answer(slow)
        slow.close()
        assert answer.startswith(b"HTTP/1.1 408 ") and b"request body" in answer, answer
        assert b"content-type: application/json" in answer and b'"code":"body_timeout"' in answer, answer
        assert 3.5 <= took < 5.5, took  # (4 s from its head; each byte came well within body_timeout)

        honest.settimeout(30)
        reply = _answer_one(honest)
        honest.close()
        assert reply.startswith(b"HTTP/1.1 200 "), reply[:300]
        assert router.metrics().value("fairstream_http_connections_refused_total", reason="body_timeout") == 1


def _answer_one(sock) -> bytes:
    """One content-length response (the connection stays open after it)."""
    out = b""
    while b"\r\n\r\n" not in out:
        out += sock.recv(65536)
    head, _, rest = out.partition(b"\r\n\r\n")
    length = int(next(ln.split(b":")[1] for ln in head.split(b"\r\n") if ln.lower().startswith(b"content-length:")))
    while len(rest) < length:
        rest += sock.recv(65536)
    return out


def test_an_http_1_0_client_gets_its_stream_unchunked_and_closed(shared_router: RouterProcess) -> None:
    # HTTP/1.0 has no chunked encoding (RFC 9112 forbids Transfer-Encoding in
    # a response to it): the events as they are, ended by the connection's
    # close. It got a chunked body, which it would read with the chunk sizes
    # mixed into the events.
    body = json.dumps(chat_body(max_tokens=5, stream=True)).encode()
    sock = _raw(shared_router)
    sock.sendall(b"POST " + CHAT.encode() + b" HTTP/1.0\r\nAuthorization: Bearer " + GOLD.encode()
                 + b"\r\nContent-Type: application/json\r\nContent-Length: " + str(len(body)).encode()
                 + b"\r\n\r\n" + body)
    answer = _answer(sock)  # (returns once the router closed the connection)
    sock.close()
    head, _, events = answer.partition(b"\r\n\r\n")
    assert head.startswith(b"HTTP/1.1 200") and b"text/event-stream" in head, head
    assert b"transfer-encoding" not in head.lower() and b"connection: close" in head.lower(), head
    role, _, numbered = events.partition(b"\n\n")  # (the role-only chunk, an event without an id, first)
    assert role.startswith(b"data: {") and b'"role":"assistant"' in role, events
    assert numbered.startswith(b"id: 1") and events.endswith(b"data: [DONE]\n\n"), events
    texts = [json.loads(line[6:])["choices"][0]["delta"].get("content", "")
             for line in events.split(b"\n") if line.startswith(b"data: {")]
    assert len("".join(texts)) > 0
    # its resume too (a Litestar stream, which uvicorn chunked whatever the version)
    rid = next(line.split(b": ", 1)[1] for line in head.split(b"\r\n") if line.lower().startswith(b"x-request-id"))
    first_id = numbered.split(b"\n", 1)[0][4:]
    sock = _raw(shared_router)
    sock.sendall(b"GET /v1/streams/" + rid + b" HTTP/1.0\r\nAuthorization: Bearer " + GOLD.encode()
                 + b"\r\nLast-Event-ID: " + first_id + b"\r\n\r\n")
    answer = _answer(sock)
    sock.close()
    head, _, rest = answer.partition(b"\r\n\r\n")
    assert head.startswith(b"HTTP/1.1 200") and b"text/event-stream" in head, head
    assert b"transfer-encoding" not in head.lower() and b"connection: close" in head.lower(), head
    assert rest == numbered.split(b"\n\n", 1)[1], rest


@pytest.mark.parametrize("method, path", [("POST", CHAT), ("POST", CHAT + "/"), ("GET", "/v1/models"),
                                          ("GET", "/admin/tenants")])
@pytest.mark.parametrize("order", ["bad first", "good first"])
def test_more_than_one_authorization_header_is_refused_on_every_route(shared_router: RouterProcess, method: str,
                                                                       path: str, order: str) -> None:
    # (the fast path used the last header, the Litestar routes the first:
    # behind a gateway that adds its own without removing the client's,
    # the key a request ran under depended on its route)
    good = ADMIN if path.startswith("/admin") else GOLD
    values = ["Bearer not-a-key", f"Bearer {good}"]
    if order == "good first":
        values.reverse()
    headers = [("authorization", v) for v in values] + [("content-type", "application/json")]
    r = httpx.request(method, shared_router.base_url + path, headers=headers, timeout=30,
                      content=json.dumps(chat_body()) if method == "POST" else None)
    err = error_of(r, 401)
    assert "more than one Authorization header" in err["message"], err


@pytest.mark.parametrize("path", ["/" + CHAT, "/v1//chat/completions", "/v1/completions//"])
def test_doubled_slashes_reach_the_completion(shared_router: RouterProcess, path: str) -> None:
    # (Litestar's router squeezes them and took it to the resume route:
    # a 400 about Last-Event-ID the client never sent)
    body = chat_body() if "chat" in path else {"model": MODEL, "prompt": "hi", "max_tokens": 4}
    r = post(shared_router, path, json=body)
    assert r.status_code == 200, r.text
    assert r.json()["usage"]["completion_tokens"] == 4


@pytest.mark.parametrize("request_bytes", [
    b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Length: 4\r\nTransfer-Encoding: chunked\r\n\r\n0\r\n\r\n",
    b"GET /v1/models HTTP/1.1\r\nHost: x\r\nX-A: a\x00b\r\n\r\n",
], ids=["length and chunked", "NUL in a header"])
def test_bytes_that_are_not_http_get_an_openai_error(shared_router: RouterProcess, request_bytes: bytes) -> None:
    # (uvicorn answered them with its plain text "Invalid HTTP request received.")
    with socket.create_connection(("127.0.0.1", shared_router.port), timeout=10) as s:
        s.sendall(request_bytes)
        answer = b""
        while chunk := s.recv(65536):
            answer += chunk
    head, _, body = answer.partition(b"\r\n\r\n")
    assert head.startswith(b"HTTP/1.1 400 ") and b"application/json" in head.lower(), answer[:300]
    err = json.loads(body)["error"]
    assert err["code"] == "invalid_http_request" and err["type"] == "invalid_request_error", err


@pytest.mark.parametrize("key, status", [(None, 401), ("wrong-key", 401), (GOLD, 413)],
                         ids=["no-key", "wrong-key", "over-the-limit"])
def test_a_client_that_writes_its_whole_body_first_reads_the_early_refusal_not_a_reset(
        shared_router: RouterProcess, key: str | None, status: int) -> None:
    # Most clients (the async openai SDK, httpx.AsyncClient) write the whole
    # request before they read. A refusal answered before the body is read
    # (no key, a wrong key, a body over max_body_bytes) was followed by a
    # plain close with the body's bytes unread or still arriving: the socket
    # was reset, and the client saw a connection error (which the SDK
    # retries) instead of its 401 or 413.
    body = json.dumps(chat_body(messages=[{"role": "user", "content": "a" * 4_000_000}])).encode()
    auth = f"Authorization: Bearer {key}\r\n" if key else ""
    head = (f"POST {CHAT} HTTP/1.1\r\nHost: x\r\n{auth}Content-Type: application/json\r\n"
            f"Content-Length: {len(body)}\r\n\r\n").encode()
    for _ in range(3):
        sock = socket.create_connection(("127.0.0.1", shared_router.port), timeout=10)
        try:
            try:
                sock.sendall(head + body)
            except (BrokenPipeError, ConnectionResetError) as e:
                raise AssertionError(f"the router reset the connection while the body was sent: {e!r}") from e
            answer = b""
            try:
                while chunk := sock.recv(65536):
                    answer += chunk
            except ConnectionResetError as e:
                raise AssertionError(f"the answer was lost to a reset (got {answer[:100]!r})") from e
        finally:
            sock.close()
        assert answer.startswith(b"HTTP/1.1 %d " % status), answer[:200]
        assert json.loads(answer.partition(b"\r\n\r\n")[2])["error"]["message"]


@pytest.mark.parametrize("path, extra", [("/admin/reload", ""), (CHAT + "/", ""), ("/v1/embeddings", ""),
                                          (CHAT, "X-Resume-Request-Id: abc\r\nLast-Event-ID: 1\r\n")],
                         ids=["admin", "trailing-slash", "unknown-path", "resume-post"])
def test_an_early_refusal_on_the_other_routes_is_read_not_reset_either(shared_router: RouterProcess, path: str,
                                                                        extra: str) -> None:
    # (the Litestar routes: their 401 or 404, answered before the body is
    # read, was followed by a reset under a client still sending it)
    body = b"{" + b"a" * 4_000_000
    head = (f"POST {path} HTTP/1.1\r\nHost: x\r\n{extra}Content-Type: application/json\r\n"
            f"Content-Length: {len(body)}\r\n\r\n").encode()
    sock = socket.create_connection(("127.0.0.1", shared_router.port), timeout=10)
    try:
        try:
            sock.sendall(head + body)
            answer = b""
            while chunk := sock.recv(65536):
                answer += chunk
        except (BrokenPipeError, ConnectionResetError) as e:
            raise AssertionError(f"the router reset the connection: {e!r}") from e
    finally:
        sock.close()
    assert answer.startswith((b"HTTP/1.1 401 ", b"HTTP/1.1 404 ")), answer[:200]
    assert b"connection: close" in answer.lower(), answer[:400]
    assert json.loads(answer.partition(b"\r\n\r\n")[2])["error"]["message"]


def test_an_early_refusal_of_a_head_request_with_a_body_has_no_content(shared_router: RouterProcess) -> None:
    # (answered before its body was read, it was written with its JSON body:
    # RFC 9110 9.3.2, a HEAD response has none, as uvicorn sends it)
    sock = socket.create_connection(("127.0.0.1", shared_router.port), timeout=10)
    try:
        sock.sendall(f"HEAD {CHAT} HTTP/1.1\r\nHost: x\r\nContent-Length: 100\r\n\r\n".encode())
        answer = b""
        while chunk := sock.recv(65536):
            answer += chunk
    finally:
        sock.close()
    head, _, rest = answer.partition(b"\r\n\r\n")
    assert head.startswith(b"HTTP/1.1 405 "), answer[:200]
    assert rest == b"", answer
