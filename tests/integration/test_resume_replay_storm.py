"""Replays of a long resume buffer give the event loop back between slices
(router/replay_slices.py), so other tenants' requests keep being answered.

A replay wrote its buffer one event at a time, and uvicorn's ``send`` (a
WebSocket's too) does not suspend while the client's transport is not
paused: each replay ran to its end in one turn of the loop, and K replays
that came in together ran back to back. A tenant with one finished
2,048-token stream (~800 events) and 40 replays of it sent at once held
every other tenant's requests ~1.1 s on a 2-core host (over SSE; over
WebSockets, a message per event, ~3 s).

The measure: a probe in a process of its own (so that the replays' reading
does not slow it) asks ``GET /v1/models`` with another tenant's key on a
keep-alive connection every 5 ms; the test takes the longest time between
two of its answers while the replays run. Before: 1.1 s and 3 s (the
replays' whole work in one stretch, which grows with K and with the host's
load). After: a slice per replay per turn, 50-140 ms. The bound (400 ms)
sits far from both.
"""

from __future__ import annotations

import asyncio
import json
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest
from websockets.asyncio.client import connect

from router.auth import hash_key
from tests.helpers import MODEL, RouterProcess, write_tenants

KEY_A, KEY_B = "storm-tenant-a", "storm-tenant-b"
REPLAYS = 40
TOKENS = 2048
LONGEST_GAP = 0.4  # seconds between two answers to the other tenant's probe

# The probe: prints the monotonic time of every answer (CLOCK_MONOTONIC is the
# host's: comparable with this process's) until its stdin closes.
PROBE = r"""
import socket, sys, threading, time
port, key = int(sys.argv[1]), sys.argv[2]
stop = threading.Event()
threading.Thread(target=lambda: (sys.stdin.read(), stop.set()), daemon=True).start()
s = socket.create_connection(("127.0.0.1", port))
req = f"GET /v1/models HTTP/1.1\r\nHost: t\r\nAuthorization: Bearer {key}\r\n\r\n".encode()
times = []
while not stop.is_set():
    s.sendall(req)
    buf = b""
    while True:
        buf += s.recv(65536)
        head, sep, body = buf.partition(b"\r\n\r\n")
        if sep:
            length = next(int(v) for k, _, v in (h.partition(b":") for h in head.split(b"\r\n")[1:])
                          if k.strip().lower() == b"content-length")
            if len(body) >= length:
                break
    assert buf.startswith(b"HTTP/1.1 200"), buf[:200]
    times.append(time.monotonic())
    time.sleep(0.005)
print(" ".join(map(repr, times)))
"""


@pytest.fixture(scope="module")
def router(tmp_path_factory) -> RouterProcess:
    d: Path = tmp_path_factory.mktemp("storm")
    tenants = d / "tenants.yaml"
    write_tenants(tenants, {"a": {"keys": [hash_key(KEY_A)]}, "b": {"keys": [hash_key(KEY_B)]}})
    r = RouterProcess(d / "r", replicas=1, tenants=tenants, sim={"step_base_ms": 1})
    r.start()
    yield r
    r.stop()


@pytest.fixture(scope="module")
def finished(router: RouterProcess) -> tuple[str, str, bytes]:
    """(stream id, its event 1's id, the SSE body after event 1) of tenant a's finished chat stream."""
    body = {"model": MODEL, "messages": [{"role": "user", "content": "Le caf"}], "max_tokens": TOKENS,
            "temperature": 0, "ignore_eos": True, "stream": True}
    with httpx.Client(base_url=router.base_url, headers={"Authorization": f"Bearer {KEY_A}"}, timeout=60) as c:
        with c.stream("POST", "/v1/chat/completions", json=body) as r:
            assert r.status_code == 200
            sid, sse = r.headers["x-request-id"], r.read()
    events = sse.split(b"\n\n")
    first = next(i for i, e in enumerate(events) if e.startswith(b"id: 1-"))
    assert sse.endswith(b"data: [DONE]\n\n") and len(events) > TOKENS // 2, len(events)
    return sid, events[first].split(b"\n")[0][4:].decode(), b"\n\n".join(events[first + 1:])


