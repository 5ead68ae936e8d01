"""Refused requests give their bodies back at once.

A refused request (a 400 naming a field, a 404 for an unknown model, a
replica's refusal of a prompt too long) once left its body, and its decoded
copy, in a reference cycle with the error's traceback (the frames that held
the error were in its traceback). The router collects cycles rarely
(``router.service``: a young collection per 50,000 allocations, and such a
cycle allocates a few hundred objects while it holds megabytes): a tenant
sending refused 4 MB bodies grew the router to gigabytes. This sends
refused 4 MB bodies of each kind to a real router and checks that its
resident memory stays about where it was; tests/integration/test_garbage.py
checks, in the router's own process, that no refusal leaves a cycle.
"""

from __future__ import annotations

import hashlib
import json
import socket

import pytest
import yaml

from tests.helpers import MODEL, RouterProcess

KEY = "fs-refused-memory"
EACH = 20  # refused requests of each kind
BODY = "a" * 4_000_000  # (the default max_body_bytes is 4 MiB)
# Kept, each refused body held 4-8 MB (the bytes, their decoded string): 20
# of one kind grew the router by 80 MB or more, the four kinds by 230 MB-1 GB.
# Given back, the four kinds grew it by ~7 MB (the allocator's arenas).
GROWTH_MB = 100

KINDS = {
    # 400: a field the router refuses after decoding the whole body
    "unsupported": ({"model": MODEL, "max_tokens": 1, "logit_bias": {"1": 1},
                     "messages": [{"role": "user", "content": BODY}]}, 400),
    # 400: a field of the wrong type (msgspec's ValidationError, chained)
    "invalid": ({"model": MODEL, "max_tokens": "x", "messages": [{"role": "user", "content": BODY}]}, 400),
    # 404: an unknown model, its name 4 MB long
    "model": ({"model": BODY, "max_tokens": 1, "messages": [{"role": "user", "content": "a"}]}, 404),
    # 400 from the replica: the prompt is over its context length (as a
    # stream: the push relay's path)
    "replica": ({"model": MODEL, "max_tokens": 1, "stream": True,
                 "messages": [{"role": "user", "content": "hello " * 600_000}]}, 400),
}


@pytest.fixture(scope="module")
def router(tmp_path_factory) -> RouterProcess:
    d = tmp_path_factory.mktemp("refused-memory")
    roomy = {"requests_per_minute": 0, "tokens_per_minute": 0, "max_concurrent": 0, "max_prompt_tokens": 0,
             "max_tokens": 0}
    (d / "tenants.yaml").write_text(yaml.safe_dump({
        "priority_classes": ["normal"],
        "defaults": {"priority": "normal", "weight": 1, "models": ["*"], "limits": roomy, "on_limit": "reject"},
        "tenants": {"t": {"keys": [hashlib.sha256(KEY.encode()).hexdigest()]}},
    }))
    r = RouterProcess(d, tenants=d / "tenants.yaml", replicas=1).start()
    yield r
    r.stop()


def _rss_mb(pid: int) -> float:
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    raise AssertionError("no VmRSS")


def _post(port: int, body: bytes) -> int:
    head = (f"POST /v1/chat/completions HTTP/1.1\r\nhost: 127.0.0.1\r\nauthorization: Bearer {KEY}\r\n"
            f"content-type: application/json\r\ncontent-length: {len(body)}\r\nconnection: close\r\n\r\n").encode()
    with socket.create_connection(("127.0.0.1", port), timeout=60) as s:
        s.sendall(head + body)
        data = b""
        while chunk := s.recv(65536):
            data += chunk
    return int(data.split(b" ", 2)[1])


def test_refused_large_bodies_do_not_pile_up(router: RouterProcess) -> None:
    bodies = {kind: (json.dumps(body).encode(), status) for kind, (body, status) in KINDS.items()}
    for body, status in bodies.values():  # warm up: what is made once stays
        assert _post(router.port, body) == status
    before = _rss_mb(router.pid)
    grew = {}
    for kind, (body, status) in bodies.items():
        at = _rss_mb(router.pid)
        for _ in range(EACH):
            assert _post(router.port, body) == status, kind
        grew[kind] = round(_rss_mb(router.pid) - at)
    total = _rss_mb(router.pid) - before
    assert total < GROWTH_MB, (f"the router grew by {total:.0f} MB over {EACH} refused requests of each kind "
                               f"({EACH * len(bodies) * 4} MB of bodies); by kind, MB: {grew}")
