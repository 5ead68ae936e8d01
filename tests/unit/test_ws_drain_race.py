"""A draining (or revoked) socket with two requests that end together: the
second one's last message must go out before the socket closes."""

from __future__ import annotations

import asyncio
import json
from types import SimpleNamespace

from router.errors import BadRequest
from router.websocket import _Conn
from router.websocket_stream import run_create


class SlowSocket:
    scope: dict = {}

    def __init__(self) -> None:
        self.release = asyncio.Event()
        self.frames: list[str] = []
        self.closed: tuple | None = None

    async def send_data(self, data: str, mode: str) -> None:
        await self.release.wait()
        self.frames.append(data)

    async def close(self, code: int, reason: str) -> None:
        self.closed = (code, reason)


async def test_two_refusals_on_a_draining_socket_both_get_their_answer(monkeypatch) -> None:
    import router.websocket_stream as ws

    async def refuse(*a, **kw):
        raise BadRequest("'max_tokens' is too large.", param="max_tokens")

    monkeypatch.setattr(ws, "start_generation", refuse)
    sock = SlowSocket()
    assert await _drained(sock, {"r1": b"{}", "r2": b"{}"}) == ["r1", "r2"], sock.frames
    assert sock.closed is not None and sock.closed[0] == 1012


async def test_two_streams_ending_together_on_a_draining_socket_both_get_their_last_frame(monkeypatch) -> None:
    """Shutdown's stop_all ends every stream of a socket at once: each
    one's last frame (done, or its error) must reach the client."""
    import router.websocket_stream as ws

    async def start(svc, policy, body, *a, **kw):
        return SimpleNamespace(pieces=None, first=None)

    async def open_stream(*a):
        return SimpleNamespace(sid=None), {}

    async def relay(es, pieces, first):
        yield b"data: [DONE]\n\n"

    monkeypatch.setattr(ws, "start_generation", start)
    monkeypatch.setattr(ws, "open_stream", open_stream)
    monkeypatch.setattr(ws, "relay_stream", relay)
    sock = SlowSocket()
    assert await _drained(sock, {cid: cid.encode() for cid in ("r1", "r2", "r3")}) == ["r1", "r2", "r3"], sock.frames


async def _drained(sock: SlowSocket, bodies: dict[str, bytes]) -> list[str]:
    """Start ``bodies`` on a socket, drain it (router shutting down: close
    once they have ended) while their sends wait, then let the sends go:
    the ids of the messages that reached the client."""
    conn = _Conn(SimpleNamespace(config=SimpleNamespace(send_timeout=60)), sock)  # type: ignore[arg-type]
    for cid, body in bodies.items():
        conn.start(cid, run_create(conn, cid, body, None))  # type: ignore[arg-type]
    conn.drain()
    for _ in range(10):
        await asyncio.sleep(0)
    sock.release.set()
    await asyncio.gather(*conn.tasks)
    if conn.closing is not None:
        await conn.closing
    return sorted(json.loads(f)["id"] for f in sock.frames)
