"""Network faults between the router and its remote replicas: a peer that
trickles its handshake, a connection black-holed (no FIN, no RST), an
upstream whose generation requests get no response head. The faulty peer is
a small server or TCP proxy in this test (the network), the router and the
replicas are real processes."""

from __future__ import annotations

import asyncio
import contextlib
import socket
import struct
import threading
import time
from collections.abc import Iterator
from typing import Any

import httpx
import pytest
import yaml

from replicas.client import connect
from tests.helpers import ADMIN, GOLD, MODEL, RouterProcess, poll, remote_replica_process
from tests.integration.test_upstream import UPSTREAM, upstream_router
from tests.sim_openai import SimOpenAI

SECRET = "s3cret-for-network-faults"


class _Loop:
    """An asyncio loop in a thread, for the fake peers."""

    def __init__(self) -> None:
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self.thread.start()

    def run(self, coro: Any, timeout: float = 10) -> Any:
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(timeout)

    def close(self) -> None:
        async def cancel_all() -> None:
            tasks = [t for t in asyncio.all_tasks() if t is not asyncio.current_task()]
            for t in tasks:
                t.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)

        self.run(cancel_all())
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(5)
        self.loop.close()


@contextlib.contextmanager
def _fake_peers() -> Iterator[_Loop]:
    loop = _Loop()
    try:
        yield loop
    finally:
        loop.close()


class _Proxy:
    """A TCP proxy that can black-hole: stop forwarding without closing
    (``hole``: every connection; ``hole_posts``: new connections whose
    request is a POST); ``get_delay``: seconds each GET is held before it
    goes on (a slow network or front end)."""

    def __init__(self, target_port: int) -> None:
        self.target_port = target_port
        self.hole = False
        self.hole_posts = False
        self.get_delay = 0.0
        self.server: asyncio.AbstractServer | None = None
        self.writers: list[asyncio.StreamWriter] = []

    async def start(self) -> int:
        self.server = await asyncio.start_server(self._serve, "127.0.0.1", 0)
        return self.server.sockets[0].getsockname()[1]

    async def close(self) -> None:
        if self.server is not None:
            self.server.close()
        for w in self.writers:
            w.transport.abort()

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        up_r, up_w = await asyncio.open_connection("127.0.0.1", self.target_port)
        self.writers += [writer, up_w]
        first = await reader.read(65536)
        if self.hole_posts and first.startswith(b"POST"):
            while await reader.read(65536):  # (held: read and never answered)
                pass
            return
        if self.get_delay and first.startswith(b"GET"):
            await asyncio.sleep(self.get_delay)
        up_w.write(first)
        await asyncio.gather(self._pipe(reader, up_w, True), self._pipe(up_r, writer), return_exceptions=True)

    async def _pipe(self, src: asyncio.StreamReader, dst: asyncio.StreamWriter, requests: bool = False) -> None:
        while data := await src.read(65536):
            if requests and self.get_delay and data.startswith(b"GET"):  # (a kept-alive connection's next GET)
                await asyncio.sleep(self.get_delay)
            while self.hole:  # (what comes now is dropped: neither FIN nor RST goes on)
                await asyncio.sleep(3600)
            dst.write(data)
        dst.close()


def _rows(router: RouterProcess) -> dict[str, dict[str, Any]]:
    r = httpx.get(router.base_url + "/admin/replicas", headers={"Authorization": f"Bearer {ADMIN}"}, timeout=5)
    assert r.status_code == 200, r.text
    return {row["name"]: row for row in r.json()["replicas"]}


