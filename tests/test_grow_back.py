"""Growing back end to end (DESIGN §15): a replacement process for a killed rank, and the surviving
ranks of its replica waiting as spares, re-form the replica at an iteration boundary; a donor
replica hands over its live state. The trajectory stays the failure-free one, every replica's
weights stay bitwise equal (checked every iteration), and a join that loses its donor is retried.

A `slow` fault on a rank that never dies keeps the job running long enough for the replacement
process to start (it only costs time: the numbers do not change).
"""
from __future__ import annotations

import pytest

from tests._launch_util import TINY_GPT, launch

ITERS, M = 14, 8
COMMON = [*TINY_GPT, "--train-iters", str(ITERS), "--recover-balance", "even"]
CHECKED = ["--check-weight-hash-across-dp-replicas-interval", "1"]

pytestmark = pytest.mark.timeout(600)


def faults(*specs: str) -> list[str]:
    return [arg for spec in specs for arg in ("--inject-fault", spec)]


def run_job(path, *extra: str, replacements: int = 0):
    return launch(4, [*COMMON, *extra], path / "metrics.jsonl", timeout=300,
                  launcher_args=["--max-replacements", str(replacements)])


def train_records(run):
    return [r for r in run.records if "lm_loss" in r]


def joins(run):
    return [r["join"] for r in run.records if "join" in r]


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    """Failure-free losses per layout."""
    runs = {}
    for name, layout in (("dp4", []), ("pp2", ["--pipeline-model-parallel-size", "2"])):
        run = run_job(tmp_path_factory.mktemp(name), *layout)
        assert run.returncode == 0, run.stderr[-3000:]
        runs[name] = train_records(run)
    return runs


def assert_failure_free_trajectory(run, reference):
    records = train_records(run)
    assert [r["iteration"] for r in records] == list(range(1, ITERS + 1)), run.stdout[-3000:]
    for mine, ref in zip(records, reference):
        i = mine["iteration"]
        assert mine["microbatches"] == M and mine["id_sum"] == sum(range((i - 1) * M, i * M)), mine
        assert abs(mine["lm_loss"] - ref["lm_loss"]) <= 1e-5 * abs(ref["lm_loss"]), (mine, ref)
    # the weight check ran after every iteration once checking started, joins included
    assert [r.get("weights_checked_after") for r in records[1:]] == list(range(1, ITERS))
    return records


def test_a_replacement_rejoins_and_the_trajectory_is_the_failure_free_one(tmp_path, reference):
    # saving and evaluating every iteration: the joiner takes part in the join iteration's too
    run = run_job(tmp_path, *CHECKED, "--save", str(tmp_path / "ckpt"), "--save-interval", "1",
                  "--eval-interval", "1",
                  *faults("kill:rank=2,iter=3,phase=forward",
                          "slow:rank=1,seconds=0.15,iter=4,phase=forward"), replacements=1)
    assert run.returncode == 0, run.stderr[-3000:]
    records = assert_failure_free_trajectory(run, reference["dp4"])
    assert "abandoned" not in run.stdout, run.stdout[-3000:]  # no checkpoint or join gave up
    assert (tmp_path / "ckpt" / "latest_checkpointed_iteration.txt").read_text().strip() == str(ITERS)
    assert len([r for r in run.records if "valid_lm_loss" in r]) == ITERS
    live = [len(r["live_replicas"]) for r in records]
    assert live[:2] == [4, 4] and live[2] == 3 and live[-1] == 4, live  # 4 -> 3 -> 4
    assert len(joins(run)) == 1, run.stdout[-3000:] + run.stderr[-3000:]
    [join] = joins(run)
    assert join["joined"] == [2] and join["donor"] == 0 and join["bytes_sent"] > 0
    assert "started replacement" in run.stderr and "all 4 rank(s) exited 0" in run.stderr


def test_a_pipeline_replica_is_re_formed_from_its_waiting_survivor(tmp_path, reference):
    # (1,2,2): replica 1 is rank 1 (stage 0) and rank 3 (stage 1); rank 3 dies in backward
    run = run_job(tmp_path, "--pipeline-model-parallel-size", "2", *CHECKED,
                  *faults("kill:rank=3,iter=3,phase=backward",
                          "slow:rank=0,seconds=0.15,iter=4,phase=forward"), replacements=1)
    assert run.returncode == 0, run.stderr[-3000:]
    records = assert_failure_free_trajectory(run, reference["pp2"])
    assert [len(r["live_replicas"]) for r in records][2] == 1 and records[-1]["live_replicas"] == [0, 1]
    assert "rank 1: waiting as a spare" in run.stdout  # the survivor, not a new process
    assert run.stderr.count("started replacement") == 1 and "rank 3 (killed" in run.stderr
    received = [line for line in run.stdout.splitlines() if "MiB received" in line]
    assert {line.split(":")[0].strip() for line in received} == {"[recover] rank 1", "[recover] rank 3"}


def test_a_join_that_loses_its_donor_is_retried_and_the_donor_comes_back(tmp_path, reference):
    # slower than the others: two replacements start one after the other before the job ends
    run = run_job(tmp_path, *CHECKED, *faults("kill:rank=2,iter=3,phase=forward",
                                              "kill:rank=0,iter=any,phase=join",
                                              "slow:rank=1,seconds=0.3,iter=4,phase=forward"),
                  replacements=2)
    assert run.returncode == 0, run.stderr[-3000:]
    records = assert_failure_free_trajectory(run, reference["dp4"])
    assert len(joins(run)) == 2, run.stdout[-3000:] + run.stderr[-3000:]
    first, second = joins(run)
    assert first["joined"] == [2] and first["dropped"] == [0] and first["donor"] == 1
    assert first["attempts"] == 2  # the attempt with donor 0 was abandoned
    assert second["joined"] == [0] and second["live"] == [0, 1, 2, 3]
    assert records[-1]["live_replicas"] == [0, 1, 2, 3]
