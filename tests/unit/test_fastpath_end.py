"""FastPath's last write, the end of the chunked body, is bounded by
send_timeout like the events before it (uvicorn's ``send`` waits for the
transport to drain with no limit). The generation, its tenant policy and
the transport are stand-ins; FastPath._completion and the wires are real."""

from __future__ import annotations

import asyncio
import types

import router.fastpath as fp
from uvicorn.protocols.http.flow_control import FlowControl


class _Transport:
    def __init__(self):
        self.writes = []
        self.aborted = False

    def write(self, data):
        self.writes.append(data)

    def is_closing(self):
        return self.aborted

    def abort(self):
        self.aborted = True

    def pause_reading(self):
        pass

    def resume_reading(self):
        pass


async def test_the_end_of_a_stream_is_bounded_by_send_timeout(monkeypatch) -> None:
    settled = []
    gen = types.SimpleNamespace(close=lambda: None)
    es = types.SimpleNamespace(gen=gen, settle=lambda: settled.append(True))
    flow = FlowControl(_Transport())

    class Relay:
        async def run(self, events, wire):
            # the last event (with [DONE]) was written at once by piece(), and
            # that write filled the transport past its high-water mark: the
            # client has stopped reading
            flow.pause_writing()

    st = types.SimpleNamespace(relay=Relay())

    async def start_generation(*a, **kw):
        return st

    async def open_stream(*a, **kw):
        return es, {}

    monkeypatch.setattr(fp, "start_generation", start_generation)
    monkeypatch.setattr(fp, "open_stream", open_stream)
    svc = types.SimpleNamespace(config=types.SimpleNamespace(max_body_bytes=1 << 20, send_timeout=0.2),
                                tenant=lambda auth: object())
    path = object.__new__(fp.FastPath)
    path.svc = svc

    body_sent = asyncio.Event()
    never = asyncio.Event()

    async def receive():
        if not body_sent.is_set():
            body_sent.set()
            return {"type": "http.request", "body": b"{}", "more_body": False}
        await never.wait()  # the client is still connected (TCP holds)

    async def send(message):
        # uvicorn's RequestResponseCycle.send: waits for the transport to drain first
        if flow.write_paused:
            await flow.drain()

    task = asyncio.ensure_future(path._completion(receive, send, True, "Bearer x", "/v1/chat/completions", []))
    done, _ = await asyncio.wait({task}, timeout=2)
    try:
        assert done, "the request (its lease, its settle) is still held 2 s after a 0.2 s send_timeout"
        assert settled
    finally:
        task.cancel()
        await asyncio.wait({task})
