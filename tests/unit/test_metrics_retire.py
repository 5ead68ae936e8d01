"""A tenant removed by a reload leaves /metrics (Metrics.retire): its series
go, its in-flight gauges once back to 0, nothing counted for it later comes
back, and a tenant added again is exported as a new one."""

from __future__ import annotations

import asyncio
import warnings

import pytest
from prometheus_client import Gauge, generate_latest
from prometheus_client.metrics import MetricWrapperBase

from router.metrics import HistogramBatch, Metrics


@pytest.fixture
def m(monkeypatch) -> Metrics:
    monkeypatch.delenv("PROMETHEUS_MULTIPROC_DIR", raising=False)  # an own registry to read back
    return Metrics()


def _lines(m: Metrics, tenant: str) -> list[str]:
    return [line for line in generate_latest(m.registry).decode().splitlines() if f'tenant="{tenant}"' in line]


def _values(family: MetricWrapperBase, tenant: str) -> tuple[str, ...]:
    """Label values of one child of ``family`` for ``tenant``."""
    return (tenant, *(f"v{i}" for i in range(len(family._labelnames) - 1)))  # (test-only: the label count)


def _traffic(m: Metrics, tenant: str) -> None:
    """One of everything counted per tenant, with the in-flight gauges back at 0."""
    m.declare([], {tenant: "normal"})
    for family in m.by_tenant:
        values = _values(family, tenant)
        if isinstance(family, Gauge):
            m.gauge_up(family, *values)
            m.gauge_down(family, *values)
        elif hasattr(family, "observe"):
            m.child(family, *values).observe(0.2)
        else:
            m.child(family, *values).inc()
    m.limited(tenant, "queue")
    m.timed_out(tenant, "total")


def test_every_family_labelled_by_tenant_is_known_to_retire(m):
    # (a family labelled by tenant that ``retire`` did not know would keep a
    # removed tenant's series: the leak this guards against)
    families = [v for v in vars(m).values() if isinstance(v, MetricWrapperBase)]
    labelled = {f for f in families if "tenant" in f._labelnames}
    assert labelled == set(m.by_tenant)
    assert all(f._labelnames[0] == "tenant" for f in labelled)


def test_a_retired_tenant_leaves_metrics_and_the_others_stay(m):
    _traffic(m, "gone")
    _traffic(m, "stays")
    before = _lines(m, "stays")
    assert len(_lines(m, "gone")) == len(before) > 100  # (every family has a child of each)
    m.retire("gone")
    assert _lines(m, "gone") == []
    assert _lines(m, "stays") == before
    # no remembered child of the tenant is left behind
    assert not [k for k in m._children if k[0] in m.by_tenant and k[1][0] == "gone"]
    assert [k for k in m._children if k[0] in m.by_tenant and k[1][0] == "stays"]


def test_what_is_counted_for_a_retired_tenant_later_is_exported_nowhere(m):
    # (its waiting requests are refused with 401 just after the reload, and
    # its running streams end later: neither brings a series back)
    _traffic(m, "gone")
    kept = m.child(m.itl, "gone", "normal")  # a stream running across the reload holds its children
    m.retire("gone")
    m.child(m.requests, "gone", "completions", "unauthorized").inc()
    m.child(m.tokens, "gone", "completion").inc(7)
    m.child(m.e2e, "gone", "normal").observe(1.5)
    m.limited("gone", "queue")
    m.timed_out("gone", "total")
    kept.observe(0.01)
    batch = HistogramBatch(m.child(m.itl, "gone", "normal"))  # (a new stream's token lane works on it too)
    batch.add(0.02)
    batch.flush()
    assert _lines(m, "gone") == []
    # and nothing piles up behind the scenes
    assert all(not list(f.collect()[0].samples) for f in m._unexported.values())
    assert not [k for k in m._children if k[0] in m.by_tenant and k[1][0] == "gone"]


