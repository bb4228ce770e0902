"""torch_dist checkpoints across layouts and processes: exact resume at the same (TP, PP, DP),
the same losses at another one (TP 2->1, PP 1->2, DP 4->2), and a writer killed during an
--async-save. Few launches on purpose (each costs ~8 s of CPU)."""
from __future__ import annotations

import json
from pathlib import Path

import pytest

from megatron.training.arguments import parse_and_validate
from megatron.training.checkpointing.torch_dist import load_common
from megatron.training.checkpointing import LATEST_FILE, find_resume_point, read_latest
from megatron.training.config.io import CheckpointConfig
from recover_patches.topology import Topology
from tests._launch_util import TINY_GPT, Run, launch

pytestmark = [pytest.mark.multiprocess, pytest.mark.timeout(600)]

# even balance: a bitwise comparison needs the same DP reduction order in both launches. No
# dropout: its masks are drawn per pipeline stage, so they differ between PP layouts (resuming
# the masks exactly is tested with dropout in test_checkpointing / test_checkpoint_dist)
FLAGS = [*TINY_GPT, "--recover-balance", "even"]
TOLERANCE = 1e-5  # another layout sums in another order (the parallel-equivalence tolerance)


def layout(tp: int, pp: int) -> list[str]:
    return ["--tensor-model-parallel-size", str(tp), "--pipeline-model-parallel-size", str(pp)]


def ok(run: Run) -> Run:
    assert run.returncode == 0, run.stderr[-3000:]
    return run


def train(tmp: Path, name: str, nproc: int, tp: int, pp: int, *extra: str) -> Run:
    return ok(launch(nproc, [*FLAGS, *layout(tp, pp), *extra], tmp / f"{name}.jsonl"))


def close(a: list[float], b: list[float]) -> bool:
    return len(a) == len(b) and all(abs(x - y) <= TOLERANCE * abs(y) for x, y in zip(a, b))


def save_resume_again(tmp: Path, saver: tuple[int, int, int], resumer: tuple[int, int, int]):
    """(nproc, TP, PP) layouts. `saved` trains 6 iterations with blocking saves; `resumed` loads
    its iteration 2 at the other layout and trains on with async saves; `again` loads the
    resumed run's iteration 4 at the same layout. Returns the three runs."""
    first, second = tmp / "first", tmp / "second"
    saved = train(tmp, "saved", *saver, "--train-iters", "6", "--save", str(first),
                  "--save-interval", "2")
    (first / LATEST_FILE).write_text("2")
    # Megatron-LM's args, as its tools read them back: the padded vocabulary among them
    saved_args = load_common(first / "iter_0000002")["args"]
    assert (saved_args.padded_vocab_size, saved_args.data_parallel_size) == (256, saver[0] // (
        saver[1] * saver[2]))
    resumed = train(tmp, "resumed", *resumer, "--train-iters", "6", "--load", str(first),
                    "--save", str(second), "--save-interval", "2", "--async-save")
    assert "written in the background" in resumed.stdout and read_latest(second) == 6
    (second / LATEST_FILE).write_text("4")
    again = train(tmp, "again", *resumer, "--train-iters", "6", "--load", str(second))
    assert again.losses() == resumed.losses()[2:]  # bitwise, from an async save
    return saved, resumed, again


def distcp_files(iteration_dir: Path) -> list[str]:
    return sorted(p.name for p in iteration_dir.glob("*.distcp"))


def test_tp2_pp2_resumes_bitwise_from_sync_and_async_saves_and_loads_at_tp1(tmp_path):
    saved, resumed, _ = save_resume_again(tmp_path, (4, 2, 2), (4, 2, 2))
    assert resumed.losses() == saved.losses()[2:]  # bitwise, from a blocking save
    one_writer = tmp_path / "one_writer"
    tp1 = train(tmp_path, "tp1", 2, 1, 1, "--train-iters", "6", "--load",  # DP 1 -> 2
                str(tmp_path / "first"), "--save", str(one_writer), "--save-interval", "2",
                "--no-ckpt-fully-parallel-save")
    assert close(tp1.losses(), saved.losses()[2:]), (tp1.losses(), saved.losses())
    assert "RNG state of" in tp1.stdout  # another layout: said, not silently skipped
    # DP 2, and the lowest replica writes everything: one file
    assert distcp_files(one_writer / "iter_0000004") == ["__0_0.distcp"]


def test_pp1_dp4_loads_at_pp2_dp2_and_that_resumes_bitwise(tmp_path):
    """The saves are shared (Megatron's default): all four replicas write a part of DP 4's one
    position, both replicas a part of each stage at DP 2; what they wrote resumes bitwise."""
    saved, resumed, _ = save_resume_again(tmp_path, (4, 1, 1), (4, 1, 2))
    assert close(resumed.losses(), saved.losses()[2:]), (resumed.losses(), saved.losses())
    assert distcp_files(tmp_path / "first" / "iter_0000002") == [
        f"__{i}_0.distcp" for i in range(4)]
    assert len(distcp_files(tmp_path / "second" / "iter_0000004")) == 4


def test_a_writer_killed_during_an_async_save_leaves_the_last_good_checkpoint(tmp_path):
    """(1,2,2): both replicas write a share of each stage. Replica 1's second stage dies in the
    background write of iteration 4; the job (recovery on) goes on with replica 0, never commits
    iteration 4, and saves iteration 6 from replica 0 alone. --enable-ft-package: every rank
    takes --recover-timeout from the file an earlier --calc-ft-timeouts run left in --save (the
    coordinator accepts the ranks only if they agree), and this run writes its own."""
    ck, victim = tmp_path / "ck", Topology(1, 2, 2).rank(0, 1, 1)
    ck.mkdir()
    (ck / "recover_timeout.json").write_text('{"recover_timeout": 7.5}')
    run = launch(4, [*FLAGS, *layout(1, 2), "--train-iters", "6", "--save", str(ck),
                     "--save-interval", "2", "--async-save", "--distributed-timeout-minutes", "1",
                     "--inject-fault", f"kill:rank={victim},iter=4,phase=checkpoint",
                     "--enable-ft-package", "--calc-ft-timeouts", "--ft-num-warmup-iters", "1"],
                 tmp_path / "m.jsonl", launcher_args=[])
    assert run.returncode == 0, run.stderr[-3000:]
    assert "--recover-timeout 7.5 from" in run.stdout
    assert "--calc-ft-timeouts: --recover-timeout" in run.stdout
    assert [r["iteration"] for r in run.records] == [1, 2, 3, 4, 5, 6]
    assert all(r["microbatches"] == 8 for r in run.records)
    assert sorted(p.name for p in ck.iterdir()) == ["iter_0000002", "iter_0000006", LATEST_FILE,
                                                    "recover_timeout.json"]
    assert json.loads((ck / "recover_timeout.json").read_text())["iterations_seen"] == 6
    assert read_latest(ck) == 6
    assert len(distcp_files(ck / "iter_0000006")) == 2  # replica 0's two stages
    (ck / LATEST_FILE).write_text("2")  # the checkpoint before the kill is intact
    config = CheckpointConfig.from_args(parse_and_validate(
        [*TINY_GPT, "--train-iters", "6", "--load", str(ck)], world_size=1))
    point = find_resume_point(config, Topology(1, 2, 2))
    assert point is not None and point.iteration == 2
