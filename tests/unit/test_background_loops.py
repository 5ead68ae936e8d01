"""The router's background loops go on after an unexpected exception, and say
so at ERROR (rate-limited); a task that dies anyway says so when it dies,
and ``stop`` says so for one that nobody reported (router/background.py).

The stores here are dependency doubles: each raises ``ValueError`` (an
exception no loop expects: not ``StoreUnavailable``) at its first call."""

from __future__ import annotations

import asyncio
import logging
from types import SimpleNamespace

import pytest

import router.background as background
import router.leases as leases
import router.peers as peers_mod
import router.relay as relay
import router.resume as resume
from router.background import KeepGoing, spawn
from router.leases import LeaseKeeper
from router.metrics import Metrics
from router.peers import PolicyPeers
from router.resume import ResumeWriter
from router.stopping import stop
from tests.helpers import apoll


@pytest.fixture(autouse=True)
def _quick(monkeypatch) -> None:
    monkeypatch.setattr(background, "BACKOFF", 0.01)


def _errors(caplog) -> list[logging.LogRecord]:
    return [r for r in caplog.records if r.levelno >= logging.ERROR]


class FailsOnce:
    """Each named async method raises ValueError at its first call, then
    records its calls and answers ``answer``."""

    def __init__(self, answer=None, **methods) -> None:
        self.calls: dict[str, list] = {name: [] for name in methods}
        for name in methods:
            setattr(self, name, self._method(name, methods[name]))

    def _method(self, name: str, answer):
        async def method(*args, **kwargs):
            self.calls[name].append(args)
            if len(self.calls[name]) == 1:
                raise ValueError(f"{name}: a reply that does not decode")
            return answer
        return method


async def test_the_lease_keeper_goes_on_after_an_unexpected_failure(monkeypatch, caplog) -> None:
    # (it caught StoreUnavailable only: anything else ended it for good,
    # unlogged, and every lease of this router expired 30 s later)
    monkeypatch.setattr(leases, "GENERATION_INTERVAL", 0.01)
    store = FailsOnce(generation="g1", renew=None, release=None)
    keeper = LeaseKeeper(store, {"lease-1": SimpleNamespace(tenant="t")})  # type: ignore[arg-type]
    keeper.start()
    try:
        await apoll(lambda: store.calls["renew"], 3, what="a renewal after the failed look")
    finally:
        await keeper.close()
    assert len(store.calls["generation"]) >= 2
    [error] = _errors(caplog)
    assert "lease keeper" in error.getMessage() and error.exc_info and error.exc_info[0] is ValueError


async def test_the_resume_flush_goes_on_after_an_unexpected_failure(caplog) -> None:
    # (if resume-writer died, _pending grew without bound and no buffer was written again)
    store = FailsOnce(stream_append=True)
    w = ResumeWriter(store, 60.0)  # type: ignore[arg-type]
    await w.start()
    try:
        for sid in ("s1", "s2"):
            w._written[sid] = 0
        w.append("s1", b"data: 1", [1], 1)
        await apoll(lambda: store.calls["stream_append"], 3, what="the first flush")
        w.append("s2", b"data: 2", [2], 2)
        await apoll(lambda: len(store.calls["stream_append"]) >= 2 and not w._pending, 3, what="the next flush")
    finally:
        await w.close()
    assert not w.resumable("s1") and w.resumable("s2")  # (s1's events are lost: a resume of it is refused)
    [error] = _errors(caplog)
    assert "resume buffer flush" in error.getMessage() and error.exc_info[0] is ValueError


async def test_the_claim_renewal_goes_on_after_an_unexpected_failure(monkeypatch, caplog) -> None:
    monkeypatch.setattr(resume, "RENEW_INTERVAL", 0.01)
    store = FailsOnce(stream_renew=[True])
    w = ResumeWriter(store, 60.0)  # type: ignore[arg-type]
    w.live.add("s1")
    await w.start()
    try:
        await apoll(lambda: len(store.calls["stream_renew"]) >= 2, 3, what="a renewal after the failed one")
    finally:
        await w.close()
    [error] = _errors(caplog)
    assert "claim renewal" in error.getMessage()


