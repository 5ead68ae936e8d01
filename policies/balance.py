"""Replica choice: a load score and power-of-two-choices over it.

Load tracking (what a replica carries) is kept by the caller; this module only
scores snapshots and chooses (tower's ``Load`` + ``p2c`` split).
"""

from __future__ import annotations

import random
from collections.abc import Sequence

import msgspec

__all__ = ["ReplicaLoad", "score", "choose", "AFFINITY_SLACK", "RUNNING_WEIGHT"]


class ReplicaLoad(msgspec.Struct, frozen=True, gc=False):
    """A snapshot of one replica's load, as the router sees it."""

    inflight: int  # requests the router has on it
    inflight_tokens: int  # tokens those requests may still produce (router's own accounting)
    running: int  # the replica's last report
    waiting: int
    kv_usage: float  # 0..1


# Weight of one running request the replica reports: below one in-flight
# token's (1/4096) for any count up to 4,096, so it breaks ties only.
RUNNING_WEIGHT = 1.0 / 4096.0 ** 2


def score(load: ReplicaLoad) -> float:
    """Lower is better. The router's own in-flight count is current; the
    replica's report lags by up to one report interval, so it only breaks
    ties (``running``: requests the router does not count, such as another
    ``--workers`` worker's, weigh in where the router's counts are equal)
    and penalizes queues that formed inside the engine (``waiting``, KV use
    past 90%)."""
    return (
        load.inflight
        + load.inflight_tokens / 4096.0
        + RUNNING_WEIGHT * load.running
        + 2.0 * load.waiting
        + 4.0 * max(0.0, load.kv_usage - 0.9)
    )


AFFINITY_SLACK = 2.0  # how much more loaded (in score units) a preferred replica may be


def choose(loads: Sequence[ReplicaLoad], rng: random.Random, prefer: int | None = None) -> int:
    """Index of the chosen replica among ``loads`` (which must not be empty):
    the less loaded of two picked at random. ``prefer`` (prefix affinity: the
    replica that served the same prompt prefix, whose KV cache may still hold
    it) wins while its score is within ``AFFINITY_SLACK`` of that pick."""
    n = len(loads)
    if n == 1:
        return 0
    if prefer is not None:
        other = choose(loads, rng)
        if score(loads[prefer]) <= score(loads[other]) + AFFINITY_SLACK:
            return prefer
        return other
    if n == 2:  # (both are the picks: no draws; a tie to replica 0, keeping a lone client on one cache)
        return 0 if score(loads[0]) <= score(loads[1]) else 1
    a = rng.randrange(n)
    b = rng.randrange(n - 1)
    if b >= a:
        b += 1
    # a tie to the first pick, itself uniform: a tie to the lower index gave
    # replica 0 two thirds of the ties among three and the last one none
    return a if score(loads[a]) <= score(loads[b]) else b
