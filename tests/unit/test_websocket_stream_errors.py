"""What a ``/v1/ws`` request is told when its stream fails, and what the
router logs: a socket client's words (``last_event_id``, a resume message),
and the request id that ties the message to the request's log line."""

from __future__ import annotations

import json
import logging
from types import SimpleNamespace

import pytest

from router.errors import error_body
from router.relay import shutdown_error
from router.sse import ChunkEncoder
from router.state import StoreUnavailable
from router.websocket import _Conn
from router.websocket_stream import SocketFrames, run_create, run_resume
from router import websocket_stream as ws


class Socket:
    scope: dict = {}

    def __init__(self) -> None:
        self.frames: list[dict] = []

    async def send_data(self, data: str, mode: str) -> None:
        self.frames.append(json.loads(data))


def conn() -> tuple[_Conn, Socket]:
    sock = Socket()
    return _Conn(SimpleNamespace(config=SimpleNamespace(send_timeout=60)), sock), sock  # type: ignore[arg-type]


async def one_chunk_then(e: BaseException):
    yield ChunkEncoder(True, "chatcmpl-x", "m", 0).delta("hi", pos=b"-1-2")
    raise e


def creating(monkeypatch, e: BaseException) -> None:
    """A create whose stream sends one chunk and then fails with ``e``."""
    async def start(*a, **kw):
        return SimpleNamespace(pieces=None, first=None)

    async def open_stream(svc, policy, st, stream, request_id):
        return SimpleNamespace(sid=request_id), None

    monkeypatch.setattr(ws, "start_generation", start)
    monkeypatch.setattr(ws, "open_stream", open_stream)
    monkeypatch.setattr(ws, "relay_stream", lambda es, pieces, first: one_chunk_then(e))


async def test_a_create_that_fails_mid_stream_names_its_request_in_the_error_and_in_the_log(
        monkeypatch, caplog) -> None:
    creating(monkeypatch, RuntimeError("a bug"))
    c, sock = conn()
    with caplog.at_level(logging.ERROR, logger="fairstream.websocket"):
        await run_create(c, "m1", b"{}", None)  # type: ignore[arg-type]
    first, _, last = sock.frames  # (the role chunk, event 1, the error)
    rid = first["stream"]
    assert last["id"] == "m1" and last["request_id"] == rid and last["error"]["type"] == "server_error", last
    [rec] = [r for r in caplog.records if "mid-stream" in r.getMessage()]
    assert rid in rec.getMessage(), rec.getMessage()  # (the request's log line carries it, not "m1")


async def test_a_create_whose_store_fails_mid_stream_is_told_to_resume_its_stream(monkeypatch) -> None:
    creating(monkeypatch, StoreUnavailable("redis down"))
    c, sock = conn()
    await run_create(c, "m1", b"{}", None)  # type: ignore[arg-type]
    first, _, last = sock.frames  # (the role chunk, event 1, the error)
    err = last["error"]
    assert last["request_id"] == first["stream"] and err["code"] == "resume_unavailable", last
    # (a create's client sent no last_event_id: it resumes its stream with the last one it has)
    assert "same" not in err["message"] and first["stream"] in err["message"], err


async def test_a_resume_whose_store_fails_mid_stream_is_told_to_resume_again(monkeypatch) -> None:
    async def serve(svc, policy, sid, last_event_id):
        return SimpleNamespace(status_code=200, iterator=one_chunk_then(StoreUnavailable("redis down")))

    monkeypatch.setattr(ws, "serve_resume", serve)
    c, sock = conn()
    await run_resume(c, "m2", "sid-9", "0-0-0", None)  # type: ignore[arg-type]
    last = sock.frames[-1]
    assert last["request_id"] == "sid-9" and last["error"]["code"] == "resume_unavailable", last
    assert "last event_id" in last["error"]["message"], last


@pytest.mark.parametrize("store", ["redis", "memory"])
def test_error_events_a_socket_gets_name_its_last_event_id_not_the_sse_header(store: str) -> None:
    enc = ChunkEncoder(True, "chatcmpl-x", "m", 0)
    # a resume's mismatch notice (router/resume_http.py ``_mismatch``)
    mismatch = enc.notice(error_body("Last-Event-ID does not match this stream.", "invalid_request_error",
                                     "Last-Event-ID", "resume_mismatch"))
    err = json.loads(SocketFrames("c", "s").message(mismatch))["error"]
    assert (err["param"], err["message"]) == ("last_event_id", "last_event_id does not match this stream."), err
    # the shutdown notice: its words for SSE, and for a socket
    body = shutdown_error(SimpleNamespace(store=SimpleNamespace(name=store)), True).body()
    told = json.loads(SocketFrames("c", "s").message(enc.notice(body)))["error"]["message"]
    assert "Last-Event-ID" not in told, told
    if store == "redis":
        assert "Last-Event-ID" in json.loads(body)["error"]["message"]
        assert "last_event_id" in told, told
