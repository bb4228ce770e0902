"""Mixed precision under faults: an fp16 overflow skips the step on every rank with Megatron's
loss-scale rules, and a bf16 job that loses a replica keeps its failure-free trajectory."""
from __future__ import annotations

import math

import pytest

from tests._launch_util import TINY_GPT, launch

pytestmark = pytest.mark.multiprocess  # every test here starts several processes

M = 8


def faults(*specs: str) -> list[str]:
    return [arg for spec in specs for arg in ("--inject-fault", spec)]


def train_records(run) -> list[dict]:
    return [r for r in run.records if "lm_loss" in r]


FP16 = ["--fp16", "--initial-loss-scale", "256", "--hysteresis", "1", "--train-iters", "6"]


@pytest.mark.timeout(600)
def test_fp16_overflow_skips_the_step_everywhere_and_halves_the_scale(tmp_path):
    # single process, and (TP, PP, DP) = (1, 2, 2) with the inf on replica 1's last stage only:
    # if any rank decided differently, the two trajectories would part
    single = launch(1, [*TINY_GPT, *FP16, *faults("inf:rank=0,iter=3,phase=backward")],
                    tmp_path / "single.jsonl")
    layout = ["--pipeline-model-parallel-size", "2", "--recover-balance", "even"]
    parallel = launch(4, [*TINY_GPT, *FP16, *layout,
                          *faults("inf:rank=3,iter=3,phase=backward,microbatch=21")],
                      tmp_path / "parallel.jsonl", launcher_args=[])
    for run in (single, parallel):
        assert run.returncode == 0, run.stdout[-2000:] + run.stderr[-3000:]
        recs = train_records(run)
        assert [r["iteration"] for r in recs] == list(range(1, 7))
        before, hit, after = recs[1], recs[2], recs[3]
        assert [r["skipped_iterations"] for r in recs] == [0, 0, 1, 1, 1, 1]
        assert not math.isfinite(hit["grad_norm"]) and math.isfinite(after["grad_norm"])
        assert hit["lr"] == before["lr"] != after["lr"]  # no scheduler step on a skipped iteration
        assert (hit["loss_scale"], after["loss_scale"]) == (256.0, 128.0)
        assert after["lm_loss"] != hit["lm_loss"]  # training goes on
        assert "number of skipped iterations:   1" in run.stdout
    for mine, ref in zip(train_records(parallel), train_records(single)):
        assert abs(mine["lm_loss"] - ref["lm_loss"]) <= 2e-3 * ref["lm_loss"], (mine, ref)


BF16 = [*TINY_GPT, "--bf16", "--pipeline-model-parallel-size", "2", "--train-iters", "8",
        "--recover-balance", "even"]
KILL = faults("kill:rank=3,iter=3,phase=backward")
# Recomputed microbatches are bitwise the same computation on another replica; only the fp32
# accumulation and reduction order differ (a bf16 weight could then round the other way).
# Measured: 4.6e-8 from the failure-free bf16 run; `drop`, which loses 2 of 8 microbatches per
# iteration from iteration 3 on, 1.3e-2.
BF16_TOLERANCE = 1e-5


@pytest.mark.timeout(900)
def test_bf16_trajectory_survives_a_kill_and_drop_does_not(tmp_path):
    reference = launch(4, BF16, tmp_path / "reference.jsonl", launcher_args=[])
    recovered = launch(4, [*BF16, *KILL], tmp_path / "recovered.jsonl", launcher_args=[])
    dropped = launch(4, [*BF16, *KILL, "--recover-policy", "drop"], tmp_path / "dropped.jsonl",
                     launcher_args=[])
    for run in (reference, recovered, dropped):
        assert run.returncode == 0, run.stdout[-2000:] + run.stderr[-3000:]
    ref = train_records(reference)

    def drift(run) -> float:
        return max(abs(r["lm_loss"] - q["lm_loss"]) / q["lm_loss"]
                   for r, q in zip(train_records(run), ref))

    recs = train_records(recovered)
    assert [r["iteration"] for r in recs] == list(range(1, 9))
    for r in recs:
        i = r["iteration"]
        assert r["microbatches"] == M and r["id_sum"] == sum(range((i - 1) * M, i * M)), r
    assert recs[2]["recoveries"] and recs[-1]["live_replicas"] == [0]
    kept = recs[2]["recoveries"][0]["groups_kept"]  # NCCL: replica 0's pipeline was intact
    assert "pp.replica0.tp0" in kept and "dp.tp0.stage0" not in kept, recs[2]["recoveries"]
    assert drift(recovered) <= BF16_TOLERANCE
    assert drift(dropped) > 100 * BF16_TOLERANCE


WEIGHT_CHECK = ["--check-weight-hash-across-dp-replicas-interval", "2", "--train-iters", "6"]


@pytest.mark.timeout(600)
def test_replicas_hold_bitwise_equal_weights_and_a_corrupted_one_is_caught(tmp_path):
    """bf16 with main params and a recovery: every replica still holds the same bits (checked after
    iterations 2 and 4). A weight changed on one rank of replica 1 stops the job loudly."""
    flags = [*TINY_GPT, "--bf16", "--tensor-model-parallel-size", "2", "--recover-balance", "even",
             *WEIGHT_CHECK]
    healthy = launch(8, [*flags, *faults("kill:rank=5,iter=3,phase=backward")],
                     tmp_path / "healthy.jsonl", launcher_args=[])
    assert healthy.returncode == 0, healthy.stdout[-2000:] + healthy.stderr[-3000:]
    recs = train_records(healthy)
    assert [r.get("weights_checked_after") for r in recs] == [None, None, 2, None, 4, None]
    assert recs[-1]["live_replicas"] == [0, 1, 3]  # rank 5 = replica 2's second TP rank
    (recovery,) = recs[2]["recoveries"]  # NCCL: rank 0's TP group outlived replica 2's failure
    assert "tp.replica0.stage0" in recovery["groups_kept"], recovery
    # rank 3 is replica 1's second TP rank; its weight changes before iteration 3's reduction
    corrupted = launch(8, [*flags, *faults("corrupt:rank=3,iter=3,phase=dp_reduce")],
                       tmp_path / "corrupted.jsonl", launcher_args=[])
    assert corrupted.returncode != 0
    said = corrupted.stdout.count("stopping: after iteration 2 the data-parallel replicas hold "
                                  "different weights")
    assert said == 8, corrupted.stdout[-3000:]  # every rank stops, not only replica 1's shard
    assert "exit code 3" in corrupted.stderr + corrupted.stdout
    assert [r["iteration"] for r in train_records(corrupted)] == [1, 2]
