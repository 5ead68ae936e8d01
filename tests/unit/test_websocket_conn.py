"""A WebSocket connection's sends after its client has gone."""

from __future__ import annotations

from litestar.exceptions import WebSocketDisconnect

from router.websocket import _Conn


class GoneSocket:
    """A socket whose client disconnected: every send fails, as uvicorn's does."""

    def __init__(self) -> None:
        self.sends = 0

    async def send_data(self, data: str, mode: str) -> None:
        self.sends += 1
        raise WebSocketDisconnect(detail="client gone", code=1006)


async def test_a_send_to_a_gone_client_is_dropped_not_raised() -> None:
    # (raised in a request's task, it left "Task exception was never
    # retrieved" in the log and the relay unclosed until garbage collection)
    sock = GoneSocket()
    conn = _Conn(None, sock)  # type: ignore[arg-type]
    await conn.send(b'{"id":"a"}')
    assert conn.gone
    await conn.send(b'{"id":"a"}')  # and nothing more is tried
    assert sock.sends == 1
