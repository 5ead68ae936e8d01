"""Refusals made for a library, in OpenAI's error shape: the CORS preflights
Litestar would refuse (``router.cors.preflight_refusal``, which must refuse
exactly those) and the WebSocket handshakes websockets refuses
(``router.handshake``)."""

from __future__ import annotations

import json

import pytest
from litestar import Litestar, post
from litestar.testing import TestClient
from websockets.datastructures import Headers
from websockets.http11 import Request

from router.cors import CorsSettings, cors_config, preflight_refusal
from router.handshake import Handshake, refusal_body

ORIGINS = ["https://chat.example.com", "https://*.example.org"]
PREFLIGHTS = [
    ("https://chat.example.com", "POST"),
    ("https://chat.example.com", None),
    ("https://team.example.org", "GET"),
    ("https://evil.example.net", "POST"),
    ("https://evil.example.net", None),
    ("https://chat.example.com", "PUT"),
    ("https://chat.example.com", "post"),  # (Litestar compares methods as they are sent)
    ("https://evil.example.net", "DELETE"),
    ("null", "POST"),
]


@post("/v1/chat/completions")
async def _chat() -> None:
    return None


@pytest.mark.parametrize("origins", [ORIGINS, ["*"]], ids=["listed", "any"])
def test_preflight_refusal_refuses_what_litestars_cors_middleware_refuses(origins: list[str]) -> None:
    # (the fast path answers these refusals in Litestar's place: the two must
    # not disagree, whatever a Litestar upgrade changes)
    config = cors_config(CorsSettings(allow_origins=origins))
    assert config is not None
    with TestClient(Litestar([_chat], cors_config=config)) as client:
        for origin, method in PREFLIGHTS:
            headers = {"origin": origin, **({"access-control-request-method": method} if method else {})}
            litestar = client.options("/v1/chat/completions", headers=headers)
            ours = preflight_refusal(config, [(k.encode(), v.encode()) for k, v in headers.items()])
            assert (ours is None) == (litestar.status_code == 204), (origin, method, litestar.text, ours)
            if ours is not None:
                assert ours.status == litestar.status_code == 400


def test_preflight_refusal_says_why() -> None:
    config = cors_config(CorsSettings(allow_origins=ORIGINS))
    assert config is not None
    both = preflight_refusal(config, [(b"origin", b"https://evil.example.net"),
                                      (b"access-control-request-method", b"PUT")])
    assert both is not None and both.code == "cors_origin_not_allowed"
    assert "origin https://evil.example.net" in both.message and "method PUT" in both.message
    method = preflight_refusal(config, [(b"origin", ORIGINS[0].encode()), (b"access-control-request-method", b"PUT")])
    assert method is not None and method.code == "cors_method_not_allowed"
    assert preflight_refusal(config, [(b"access-control-request-method", b"PUT")]) is None  # (no Origin: no preflight)
    long = preflight_refusal(config, [(b"origin", b"https://" + b"x" * 100_000)])
    assert long is not None and len(long.message) < 300  # (a client's value is clipped)


def _refused(raw_headers: list[tuple[str, str]]) -> tuple[int, dict, dict]:
    """websockets' answer (status, headers, error) to a handshake request."""
    response = Handshake().accept(Request("/v1/ws", Headers(raw_headers)))
    headers = {k.lower(): v for k, v in response.headers.raw_items()}
    return response.status_code, headers, json.loads(response.body)["error"]


def test_handshake_refusals_are_openai_errors_with_websockets_status_and_reason() -> None:
    upgrade = [("Host", "x"), ("Upgrade", "websocket"), ("Connection", "Upgrade")]
    status, headers, err = _refused([*upgrade, ("Sec-WebSocket-Version", "13")])
    assert status == 400 and headers["content-type"] == "application/json"
    assert headers["connection"] == "close"
    assert err == {"message": "Failed to open a WebSocket connection: missing Sec-WebSocket-Key header.",
                   "type": "invalid_request_error", "param": None, "code": "invalid_websocket_handshake"}
    status, headers, err = _refused([("Host", "x"), ("Sec-WebSocket-Key", "dGhlIHNhbXBsZSBub25jZQ=="),
                                     ("Sec-WebSocket-Version", "13")])
    assert status == 426 and headers["upgrade"] == "websocket"  # (what websockets adds to its refusal stays)
    assert "Connection header" in err["message"] and "\n" not in err["message"]
    good = Handshake().accept(Request("/v1/ws", Headers([*upgrade, ("Sec-WebSocket-Key", "dGhlIHNhbXBsZSBub25jZQ=="),
                                                         ("Sec-WebSocket-Version", "13")])))
    assert good.status_code == 101


@pytest.mark.parametrize("status, text, type_, code", [
    (403, "", "invalid_request_error", "forbidden"),  # uvicorn: the app closed the socket before accepting it
    (500, "Internal Server Error", "server_error", None),  # uvicorn: the app failed before accepting it
    (500, "", "server_error", None),
])
def test_refusal_body_of_uvicorns_own_refusals(status: int, text: str, type_: str, code: str | None) -> None:
    err = json.loads(refusal_body(status, text))["error"]
    assert (err["type"], err["param"], err["code"]) == (type_, None, code) and err["message"], err
    long = json.loads(refusal_body(400, "x" * 70_000))["error"]  # (websockets' reason echoes header values)
    assert len(long["message"]) < 400
