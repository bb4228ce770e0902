"""Megatron's non-persistent checkpoints: local (each rank's own file, restored from a DP peer's
copy when a node's disk is gone) and global (a regular checkpoint of which only the newest is
kept), chosen over --load's checkpoint when at least as new; their flags' checks. One process
here; the multi-rank restore after a node's loss is the launch at the end."""
from __future__ import annotations

from pathlib import Path

import pytest
import torch

from megatron.training.arguments import parse_and_validate
from megatron.training.checkpointing import LATEST_FILE, Checkpointer, read_latest
from megatron.training.config.io import CheckpointConfig
from megatron.training.replication import foreign_copy, replication_cliques
from recover_patches.topology import Topology
from tests._launch_util import TINY_GPT, launch
from tests.test_checkpoint_dist import GPTTrainer, make_args, run

LOCAL = ["--non-persistent-ckpt-type", "local", "--non-persistent-save-interval", "3"]


@pytest.fixture(scope="module", autouse=True)
def _one_rank(one_rank_group):
    yield


def test_replication_cliques_are_nvrxs_and_must_be_one_position():
    assert replication_cliques(2, 2, 8) == [(0, 2), (1, 3), (4, 6), (5, 7)]
    assert replication_cliques(1, 2, 4) == [(0, 1), (2, 3)]
    # (tp 1, dp 2, pp 2): a rank's replica neighbour is 1 away, its next stage 2 away
    topology = Topology.from_world(4, 1, 2)
    assert foreign_copy(topology, 1, 2) is None
    assert foreign_copy(topology, 2, 2) == (0, 2)


@pytest.mark.parametrize("flags, named", [
    (["--non-persistent-ckpt-type", "in_memory"], "--non-persistent-ckpt-type"),
    (["--non-persistent-save-interval", "2"], "--non-persistent-save-interval"),
    (["--non-persistent-ckpt-type", "local"], "--non-persistent-local-ckpt-dir"),
    (["--non-persistent-ckpt-type", "global", "--replication", "--replication-jump", "1"],
     "--replication"),
    ([*LOCAL, "--non-persistent-local-ckpt-dir", "d", "--replication"], "--replication-jump"),
    ([*LOCAL, "--non-persistent-local-ckpt-dir", "d", "--replication", "--replication-jump", "2",
      "--pipeline-model-parallel-size", "2"], "--replication-jump"),  # rank 0's copy at stage 1
])
def test_bad_non_persistent_flags_are_one_line_and_exit_2(flags, named, capsys):
    with pytest.raises(SystemExit) as exit_info:
        parse_and_validate([*TINY_GPT, "--train-iters", "4", *flags], world_size=4)
    assert exit_info.value.code == 2
    err = capsys.readouterr().err
    assert err.startswith(f"pretrain_gpt_recover.py: error: {named}: ") and err.count("\n") == 1


def saver(args) -> Checkpointer:
    return Checkpointer(CheckpointConfig.from_args(args), 0, 1)


def test_local_checkpoints_resume_exactly_and_only_when_newer(tmp_path):
    """--save-interval 4, local every 3: after 7 iterations --load's latest is 4 and the local
    checkpoints 3 and 6 (a rank keeps two); a restart resumes from 6, bitwise. With local
    checkpoints older than --load's, --load's wins."""
    local = tmp_path / "local"
    flags = [*LOCAL, "--non-persistent-local-ckpt-dir", str(local), "--save-interval", "4"]
    first = GPTTrainer(make_args(tmp_path, *flags))
    reference = run(first, saver(make_args(tmp_path, *flags)), 9)  # local 3, 6, 9; --save 4, 8
    mine = local / "tp1_pp1_dp1" / "rank_00000"
    assert sorted(p.name for p in mine.iterdir()) == ["iter_0000006.pt", "iter_0000009.pt"]
    (mine / "iter_0000009.pt").unlink()  # the job died while writing 9
    resume = make_args(tmp_path, *flags, "--load", str(tmp_path / "ck"))
    (tmp_path / "ck" / LATEST_FILE).write_text("4\n")
    torch.manual_seed(7)
    resumed = GPTTrainer(resume)
    saver(resume).load(resumed)
    assert resumed.state.iteration == 6
    assert run(resumed, saver(make_args(tmp_path / "again")), 3) == reference[6:]
    (tmp_path / "ck" / LATEST_FILE).write_text("8\n")  # now --load's is newer: it wins
    persistent = GPTTrainer(resume)
    saver(resume).load(persistent)
    assert persistent.state.iteration == 8


