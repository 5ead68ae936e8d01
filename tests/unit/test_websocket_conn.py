"""A WebSocket connection's sends after its client has gone."""

from __future__ import annotations

import asyncio
from types import SimpleNamespace

from litestar.exceptions import WebSocketDisconnect

from router.websocket import _Conn


class GoneSocket:
    """A socket whose client disconnected: every send fails, as uvicorn's does."""

    def __init__(self) -> None:
        self.sends = 0

    async def send_data(self, data: str, mode: str) -> None:
        self.sends += 1
        raise WebSocketDisconnect(detail="client gone", code=1006)


def service(send_timeout: float) -> SimpleNamespace:
    return SimpleNamespace(config=SimpleNamespace(send_timeout=send_timeout))


async def test_a_send_to_a_gone_client_is_dropped_not_raised() -> None:
    # (raised in a request's task, it left "Task exception was never
    # retrieved" in the log and the relay unclosed until garbage collection)
    sock = GoneSocket()
    conn = _Conn(service(60), sock)  # type: ignore[arg-type]
    await conn.send(b'{"id":"a"}')
    assert conn.gone
    await conn.send(b'{"id":"a"}')  # and nothing more is tried
    assert sock.sends == 1


class FullSocket:
    """A socket whose client reads nothing: a send waits for room forever."""

    async def send_data(self, data: str, mode: str) -> None:
        await asyncio.Event().wait()


async def test_a_client_that_takes_no_frame_for_send_timeout_is_given_up() -> None:
    # (its requests held their leases as long as the client stayed connected)
    conn = _Conn(service(0.1), FullSocket())  # type: ignore[arg-type]
    await asyncio.wait_for(conn.send(b'{"id":"a"}'), 2)
    assert conn.gone
