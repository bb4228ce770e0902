"""ReCoVer's invariant end to end: with ranks killed (or hung) mid-iteration, every iteration
still commits the same M microbatches and the loss follows the failure-free run; the `drop`
baseline does not. (TP, PP, DP) = (1, 2, 4): replica r is ranks r (stage 0) and r + 4 (stage 1).
"""
from __future__ import annotations

import pytest

from tests._launch_util import TINY_GPT, launch

pytestmark = pytest.mark.multiprocess  # every test here starts several processes

ITERS = 12
M = 8
LAYOUT = ["--tensor-model-parallel-size", "1", "--pipeline-model-parallel-size", "2",
          "--train-iters", str(ITERS), "--recover-balance", "even"]


def faults(*specs: str) -> list[str]:
    return [arg for spec in specs for arg in ("--inject-fault", spec)]


def run_job(tmp_path, *extra: str, launcher_args=None, nproc=8):
    return launch(nproc, [*TINY_GPT, *LAYOUT, *extra], tmp_path / "metrics.jsonl",
                  launcher_args=launcher_args or [], timeout=300)


def train_records(run):
    return [r for r in run.records if "lm_loss" in r]


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    run = run_job(tmp_path_factory.mktemp("reference"))
    assert run.returncode == 0, run.stderr[-3000:]
    return train_records(run)


def assert_same_trajectory(run, reference):
    records = train_records(run)
    assert [r["iteration"] for r in records] == list(range(1, ITERS + 1)), run.stdout[-3000:]
    for mine, ref in zip(records, reference):
        i = mine["iteration"]
        assert mine["microbatches"] == M, mine
        assert mine["id_sum"] == sum(range((i - 1) * M, i * M)), mine  # exactly the planned ids
        assert abs(mine["lm_loss"] - ref["lm_loss"]) <= 1e-5 * abs(ref["lm_loss"]), (mine, ref)
    return records


KILLS = {
    # two successive failures in different iterations (a stage-1 rank, then a stage-0 rank)
    "forward-then-dp_reduce": faults("kill:rank=5,iter=3,phase=forward",
                                     "kill:rank=2,iter=7,phase=dp_reduce"),
    "backward": faults("kill:rank=3,iter=4,phase=backward"),
    "p2p": faults("kill:rank=6,iter=5,phase=p2p"),
    # the logging rank, after the commit vote: its successor must log the iteration it missed
    "optimizer-logging-rank": faults("kill:rank=0,iter=6,phase=optimizer"),
    # a second failure while the survivors recover from the first
    "during-recovery": faults("kill:rank=1,iter=4,phase=forward",
                              "kill:rank=7,iter=4,phase=recovery"),
}


@pytest.mark.timeout(900)
@pytest.mark.parametrize("name", list(KILLS))
def test_killed_ranks_keep_the_trajectory(reference, tmp_path, name):
    spares = name != "p2p"  # the survivors of a broken replica wait as spares, or leave
    run = run_job(tmp_path, *KILLS[name], "--recover-spares", "on" if spares else "off")
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    records = assert_same_trajectory(run, reference)
    recoveries = [rec for r in records for rec in r["recoveries"]]
    assert recoveries, "no recovery was recorded"
    for rec in recoveries:
        assert rec["lost_ids"] and set(rec["seconds"]) >= {"detection", "rebuild"}
    assert len(records[-1]["live_replicas"]) == 4 - len(KILLS[name]) // 2
    if spares:  # no replacement was started: they wait until the job completes, then exit 0
        assert "waiting as a spare" in run.stdout and "leaving cleanly" not in run.stdout
        assert "the job completed while this rank waited as a spare: exiting" in run.stdout
    else:
        assert "leaving cleanly" in run.stdout and "waiting as a spare" not in run.stdout


@pytest.mark.timeout(600)
def test_drop_policy_leaves_the_trajectory(reference, tmp_path):
    run = run_job(tmp_path, *KILLS["backward"], "--recover-policy", "drop")
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    records = train_records(run)
    assert len(records) == ITERS
    assert [r["microbatches"] for r in records[3:]] == [6] * (ITERS - 3)  # the batch shrank
    drift = max(abs(r["lm_loss"] - ref["lm_loss"]) / ref["lm_loss"]
                for r, ref in zip(records, reference))
    assert drift > 1e-3, f"drop stayed within {drift:.1e} of the reference"


@pytest.mark.timeout(600)
def test_hung_rank_is_recovered_after_the_timeout(reference, tmp_path):
    run = run_job(tmp_path, *faults("hang:rank=6,iter=4,phase=backward"),
                  "--recover-timeout", "5")
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    assert_same_trajectory(run, reference)
    assert "hang" in run.stderr or "hang" in run.stdout


@pytest.mark.timeout(600)
def test_losing_every_replica_stops_cleanly(tmp_path):
    run = launch(4, [*TINY_GPT, "--tensor-model-parallel-size", "1",
                     "--pipeline-model-parallel-size", "2", "--train-iters", "6",
                     # even: a throughput plan may give replica 0 no microbatch in iteration 2
                     # (a slow first iteration under load), and then its forward kill never fires
                     "--recover-balance", "even",
                     *faults("kill:rank=0,iter=2,phase=forward", "kill:rank=3,iter=4,phase=forward")],
                 tmp_path / "metrics.jsonl", launcher_args=[], timeout=300)
    # no replica holds the state: the coordinator stops the job, the launcher exits 3 (restart)
    assert run.returncode == 3, run.stdout[-3000:] + run.stderr[-3000:]
    assert "the job stopped (" in run.stderr
    assert "0 complete replica(s) left" in run.stdout and "Restart with --load" in run.stdout
    # replica 0's surviving rank 2 waited as a spare; with no live member left it stops too
    assert "rank 2: stopping: the job stopped while this rank waited as a spare" in run.stdout
    assert "exit code 3" in run.stderr + run.stdout
    assert [r["iteration"] for r in train_records(run)] == [1, 2, 3]


@pytest.mark.timeout(600)
@pytest.mark.parametrize("name", ["backward", "forward-then-dp_reduce"])
def test_overlapped_bucket_reduction_keeps_the_trajectory(reference, tmp_path, name):
    """With --overlap-grad-reduce the DP collectives start inside backward hooks: a failure seen
    there is kept for the reduction to raise, and recovery rounds reduce the same buckets."""
    run = run_job(tmp_path, *KILLS[name], "--overlap-grad-reduce", "--ddp-bucket-size", "20000")
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    records = assert_same_trajectory(run, reference)
    assert [rec for r in records for rec in r["recoveries"]], "no recovery was recorded"
