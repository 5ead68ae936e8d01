"""A request's counts kept in plain Python (``Metrics.counts``,
router/metric_batches.py) export what prometheus-client's ``inc`` and
``observe`` on each child exported: the same text at every scrape (its
series appearing when they did, in the same order; byte for byte but a
histogram's sum, which is added a batch at a time: equal to 1e-9), through a reload that retires a tenant
and one that adds it again, and at once in multiprocess mode."""

from __future__ import annotations

import asyncio
import math
import os
import random
import subprocess
import sys
import textwrap
from pathlib import Path
from types import SimpleNamespace

import pytest

from router.metrics import Metrics

ROOT = Path(__file__).resolve().parents[2]
_NO_POOL = SimpleNamespace(slots=[])


class Direct:
    """The request path's counting as it was: a child's ``inc`` or ``observe`` each."""

    def __init__(self, m: Metrics) -> None:
        self.m = m

    def waited(self, tenant, priority, s):
        self.m.child(self.m.queue_wait, tenant, priority).observe(s)

    def streaming(self, tenant, priority):
        self.m.child(self.m.ttft, tenant, priority)
        self.m.child(self.m.itl, tenant, priority)

    def first_token(self, tenant, priority, s):
        self.m.child(self.m.ttft, tenant, priority).observe(s)

    def ended(self, tenant, priority, endpoint, outcome):
        self.m.child(self.m.requests, tenant, endpoint, outcome).inc()

    def generated(self, tenant, priority, endpoint, outcome, prompt, completion, s):
        m = self.m
        m.child(m.requests, tenant, endpoint, outcome).inc()
        m.child(m.tokens, tenant, "prompt").inc(prompt)
        m.child(m.tokens, tenant, "completion").inc(completion)
        m.child(m.e2e, tenant, priority).observe(s)


class Batched:
    """The same through ``Metrics.counts``."""

    def __init__(self, m: Metrics) -> None:
        self.m = m

    def waited(self, tenant, priority, s):
        self.m.counts(tenant, priority).waited(s)

    def streaming(self, tenant, priority):
        self.m.counts(tenant, priority).streaming()

    def first_token(self, tenant, priority, s):
        self.m.counts(tenant, priority).first_token(s)

    def ended(self, tenant, priority, endpoint, outcome):
        self.m.counts(tenant, priority).ended(endpoint, outcome)

    def generated(self, tenant, priority, endpoint, outcome, prompt, completion, s):
        self.m.counts(tenant, priority).generated(endpoint, outcome, prompt, completion, s)


def _requests(rng: random.Random, tenants: list[tuple[str, str]], n: int):
    """``n`` requests' counting calls, as the request path makes them."""
    for _ in range(n):
        tenant, priority = rng.choice(tenants)
        endpoint = rng.choice(("chat", "completions"))
        yield "waited", (tenant, priority, rng.expovariate(20))
        fate = rng.random()
        if fate < 0.2:  # refused or timed out before its stream
            yield "ended", (tenant, priority, endpoint, rng.choice(("unavailable", "timeout_first_token")))
            continue
        yield "streaming", (tenant, priority)
        if fate > 0.3:  # (a stream that ended before a token: its histograms at 0)
            yield "first_token", (tenant, priority, rng.uniform(0.001, 2.5))
        yield "generated", (tenant, priority, endpoint, rng.choice(("ok", "cancelled")), rng.randrange(1, 900),
                            rng.randrange(0, 300), rng.uniform(0.01, 40.0))


def _scrape(m: Metrics) -> bytes:
    return asyncio.run(m.expose(_NO_POOL))


def _same(batched: bytes, direct: bytes) -> bool:
    """The two pages are the same text, but for the histograms' sums (added a
    batch at a time, which may change their last digit): equal to 1e-9."""
    a, b = batched.splitlines(), direct.splitlines()
    if len(a) != len(b):
        return False
    for x, y in zip(a, b):
        if x == y:
            continue
        nx, _, vx = x.rpartition(b" ")
        ny, _, vy = y.rpartition(b" ")
        if nx != ny or b"_sum{" not in nx or not math.isclose(float(vx), float(vy), rel_tol=1e-9):
            return False
    return True


@pytest.fixture
def pair(monkeypatch):
    monkeypatch.delenv("PROMETHEUS_MULTIPROC_DIR", raising=False)
    a, b = Metrics(), Metrics()
    for m in (a, b):
        m.declare(["r0"], {"t1": "normal", "t2": "high"})
    return a, b


