"""A tenant policy reload that fails in an unexpected way (not a bad file)
is logged and reported, never lost: a failure before the swap keeps the old
policy; a failure of the reload hook after it (metrics, the scheduler's and
admission's follow, refusing removed tenants' requests) leaves the new policy
in force but reported as partly applied, and the same file reloaded again
applies it again."""

from __future__ import annotations

import logging
from pathlib import Path

import router.policy as policy_mod
from router.policy import PolicyRegistry
from tests.helpers import DEMO_TENANTS

TEXT = DEMO_TENANTS.read_text()
CHANGED = TEXT.replace("weight: 3", "weight: 4", 1)


async def test_a_reload_hook_that_fails_is_logged_and_the_reload_reported_partly_applied(tmp_path: Path,
                                                                                         caplog) -> None:
    path = tmp_path / "tenants.yaml"
    path.write_text(TEXT)
    calls: list[tuple[bool, bool]] = []

    def hook(ok: bool, changed: bool) -> None:
        calls.append((ok, changed))
        if len(calls) == 1:
            raise ValueError("a bug in what follows the reload")

    registry = PolicyRegistry(path, on_reload=hook)
    path.write_text(CHANGED)
    result = await registry.reload()
    assert not result.ok and result.changed and result.version == 2 == registry.current.version
    assert "version 2 is in force, but applying it failed part way" in result.errors[0], result.errors
    assert registry.last_errors == result.errors  # (the admin view's last_reload_errors)
    [error] = [r for r in caplog.records if r.levelno >= logging.ERROR]
    assert error.exc_info[0] is ValueError and "failed part way" in error.getMessage()

    again = await registry.reload()  # (the same file: applied again, the hook fixed)
    assert again.ok and again.changed and again.version == 3 and not registry.last_errors
    assert calls == [(True, True), (True, True)]


async def test_an_unexpected_failure_before_the_swap_keeps_the_old_policy_and_says_why(tmp_path: Path, monkeypatch,
                                                                                      caplog) -> None:
    path = tmp_path / "tenants.yaml"
    path.write_text(TEXT)
    calls: list[tuple[bool, bool]] = []
    registry = PolicyRegistry(path, on_reload=lambda ok, changed: calls.append((ok, changed)))

    async def broken(*args):
        raise RuntimeError("the parse answered something unexpected")

    monkeypatch.setattr(policy_mod, "parse_elsewhere", broken)  # (the parse child process: a dependency)
    path.write_text(CHANGED)
    result = await registry.reload()
    assert not result.ok and not result.changed and registry.current.version == 1
    assert "RuntimeError: the parse answered something unexpected" in result.errors[0], result.errors
    assert calls == [(False, False)]  # (counted as a failed reload: fairstream_config_last_reload_successful 0)
    [error] = [r for r in caplog.records if r.levelno >= logging.ERROR and r.exc_info]
    assert error.exc_info[0] is RuntimeError
