"""Refused logins are logged at most so many lines a second (router.relay):
a flood of bad keys is counted in full but not written line by line."""

from __future__ import annotations

from router.relay import _LogBudget


def test_lines_over_the_budget_are_left_out_and_then_counted() -> None:
    budget = _LogBudget(3)
    assert [budget.take(10.0 + i / 100) for i in range(5)] == [0, 0, 0, None, None]
    assert budget.take(11.0) == 2  # the next second's first line says how many were left out
    assert budget.take(11.5) == 0
    assert budget.take(11.6) == 0
    assert budget.take(11.7) is None
    assert budget.take(15.2) == 1


def test_a_quiet_stream_of_lines_is_never_cut() -> None:
    budget = _LogBudget(3)
    assert all(budget.take(float(t)) == 0 for t in range(100))