def test_the_counts_export_what_each_childs_inc_and_observe_did(pair):
    a, b = pair
    direct, batched = Direct(a), Batched(b)
    rng = random.Random(7)
    # t3 is in no tenants.yaml: its children are made by its first request, as before
    calls = list(_requests(rng, [("t1", "normal"), ("t2", "high"), ("t3", "normal"), ("t1", "low")], 600))
    for i, (name, args) in enumerate(calls):
        getattr(direct, name)(*args)
        getattr(batched, name)(*args)
        if i % 97 == 0:  # scrapes in between: the sums go on from the exported ones
            assert _same(_scrape(b), _scrape(a)), i
    page = _scrape(b)
    assert _same(page, _scrape(a))
    assert b'fairstream_request_duration_seconds_count{priority="low",tenant="t1"}' in page
    assert b'fairstream_tokens_total{direction="completion",tenant="t3"}' in page


def test_a_scrape_shows_every_count_made_before_it(pair):
    _, b = pair
    b.counts("t1", "normal").generated("chat", "ok", 5, 7, 0.25)
    page = _scrape(b).decode()
    assert 'fairstream_requests_total{endpoint="chat",outcome="ok",tenant="t1"} 1.0' in page
    assert 'fairstream_tokens_total{direction="completion",tenant="t1"} 7.0' in page
    assert 'fairstream_request_duration_seconds_sum{priority="normal",tenant="t1"} 0.25' in page


def test_through_a_reload_that_retires_a_tenant_and_one_that_adds_it_again(pair):
    a, b = pair
    direct, batched = Direct(a), Batched(b)
    rng = random.Random(11)
    tenants = [("t1", "normal"), ("t2", "high")]
    # a stream's, from before the reload: it goes on counting into what it holds
    kept, kept_child = b.counts("t2", "high"), None
    phases = [list(_requests(rng, tenants, 80)) for _ in range(3)]
    for phase, step in zip(phases, (lambda m: m.retire("t2"), lambda m: m.declare([], {"t2": "high"}), None)):
        for name, args in phase:
            getattr(direct, name)(*args)
            getattr(batched, name)(*args)
        kept.ended("chat", "length")
        kept_child = kept_child or a.child(a.requests, "t2", "chat", "length")
        kept_child.inc()
        if step is not None:
            step(a)
            step(b)
        assert _same(_scrape(b), _scrape(a))


def test_in_multiprocess_mode_a_count_is_in_the_files_at_once(tmp_path):
    # (a scrape reads every worker's files; another worker's counts that waited would be missing)
    script = textwrap.dedent("""
        from prometheus_client import CollectorRegistry, generate_latest, multiprocess
        from router.metrics import Metrics
        m = Metrics()
        assert m.multiprocess
        m.counts("t1", "normal").generated("chat", "ok", 5, 7, 0.25)
        m.counts("t1", "normal").waited(0.5)
        reg = CollectorRegistry()
        multiprocess.MultiProcessCollector(reg)
        print(generate_latest(reg).decode())
    """)
    env = {**os.environ, "PROMETHEUS_MULTIPROC_DIR": str(tmp_path)}
    out = subprocess.run([sys.executable, "-c", script], cwd=ROOT, env=env, capture_output=True, text=True,
                         timeout=60, check=True).stdout
    assert 'fairstream_requests_total{endpoint="chat",outcome="ok",tenant="t1"} 1.0' in out
    assert 'fairstream_tokens_total{direction="prompt",tenant="t1"} 5.0' in out
    assert 'fairstream_request_duration_seconds_sum{priority="normal",tenant="t1"} 0.25' in out
    assert 'fairstream_queue_wait_seconds_count{priority="normal",tenant="t1"} 1.0' in out


def test_a_scrape_flushes_many_tenants_a_batch_per_turn_of_the_loop(pair):
    # (one flush of every tenant's counts held the loop ~25 ms per 1,000 tenants, every scrape)
    _, b = pair
    for i in range(120):
        b.counts(f"t{i}", "normal").generated("chat", "ok", 1, 2, 0.5)

    async def scrape_beside_a_ticker():
        turns = 0
        done = False

        async def tick():
            nonlocal turns
            while not done:
                turns += 1
                await asyncio.sleep(0)

        ticker = asyncio.ensure_future(tick())
        await asyncio.sleep(0)
        before = turns
        await b.flush_gradually(batch=50)
        during = turns - before
        done = True
        await ticker
        return during, await b.expose(_NO_POOL)

    during, page = asyncio.run(scrape_beside_a_ticker())
    assert during >= 2, during  # (120 tenants in batches of 50: the loop turned between them)
    text = page.decode()
    assert all(f'fairstream_requests_total{{endpoint="chat",outcome="ok",tenant="t{i}"}} 1.0' in text
               for i in range(120))
