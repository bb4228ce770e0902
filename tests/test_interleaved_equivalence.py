"""The interleaved schedule (VP = 2 model chunks per pipeline rank) end to end: every layout
trains along the single-process trajectory, for every quota a replica can get, and a rank killed
in p2p or in backward does not change it.

The batch ramps from 1 to 6 microbatches (`--rampup-batch-size 1 1 15`: 1,1,1,2,2,3,4,5,6), so
one short run gives a replica quotas of 0 and 1 (one microbatch over two replicas), PP - 1 and
PP + 1 -- lists Megatron's interleaved schedule refuses (not a multiple of PP).
"""
from __future__ import annotations

import re

import pytest

from tests._launch_util import TINY_GPT, launch

pytestmark = pytest.mark.multiprocess  # every test here starts several processes

BATCHES = [1, 1, 1, 2, 2, 3, 4, 5, 6]
COMMON = [*TINY_GPT, "--num-layers", "8", "--train-iters", str(len(BATCHES)),
          "--global-batch-size", "6", "--rampup-batch-size", "1", "1", "15",
          "--recover-balance", "even"]


def _run(tmp_path, nproc: int, *extra: str, launcher_args=None):
    run = launch(nproc, [*COMMON, *extra], tmp_path / "metrics.jsonl", timeout=300,
                 launcher_args=launcher_args)
    assert run.returncode == 0, run.stderr[-3000:]
    return [r for r in run.records if "lm_loss" in r], run


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    records, _ = _run(tmp_path_factory.mktemp("one-process"), 1)
    assert [r["microbatches"] for r in records] == BATCHES
    assert records[-1]["lm_loss"] < records[0]["lm_loss"]  # it learns: equality proves something
    return records


def assert_on_reference(records, reference) -> None:
    assert [r["iteration"] for r in records] == list(range(1, len(BATCHES) + 1))
    first = 0
    for mine, ref, m in zip(records, reference, BATCHES):
        assert mine["microbatches"] == m, mine  # every id of the iteration committed once
        assert mine["id_sum"] == sum(range(first, first + m)), mine
        assert mine["tokens"] == ref["tokens"]
        assert abs(mine["lm_loss"] - ref["lm_loss"]) <= 1e-5 * abs(ref["lm_loss"]), (mine, ref)
        first += m


# (TP, PP, DP) and the flag that makes two chunks per rank (both of Megatron's spellings)
LAYOUTS = {
    # with buckets that start reducing during backward, as soon as their chunk is done
    "tp1-pp2-dp2": (1, 2, 2, ["--num-layers-per-virtual-pipeline-stage", "2",
                              "--overlap-grad-reduce", "--ddp-bucket-size", "20000"]),
    "tp2-pp2-dp1": (2, 2, 1, ["--num-virtual-stages-per-pipeline-rank", "2"]),
    "tp1-pp4-dp1": (1, 4, 1, ["--num-layers-per-virtual-pipeline-stage", "1"]),
    # uneven stages with chunks: rank 0 holds 2 layers (1 per chunk), rank 1 holds 6 (3 per chunk)
    "uneven-tp1-pp2-dp2": (1, 2, 2, ["--num-virtual-stages-per-pipeline-rank", "2",
                                     "--decoder-first-pipeline-num-layers", "2"]),
}


@pytest.mark.timeout(600)
@pytest.mark.parametrize("name", list(LAYOUTS))
def test_vp2_layout_matches_one_process_for_every_quota(reference, tmp_path, name):
    tp, pp, dp, vp_flag = LAYOUTS[name]
    records, run = _run(tmp_path, tp * pp * dp, "--tensor-model-parallel-size", str(tp),
                        "--pipeline-model-parallel-size", str(pp), *vp_flag)
    assert "interleaved schedule: 2 model chunks per pipeline rank" in run.stdout
    assert_on_reference(records, reference)
    if "--decoder-first-pipeline-num-layers" in vp_flag:  # the split really was uneven:
        # rank 0 holds the embedding and 2 of 8 layers (an even split: 4, 218368 parameters)
        held = re.search(r"rank 0: (\d+) parameters on this rank", run.stdout)
        assert held and int(held.group(1)) < 150_000, run.stdout[:3000]
    quotas = {q for r in records for q in r["quotas"].values()}
    wanted = {1, pp - 1, pp + 1} | ({0} if dp > 1 else set())
    assert wanted <= quotas, (wanted, quotas)


