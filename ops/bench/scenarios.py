"""The benchmark's scenarios: the same load for every system.

S1  64 concurrent streams x 128 tokens, no inter-token delay (upstream: one
    event-loop turn between tokens; sim: step_base_ms 0), ``waves`` x 64
    requests back to back per virtual user.
S2  256 concurrent streams x 64 tokens, 20 ms between tokens.
S3  2,000 mostly idle open streams: 2 tokens each, the second ``hold``
    seconds after the first; the router's RSS is sampled while they are
    open (RSS per open stream = (peak RSS - RSS before) / open streams).
    Runs in a fresh process of each system (``fresh``): after S1, S2 and
    S5 a process's heap has free memory from their requests that the idle
    streams reuse, and how much depends on what ran before (fairstream:
    18.0 KB per stream after them, 19.4 KB fresh, in one session).
S4  1,000 requests at once behind a saturated cluster (sim replicas with
    32 sequences each; fairstream caps each replica at 32 in flight, so
    ~940 wait in its fair queues; direct, they wait in the engines'
    queues), plus the in-process scheduling-decision micro-benchmark.
S5  64 concurrent streams x 1 token, 100 requests back to back per virtual
    user: the cost of a request itself (auth, admission, scheduling, the
    upstream request, response head, accounting, log line), which S1 and
    S2 spread over 128 and 64 tokens; the report divides the router's CPU
    by the requests that completed.

Budgets bound every run: no new request after ``budget_s``, everything
still open at ``deadline_s`` is cancelled (and counted as an error).
"""

from __future__ import annotations

from dataclasses import dataclass, field

__all__ = ["Scenario", "SCENARIOS", "build"]


@dataclass(frozen=True)
class Scenario:
    name: str
    title: str
    concurrency: int
    requests: int
    max_tokens: int
    mock: dict = field(default_factory=dict)  # mock upstream timing (MockConfig fields)
    sim: dict = field(default_factory=dict)  # sim replica config
    budget_s: float = 30.0
    deadline_s: float = 60.0
    ramp_s: float = 0.0
    idle: bool = False  # S3: measure RSS per open stream
    sim_cap: int | None = None  # fairstream max_concurrency per sim replica
    upstream: bool = True  # runs on the mock-upstream systems
    on_sim: bool = True  # runs on the sim systems
    fresh: bool = False  # runs in a newly started process of each system, not after the other scenarios


def build(waves: int = 6, s2_waves: int = 3, idle_streams: int = 2000, hold_s: float = 8.0,
          slow_budget: float = 20.0) -> dict[str, Scenario]:
    sim_fast = {"step_base_ms": 0.0, "step_per_seq_ms": 0.0, "step_per_prefill_token_ms": 0.0,
                "max_num_seqs": 1024, "max_num_batched_tokens": 65536, "eos": False}
    return {
        "S1": Scenario(
            "S1", "64 streams x 128 tokens, no inter-token delay", 64, 64 * waves, 128,
            mock={"delay_ms": 0.0}, sim=sim_fast, budget_s=slow_budget, deadline_s=slow_budget + 25,
        ),
        "S2": Scenario(
            "S2", "256 streams x 64 tokens, 20 ms between tokens", 256, 256 * s2_waves, 64,
            mock={"delay_ms": 20.0}, sim=sim_fast | {"step_base_ms": 20.0},
            budget_s=slow_budget, deadline_s=slow_budget + 30,
        ),
        "S3": Scenario(
            "S3", f"{idle_streams} idle open streams (1 token, then {hold_s:g} s)", idle_streams, idle_streams, 2,
            mock={"delay_ms": 0.0, "hold_ms": hold_s * 1000}, ramp_s=2.0, idle=True, fresh=True,
            sim=sim_fast | {"step_base_ms": hold_s * 1000 / 2, "max_num_seqs": 4096},
            budget_s=slow_budget, deadline_s=hold_s + slow_budget + 20, on_sim=False,
        ),
        "S5": Scenario(
            "S5", "64 streams x 1 token, back to back (per-request cost)", 64, 64 * 100, 1,
            mock={"delay_ms": 0.0}, sim=sim_fast, budget_s=slow_budget, deadline_s=slow_budget + 25,
        ),
        "S4": Scenario(
            "S4", "1000 queued requests x 16 tokens behind a saturated cluster", 1000, 1000, 16,
            sim=sim_fast | {"step_base_ms": 5.0, "max_num_seqs": 32}, sim_cap=32,
            budget_s=slow_budget, deadline_s=60.0, upstream=False,
        ),
    }


SCENARIOS = build()
