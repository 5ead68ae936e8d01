"""The claim-renewal micro-benchmark (ops/bench/claimbench.py) runs against a
real redis-server: both ways renew every claim it opened."""

from __future__ import annotations

from ops.bench.claimbench import measure
from tests.redis_server import RedisServer, require_redis_server


async def test_claimbench_renews_every_claim_both_ways() -> None:
    with RedisServer(require_redis_server()) as server:
        r = await measure(server.url, streams=600, rounds=1)
    assert r["renewed_one_at_a_time"] == r["renewed_pipelined"] == 600
    assert r["one_at_a_time_ms"] > 0 and r["pipelined_ms"] > 0
