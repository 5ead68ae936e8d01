"""router/workers.py ``hold_port``: a second ``serve --workers`` on a port
that one holds is refused, also when the first had to bind beside the
TIME_WAITs of a closed server."""

from __future__ import annotations

import socket

import pytest

from router.workers import hold_port
from tests.helpers import free_port


def _time_wait(port: int) -> None:
    """A server on ``port`` (SO_REUSEADDR, as uvicorn's) that closes a
    connection first: its side stays in TIME_WAIT."""
    server = socket.socket()
    server.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    server.bind(("127.0.0.1", port))
    server.listen()
    client = socket.create_connection(("127.0.0.1", port))
    conn, _ = server.accept()
    conn.close()  # (the server closes first)
    client.recv(1)
    client.close()
    server.close()


@pytest.mark.parametrize("time_wait", [False, True], ids=["free", "time_wait"])
def test_a_held_port_is_refused_to_a_second_instance(time_wait: bool) -> None:
    port = free_port()
    if time_wait:
        _time_wait(port)
    first = hold_port("127.0.0.1", port)
    try:
        with pytest.raises(OSError):  # (the second instance: exit 3)
            hold_port("127.0.0.1", port).close()
        # the workers bind beside it
        worker = socket.socket()
        worker.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        worker.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
        worker.bind(("127.0.0.1", port))
        worker.listen()
        worker.close()
    finally:
        first.close()