@pytest.mark.timeout(600)
def test_embedding_and_loss_counted_as_layers_keep_the_trajectory(reference, tmp_path):
    """--account-for-embedding/loss-in-pipeline-split: 8 layers + 2 over PP 2 is 4 + 4 layers."""
    records, _ = _run(tmp_path, 2, "--pipeline-model-parallel-size", "2",
                      "--account-for-embedding-in-pipeline-split",
                      "--account-for-loss-in-pipeline-split")
    assert_on_reference(records, reference)


VP2 = ["--pipeline-model-parallel-size", "2", "--num-layers-per-virtual-pipeline-stage", "2"]
DROPOUT = ["--hidden-dropout", "0.1", "--attention-dropout", "0.1"]


@pytest.fixture(scope="module")
def vp2_dropout_reference(tmp_path_factory):
    """Failure-free (1, 2, 2) VP = 2 with dropout: masks are drawn per (microbatch id, virtual
    stage), so another layout draws others, and a recomputed microbatch must draw these."""
    records, _ = _run(tmp_path_factory.mktemp("vp2-dropout"), 4, *VP2, *DROPOUT)
    return records


KILLS = {  # (1, 2, 2): replica r is ranks r (stage 0) and r + 2 (stage 1)
    # 5 microbatches: replica 0 runs 3, lost with rank 2; replica 1 recomputes them (dropout on)
    "p2p": ("kill:rank=2,iter=8,phase=p2p", DROPOUT),
    "backward": ("kill:rank=1,iter=7,phase=backward", []),
}


@pytest.mark.timeout(600)
@pytest.mark.parametrize("name", list(KILLS))
def test_a_killed_rank_keeps_the_vp2_trajectory(reference, vp2_dropout_reference, tmp_path, name):
    fault, dropout = KILLS[name]
    records, run = _run(tmp_path, 4, *VP2, *dropout, "--inject-fault", fault, launcher_args=[])
    assert "peer failure" in run.stdout, run.stdout[-3000:]  # the fault really fired
    if dropout:
        assert vp2_dropout_reference[-1]["lm_loss"] != reference[-1]["lm_loss"]  # dropout is on
    assert_on_reference(records, vp2_dropout_reference if dropout else reference)


@pytest.mark.timeout(600)
def test_a_vp2_checkpoint_resumes_in_one_process(reference, tmp_path):
    """An async torch_dist save by ranks with two chunks each loads into one process without
    chunks (the checkpoint's keys are global layer numbers) and goes on along the trajectory."""
    ckpt = tmp_path / "ckpt"
    (tmp_path / "save").mkdir()
    (tmp_path / "resume").mkdir()
    _run(tmp_path / "save", 4, "--pipeline-model-parallel-size", "2",
         "--num-virtual-stages-per-pipeline-rank", "2", "--save", str(ckpt), "--save-interval",
         "6", "--async-save")
    assert (ckpt / "iter_0000006" / "common.pt").exists()
    (ckpt / "latest_checkpointed_iteration.txt").write_text("6")  # as if it had stopped at 6
    records, _ = _run(tmp_path / "resume", 1, "--load", str(ckpt))
    assert [r["iteration"] for r in records] == [7, 8, 9]
    for mine, ref in zip(records, reference[6:]):
        assert mine["microbatches"] == ref["microbatches"]
        assert abs(mine["lm_loss"] - ref["lm_loss"]) <= 1e-5 * abs(ref["lm_loss"]), (mine, ref)


@pytest.mark.timeout(600)
def test_a_replacement_rejoins_a_vp2_replica_and_the_trajectory_holds(reference, tmp_path):
    """Growing back with model chunks: rank 3 (replica 1's second stage) dies in backward, its
    launcher starts a replacement, the replica is re-formed from replica 0's state (every chunk)
    and both replicas train on. Rank 0 is slowed so the replacement is up before the job ends."""
    records, run = _run(tmp_path, 4, "--pipeline-model-parallel-size", "2",
                        "--num-layers-per-virtual-pipeline-stage", "2",
                        "--inject-fault", "kill:rank=3,iter=5,phase=backward",
                        "--inject-fault", "slow:rank=0,seconds=0.3,iter=6,phase=forward",
                        launcher_args=["--max-replacements", "1"])
    assert_on_reference(records, reference)
    assert len(records[4]["live_replicas"]) == 1 and records[-1]["live_replicas"] == [0, 1]
    assert re.search(r"replicas \[1\] joined \(state from replica 0", run.stdout), run.stdout[-3000:]