def test_a_replica_that_trickles_its_handshake_fails_at_the_connect_timeout_and_is_retried(tmp_path, monkeypatch):
    # (it stayed "starting" for good, nothing logged: the timeout was per read,
    # and a byte a second never let one run out)
    monkeypatch.setenv("FS_SECRET", SECRET)
    connections = []

    async def loris(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        connections.append(time.monotonic())
        writer.write(struct.pack(">I", 200))
        while True:
            await asyncio.sleep(1)
            writer.write(b"\x00")

    with _fake_peers() as peers:
        server = peers.run(asyncio.start_server(loris, "127.0.0.1", 0))
        port = server.sockets[0].getsockname()[1]
        router = RouterProcess(tmp_path / "r", replicas=1, settings={
            "replicas": [{"name": "sim-0", "engine": "sim", "config": {"model": MODEL, "seed": 0}},
                         {"name": "loris", "address": f"127.0.0.1:{port}", "secret_env": "FS_SECRET"}],
            "health_interval": 0.2, "restart_backoff_max": 0.5})
        router.replica_names = ["sim-0"]
        with router:
            poll(lambda: _rows(router)["loris"]["last_error"] is not None, 20, what="loris's failure")
            err = _rows(router)["loris"]["last_error"]
            assert "handshake" in err and "10s" in err, err
            assert "replica loris" in router.log() and "handshake" in router.log()
            poll(lambda: len(connections) >= 2, 10, what="a new attempt")
            assert connections[1] - connections[0] < 13, connections


def test_a_replica_drops_a_connection_that_trickles_its_handshake(tmp_path):
    with remote_replica_process(tmp_path / "replica.log", "FS_TEST_SECRET", SECRET, {"model": MODEL}) as (port, _):
        with socket.create_connection(("127.0.0.1", port), timeout=20) as s:
            s.sendall(struct.pack(">I", 200))
            start = time.monotonic()
            s.settimeout(1.5)
            closed = False
            while time.monotonic() - start < 16 and not closed:
                s.sendall(b"\x00")
                try:
                    closed = s.recv(1024) == b""
                except TimeoutError:
                    pass
                except ConnectionResetError:
                    closed = True
            assert closed, "the replica still holds a handshake trickled for 16 s"
            assert time.monotonic() - start < 13


def test_a_replica_aborts_the_streams_of_a_router_connection_gone_silent(tmp_path, monkeypatch):
    # (black-holed: the router regenerated them elsewhere after its health
    # timeout, the replica went on generating them until max_tokens)
    monkeypatch.setenv("FS_ROUTER_SECRET", SECRET)
    sim = {"model": MODEL, "seed": 0, "step_base_ms": 30}
    with remote_replica_process(tmp_path / "replica.log", "FS_TEST_SECRET", SECRET, sim) as (port, _), \
            _fake_peers() as peers:
        proxy = _Proxy(port)
        proxy_port = peers.run(proxy.start())
        router = RouterProcess(tmp_path / "r", replicas=0, settings={
            "replicas": [{"name": "far-0", "address": f"127.0.0.1:{proxy_port}", "secret_env": "FS_ROUTER_SECRET"}],
            "health_interval": 0.2, "health_timeout": 1.0, "restart_backoff_max": 0.5})
        router.replica_names = ["far-0"]

        async def running() -> int:
            watcher = await connect("watcher", f"127.0.0.1:{port}", secret=SECRET)
            try:
                return (await watcher.ping(5)).load.running
            finally:
                await watcher.close()

        with router:
            with httpx.Client(base_url=router.base_url, headers={"Authorization": f"Bearer {GOLD}"},
                              timeout=30) as http:
                with http.stream("POST", "/v1/completions", json={
                        "model": MODEL, "prompt": "Le caf", "max_tokens": 1000, "stream": True}) as r:
                    assert r.status_code == 200
                    lines = r.iter_lines()  # (kept: a generator collected closes the response)
                    next(lines)
                    poll(lambda: asyncio.run(running()) == 1, 5, what="the stream running on the replica")
                    proxy.hole = True
                    held = time.monotonic()
                    poll(lambda: asyncio.run(running()) == 0, 15, what="the silent connection's stream aborted")
                    # (health_interval 0.2 + 2 x health_timeout 1.0, and the replica's check)
                    assert time.monotonic() - held < 6
            assert "far-0" in router.log()
        peers.run(proxy.close())
    assert "no frame from the router" in (tmp_path / "replica.log").read_text()


@pytest.mark.parametrize("get_delay", [0.0, 0.3])
def test_an_upstream_that_sends_no_response_head_is_out_of_dispatch_until_it_answers_again(tmp_path, get_delay):
    # (its GET /models passed, so it stayed ready, and each request sent to it
    # waited out the head timeout before failing over)
    upstream = SimOpenAI(tmp_path).start()
    try:
        with _fake_peers() as peers:
            proxy = _Proxy(upstream.port)
            proxy_port = peers.run(proxy.start())
            router = upstream_router(tmp_path / "r", f"http://127.0.0.1:{proxy_port}/v1", local=1)
            router.config.update({"health_interval": 0.2, "health_timeout": 1.0})
            router.config_path.write_text(yaml.safe_dump(router.config, sort_keys=False))
            with router:
                body = {"model": MODEL, "prompt": "Le caf", "max_tokens": 4}
                with httpx.Client(base_url=router.base_url, headers={"Authorization": f"Bearer {GOLD}"},
                                  timeout=30) as http:
                    proxy.get_delay = get_delay  # (its GET /models slow: 0.3 s of the 1 s health timeout)
                    proxy.hole_posts = True
                    assert http.post("/v1/completions", json=body).status_code == 200  # (the upstream's: failed over)
                    poll(lambda: _rows(router)[UPSTREAM]["state"] == "stalled", 5, what="the upstream stalled")
                    row = _rows(router)[UPSTREAM]
                    assert "no response head within 1s" in (row["last_error"] or ""), row
                    assert router.metrics().value("fairstream_replica_up", replica=UPSTREAM) == 0
                    for _ in range(4):  # (none goes to it: no head timeout to wait out)
                        start = time.monotonic()
                        assert http.post("/v1/completions", json=body).status_code == 200
                        assert time.monotonic() - start < 0.8
                    # Health checks pass meanwhile (/models is a GET), while their POST probe gets no answer: the
                    # probe's wait is not the health check's (it was: "no pong within 1s", down, its streams failed
                    # over, and the reconnect put it straight back in dispatch, to wait out the head timeout again).
                    for _ in range(10):
                        time.sleep(0.25)
                        row = _rows(router)[UPSTREAM]
                        assert row["state"] == "stalled" and row["reconnects"] == 0, row
                    proxy.hole_posts = False
                    poll(lambda: _rows(router)[UPSTREAM]["state"] == "ready", 10, what="the upstream back")
            peers.run(proxy.close())
    finally:
        upstream.stop()
