"""The router's listener accepts a burst of connections in the loop turn that
finds them, however busy the loop is (libuv alone takes one per turn: a busy
router left the last of 64 new clients waiting over a second)."""

from __future__ import annotations

import asyncio
import socket
import time

import uvloop

from router.listener import BatchServer, new_event_loop

CLIENTS = 30


def _burst(loop_factory) -> list[int]:
    """Loop turns (of a loop kept busy ~10 ms per turn) at which each of
    CLIENTS connections, waiting to be accepted at once, reached
    ``connection_made``."""
    made: list[int] = []
    turns = [0]

    class Proto(asyncio.Protocol):
        def connection_made(self, transport) -> None:
            made.append(turns[0])

    async def main() -> None:
        loop = asyncio.get_running_loop()
        server = await loop.create_server(Proto, "127.0.0.1", 0, backlog=128)
        port = server.sockets[0].getsockname()[1]
        # the kernel completes the handshakes; they wait in the backlog
        socks = [socket.create_connection(("127.0.0.1", port)) for _ in range(CLIENTS)]

        def busy() -> None:  # one turn of a loop busy relaying tokens
            turns[0] += 1
            end = time.perf_counter() + 0.01
            while time.perf_counter() < end:
                pass
            if len(made) < CLIENTS and turns[0] < 500:
                loop.call_soon(busy)

        loop.call_soon(busy)
        while len(made) < CLIENTS and turns[0] < 500:
            await asyncio.sleep(0)
        for s in socks:
            s.close()
        server.close()
        await server.wait_closed()

    with asyncio.Runner(loop_factory=loop_factory) as runner:
        runner.run(main())
    return made


def test_a_burst_of_connections_is_accepted_in_a_few_turns() -> None:
    made = _burst(new_event_loop)
    assert len(made) == CLIENTS
    assert made[-1] - made[0] <= 1, made  # one accept per turn would take CLIENTS turns


def test_stock_uvloop_takes_one_connection_per_turn() -> None:
    """What the listener is for (if uvloop ever batches again, it can go)."""
    made = _burst(uvloop.new_event_loop)
    assert len(made) == CLIENTS and made[-1] - made[0] >= CLIENTS - 2, made


def test_the_server_closes_its_sockets_and_serves_over_ipv4() -> None:
    async def main() -> None:
        loop = asyncio.get_running_loop()
        server = await loop.create_server(asyncio.Protocol, "127.0.0.1", 0)
        assert isinstance(server, BatchServer) and server.is_serving()
        sock = server.sockets[0]
        assert sock.family == socket.AF_INET
        server.close()
        await server.wait_closed()
        assert not server.is_serving() and sock.fileno() == -1

    with asyncio.Runner(loop_factory=new_event_loop) as runner:
        runner.run(main())
