"""Fixtures shared by the test suite.

* ``router``: a fresh router with two sim replicas, for tests that change it
  (kill replicas, disconnect clients); stopped and leak-checked afterwards.
* ``make_router``: the same with any config (``replicas=``, ``sim=``,
  ``settings=``); every router it made is stopped at teardown.
* ``shared_router``: one router per test module for read-only tests. A module
  can configure it with a module-level ``SHARED_ROUTER = {...}`` dict of
  ``RouterProcess`` keyword arguments.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

import pytest
from hypothesis import settings

from tests.helpers import RouterProcess

# Property tests run on a small shared CI machine: no per-example deadline
# (a GC pause is not a bug), a fixed number of examples.
settings.register_profile("fairstream", deadline=None, max_examples=100)
settings.load_profile("fairstream")


@pytest.fixture
def make_router(tmp_path) -> Iterator[Callable[..., RouterProcess]]:
    made: list[RouterProcess] = []

    def make(**kwargs: Any) -> RouterProcess:
        r = RouterProcess(tmp_path / f"router{len(made)}", **kwargs)
        made.append(r)
        return r.start()

    yield make
    errors = []
    for r in made:
        try:
            r.stop()
        except AssertionError as e:
            errors.append(str(e))
    assert not errors, "\n".join(errors)


@pytest.fixture
def router(make_router) -> RouterProcess:
    return make_router()


@pytest.fixture(scope="module")
def shared_router(request, tmp_path_factory) -> Iterator[RouterProcess]:
    kwargs = getattr(request.module, "SHARED_ROUTER", {})
    r = RouterProcess(tmp_path_factory.mktemp("shared_router"), **kwargs)
    r.start()
    yield r
    r.stop()
