"""The JSON log line's fields, and remembered metric children."""

from __future__ import annotations

import asyncio
import inspect
import json
import logging
import re
import time

import pytest
from prometheus_client import generate_latest

from replicas.logs import TurnHandler
from router.logs import JsonFormatter
from router.metrics import Metrics


def _record(created: float, **extra: object) -> logging.LogRecord:
    rec = logging.makeLogRecord({"name": "fairstream.request", "levelno": logging.INFO, "levelname": "INFO",
                              "msg": "request %s", "args": ("ok",), **extra})
    rec.created = created
    rec.msecs = int((created - int(created)) * 1000)
    return rec


def test_the_time_field_follows_each_record_across_seconds():
    fmt = JsonFormatter()
    # out of order, across a second, a minute and a day: the remembered
    # second must never leak into another record's time
    for created in (1796000000.999, 1796000001.0, 1796000000.5, 1796000060.25, 1796086400.001, 1796000001.75):
        line = json.loads(fmt.format(_record(created)))
        expected = time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(int(created))) + f".{int((created % 1) * 1000):03d}Z"
        assert line["time"] == expected
        assert line["ts"] == round(created, 6)


def test_extra_fields_keep_their_order_and_values():
    line = json.loads(JsonFormatter().format(_record(1796000000.0, tenant="t1", outcome="ok", duration_s=0.5)))
    assert list(line)[:5] == ["ts", "time", "level", "logger", "msg"]
    assert line["msg"] == "request ok"
    assert [k for k in line if k in ("tenant", "outcome", "duration_s")] == ["tenant", "outcome", "duration_s"]
    assert line["duration_s"] == 0.5


def test_a_remembered_child_is_the_one_the_family_exports(monkeypatch):
    monkeypatch.delenv("PROMETHEUS_MULTIPROC_DIR", raising=False)  # an own registry to read back
    m = Metrics()
    c = m.child(m.requests, "t1", "chat", "ok")
    assert m.child(m.requests, "t1", "chat", "ok") is c
    # every label value counts, not only the first; and the family counts too
    assert m.child(m.requests, "t1", "chat", "lost") is not c
    assert m.child(m.requests, "t1", "completions", "ok") is not c
    assert m.child(m.tokens, "t1", "prompt") is not m.child(m.tokens, "t1", "completion")
    assert m.child(m.e2e, "t1", "normal") is not m.child(m.ttft, "t1", "normal")
    c.inc()
    m.child(m.requests, "t1", "chat", "ok").inc()
    m.child(m.requests, "t1", "chat", "lost").inc(3)
    m.child(m.requests, "t2", "chat", "ok").inc()
    m.child(m.tokens, "t1", "prompt").inc(5)
    m.child(m.tokens, "t1", "completion").inc(7)
    text = generate_latest(m.registry).decode()
    assert 'fairstream_requests_total{endpoint="chat",outcome="ok",tenant="t1"} 2.0' in text
    assert 'fairstream_requests_total{endpoint="chat",outcome="lost",tenant="t1"} 3.0' in text
    assert 'fairstream_requests_total{endpoint="chat",outcome="ok",tenant="t2"} 1.0' in text
    assert 'fairstream_requests_total{endpoint="completions",outcome="ok",tenant="t1"} 0.0' in text
    assert 'fairstream_tokens_total{direction="prompt",tenant="t1"} 5.0' in text
    assert 'fairstream_tokens_total{direction="completion",tenant="t1"} 7.0' in text


def test_refusals_and_timeouts_are_counted_only_under_declared_labels():
    # a label value outside RATE_LIMITS / TIMEOUTS would be a series that
    # declare() never exported at 0, so increase() would miss its first event
    m = Metrics()
    m.declare([], {"acme": "normal"})
    m.limited("acme", "queue_wait")
    m.timed_out("acme", "first_token")
    text = generate_latest(m.registry).decode()
    assert 'fairstream_rate_limited_total{limit="queue_wait",tenant="acme"} 1.0' in text
    assert 'fairstream_timeouts_total{tenant="acme",timeout="first_token"} 1.0' in text
    with pytest.raises(AssertionError):
        m.limited("acme", "too_large")
    with pytest.raises(AssertionError):
        m.timed_out("acme", "stall")


