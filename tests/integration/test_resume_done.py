"""A stream's ``[DONE]`` carries an ``id:``, and a resume at that id is a 204
No Content, charged nothing.

A browser's EventSource (and npm ``eventsource``) does not know that
``[DONE]`` ends an OpenAI stream: when the response ends it reconnects, every
3 s, with the last id it had. ``[DONE]`` had none, so that was the finish's
(or usage event's), and each reconnect was answered 200 with ``[DONE]``
again and took a request of the tenant's ``requests_per_minute``, for good
(a tenant of 6 a minute lost them all in 18 s). The SSE spec's way to stop
a reconnecting client is an answer other than 200: a client that has
``[DONE]`` now says so by its id and gets a 204; one that missed it resumes
from the event before and gets it."""

from __future__ import annotations

import json

import httpx
import pytest
from websockets.sync.client import connect

from router.auth import hash_key
from tests.helpers import MODEL, RouterProcess, parse_sse, write_tenants

KEY = "resume-done-tenant"
RPM = 3


@pytest.fixture
def limited_router(tmp_path):
    tenants = tmp_path / "tenants.yaml"
    write_tenants(tenants, {"a": {"keys": [hash_key(KEY)], "on_limit": "reject",
                                  "limits": {"requests_per_minute": RPM}}})
    with RouterProcess(tmp_path / "r", replicas=1, tenants=tenants) as router:
        yield router


@pytest.mark.parametrize("usage", [False, True], ids=["no-usage", "usage"])
def test_a_resume_at_the_done_id_is_a_204_charged_nothing(limited_router: RouterProcess, usage: bool) -> None:
    auth = {"Authorization": f"Bearer {KEY}"}
    with httpx.Client(base_url=limited_router.base_url, headers=auth, timeout=20) as http:
        body = {"model": MODEL, "prompt": "Le caf", "max_tokens": 8, "stream": True,
                **({"stream_options": {"include_usage": True}} if usage else {})}
        r = http.post("/v1/completions", json=body)
        assert r.status_code == 200, r.text
        rid, events = r.headers["x-request-id"], parse_sse(r.text)
        done, before = events[-1], events[-2]
        # [DONE] is numbered next to the event before it (which ends in -1, or -2 with usage)
        assert done.data == "[DONE]" and done.id == str(int(before.id.split("-")[0]) + 1), r.text
        assert before.id.endswith("-2" if usage else "-1"), before.id
        # an EventSource that had it all reconnects with its id, over and over: each a 204,
        # none taking a request (the stream took one of RPM)
        for path, headers in [(f"/v1/streams/{rid}", {"Last-Event-ID": done.id}),
                              (f"/v1/streams/{rid}?last_event_id={done.id}", {})] * RPM:
            again = http.get(path, headers=headers)
            assert again.status_code == 204 and again.content == b"", (again.status_code, again.text)
            assert again.headers["x-request-id"] == rid
        post = http.post("/v1/completions", json={}, headers={"Last-Event-ID": done.id, "X-Resume-Request-Id": rid})
        assert post.status_code == 204, post.text
        # a client that missed [DONE] gets it, with its id, from the event before
        missed = http.get(f"/v1/streams/{rid}", headers={"Last-Event-ID": before.id})
        assert missed.status_code == 200 and parse_sse(missed.text) == [done], missed.text
        # that took one request (RPM - 1 left: one more), and nothing else did
        assert http.get(f"/v1/streams/{rid}", headers={"Last-Event-ID": "0"}).status_code == 200
        assert http.get(f"/v1/streams/{rid}", headers={"Last-Event-ID": "0"}).status_code == 429
        # past [DONE], an id no event has: a 400 naming the last one
        past = http.get(f"/v1/streams/{rid}", headers={"Last-Event-ID": str(int(done.id) + 1)})
        assert past.status_code in (400, 429), past.text
        # another tenant's stream at its [DONE] id is not found, not a 204
        other = http.get(f"/v1/streams/{rid}", headers={"Last-Event-ID": done.id,
                                                         "Authorization": "Bearer fs-demo-gold"})
        assert other.status_code == 401 or other.status_code == 404, other.text


def test_the_openai_sdk_reads_a_stream_whose_done_has_an_id(shared_router: RouterProcess) -> None:
    import openai

    client = openai.OpenAI(base_url=shared_router.base_url + "/v1", api_key="fs-demo-gold")
    chunks = list(client.chat.completions.create(model=MODEL, max_tokens=5, stream=True,
                                                 messages=[{"role": "user", "content": "hi"}]))
    assert chunks and chunks[-1].choices[0].finish_reason == "length", chunks


def test_a_websocket_resume_at_the_done_id_is_told_done(shared_router: RouterProcess) -> None:
    r = httpx.post(shared_router.base_url + "/v1/completions", headers={"Authorization": "Bearer fs-demo-gold"},
                   json={"model": MODEL, "prompt": "Le caf", "max_tokens": 4, "stream": True}, timeout=20)
    rid, done = r.headers["x-request-id"], parse_sse(r.text)[-1]
    url = shared_router.base_url.replace("http", "ws") + "/v1/ws"
    with connect(url, additional_headers={"Authorization": "Bearer fs-demo-gold"}) as ws:
        ws.send(json.dumps({"id": "r1", "type": "resume", "stream": rid, "last_event_id": done.id}))
        assert json.loads(ws.recv(timeout=10)) == {"id": "r1", "done": True}
