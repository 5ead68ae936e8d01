"""Browser apps on other origins (router.yaml ``cors``): preflights, and the
CORS headers on the fast path's completion responses (streamed, whole and
errors) as on Litestar's routes; none for an origin not listed, and none at
all when CORS is off."""

from __future__ import annotations

import httpx
import pytest

from tests.helpers import GOLD, MODEL, RouterProcess, parse_sse

APP = "https://chat.example.com"
SHARED_ROUTER = {"settings": {"cors": {"allow_origins": [APP, "https://*.example.org"], "max_age": 120}}}
CHAT = "/v1/chat/completions"


def _body(**kw) -> dict:
    return {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4, **kw}


def _post(router: RouterProcess, origin: str | None, key: str = GOLD, **kw) -> httpx.Response:
    headers = {"authorization": f"Bearer {key}"}
    if origin:
        headers["origin"] = origin
    return httpx.post(router.base_url + CHAT, headers=headers, json=_body(**kw), timeout=30)


def _allows(r: httpx.Response, origin: str) -> None:
    assert r.headers.get("access-control-allow-origin") == origin, dict(r.headers)
    assert "origin" in r.headers.get("vary", "").lower()
    exposed = {h.strip() for h in r.headers["access-control-expose-headers"].split(",")}
    assert {"x-request-id", "retry-after", "x-ratelimit-remaining-tokens"} <= exposed


@pytest.mark.parametrize("origin", [APP, "https://team.example.org"])
def test_preflight_of_a_listed_origin(shared_router: RouterProcess, origin: str) -> None:
    # what a browser sends before the openai SDK's POST (it adds x-stainless-* headers)
    r = httpx.options(shared_router.base_url + CHAT, timeout=10, headers={
        "origin": origin,
        "access-control-request-method": "POST",
        "access-control-request-headers": "authorization, content-type, x-stainless-os",
    })
    assert r.status_code == 204, r.text
    assert r.headers["access-control-allow-origin"] == origin
    allowed = {h.strip().lower() for h in r.headers["access-control-allow-headers"].split(",")}
    assert {"authorization", "content-type", "x-stainless-os"} <= allowed
    assert "POST" in r.headers["access-control-allow-methods"]
    assert r.headers["access-control-max-age"] == "120"


@pytest.mark.parametrize("origin, method, code, says", [
    ("https://evil.example.net", "POST", "cors_origin_not_allowed", "the origin https://evil.example.net is not allowed"),
    ("https://evil.example.net", None, "cors_origin_not_allowed", "the origin https://evil.example.net is not allowed"),
    (APP, "PUT", "cors_method_not_allowed", "the method PUT is not allowed"),
], ids=["origin", "origin, no method", "method"])
def test_a_refused_preflight_gets_an_openai_error(shared_router: RouterProcess, origin: str, method: str | None,
                                                  code: str, says: str) -> None:
    # (Litestar answered them with its plain text "Disallowed CORS Origin")
    headers = {"origin": origin, **({"access-control-request-method": method} if method else {})}
    r = httpx.options(shared_router.base_url + CHAT, timeout=10, headers=headers)
    assert r.status_code == 400, r.text
    assert r.headers["content-type"] == "application/json" and int(r.headers["content-length"]) == len(r.content)
    assert not any(k.startswith("access-control-") for k in r.headers), dict(r.headers)
    assert len(r.headers["x-request-id"]) == 24  # (as every other answer of the API)
    body = r.json()
    assert set(body) == {"error"} and set(body["error"]) == {"message", "type", "param", "code"}, body
    err = body["error"]
    assert (err["type"], err["param"], err["code"]) == ("invalid_request_error", None, code), err
    assert says in err["message"], err


def test_streamed_completion_carries_the_headers(shared_router: RouterProcess) -> None:
    r = _post(shared_router, APP, stream=True)
    assert r.status_code == 200
    _allows(r, APP)
    assert parse_sse(r.text)[-1].data == "[DONE]"


def test_whole_completion_and_errors_carry_the_headers(shared_router: RouterProcess) -> None:
    r = _post(shared_router, APP)
    assert r.status_code == 200 and r.json()["choices"]
    _allows(r, APP)
    # a browser app must be able to read why it was refused
    for r in (_post(shared_router, APP, key="sk-wrong"), _post(shared_router, APP, n=3)):
        assert r.status_code in (400, 401) and r.json()["error"]["message"]
        _allows(r, APP)


def test_litestar_routes_carry_the_headers(shared_router: RouterProcess) -> None:
    r = httpx.get(shared_router.base_url + "/v1/models", timeout=10,
                  headers={"authorization": f"Bearer {GOLD}", "origin": APP})
    assert r.status_code == 200
    _allows(r, APP)


def test_an_origin_not_listed_gets_no_allow_origin(shared_router: RouterProcess) -> None:
    for stream in (False, True):
        r = _post(shared_router, "https://evil.example.net", stream=stream)
        assert r.status_code == 200  # the server answers; the browser hides it from that page
        assert "access-control-allow-origin" not in r.headers


def test_cors_is_off_by_default(router: RouterProcess) -> None:
    for stream in (False, True):
        r = _post(router, APP, stream=stream)
        assert r.status_code == 200
        assert not any(k.startswith("access-control-") for k in r.headers), dict(r.headers)
    r = httpx.options(router.base_url + CHAT, timeout=10,
                      headers={"origin": APP, "access-control-request-method": "POST"})
    assert "access-control-allow-origin" not in r.headers