def test_a_request_ended_by_a_bug_is_an_error_not_a_cancellation():
    import asyncio

    from router.errors import BadRequest, Forbidden, Unauthorized
    from router.relay import outcome_of
    assert outcome_of(asyncio.CancelledError()) == "cancelled"
    assert outcome_of(ConnectionResetError()) == "cancelled"
    assert outcome_of(BadRequest("x")) == "client_error"
    # (a key refused once its request had a tenant: one a reload removed while the request waited)
    assert outcome_of(Unauthorized("x")) == outcome_of(Forbidden("x")) == "unauthorized"
    # (a 500 was counted and logged as "request cancelled": invisible to dashboards and alerts)
    assert outcome_of(OverflowError("can't serialize")) == "error"


def test_a_replica_process_keeps_the_process_id_that_vllms_log_format_uses():
    import subprocess
    import sys
    # (a replica process logged every vLLM line as a '--- Logging error ---'
    # traceback: %(process)d met None)
    code = ("import logging, sys; from replicas.logs import setup_logging; "
            "setup_logging('info', json=False, lean=False); "
            "h = logging.StreamHandler(sys.stdout); h.setFormatter(logging.Formatter('pid=%(process)d %(message)s')); "
            "logging.getLogger('vllm').addHandler(h); logging.getLogger('vllm').warning('hello')")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=30)
    assert "Logging error" not in out.stderr, out.stderr
    assert out.stdout.startswith("pid=") and "hello" in out.stdout


class _Writes:
    """A stream that keeps each write."""

    def __init__(self) -> None:
        self.writes: list[str] = []

    def write(self, text: str) -> None:
        self.writes.append(text)

    def flush(self) -> None:
        pass


def _turn_logger(stream: _Writes) -> tuple[logging.Logger, TurnHandler]:
    handler = TurnHandler(stream)
    handler.setFormatter(logging.Formatter("%(message)s"))
    logger = logging.getLogger(f"test.turn.{id(stream)}")
    logger.propagate = False
    logger.setLevel(logging.INFO)
    logger.addHandler(handler)
    return logger, handler


async def test_lines_logged_in_one_turn_of_the_bound_loop_are_written_together_after_it():
    stream = _Writes()
    logger, handler = _turn_logger(stream)
    handler.bind(asyncio.get_running_loop())
    try:
        logger.info("one")
        logger.info("two")
        assert stream.writes == []  # not before the turn ends
        await asyncio.sleep(0)
        assert stream.writes == ["one\ntwo\n"]
        # a line from another thread goes at once, after the ones waiting
        logger.info("three")
        await asyncio.to_thread(logger.info, "from a thread")
        assert stream.writes[1:] == ["three\n", "from a thread\n"]
        logger.info("four")
    finally:
        handler.unbind()  # writes what waits
    assert stream.writes[-1] == "four\n"
    logger.info("five")  # unbound: at once
    assert stream.writes[-1] == "five\n"


def test_a_line_logged_after_the_bound_loop_closed_is_written_at_once():
    stream = _Writes()
    logger, handler = _turn_logger(stream)
    loop = asyncio.new_event_loop()
    handler.bind(loop)
    loop.close()
    logger.info("after")
    assert stream.writes == ["after\n"]
    logger.info("again")
    assert stream.writes == ["after\n", "again\n"]


async def test_a_stream_that_fails_is_reported_once_per_turn_and_the_loop_goes_on(monkeypatch) -> None:
    # (a flush on the loop that raised would be logged by the loop's
    # exception handler, through this handler, which would flush again:
    # a busy loop)
    class Broken(_Writes):
        def write(self, text: str) -> None:
            raise BrokenPipeError("the log reader is gone")

        def flush(self) -> None:
            raise BrokenPipeError("the log reader is gone")

    logger, handler = _turn_logger(Broken())
    reported: list[object] = []
    monkeypatch.setattr(handler, "handleError", reported.append)
    loop = asyncio.get_running_loop()
    handled: list[dict] = []
    loop.set_exception_handler(lambda _, context: handled.append(context))
    handler.bind(loop)
    try:
        logger.info("one")
        logger.info("two")
        for _ in range(5):
            await asyncio.sleep(0)
        assert len(reported) == 1 and handled == []
    finally:
        loop.set_exception_handler(None)
        handler.unbind()


