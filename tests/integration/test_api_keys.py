"""Which API keys authenticate, over HTTP (Litestar's routes and the fast
path) and over the WebSocket alike: a key is text, sent in the header as
its UTF-8 bytes (what curl sends, and httpx given bytes) or in the auth
message as JSON text, and hashed as UTF-8 either way; a header that is not
UTF-8 is read as latin-1 (what http.client, requests and browsers send).
Keys with control characters but the tab can be sent in no header, and are
refused on both transports."""

from __future__ import annotations

import asyncio
import hashlib
import json
from pathlib import Path

import httpx
import pytest
from websockets.asyncio.client import connect

from router.auth import hash_key
from tests.helpers import MODEL, RouterProcess, write_tenants

KEY_UNI = "sk-ключ-юникод-0123456789"  # (24 characters or more: its error shows its ends)
# registered as its digest, as `sha256sum` would make it (`fairstream hash-key` refuses it)
KEY_CTL = "sk-control\x01character-key"
WRONG_UNI = "sk-неверный-ключ-0123-вот"
KEY_LATIN = "sk-café-0123456789abcdefghij"
KEY_TAB = "sk-tab\tinside-0123456789abcdef"


@pytest.fixture(scope="module")
def router(tmp_path_factory) -> RouterProcess:
    d: Path = tmp_path_factory.mktemp("keys")
    tenants = d / "tenants.yaml"
    write_tenants(tenants, {"uni": {"keys": [hash_key(KEY_UNI), hashlib.sha256(KEY_CTL.encode()).hexdigest(),
                                             hash_key(KEY_LATIN), hash_key(KEY_TAB)]}})
    r = RouterProcess(d / "r", replicas=1, tenants=tenants, sim={"step_base_ms": 1})
    r.start()
    yield r
    r.stop()


def _auth(key: str) -> dict[str, bytes]:
    return {"Authorization": b"Bearer " + key.encode("utf-8")}  # (httpx sends a str value only if ASCII)


def _chat() -> dict:
    return {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 3}


def test_a_non_ascii_key_sent_as_utf8_authenticates_over_http(router: RouterProcess) -> None:
    with httpx.Client(base_url=router.base_url, timeout=30) as http:
        assert http.get("/v1/models", headers=_auth(KEY_UNI)).status_code == 200  # a Litestar route
        r = http.post("/v1/chat/completions", headers=_auth(KEY_UNI), json=_chat())  # the fast path
        assert r.status_code == 200, r.text
        r = http.post("/v1/completions", headers=_auth(KEY_UNI), json={"model": MODEL, "prompt": "hi", "max_tokens": 3})
        assert r.status_code == 200, r.text


def test_a_wrong_non_ascii_key_is_shown_ungarbled(router: RouterProcess) -> None:
    with httpx.Client(base_url=router.base_url, timeout=30) as http:
        for r in (http.get("/v1/models", headers=_auth(WRONG_UNI)),
                  http.post("/v1/chat/completions", headers=_auth(WRONG_UNI), json=_chat())):
            assert r.status_code == 401, r.text
            assert r.json()["error"]["message"] == "Incorrect API key provided: sk-****-вот.", r.text


def test_a_key_sent_as_latin_1_authenticates_too(router: RouterProcess) -> None:
    # (Python's http.client and requests, browsers' fetch and Node send a
    # header's characters up to U+00FF as latin-1: bytes that are not UTF-8
    # are read so, and the key is the same text as a UTF-8 client's)
    with httpx.Client(base_url=router.base_url, timeout=30) as http:
        latin = {"Authorization": b"Bearer " + KEY_LATIN.encode("latin-1")}
        assert http.get("/v1/models", headers=latin).status_code == 200  # a Litestar route
        r = http.post("/v1/chat/completions", headers=latin, json=_chat())  # the fast path
        assert r.status_code == 200, r.text
        assert http.get("/v1/models", headers=_auth(KEY_LATIN)).status_code == 200  # the same key as UTF-8
        r = http.post("/v1/chat/completions", headers={"Authorization": b"Bearer sk-\xff"}, json=_chat())
        assert r.status_code == 401 and r.json()["error"]["code"] == "invalid_api_key", r.text


def test_a_key_with_a_tab_inside_authenticates(router: RouterProcess) -> None:
    # (a header can carry a tab: RFC 9110 5.5; such a key worked before keys were checked for control characters)
    with httpx.Client(base_url=router.base_url, timeout=30) as http:
        r = http.post("/v1/chat/completions", headers=_auth(KEY_TAB), json=_chat())
        assert r.status_code == 200, r.text
        assert http.get("/v1/models", headers=_auth(KEY_TAB)).status_code == 200


async def _ws_auth(router: RouterProcess, key: str) -> dict:
    url = router.base_url.replace("http://", "ws://") + "/v1/ws"
    async with connect(url, proxy=None, open_timeout=10, close_timeout=5) as ws:
        await ws.send(json.dumps({"type": "auth", "api_key": key}))
        return json.loads(await asyncio.wait_for(ws.recv(), 10))


async def test_the_websocket_takes_the_keys_http_takes(router: RouterProcess) -> None:
    assert await _ws_auth(router, KEY_UNI) == {"type": "auth", "ok": True}
    # spaces around a key are no part of it, as in a header
    assert await _ws_auth(router, f"  {KEY_UNI} ") == {"type": "auth", "ok": True}
    # a key no header can carry does not authenticate here either (it did)
    refused = await _ws_auth(router, KEY_CTL)
    assert refused["error"]["code"] == "invalid_api_key" and "control" in refused["error"]["message"], refused
    with httpx.Client(base_url=router.base_url, timeout=30) as http:
        r = http.get("/v1/models", headers={"Authorization": b"Bearer " + KEY_CTL.encode()})
        assert r.status_code in (400, 401), r.text  # (httptools refuses the byte, or the router the key)
