"""The turns subscription (``RedisStore.watch``) outlives a failure of its
callback, and a subscription Redis refuses for good (an ACL without
SUBSCRIBE) is a WARNING, not a DEBUG line a second forever: cross-router
turns then go by the heads' polls only."""

from __future__ import annotations

import asyncio
import logging
import uuid

import pytest
import redis.asyncio as aioredis

import router.background as background
from tests.helpers import apoll


@pytest.mark.redis
async def test_a_turn_callback_that_fails_does_not_end_the_subscription(redis_server, monkeypatch, caplog) -> None:
    from router.state.redis_store import RedisStore

    monkeypatch.setattr(background, "BACKOFF", 0.05)
    prefix = f"fs-{uuid.uuid4().hex[:8]}"
    store = RedisStore(redis_server.url, prefix=prefix, timeout=2.0)
    client = aioredis.Redis.from_url(redis_server.url)
    heard: list[str] = []

    def on_turn(tenant: str) -> None:
        heard.append(tenant)
        if len(heard) == 1:
            raise ValueError("a bug in on_turn")

    try:
        store.watch(on_turn)

        async def told() -> bool:
            await client.publish(f"{prefix}:turns", "t")
            return len(heard) >= 2

        await apoll(told, 5, interval=0.1, what="a turn heard after the callback failed")
    finally:
        await client.aclose()
        await store.close()
    [error] = [r for r in caplog.records if r.levelno >= logging.ERROR]
    assert "turns subscription" in error.getMessage() and error.exc_info[0] is ValueError


@pytest.mark.redis
async def test_a_subscription_redis_refuses_is_a_warning(redis_server, caplog) -> None:
    from router.state.redis_store import RedisStore

    user = f"nosub-{uuid.uuid4().hex[:8]}"
    admin = aioredis.Redis.from_url(redis_server.url)
    await admin.execute_command("ACL", "SETUSER", user, "on", ">pw", "~*", "&*", "+@all", "-subscribe")
    url = redis_server.url.replace("redis://", f"redis://{user}:pw@")
    store = RedisStore(url, prefix=f"fs-{uuid.uuid4().hex[:8]}", timeout=2.0)
    caplog.set_level(logging.DEBUG, logger="fairstream.state")
    try:
        store.watch(lambda tenant: None)
        await apoll(lambda: [r for r in caplog.records if "turns subscription" in r.getMessage()], 5,
                    what="the refusal logged")
        await asyncio.sleep(0.1)
    finally:
        await store.close()
        await admin.execute_command("ACL", "DELUSER", user)
        await admin.aclose()
    said = [r for r in caplog.records if "turns subscription" in r.getMessage()]
    assert said[0].levelno == logging.WARNING, [(r.levelname, r.getMessage()) for r in said]
    assert "poll" in said[0].getMessage()


async def test_a_subscription_that_ends_cleanly_is_made_again_after_a_pause() -> None:
    # (a listen() that ends without an error, as on a connection closed
    # cleanly, was subscribed again at once: a hot loop on a dead server)
    from router.state.redis_store import RedisStore

    subscribed: list[float] = []

    class EndsAtOnce:  # a dependency double of redis-py's PubSub
        async def __aenter__(self):
            return self

        async def __aexit__(self, *exc) -> None:
            pass

        async def subscribe(self, channel) -> None:
            subscribed.append(asyncio.get_running_loop().time())
            await asyncio.sleep(0)  # (as a round trip would: the hot loop must not starve this test)

        async def listen(self):
            return
            yield

    store = RedisStore("redis://127.0.0.1:1", prefix="fs-clean")
    real = store._redis
    store._redis = type("Redis", (), {"pubsub": lambda self, **kw: EndsAtOnce(),  # type: ignore[assignment]
                                      "aclose": lambda self: real.aclose()})()
    try:
        store.watch(lambda tenant: None)
        await asyncio.sleep(0.3)
    finally:
        await store.close()
    assert len(subscribed) == 1, len(subscribed)
