"""Drives a scenario: closed-loop workers or Poisson arrivals, bounded in count and time.

``Run`` owns everything it starts (request tasks, workers, the scraper, the
HTTP clients) and ends it before ``execute`` returns. Requests are spread over
several small httpx clients (httpcore's pool scans every connection per
request), and streams are read to their end so connections are reused. Sending stops at the
scenario's time limit or request count; open requests then get
``drain_timeout_s`` to finish, after which they are cancelled (and recorded
as ``cancelled``).
"""

from __future__ import annotations

import asyncio
import contextlib
import math
import random
import signal
import ssl
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field

import httpx

from ops.loadgen.client import Result, send
from ops.loadgen.plan import Planner, RequestSpec, split_workers
from ops.loadgen.scenario import Scenario
from ops.loadgen.scrape import Scraper, Snapshot

__all__ = ["Run", "RunData", "Progress"]

_CONNS_PER_CLIENT = 16
_LAG_PROBE_S = 0.05


@dataclass
class Progress:
    """Live counters for the progress display."""

    sent: int = 0
    completed: int = 0
    errors: int = 0
    tokens: float = 0.0
    recent: deque = field(default_factory=lambda: deque(maxlen=4096))  # (time, tokens) of finished requests

    def tokens_per_s(self, now: float, window: float = 3.0) -> float:
        while self.recent and self.recent[0][0] < now - window:
            self.recent.popleft()
        return sum(n for _, n in self.recent) / window


@dataclass
class RunData:
    """Everything a run measured."""

    scenario: Scenario
    base_url: str
    started_at: float  # wall clock (time.time()) at start
    wall_s: float = 0.0  # start -> last request ended
    send_s: float = 0.0  # start -> sending stopped
    results: list[Result] = field(default_factory=list)
    snapshots: list[Snapshot] = field(default_factory=list)
    scrape_errors: int = 0
    loop_lag: list[float] = field(default_factory=list)
    """How late the client's event loop woke a 50 ms timer, sampled through the run:
    large values mean the load generator itself was the bottleneck."""
    interrupted: bool = False  # Ctrl-C stopped the sending before the scenario's bounds