def test_global_non_persistent_checkpoints_keep_the_newest_and_resume(tmp_path):
    flags = ["--non-persistent-ckpt-type", "global", "--non-persistent-save-interval", "3",
             "--save-interval", "4"]
    first = GPTTrainer(make_args(tmp_path, *flags))
    reference = run(first, saver(make_args(tmp_path, *flags)), 7)  # global 3, 6; --save 4
    ck = tmp_path / "ck"
    assert sorted(p.name for p in (ck / "non_persistent").iterdir()) == [
        "iter_0000006", LATEST_FILE]  # 3 went when 6 was written
    assert read_latest(ck) == 4
    (ck / LATEST_FILE).write_text("4\n")
    resume = make_args(tmp_path, *flags, "--load", str(ck))
    resumed = GPTTrainer(resume)
    saver(resume).load(resumed)
    assert resumed.state.iteration == 6
    assert run(resumed, saver(make_args(tmp_path / "again")), 1) == reference[6:]


@pytest.mark.multiprocess
@pytest.mark.timeout(600)
def test_a_nodes_ranks_restore_from_their_peers_copies_after_its_loss(tmp_path):
    """(tp 1, pp 2, dp 2), --replication with the copies 1 rank apart (the other replica's own
    files). The job dies saving iteration 6 persistently (--load's latest stays 3); the local
    checkpoints of 4 survive except on the lost node: replica 1's ranks 1 and 3. The restart
    restores 4 from local checkpoints, ranks 1 and 3 from their peers' copies, and repeats the
    first run's losses of iterations 5 and 6 bitwise."""
    ck, local = tmp_path / "ck", tmp_path / "local"
    flags = [*TINY_GPT, "--hidden-dropout", "0.1", "--pipeline-model-parallel-size", "2",
             "--recover-balance", "even", "--distributed-timeout-minutes", "1", "--train-iters",
             "6", "--save", str(ck), "--load", str(ck), "--save-interval", "3",
             "--non-persistent-ckpt-type", "local", "--non-persistent-save-interval", "2",
             "--non-persistent-local-ckpt-dir", str(local), "--replication",
             "--replication-jump", "1", "--replication-factor", "2"]
    crashed = launch(4, [*flags, "--inject-fault", "kill:rank=0,iter=6,phase=checkpoint"],
                     tmp_path / "crash.jsonl")
    assert crashed.returncode != 0 and [r["iteration"] for r in crashed.records] == list(
        range(1, 7)), crashed.stderr[-2000:]
    assert read_latest(ck) == 3
    layout = local / "tp1_pp2_dp2"
    for rank in (1, 3):  # the node and its disk are gone
        assert sorted(p.name for p in (layout / f"rank_{rank:05d}").iterdir()) == [
            "iter_0000002.pt", "iter_0000004.pt"]
        for file in (layout / f"rank_{rank:05d}").iterdir():
            file.unlink()
    resumed = launch(4, flags, tmp_path / "resume.jsonl")
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert "loaded local checkpoint of iteration 4" in resumed.stdout
    assert "rank(s) [1, 3] had no copy of their own and took a DP peer's" in resumed.stdout
    assert "--replication: the --replication-factor 2 copies" in resumed.stdout
    assert [r["iteration"] for r in resumed.records] == [5, 6]
    assert resumed.losses() == crashed.losses()[4:]
