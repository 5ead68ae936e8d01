"""Rate-limit math: token buckets with reservations, refunds and leases.

Pure functions over plain state; the caller passes ``now`` (seconds). The
in-memory state store runs these directly; the Redis store runs the same
arithmetic in Lua (``router/state/lua/admit.lua``), and one contract test
suite holds both to it.

Buckets. A limit of ``L`` per minute is a bucket of capacity ``L`` refilled
continuously at ``L / 60`` per second, the way OpenAI's limits replenish. So
over any interval of ``t`` seconds a tenant is admitted at most
``L + L * t / 60`` units (a full bucket plus the refill), and never more.

Requests and tokens. A request costs 1 from the requests bucket and its
*estimate* (prompt tokens + max_tokens) from the tokens bucket, reserved at
admission. At the end ``settle`` gives back ``reserved - used`` when the real
usage was lower (never more than was reserved) and takes the difference when
it was higher (the level may then go below zero: a debt repaid by refill).

Admission is all-or-nothing: if any limit refuses, nothing is taken, and the
caller learns which limit refused and when the request would fit.
"""

from __future__ import annotations

import math

import msgspec

__all__ = [
    "Bucket",
    "Decision",
    "level",
    "admit",
    "settle",
    "prune_leases",
]

class Bucket(msgspec.Struct, gc=False):
    """Level (units available) at time ``ts``."""

    tokens: float
    ts: float


class Decision(msgspec.Struct, gc=False):
    """The outcome of one admission attempt."""

    ok: bool
    reason: str = ""  # "requests" | "tokens" | "concurrency" | "queued" | "too_large" when refused
    retry_after: float = 0.0  # seconds until the request would fit (inf: never)
    remaining_requests: float = 0.0
    remaining_tokens: float = 0.0
    reset_requests: float = 0.0  # seconds until the requests bucket is full
    reset_tokens: float = 0.0
    # An admitted continuation of a resumed stream: the tokens of its
    # earlier generators' unsettled reservations it took over (it needed that
    # many fewer), and how many of the stream's tokens came before them
    # (``AdmitRequest.base``); 0 and 0 when it took over none.
    taken: int = 0
    base: int = 0


QUEUED_RETRY = 0.25  # seconds; when a request waiting behind others of its tenant asks again


def level(bucket: Bucket | None, per_minute: int, now: float) -> float:
    """Units available at ``now``: the stored level plus refill, capped at capacity."""
    if bucket is None:
        return float(per_minute)
    rate = per_minute / 60.0
    return min(float(per_minute), bucket.tokens + max(0.0, now - bucket.ts) * rate)


def _wait(available: float, cost: float, per_minute: int) -> float:
    """Seconds until ``cost`` units are available at the bucket's refill rate."""
    if cost > per_minute:
        return math.inf
    short = cost - available
    return 0.0 if short <= 0 else short * 60.0 / per_minute


def _reset(available: float, per_minute: int) -> float:
    return max(0.0, (per_minute - available) * 60.0 / per_minute)


def admit(
    requests: Bucket | None,
    tokens: Bucket | None,
    leases: int,
    *,
    rpm: int,
    tpm: int,
    max_concurrent: int,
    cost_tokens: int,
    now: float,
    behind: bool = False,
) -> tuple[Decision, Bucket | None, Bucket | None]:
    """Try to admit one request reserving ``cost_tokens``.

    ``leases`` is the number of live concurrency leases; ``behind``: other
    requests of the tenant wait ahead of this one, so it is refused
    (``queued``, to ask again in ``QUEUED_RETRY``) even where its limits
    pass. Returns the decision and the new bucket states (unchanged when
    refused).
    """
    req_level = level(requests, rpm, now) if rpm else math.inf
    tok_level = level(tokens, tpm, now) if tpm else math.inf
    waits = []
    if rpm:
        waits.append(("requests", _wait(req_level, 1, rpm)))
    if tpm:
        waits.append(("tokens", _wait(tok_level, cost_tokens, tpm)))
    refused = [(r, w) for r, w in waits if w > 0]
    if max_concurrent and leases >= max_concurrent:
        refused.append(("concurrency", 1.0))
    if behind:
        refused.append(("queued", QUEUED_RETRY))
    rem_req = req_level if rpm else 0.0
    rem_tok = tok_level if tpm else 0.0
    if refused:
        reason, wait = max(refused, key=lambda rw: rw[1])
        if wait == math.inf:
            reason = "too_large"
        return (
            Decision(
                False,
                reason,
                wait,
                remaining_requests=rem_req,
                remaining_tokens=rem_tok,
                reset_requests=_reset(req_level, rpm) if rpm else 0.0,
                reset_tokens=_reset(tok_level, tpm) if tpm else 0.0,
            ),
            requests,
            tokens,
        )
    new_req = Bucket(req_level - 1, now) if rpm else requests
    new_tok = Bucket(tok_level - cost_tokens, now) if tpm else tokens
    return (
        Decision(
            True,
            remaining_requests=rem_req - 1 if rpm else 0.0,
            remaining_tokens=rem_tok - cost_tokens if tpm else 0.0,
            reset_requests=_reset(req_level - 1, rpm) if rpm else 0.0,
            reset_tokens=_reset(tok_level - cost_tokens, tpm) if tpm else 0.0,
        ),
        new_req,
        new_tok,
    )


def settle(tokens: Bucket | None, *, tpm: int, reserved: int, used: int, now: float) -> Bucket | None:
    """Correct the tokens bucket once the real usage is known.

    Gives back ``reserved - used`` (capped at capacity: a refund never
    creates more than a full bucket) or takes ``used - reserved`` extra.
    """
    if not tpm:
        return tokens
    current = level(tokens, tpm, now)  # a missing bucket is a full one
    return Bucket(min(float(tpm), current + (reserved - used)), now)


def prune_leases(expiries: dict[str, float], now: float) -> dict[str, float]:
    """Live leases only (expiry after ``now``)."""
    return {k: v for k, v in expiries.items() if v > now}