def longest_gap_while(router: RouterProcess, storm) -> tuple[float, object]:
    """The longest time between two answers to the probe while ``storm()``
    runs (and ``storm``'s result)."""
    probe = subprocess.Popen([sys.executable, "-c", PROBE, str(router.port), KEY_B], stdin=subprocess.PIPE,
                             stdout=subprocess.PIPE, text=True)
    try:
        time.sleep(0.5)  # (its connection up and answered)
        start = time.monotonic()
        result = storm()
        end = time.monotonic()
        time.sleep(0.1)
        out, _ = probe.communicate("", timeout=30)
    finally:
        if probe.poll() is None:
            probe.kill()
            probe.wait()
    assert probe.returncode == 0, out
    times = [float(t) for t in out.split()]
    assert times and times[0] < start and times[-1] > end, "the probe ran through the replays"
    gaps = [b - a for a, b in zip(times, times[1:]) if b > start and a < end]
    return max(gaps), result


def test_concurrent_sse_replays_of_a_long_buffer_leave_other_tenants_answered(router, finished) -> None:
    sid, first, rest = finished
    request = (f"GET /v1/streams/{sid} HTTP/1.1\r\nHost: t\r\nAuthorization: Bearer {KEY_A}\r\n"
               f"Last-Event-ID: {first}\r\nConnection: close\r\n\r\n").encode()

    def storm() -> list[bytes]:
        socks = [socket.create_connection(("127.0.0.1", router.port)) for _ in range(REPLAYS)]
        for s in socks:
            s.sendall(request)
        got = []
        for s in socks:
            with s:
                chunks = []
                while data := s.recv(1 << 20):
                    chunks.append(data)
            got.append(b"".join(chunks))
        return got

    gap, got = longest_gap_while(router, storm)
    for answer in got:  # (the same events, in order, to [DONE]: chunked, so the body is compared unchunked)
        head, _, body = answer.partition(b"\r\n\r\n")
        assert head.startswith(b"HTTP/1.1 200") and b"transfer-encoding: chunked" in head.lower(), head
        assert _unchunked(body) == rest
    assert gap < LONGEST_GAP, f"another tenant waited {gap * 1000:.0f} ms while {REPLAYS} replays ran"


def test_concurrent_websocket_replays_of_a_long_buffer_leave_other_tenants_answered(router, finished) -> None:
    sid, first, rest = finished
    # (the events after event 1: a message each before the done message, [DONE]'s, which has an id too)
    want = rest.count(b"\n\nid: ")

    async def replays() -> list[int]:
        url = router.base_url.replace("http://", "ws://") + "/v1/ws"
        socks = [await connect(url, additional_headers={"Authorization": f"Bearer {KEY_A}"}, proxy=None,
                               max_size=None) for _ in range(REPLAYS)]
        msg = json.dumps({"type": "resume", "id": "r", "stream": sid, "last_event_id": first})
        await asyncio.gather(*(ws.send(msg) for ws in socks))

        async def read(ws) -> int:
            async with ws:
                n = 0
                while not (m := json.loads(await asyncio.wait_for(ws.recv(), 30))).get("done"):
                    assert "error" not in m, m
                    n += 1
                return n
        return await asyncio.gather(*(read(ws) for ws in socks))

    gap, counts = longest_gap_while(router, lambda: asyncio.run(replays()))
    assert counts == [want] * REPLAYS
    assert gap < LONGEST_GAP, f"another tenant waited {gap * 1000:.0f} ms while {REPLAYS} replays ran"


def _unchunked(body: bytes) -> bytes:
    out, at = [], 0
    while True:
        eol = body.index(b"\r\n", at)
        size = int(body[at:eol], 16)
        if size == 0:
            return b"".join(out)
        out.append(body[eol + 2:eol + 2 + size])
        at = eol + 4 + size