async def test_the_policy_peers_check_goes_on_after_an_unexpected_failure(monkeypatch, caplog) -> None:
    monkeypatch.setattr(peers_mod, "PEERS_INTERVAL", 0.01)
    store = FailsOnce(peers={"r1": "d"})
    store.name, store.connecting = "redis", False
    policy = SimpleNamespace(current=SimpleNamespace(digest="d"))
    p = PolicyPeers(store, policy, Metrics(), "r1")  # type: ignore[arg-type]
    await p.start()
    try:
        await apoll(lambda: len(store.calls["peers"]) >= 2, 3, what="a check after the failed one")
    finally:
        await p.close()
    [error] = _errors(caplog)
    assert "policy peers check" in error.getMessage()


async def test_a_loop_failing_at_every_turn_logs_once_per_interval_with_a_count(caplog) -> None:
    guard = KeepGoing("a tight loop")
    for _ in range(50):
        async with guard:
            raise ValueError("again")
    guard.log_every = 0.0
    async with guard:
        raise ValueError("and again")
    errors = _errors(caplog)
    assert len(errors) == 2, [r.getMessage() for r in errors]
    assert "49 more failures not logged" in errors[1].getMessage()


async def test_a_cancel_passes_through_the_guard() -> None:
    async def loop() -> None:
        while True:
            async with KeepGoing("a loop"):
                await asyncio.sleep(3600)

    task = asyncio.get_running_loop().create_task(loop())
    await asyncio.sleep(0)
    assert await stop(task) and task.cancelled()


async def test_a_task_that_dies_says_so_when_it_dies_and_once(caplog) -> None:
    async def dies() -> None:
        raise KeyError("a bug")

    task = spawn(dies(), "doomed")
    await asyncio.sleep(0.01)
    [error] = _errors(caplog)  # (at once, not at shutdown)
    assert "doomed" in error.getMessage() and error.exc_info[0] is KeyError
    assert await stop(task)
    assert len(_errors(caplog)) == 1  # (stop does not say it again)


async def test_stop_logs_a_failure_nobody_reported_instead_of_dropping_it(caplog) -> None:
    async def dies() -> None:
        raise KeyError("a bug")

    task = asyncio.get_running_loop().create_task(dies(), name="plain")
    await asyncio.sleep(0)
    assert await stop(task)
    [error] = _errors(caplog)
    assert "plain" in error.getMessage() and error.exc_info[0] is KeyError


async def test_a_cancel_that_came_out_as_another_error_ends_the_loop_unlogged(caplog) -> None:
    # (redis-py's timeout on 3.11 can turn a cancel into its own error: the
    # guard must not take it for a failed turn and run on)
    async def loop() -> None:
        while True:
            async with KeepGoing("a loop"):
                try:
                    await asyncio.sleep(3600)
                except asyncio.CancelledError:
                    raise TimeoutError("a timeout that swallowed the cancel") from None

    task = asyncio.get_running_loop().create_task(loop())
    await asyncio.sleep(0)
    task.cancel()
    await asyncio.wait((task,), timeout=1.0)
    assert task.cancelled() and not _errors(caplog)


@pytest.mark.parametrize("end", ["finish", "detach"])
async def test_a_stream_whose_last_flush_fails_unexpectedly_is_released_all_the_same(end: str) -> None:
    # (the failure skipped the release: the stream stayed in ``live``, and
    # the renewal loop kept its claim until the router restarted)
    store = FailsOnce(stream_append=True, stream_release=None)
    w = ResumeWriter(store, 60.0)  # type: ignore[arg-type]
    w.live.add("s1")
    w._written["s1"] = 0
    w.append("s1", b"data: 1", [1], 1)
    with pytest.raises(ValueError):
        await (w.finish("s1", b"data: [DONE]", 1) if end == "finish" else w.detach("s1", 1, 1))
    assert [args[0] for args in store.calls["stream_release"]] == ["s1"] and "s1" not in w.live


async def test_a_stream_whose_settling_fails_unexpectedly_gives_its_admission_back() -> None:
    # (the failure skipped admission.finish: the lease keeper renewed the
    # tenant's concurrency lease for good, a max_concurrent 1 tenant locked out)
    finished = []

    class Writer:
        async def finish(self, sid, final, text_len) -> None:
            raise ValueError("an append that failed")

    class Admission:
        async def finish(self, ticket, used) -> None:
            finished.append((ticket, used))

    ticket = object()
    with pytest.raises(ValueError):
        await relay._settle(SimpleNamespace(admission=Admission()), Writer(), "s1", "stop", b"data: [DONE]", 1,
                            ticket, 3, 3)  # type: ignore[arg-type]
    assert finished == [(ticket, 3)]
