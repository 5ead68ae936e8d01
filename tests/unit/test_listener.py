"""The router's listener accepts a burst of connections in the loop turn that
finds them, however busy the loop is. libuv alone takes one per turn: on
stock uvloop the burst below takes 30 turns, and a busy router left the last
of 64 new clients waiting over a second (docs/perf.md)."""

from __future__ import annotations

import asyncio
import socket
import time

from router.listener import ACCEPTS_PER_TURN, BatchServer, new_event_loop

CLIENTS = 30


def _burst(loop_factory, clients: int = CLIENTS, backlog: int = 128) -> list[int]:
    """Loop turns (of a loop kept busy ~10 ms per turn) at which each of
    ``clients`` connections, waiting to be accepted at once, reached
    ``connection_made``."""
    made: list[int] = []
    turns = [0]

    class Proto(asyncio.Protocol):
        def connection_made(self, transport) -> None:
            made.append(turns[0])

    async def main() -> None:
        loop = asyncio.get_running_loop()
        server = await loop.create_server(Proto, "127.0.0.1", 0, backlog=backlog)
        port = server.sockets[0].getsockname()[1]
        # the kernel completes the handshakes; they wait in the backlog
        socks = [socket.create_connection(("127.0.0.1", port)) for _ in range(clients)]

        def busy() -> None:  # one turn of a loop busy relaying tokens
            turns[0] += 1
            end = time.perf_counter() + 0.01
            while time.perf_counter() < end:
                pass
            if len(made) < clients and turns[0] < 500:
                loop.call_soon(busy)

        loop.call_soon(busy)
        while len(made) < clients and turns[0] < 500:
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


def test_a_storm_of_connections_is_taken_in_over_turns_between_which_the_loop_runs() -> None:
    """A storm larger than a turn's share waits for the next turns, so the
    running streams' tokens go out between them (taken in one turn, a
    3,000-connection storm paused every stream ~190 ms)."""
    clients = 300  # (more than two turns' share)
    made = _burst(new_event_loop, clients, backlog=4096)
    assert len(made) == clients
    per_turn = {t: made.count(t) for t in set(made)}
    assert len(per_turn) >= 3, per_turn  # (taken in one turn before)
    assert max(per_turn.values()) <= ACCEPTS_PER_TURN, per_turn
    assert made[-1] - made[0] <= 4, per_turn  # (and still in a few turns, not one per turn)


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


def test_a_bound_socket_is_listened_on_and_served() -> None:
    """The ``--workers`` path hands uvicorn a bound socket (uvicorn's own
    ``bind_socket`` does not listen on it): it is listened on and served."""
    got: list[bytes] = []

    class Echo(asyncio.Protocol):
        def connection_made(self, transport) -> None:
            self.transport = transport

        def data_received(self, data: bytes) -> None:
            got.append(data)
            self.transport.write(data)

    async def main() -> None:
        loop = asyncio.get_running_loop()
        sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        sock.bind(("127.0.0.1", 0))
        server = await loop.create_server(Echo, sock=sock, backlog=16)
        assert isinstance(server, BatchServer)
        reader, writer = await asyncio.open_connection(*sock.getsockname())
        writer.write(b"ping")
        assert await asyncio.wait_for(reader.readexactly(4), 5) == b"ping"
        writer.close()
        server.close()
        await server.wait_closed()
        assert server.sockets == () and sock.fileno() == -1

    with asyncio.Runner(loop_factory=new_event_loop) as runner:
        runner.run(main())
    assert got == [b"ping"]