def test_a_gauge_still_counting_requests_stays_until_it_is_back_to_0(m):
    m.declare([], {"gone": "normal"})
    m.gauge_up(m.admission_waiting, "gone")
    m.gauge_up(m.admission_waiting, "gone")
    m.gauge_up(m.queued, "gone", "normal")
    m.gauge_up(m.queued, "gone", "low")
    m.gauge_down(m.queued, "gone", "low")  # (at 0: goes with the rest)
    m.retire("gone")
    assert sorted(_lines(m, "gone")) == [
        'fairstream_admission_waiting{tenant="gone"} 2.0',
        'fairstream_queue_depth{priority="normal",tenant="gone"} 1.0',
    ]
    # a request that started before the reload enters late: still counted there
    m.gauge_up(m.admission_waiting, "gone")
    m.gauge_down(m.queued, "gone", "normal")
    assert _lines(m, "gone") == ['fairstream_admission_waiting{tenant="gone"} 3.0']
    m.gauge_down(m.admission_waiting, "gone")
    m.gauge_down(m.admission_waiting, "gone")
    assert _lines(m, "gone") == ['fairstream_admission_waiting{tenant="gone"} 1.0']
    m.gauge_down(m.admission_waiting, "gone")
    assert _lines(m, "gone") == []
    # once gone, a late request's up and down show nowhere (and never below 0)
    m.gauge_up(m.queued, "gone", "normal")
    m.gauge_down(m.queued, "gone", "normal")
    m.gauge_down(m.admission_waiting, "gone")
    assert _lines(m, "gone") == []
    assert not m._draining


def test_a_tenant_added_again_is_exported_from_0(m):
    _traffic(m, "back")
    m.child(m.requests, "back", "chat", "ok").inc(5)
    m.retire("back")
    m.declare([], {"back": "normal"})
    lines = _lines(m, "back")
    # the event counters at 0, as for a new tenant; nothing of its old counts
    assert 'fairstream_rate_limited_total{limit="queue",tenant="back"} 0.0' in lines
    assert 'fairstream_timeouts_total{tenant="back",timeout="total"} 0.0' in lines
    assert 'fairstream_requests_total{endpoint="chat",outcome="error",tenant="back"} 0.0' in lines
    assert not [line for line in lines if "fairstream_requests" in line and not line.endswith(" 0.0")]
    # and counted again, through remembered children the family exports
    c = m.child(m.requests, "back", "chat", "ok")
    c.inc()
    assert m.child(m.requests, "back", "chat", "ok") is c
    assert 'fairstream_requests_total{endpoint="chat",outcome="ok",tenant="back"} 1.0' in _lines(m, "back")


def test_a_tenant_added_again_while_its_gauge_drains_keeps_the_gauge(m):
    m.declare([], {"t": "normal"})
    m.gauge_up(m.admission_waiting, "t")
    m.gauge_up(m.admission_waiting, "t")
    m.retire("t")
    m.declare([], {"t": "normal"})  # back before its waiting requests left
    m.gauge_down(m.admission_waiting, "t")
    m.gauge_down(m.admission_waiting, "t")
    # an ordinary gauge again: at 0, exported
    assert 'fairstream_admission_waiting{tenant="t"} 0.0' in _lines(m, "t")
    m.gauge_up(m.admission_waiting, "t")
    assert 'fairstream_admission_waiting{tenant="t"} 1.0' in _lines(m, "t")


def test_in_multiprocess_mode_retire_keeps_the_series_quietly(monkeypatch, tmp_path):
    # prometheus-client cannot remove a series whose values are in files
    # (``remove`` warns there); they stay until the router restarts
    monkeypatch.setenv("PROMETHEUS_MULTIPROC_DIR", str(tmp_path))
    m = Metrics()
    assert m.multiprocess
    m.declare([], {"gone": "normal"})
    c = m.child(m.requests, "gone", "chat", "ok")
    m.gauge_up(m.admission_waiting, "gone")
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        m.retire("gone")
        m.gauge_down(m.admission_waiting, "gone")
    assert m.child(m.requests, "gone", "chat", "ok") is c


