"""What a resume costs a tenant: one request of its ``requests_per_minute``,
and no token of the stream a second time.

A replay of a finished stream generates nothing, but it is a request the
router serves (the whole buffer again, its log line): without a charge a
tenant held to a few requests a minute could replay its streams as fast as
its connections allow (a review: 60 a second from a 60/min tenant, the other
tenants' longest gap between events 17 -> 213 ms).

A stream its client left pays for every token its generation had, those
past its events too; its resume's continuation generates those again and
must not count them again (the count charged is kept with the buffer)."""

from __future__ import annotations

import json
import socket

import httpx
import yaml

from router.auth import hash_key
from tests.helpers import ADMIN, MODEL, RouterProcess, parse_sse, poll

KEY = "resume-limits-tenant"
RPM = 3


def test_resumes_take_from_the_tenants_requests_per_minute(tmp_path) -> None:
    tenants = tmp_path / "tenants.yaml"
    tenants.write_text(yaml.safe_dump({
        "admin_keys": [hash_key(ADMIN)],
        "tenants": {"a": {"keys": [hash_key(KEY)], "on_limit": "reject",
                          "limits": {"requests_per_minute": RPM}}},
    }, sort_keys=False))
    with RouterProcess(tmp_path / "r", replicas=1, tenants=tenants) as router:
        auth = {"Authorization": f"Bearer {KEY}"}
        with httpx.Client(base_url=router.base_url, headers=auth, timeout=20) as http:
            r = http.post("/v1/completions", json={"model": MODEL, "prompt": "Le caf", "max_tokens": 8,
                                                   "stream": True})
            assert r.status_code == 200, r.text
            rid = r.headers["x-request-id"]
            statuses = []
            for _ in range(RPM + 2):
                replay = http.get(f"/v1/streams/{rid}", headers={"Last-Event-ID": "0"})
                statuses.append(replay.status_code)
                if replay.status_code == 429:
                    err = replay.json()["error"]
                    assert err["code"] == "rate_limit_exceeded", err
                    assert float(replay.headers["retry-after"]) > 0, replay.headers
                    assert replay.headers["x-ratelimit-limit-requests"] == str(RPM)
            # the stream took one request; the bucket (3, refilling one per 20 s) has room for two replays
            assert statuses[:RPM - 1] == [200] * (RPM - 1), statuses
            assert statuses[RPM - 1:] == [429] * 3, statuses
            # the POST form of a resume is charged alike
            post = http.post("/v1/completions", json={}, headers={"Last-Event-ID": "0", "X-Resume-Request-Id": rid})
            assert post.status_code == 429, post.text
            limited = router.metrics().value("fairstream_rate_limited_total", tenant="a", limit="requests")
            assert limited == 4, limited


def test_a_stream_left_behind_a_paused_transport_and_resumed_counts_each_token_once(tmp_path) -> None:
    # Its client reads the response head and then nothing: the router's
    # buffers fill, the generation goes on behind the paused transport (its
    # tokens in no event), and send_timeout drops the client. The request
    # counts all the tokens its generation had (a client that never comes
    # back pays for what the replica made); its resume regenerates those
    # past the buffer, and counted them again: 30,000 tokens of usage
    # counted (and charged to the token bucket) as tens of thousands more.
    tenants = tmp_path / "tenants.yaml"
    # (one token per event: 30,000 of them outgrow every buffer on the way;
    # the tokens of a read merged into events of 16 would all fit in them)
    tenants.write_text(yaml.safe_dump({"admin_keys": [hash_key(ADMIN)],
                                       "tenants": {"a": {"keys": [hash_key(KEY)], "chunk_tokens": 1}}},
                                      sort_keys=False))
    sim = {"step_base_ms": 0.0, "step_per_seq_ms": 0.0, "max_model_len": 40000}
    max_tokens = 30000
    with RouterProcess(tmp_path / "r", replicas=1, tenants=tenants, sim=sim,
                       settings={"send_timeout": 1.0}) as router:
        body = json.dumps({"model": MODEL, "prompt": "Le caf", "max_tokens": max_tokens, "stream": True,
                           "temperature": 0, "ignore_eos": True}).encode()
        sock = socket.socket()
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)  # (before connect: a small window)
        try:
            sock.connect(("127.0.0.1", router.port))
            sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer " + KEY.encode()
                         + b"\r\nContent-Type: application/json\r\nContent-Length: " + str(len(body)).encode()
                         + b"\r\n\r\n" + body)
            head = b""
            while b"\r\n\r\n" not in head:  # (the head, then it reads nothing more)
                head += sock.recv(1)
            assert head.startswith(b"HTTP/1.1 200"), head
            rid = next(line.split(b":", 1)[1].strip().decode() for line in head.split(b"\r\n")
                       if line.lower().startswith(b"x-request-id:"))
            first = poll(lambda: [rec for rec in router.records("fairstream.request") if rec["request_id"] == rid],
                         20, what="the dropped request's log line")
        finally:
            sock.close()
        assert first[0]["outcome"] == "cancelled", first
        with httpx.Client(base_url=router.base_url, headers={"Authorization": f"Bearer {KEY}"}, timeout=60) as http:
            r = http.get(f"/v1/streams/{rid}", headers={"Last-Event-ID": "0"})
            assert r.status_code == 200, r.text
            events = parse_sse(r.text)
            assert events[-1].data == "[DONE]", events[-1]
            assert events[-2].json()["choices"][0]["finish_reason"] == "length"
            lines = poll(lambda: (ls := [rec for rec in router.records("fairstream.request")
                                         if rec["request_id"] == rid])[1:] and ls, 20, what="the resume's line")
            counted = router.metrics().value("fairstream_tokens_total", tenant="a", direction="completion")
    assert [rec["endpoint"] for rec in lines] == ["completions", "resume"], lines
    assert lines[1]["stream_completion_tokens"] == max_tokens, lines
    assert sum(rec["completion_tokens"] for rec in lines) == max_tokens, lines
    assert counted == max_tokens, (counted, lines)

