"""A replica whose engine has died stops: it answers nothing more and exits 1."""

from __future__ import annotations

import asyncio

import pytest

from replicas.engine import EngineDead
from replicas.server import ReplicaServer, exit_if_dead, watch_engine


async def test_a_dead_engine_ends_the_watch_and_the_process_exits_1() -> None:
    server = ReplicaServer("sim", {"model": "m"})
    eng = server.engine
    watch = asyncio.ensure_future(watch_engine(eng))
    await asyncio.sleep(0.05)
    assert not watch.done()
    exit_if_dead(eng)  # alive: nothing happens
    eng.die("engine core killed")
    await asyncio.wait_for(watch, 1)
    with pytest.raises(SystemExit) as e:
        exit_if_dead(eng)
    assert e.value.code == 1 and eng.death == "engine core killed"


async def test_a_request_to_a_dead_engine_gets_no_answer_from_this_replica() -> None:
    # (an error answer would end it at the router as a 400 or a lost stream;
    # no answer, then the dropped connection, fails it over)
    server = ReplicaServer("sim", {"model": "m"})
    await server.engine.start()

    def dead_add(*args):
        server.engine.die("dead")
        raise EngineDead("dead")

    server.engine.add = dead_add

    class Conn:
        requests: dict = {}
        queued: list = []

        def queue(self, delta):
            self.queued.append(delta)

    from replicas.protocol import Generate, SamplingParams
    conn = Conn()
    server._generate(conn, Generate(1, SamplingParams(max_tokens=4), prompt_token_ids=[1, 2]))
    assert conn.queued == []
    await server.engine.close()
