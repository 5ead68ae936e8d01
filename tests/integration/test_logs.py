"""Structured JSON logs: a summary line per request, keyed by the response's
x-request-id; prompts and completions only for tenants with log_content."""

from __future__ import annotations

import json

import httpx
import yaml

from router.auth import hash_key
from tests.helpers import DEMO_TENANTS, GOLD, MODEL, RouterProcess, poll

CHATTY = "chatty-tenant-key"
SECRET_PROMPT = "my very private prompt 4711"


def test_request_log_lines(tmp_path):
    tenants = yaml.safe_load(DEMO_TENANTS.read_text())
    tenants["tenants"]["chatty"] = {"keys": [hash_key(CHATTY)], "log_content": True}
    tenants["tenants"]["typo"] = {"keys": [hash_key("typo-key")], "models": [MODEL, "no-such-model"]}
    (tmp_path / "tenants.yaml").write_text(yaml.safe_dump(tenants))
    with RouterProcess(tmp_path / "r", tenants=tmp_path / "tenants.yaml") as router:
        url = router.base_url + "/v1/completions"
        # ignore_eos: with sampling the sim may end early, and the test counts 8 tokens
        body = {"model": MODEL, "prompt": SECRET_PROMPT, "max_tokens": 8, "ignore_eos": True}
        quiet = httpx.post(url, headers={"Authorization": f"Bearer {GOLD}", "X-Request-Id": "gw-trace-7"}, json=body,
                           timeout=20)
        loud = httpx.post(url, headers={"Authorization": f"Bearer {CHATTY}"}, json=body, timeout=20)
        bad = httpx.post(url, headers={"Authorization": f"Bearer {GOLD}"}, json={**body, "n": 3}, timeout=20)
        assert quiet.status_code == loud.status_code == 200 and bad.status_code == 400
        rid = quiet.headers["x-request-id"]
        assert bad.headers["x-request-id"]

        lines = poll(lambda: len(recs := router.records("fairstream.request")) >= 3 and recs, 10, what="log lines")
        by_id = {rec["request_id"]: rec for rec in lines}
        rec = by_id[rid]
        assert rec["tenant"] == "gold" and rec["outcome"] == "ok" and rec["level"] == "info"
        assert rec["client_request_id"] == "gw-trace-7" and rid != "gw-trace-7"  # the caller's id, beside ours
        # a trailing slash takes the same path (it went through a drifted copy that dropped the caller's id)
        slash = httpx.post(url + "/", headers={"Authorization": f"Bearer {GOLD}", "X-Request-Id": "gw-trace-8"},
                           json=body, timeout=20)
        assert slash.status_code == 200, slash.text
        rec8 = poll(lambda: next((r for r in router.records("fairstream.request")
                                  if r["request_id"] == slash.headers["x-request-id"]), None), 10, what="its line")
        assert rec8["client_request_id"] == "gw-trace-8" and rec8["completion_tokens"] == 8, rec8
        assert rec["completion_tokens"] == 8 and rec["prompt_tokens"] > 0 and rec["replica"].startswith("sim-")
        assert "prompt" not in rec and "completion" not in rec
        refused = by_id[bad.headers["x-request-id"]]
        assert refused["outcome"] == "client_error" and refused["status"] == 400, refused
        assert refused["error_param"] == "n" and "n" in refused["error"], refused  # why, not only that
        chatty = by_id[loud.headers["x-request-id"]]
        assert chatty["prompt"] == SECRET_PROMPT
        assert chatty["completion"] == loud.json()["choices"][0]["text"]
        # a wrong key: a response and a line with the same request id, and a count (no tenant to name)
        wrong = httpx.post(url, headers={"Authorization": "Bearer not-a-key"}, json=body, timeout=20)
        assert wrong.status_code == 401 and wrong.headers["x-request-id"]
        line = poll(lambda: next((r for r in router.records("fairstream.request")
                                  if r["request_id"] == wrong.headers["x-request-id"]), None), 10, what="its line")
        assert line["outcome"] == "unauthorized" and line["error_code"] == "invalid_api_key" and line["tenant"] == ""
        assert "not-a-key" not in router.log()  # (the key is redacted in the message)
        assert router.metrics().value("fairstream_requests_total", tenant="", endpoint="completions",
                                      outcome="unauthorized") == 1
        # a model name no replica serves is pointed out at start
        assert f"tenant typo allows models no replica serves: no-such-model (served: {MODEL})" in router.log()
        # the private prompt appears only in the chatty tenant's line
        assert router.log().count(SECRET_PROMPT) == 1
        # The replica processes log in the router's format, naming themselves:
        # the router's stderr is one JSON object per line, all of it.
        records = [json.loads(line) for line in router.log().splitlines() if line.strip()]
        started = [r for r in records if r["msg"].startswith("replica ready on")]
        assert {r.get("replica") for r in started} == set(router.replica_names), started


def test_the_http_servers_own_lines_are_json_too(tmp_path):
    import socket

    with RouterProcess(tmp_path / "r", replicas=1) as router:
        host, port = router.base_url.removeprefix("http://").rsplit(":", 1)
        with socket.create_connection((host, int(port)), timeout=5) as s:
            s.sendall(b"NOT HTTP AT ALL\r\n\r\n")  # uvicorn logs "Invalid HTTP request received."
            s.recv(1024)
        line = poll(lambda: next((ln for ln in router.log().splitlines() if "Invalid HTTP request" in ln), None),
                    10, what="uvicorn's line")
    assert json.loads(line)["level"] == "warning", line


def test_text_logs_reach_the_replicas(tmp_path):
    """``--log-format text``: the replicas' lines are text as well."""
    with RouterProcess(tmp_path / "r", replicas=1, args=["--log-format", "text"]) as router:
        log = router.log()
    lines = [line for line in log.splitlines() if "replica ready on" in line]
    assert lines and not any(line.startswith("{") for line in lines), lines
    assert " replica sim-0 INFO replica ready on" in lines[0], lines


def test_text_request_lines_carry_their_fields(tmp_path):
    with RouterProcess(tmp_path / "r", replicas=1, args=["--log-format", "text"]) as router:
        r = httpx.post(router.base_url + "/v1/completions", headers={"Authorization": f"Bearer {GOLD}"},
                       json={"model": MODEL, "prompt": "hi", "max_tokens": 3}, timeout=20)
        assert r.status_code == 200
        rid = r.headers["x-request-id"]
        line = poll(lambda: next((ln for ln in router.log().splitlines() if rid in ln), None), 10, what="its line")
    assert "fairstream.request INFO request ok" in line, line
    for field in (f"request_id={rid}", "tenant=gold", "outcome=ok", "completion_tokens=", "duration_s="):
        assert field in line, line

