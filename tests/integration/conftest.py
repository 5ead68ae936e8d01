"""Fixtures the integration tests share."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from tests.redis_server import RedisServer, require_redis_server


@pytest.fixture
def redis_server() -> Iterator[RedisServer]:
    """A fresh redis-server on a free port for this test (its routers share it)."""
    require_redis_server()
    with RedisServer() as server:
        yield server