def test_a_line_logged_in_the_last_turn_of_a_loop_closed_bound_is_not_held_back() -> None:
    stream = _Writes()
    logger, handler = _turn_logger(stream)
    loop = asyncio.new_event_loop()
    handler.bind(loop)
    loop.call_soon(loop.stop)
    loop.call_soon(logger.info, "last turn")  # (its turn's end never comes)
    loop.run_forever()
    loop.close()
    logger.info("after")
    assert stream.writes == ["last turn\n", "after\n"]


async def test_a_turns_lines_go_out_in_writes_a_pipe_takes_whole() -> None:
    stream = _Writes()
    logger, handler = _turn_logger(stream)
    handler.bind(asyncio.get_running_loop())
    try:
        lines = [f"{i:03d} " + "x" * 395 for i in range(30)]  # 400 bytes each, with the newline
        for line in lines:
            logger.info(line)
        logger.info("é" * 3000)  # 6,000 bytes: alone, as one line always was
        await asyncio.sleep(0)
    finally:
        handler.unbind()
    assert "".join(stream.writes) == "".join(f"{line}\n" for line in lines) + "é" * 3000 + "\n"
    assert [len(w.encode()) for w in stream.writes] == [4000, 4000, 4000, 6001]


def test_reload_results_are_exported_at_zero_before_the_first_reload():
    # (with no series until then, increase() over the first failure counted 0)
    text = generate_latest(Metrics().registry).decode()
    assert 'fairstream_config_reloads_total{result="success"} 0.0' in text
    assert 'fairstream_config_reloads_total{result="failure"} 0.0' in text


def _json_root(monkeypatch, formatter: logging.Formatter) -> _Writes:
    """The root logger as ``setup_logging`` leaves it (one ``TurnHandler``),
    without pytest's capture handlers."""
    stream = _Writes()
    handler = TurnHandler(stream)
    handler.setFormatter(formatter)
    root = logging.getLogger()
    monkeypatch.setattr(root, "handlers", [handler])
    monkeypatch.setattr(root, "level", logging.INFO)
    logging.getLogger("test.summary").setLevel(logging.NOTSET)
    return stream


def test_a_summary_line_is_the_line_its_record_would_make_and_costs_no_record(monkeypatch):
    from replicas.logs import SummaryLog
    from router.logs import request_id_var

    stream = _json_root(monkeypatch, JsonFormatter({"pid": 7}))
    made: list[object] = []
    make = logging.Logger.makeRecord
    monkeypatch.setattr(logging.Logger, "makeRecord", lambda *a, **k: made.append(a) or make(*a, **k))
    fields = {"request_id": "r1", "tenant": "t", "outcome": "ok", "duration_s": 0.25, "prompt_tokens": 3,
              "prompt": [{"role": "user", "content": "é \"quoted\""}]}
    token = request_id_var.set("ctx-id")
    try:
        SummaryLog("test.summary").info("request ok", fields)
        assert made == []  # straight to the handler
        logging.getLogger("test.summary").info("request %s", "ok", extra=fields)
        assert len(made) == 1
        del fields["request_id"]  # the context's id fills in, as on a record
        SummaryLog("test.summary").info("request ok", fields)
    finally:
        request_id_var.reset(token)
    direct, logged, filled = (json.loads(w) for w in stream.writes)
    for line in (direct, logged, filled):
        assert abs(line.pop("ts") - time.time()) < 5 and line.pop("time").endswith("Z")
    assert list(direct.items()) == list(logged.items())  # same fields, same order
    assert direct["pid"] == 7 and direct["msg"] == "request ok" and direct["prompt"][0]["content"] == 'é "quoted"'
    assert filled["request_id"] == "ctx-id"


def test_a_summary_line_goes_through_logging_whenever_anything_else_would_see_it(monkeypatch):
    from replicas.logs import SummaryLog, TextFormatter

    log = SummaryLog("test.summary")
    stream = _json_root(monkeypatch, JsonFormatter())
    seen: list[logging.LogRecord] = []
    other = logging.Handler()
    other.emit = seen.append  # type: ignore[method-assign]
    logging.getLogger().handlers.append(other)  # (pytest's caplog is such a handler)
    log.info("request ok", {"tenant": "t"})
    assert [(r.getMessage(), r.tenant) for r in seen] == [("request ok", "t")]  # type: ignore[attr-defined]
    assert json.loads(stream.writes[0])["tenant"] == "t"
    logging.getLogger().handlers.remove(other)

    logger = logging.getLogger("test.summary")
    monkeypatch.setattr(logger, "filters", [lambda r: False])
    log.info("request ok", {"tenant": "filtered"})
    monkeypatch.setattr(logger, "filters", [])
    monkeypatch.setattr(logger, "level", logging.WARNING)
    logger.manager._clear_cache()
    log.info("request ok", {"tenant": "quiet"})
    monkeypatch.setattr(logger, "level", logging.NOTSET)
    logger.manager._clear_cache()
    assert len(stream.writes) == 1

    stream = _json_root(monkeypatch, TextFormatter("%(name)s %(levelname)s %(message)s"))
    log.info("request ok", {"tenant": "t"})
    assert stream.writes == ["test.summary INFO request ok tenant=t\n"]


