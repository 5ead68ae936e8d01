"""Which scenarios of the side-by-side benchmark share a system's process."""

from ops.bench.__main__ import process_batches
from ops.bench.scenarios import build


def test_s3_runs_in_a_process_of_its_own_after_the_others():
    scens = build()
    assert process_batches(["S1", "S2", "S5", "S3"], scens) == [["S1", "S2", "S5"], ["S3"]]
    assert process_batches(["S3", "S1"], scens) == [["S1"], ["S3"]]


def test_without_a_fresh_scenario_every_scenario_shares_one_process():
    scens = build()
    assert process_batches(["S1", "S2", "S5"], scens) == [["S1", "S2", "S5"]]
    assert process_batches(["S3"], scens) == [["S3"]]
    assert process_batches([], scens) == []