def test_retiring_many_tenants_reads_no_family_whole(m, monkeypatch):
    # (retire read every sample of every family once per removed tenant: a
    # reload that removed 1,000 tenants held the event loop ~30 s, 2,000
    # ~170 s, and every stream with it). Now one look at each family's
    # children for all of them; a family's own ``collect`` (all its samples) is never called.
    for i in range(300):
        _traffic(m, f"t{i}")
    _traffic(m, "stays")
    stays = _lines(m, "stays")
    whole: list[MetricWrapperBase] = []
    collect = MetricWrapperBase.collect

    def counting(self):
        if not self._labelvalues and self._labelnames:  # a family, not one child
            whole.append(self)
        return collect(self)

    monkeypatch.setattr(MetricWrapperBase, "collect", counting)
    m.retire(*(f"t{i}" for i in range(300)))
    monkeypatch.setattr(MetricWrapperBase, "collect", collect)
    assert whole == []
    assert all(_lines(m, f"t{i}") == [] for i in range(0, 300, 37))
    assert _lines(m, "stays") == stays


def test_a_tenant_moved_to_another_class_leaves_its_old_class_queue_depth_when_it_is_empty(m):
    # (a reload that changed a tenant's priority class left its queue depth
    # exported under the old class too, at 0, until a restart)
    m.declare([], {"t": "normal", "u": "normal"})
    m.gauge_up(m.queued, "u", "normal")  # (u has a request still queued under its old class)
    m.reclass({"t": "high", "u": "high"})
    m.declare([], {"t": "high", "u": "high"})
    text = generate_latest(m.registry).decode()
    assert 'fairstream_queue_depth{priority="normal",tenant="t"}' not in text
    assert 'fairstream_queue_depth{priority="high",tenant="t"} 0.0' in text
    assert 'fairstream_queue_depth{priority="normal",tenant="u"} 1.0' in text
    m.gauge_down(m.queued, "u", "normal")  # (its last one leaves: the series goes)
    assert 'fairstream_queue_depth{priority="normal",tenant="u"}' not in generate_latest(m.registry).decode()


async def test_retiring_gradually_looks_at_a_batch_of_children_per_loop_turn(m):
    # (a reload that removed 5,000 tenants removed their 115,000 children in
    # one turn: every stream stopped ~0.6 s)
    for i in range(40):
        m.declare([], {f"t{i}": "normal"})
    _traffic(m, "stays")
    stays = _lines(m, "stays")
    children = sum(len(f._metrics) for f in m.by_tenant)
    turns = sum(-(-len(f._metrics) // 25) for f in m.by_tenant if f._metrics)
    steps = list(m._retiring([f"t{i}" for i in range(40)], 25))
    assert len(steps) == turns and children > 25 * len(m.by_tenant)
    assert all(_lines(m, f"t{i}") == [] for i in range(40))
    assert _lines(m, "stays") == stays
    # on the loop: retired at once (counts go nowhere), its series go a batch a turn
    _traffic(m, "a")
    m.declare([], {"b": "normal"})
    task = asyncio.ensure_future(m.retire_gradually(["a", "b"], batch=5))
    await asyncio.sleep(0)
    assert m._retired >= {"a", "b"} and _lines(m, "b")
    await task
    assert _lines(m, "a") == [] == _lines(m, "b")


async def test_a_tenant_added_again_while_its_series_go_is_exported_as_a_new_one(m):
    # (its families not yet walked kept its old series, the others lost
    # them: it came back half old, half new)
    m.declare([], {"new": "normal"})
    new = [line.replace('"new"', '"t"') for line in _lines(m, "new")]  # (what a new tenant exports)
    for i in range(20):
        _traffic(m, f"t{i}")
    _traffic(m, "t")
    m.child(m.requests, "t", "chat", "ok").inc(5)
    m.child(m.e2e, "t", "normal").observe(3)
    m.gauge_up(m.admission_waiting, "t")
    m.gauge_up(m.admission_waiting, "t")  # (two requests still waiting)
    task = asyncio.ensure_future(m.retire_gradually([f"t{i}" for i in range(20)] + ["t"], batch=5))
    first = next(iter(m.by_tenant))
    while any(values[0] == "t" for values in first._metrics):  # (its first family walked, the others not)
        await asyncio.sleep(0)
    partly = _lines(m, "t")
    assert not task.done() and partly and not [line for line in partly if line.startswith(first._name)]
    m.unretire(["t"])  # (a reload adds it back: Service._on_reload)
    await m.declare_gradually({"t": "normal"})
    await task
    m.gauge_down(m.admission_waiting, "t")
    m.gauge_down(m.admission_waiting, "t")
    assert sorted(_lines(m, "t")) == sorted(new) and len(new) > 20
    assert _lines(m, "t1") == []