async def test_a_summary_line_that_cannot_be_written_is_reported_with_its_text(monkeypatch) -> None:
    class Broken(_Writes):
        def write(self, text: str) -> None:
            raise BrokenPipeError("the log reader is gone")

    handler = TurnHandler(Broken())
    reported: list[logging.LogRecord] = []
    monkeypatch.setattr(handler, "handleError", reported.append)
    handler.emit_line("at once")  # (no loop bound)
    handler.bind(asyncio.get_running_loop())
    try:
        handler.emit_line("one")
        handler.emit_line("two")
        await asyncio.sleep(0)
    finally:
        handler.unbind()
    assert [r.getMessage() for r in reported] == ["at once", "two"]


def test_a_summary_line_that_cannot_be_formatted_is_reported_not_raised(monkeypatch):
    # (a record's formatting errors are logging's to report; the line without
    # a record raised into the request's settlement instead)
    from replicas.logs import SummaryLog

    class Bad:
        def __str__(self) -> str:
            raise ValueError("no str")

    stream = _json_root(monkeypatch, JsonFormatter())
    handler = logging.getLogger().handlers[0]
    reported: list[logging.LogRecord] = []
    monkeypatch.setattr(handler, "handleError", reported.append)
    SummaryLog("test.summary").info("request ok", {"bad": Bad()})
    assert [r.getMessage() for r in reported] == ["request ok"] and stream.writes == []


def test_a_text_line_quotes_a_field_with_a_control_character():
    from replicas.logs import TextFormatter
    fmt = TextFormatter("%(message)s")
    for value in ("a\rforged", "a\x1b[2Jb", "a\tb", "a\x85b", "a\u2028b", "a\nb", "caf\u00e9 \ud800"):
        record = logging.LogRecord("fairstream.request", logging.INFO, __file__, 1, "request ok", None, None)
        record.path = value
        line = fmt.format(record)
        # (a bare \r let a client's path overwrite the start of the line on a terminal)
        assert line.isprintable(), repr(line)
        assert json.loads(line.split("path=", 1)[1]) == value
    record = logging.LogRecord("fairstream.request", logging.INFO, __file__, 1, "request ok", None, None)
    record.path = "/v1/completions"
    assert fmt.format(record) == "request ok path=/v1/completions"


def test_queue_depth_resumes_and_store_errors_are_exported_at_0(monkeypatch):
    # (they appeared at their first event: Grafana's panels said "No data",
    # and rate()/increase() missed each new label's first event)
    from router.state.base import ERROR_OPS
    from router.state.resilient import ResilientStore

    monkeypatch.delenv("PROMETHEUS_MULTIPROC_DIR", raising=False)
    m = Metrics()
    m.declare([], {"acme": "high", "bolt": "low"})
    text = generate_latest(m.registry).decode()
    for tenant, priority in (("acme", "high"), ("bolt", "low")):
        assert f'fairstream_queue_depth{{priority="{priority}",tenant="{tenant}"}} 0.0' in text
        assert f'fairstream_stream_resumes_total{{tenant="{tenant}"}} 0.0' in text
    assert 'fairstream_queue_depth{priority="normal",tenant="acme"}' not in text  # (not its class)
    for op in ("connect", "admit", "settle", "renew", "stream_append", "stream_read", "ping"):
        assert f'fairstream_state_store_errors_total{{op="{op}"}} 0.0' in text
    # every op the store counts is one exported at 0 (an outage on each is in tests/contract)
    source = inspect.getsource(ResilientStore)
    counted = set(re.findall(r'_down\("(\w+)"', source)) | set(re.findall(r'_stream_op\(\s*"(\w+)"', source))
    assert counted and counted <= set(ERROR_OPS), counted - set(ERROR_OPS)
