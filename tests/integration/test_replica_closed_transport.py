"""A replica connection whose transport closed before its reader ran.

A replica killed the instant a request is dispatched to it: the router's
write to its socket fails (EPIPE), which closes the transport at once, but
the connection's reader learns of it (``ReplicaClient.closed``) only when it
next runs. A write in between raised uvloop's ``RuntimeError`` ("the handler
is closed"), which the router took for a bug in its own code: an HTTP 500
instead of a failover. Every write of the client must report such a
connection as a dead replica, leave no request registered on it, and take
the replica out of the pool's choice at once (a failover from that write
that picked it again, still "ready", spent the stream's failovers in one
loop turn: ``stream_lost``)."""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys

import msgspec
import pytest
import uvloop

from replicas.client import ReplicaDead, connect
from replicas.spec import ReplicaSpec
from replicas.pool import ReplicaSlot
from replicas.protocol import SamplingParams
from tests.helpers import MODEL, poll

LOOPS = {"uvloop": uvloop.new_event_loop, "asyncio": asyncio.new_event_loop}


@pytest.fixture
def replica(tmp_path):
    """A real sim replica on a Unix socket: (address, process)."""
    path = tmp_path / "r.sock"
    log = open(tmp_path / "replica.log", "ab")
    proc = subprocess.Popen(
        [sys.executable, "-m", "replicas", "--engine", "sim", "--socket", str(path),
         "--config-json", msgspec.json.encode({"model": MODEL, "seed": 0}).decode()],
        stdout=log, stderr=subprocess.STDOUT,
    )
    try:
        poll(lambda: path.exists() or proc.poll() is not None, 15, what="replica socket")
        assert proc.poll() is None, (tmp_path / "replica.log").read_text()
        yield f"unix:{path}", proc
    finally:
        log.close()
        if proc.poll() is None:
            proc.kill()
        proc.wait()


def _generate(client):
    return client.generate(SamplingParams(max_tokens=8), prompt="hello")


def _killed_under(client, proc) -> None:
    """SIGKILL the replica and wait for it, without letting the loop run (the
    reader does not see the end), then write once so that the transport
    learns the peer is gone as the router's next write would."""
    os.kill(proc.pid, signal.SIGKILL)
    proc.wait()
    try:
        client.abort(_generate(client))  # (this first write may fail or not: EPIPE comes on it or the next)
    except ReplicaDead:
        pass


@pytest.mark.parametrize("loop", sorted(LOOPS))
@pytest.mark.parametrize("how", ["killed", "closed"])
def test_a_write_on_a_closed_transport_is_a_dead_replica(replica, loop, how) -> None:
    address, proc = replica

    async def main() -> None:
        client = await connect("sim-x", address)
        try:
            first = _generate(client)  # (it works while the replica lives)
            client.abort(first)
            slot = ReplicaSlot(ReplicaSpec(name="sim-x", address=address))
            slot.client, slot.state = client, "ready"
            assert slot.ready
            if how == "killed":
                _killed_under(client, proc)
            else:
                client._writer.transport.abort()
            # one loop turn: the transport's connection_lost runs (uvloop's
            # transport is "closed" from then on), the reader it wakes has
            # not yet: a request dispatched in this turn
            await asyncio.sleep(0)
            assert not client._task.done()  # (the reader has not run: the window of the defect)
            with pytest.raises(ReplicaDead):
                _generate(client)
            assert client.active == 0  # (no collector left behind for a request never sent)
            # and it is out of the choice from this write on, not when the reader runs: a failover
            # from it must not pick it again (it did, until its failovers were spent in one turn)
            assert client.closed is not None and not slot.ready
            with pytest.raises(ReplicaDead):
                await client.ping(1.0)
            client.abort(first)  # (a no-op, no error)
        finally:
            await client.close()

    with asyncio.Runner(loop_factory=LOOPS[loop]) as runner:
        runner.run(main())


@pytest.mark.parametrize("loop", sorted(LOOPS))
def test_streams_on_a_connection_a_write_found_closing_fail_with_its_own_reason(replica, loop) -> None:
    """The supervisor closes a client as soon as it sees it closed, which a
    write now marks before the reader runs: the reader must still fail the
    streams it had, with what ended the connection, not be cancelled first
    ("closed by the router": a stop, not a lost replica)."""
    address, _ = replica

    async def main() -> None:
        client = await connect("sim-x", address)
        running = _generate(client)
        client._writer.transport.abort()
        await asyncio.sleep(0)
        with pytest.raises(ReplicaDead):
            _generate(client)  # (marks it closed; its reader has not run)
        await client.close()  # (as the supervisor's watch would, at once)
        assert running.dead is not None
        assert "closed by the router" not in str(running.dead), running.dead

    with asyncio.Runner(loop_factory=LOOPS[loop]) as runner:
        runner.run(main())