class Run:
    def __init__(self, scenario: Scenario, base_url: str, *, scrape: bool = True,
                 on_tick: Callable[[Run], None] | None = None) -> None:
        self.s = scenario
        self.base_url = base_url.rstrip("/")
        self.planner = Planner(scenario)
        self.progress = Progress()
        self.data = RunData(scenario, self.base_url, time.time())
        self.scrape = scrape and scenario.scrape_interval_s > 0
        self.on_tick = on_tick
        self.t0 = time.perf_counter()
        self._tasks: set[asyncio.Task] = set()
        self._stop = asyncio.Event()
        self._clients: list[httpx.AsyncClient] = []
        self._next_client = 0

    # -- progress --------------------------------------------------------------

    def elapsed(self) -> float:
        return time.perf_counter() - self.t0

    def fraction(self) -> float:
        """How far the run is (0-1), by time or by count, whichever is further."""
        f = min(1.0, self.elapsed() / self.s.time_limit())
        if self.s.max_requests:
            f = max(f, self.progress.sent / self.s.max_requests)
        return f

    def interrupt(self) -> None:
        """Ctrl-C: stop sending and drain what is open, then report as after
        any run; once the sending is over (this Ctrl-C's, or the scenario's
        bounds), end what is open at once."""
        if self._stop.is_set():
            for t in list(self._tasks):
                t.cancel()
            return
        self.data.interrupted = True
        self._stop.set()

    def _finish(self, r: Result) -> None:
        self.data.results.append(r)
        p = self.progress
        p.completed += 1
        if not r.ok:
            p.errors += 1
        p.tokens += r.completion_tokens
        p.recent.append((self.elapsed(), r.completion_tokens))

    # -- sending ---------------------------------------------------------------

    def _may_send(self) -> bool:
        if self._stop.is_set():
            return False
        if self.s.max_requests is not None and self.progress.sent >= self.s.max_requests:
            self._stop.set()
            return False
        if self.elapsed() >= self.s.time_limit():
            self._stop.set()
            return False
        return True

    def _client(self) -> httpx.AsyncClient:
        """Clients in turn: httpcore's pool scans all its connections for every
        request, so many small pools cost far less client CPU than one big one."""
        self._next_client = (self._next_client + 1) % len(self._clients)
        return self._clients[self._next_client]

    async def _one(self, spec: RequestSpec, client: httpx.AsyncClient) -> Result:
        r = Result(spec.tenant, spec.cls, spec.stream, self.elapsed())
        try:
            await send(client, self.base_url, spec, r, t0=self.t0, timeout=self.s.request_timeout_s)
        finally:
            self._finish(r)
        return r

    async def _worker(self, tenant: str) -> None:
        client = self._client()  # a closed-loop worker has one request open at a time
        while self._may_send():
            self.progress.sent += 1
            r = await self._one(self.planner.next(tenant), client)
            if not r.ok and self.s.error_pause_s:
                try:
                    await asyncio.wait_for(self._stop.wait(), self.s.error_pause_s)
                except TimeoutError:
                    pass

    async def _arrivals(self) -> None:
        rng = random.Random(f"{self.s.seed}:arrivals")
        assert self.s.rate is not None
        next_at = self.elapsed()
        while True:
            next_at += rng.expovariate(self.s.rate)
            delay = next_at - self.elapsed()
            if delay > 0:
                try:
                    await asyncio.wait_for(self._stop.wait(), delay)
                except TimeoutError:
                    pass
            if not self._may_send():
                return
            self.progress.sent += 1
            spec = self.planner.next(self.planner.next_tenant())
            if len(self._tasks) >= self.s.max_inflight:
                r = Result(spec.tenant, spec.cls, spec.stream, self.elapsed(), error="client_overload")
                self._finish(r)
                continue
            self._spawn(self._one(spec, self._client()))

    def _spawn(self, coro) -> asyncio.Task:
        task = asyncio.get_running_loop().create_task(coro)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)
        return task

    async def _ticker(self) -> None:
        last_tick = 0.0
        while True:
            now = self.elapsed()
            if now - last_tick >= 0.25:
                last_tick = now
                if self.on_tick is not None:
                    self.on_tick(self)
                if now >= self.s.time_limit():
                    self._stop.set()
            await asyncio.sleep(_LAG_PROBE_S)
            self.data.loop_lag.append(max(0.0, self.elapsed() - now - _LAG_PROBE_S))

    # -- the run ----------------------------------------------------------------

    async def execute(self) -> RunData:
        s = self.s
        n_open = s.concurrency or s.max_inflight
        n_clients = max(1, math.ceil(n_open / _CONNS_PER_CLIENT))
        # Enough connections per client for its share (round-robin), plus slack.
        per_client = math.ceil(n_open / n_clients) + 4
        limits = httpx.Limits(max_connections=per_client, max_keepalive_connections=per_client)
        timeout = httpx.Timeout(s.request_timeout_s, connect=10.0)
        scraper = Scraper(self.base_url + "/metrics", s.scrape_interval_s, self.t0) if self.scrape else None
        tls = ssl.create_default_context()  # one for all clients: each would load the CA store
        async with contextlib.AsyncExitStack() as stack:
            self._clients = [
                await stack.enter_async_context(
                    httpx.AsyncClient(limits=limits, timeout=timeout, trust_env=False, verify=tls))
                for _ in range(n_clients)
            ]
            # The scraper has its own connection: never queued behind the load.
            client = await stack.enter_async_context(httpx.AsyncClient(timeout=timeout, trust_env=False, verify=tls))
            self.t0 = time.perf_counter()
            self.data.started_at = time.time()
            if scraper is not None:
                scraper.t0 = self.t0
                scraper.start(client)
            loop = asyncio.get_running_loop()
            ticker = loop.create_task(self._ticker())
            # (not in the main thread: no handler; uvloop says so with a ValueError)
            with contextlib.suppress(NotImplementedError, RuntimeError, ValueError):
                loop.add_signal_handler(signal.SIGINT, self.interrupt)
            try:
                if s.mode == "concurrency":
                    assert s.concurrency is not None
                    split = split_workers(s.concurrency, self.planner.tenant_weights())
                    for tenant, n in split.items():
                        for _ in range(n):
                            self._spawn(self._worker(tenant))
                    await self._stop.wait()
                else:
                    await self._arrivals()
                self._stop.set()
                self.data.send_s = self.elapsed()
                if self._tasks:
                    _, pending = await asyncio.wait(set(self._tasks), timeout=s.drain_timeout_s)
                    for t in pending:
                        t.cancel()
                    await asyncio.gather(*pending, return_exceptions=True)
            finally:
                self._stop.set()
                for t in list(self._tasks):
                    t.cancel()
                await asyncio.gather(*self._tasks, return_exceptions=True)
                ticker.cancel()
                await asyncio.gather(ticker, return_exceptions=True)
                if scraper is not None:
                    await scraper.close()
                    self.data.snapshots = scraper.snapshots
                    self.data.scrape_errors = scraper.errors
                self._clients = []
                with contextlib.suppress(NotImplementedError, RuntimeError, ValueError):
                    loop.remove_signal_handler(signal.SIGINT)
        self.data.wall_s = self.elapsed()
        if self.on_tick is not None:
            self.on_tick(self)
        return self.data
