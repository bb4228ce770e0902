"""torch_dist checkpoints with context parallelism: CP ranks hold the same weights, so they
share a save as replicas do, and a checkpoint loads at another CP size. CP 2 x DP 2 saves (four
writers), CP 1 resumes it and saves with one writer, CP 2 x DP 2 resumes that: every resumed
iteration has the losses of the uninterrupted CP 2 run (within reduction-order noise), and the
last save, after a CP rank of replica 0 died, is written by the survivors."""
from __future__ import annotations

from pathlib import Path

import pytest

from megatron.training.checkpointing import LATEST_FILE, read_latest
from tests._launch_util import TINY_GPT, Run, launch

pytestmark = [pytest.mark.multiprocess, pytest.mark.timeout(420)]

ITERS = 6
FLAGS = [*TINY_GPT, "--train-iters", str(ITERS), "--recover-balance", "even"]
CP2 = ["--context-parallel-size", "2", "--cp-comm-type", "allgather"]
TOLERANCE = 1e-5  # another CP size sums the loss and gradients in another order


def train(tmp: Path, name: str, nproc: int, *extra: str,
          launcher_args: list[str] | None = None) -> Run:
    run = launch(nproc, [*FLAGS, *extra], tmp / f"{name}.jsonl", launcher_args=launcher_args)
    assert run.returncode == 0, run.stdout[-2000:] + run.stderr[-3000:]
    return run


def close(mine: list[float], reference: list[float]) -> bool:
    return len(mine) == len(reference) and all(
        abs(a - b) <= TOLERANCE * abs(b) for a, b in zip(mine, reference))


def distcp_files(iteration_dir: Path) -> list[str]:
    return sorted(p.name for p in iteration_dir.glob("*.distcp"))


def test_cp2_saves_cp1_resumes_and_saves_cp2_resumes_with_the_same_losses(tmp_path):
    first, second = tmp_path / "first", tmp_path / "second"
    saved = train(tmp_path, "cp2", 4, *CP2, "--save", str(first), "--save-interval", "2")
    # CP 2 x DP 2 shares the writing among the four ranks that hold the (only) position
    assert distcp_files(first / "iter_0000002") == [f"__{i}_0.distcp" for i in range(4)]
    (first / LATEST_FILE).write_text("2")
    cp1 = train(tmp_path, "cp1", 2, "--load", str(first), "--save", str(second),
                "--save-interval", "2", "--no-ckpt-fully-parallel-save")
    assert close(cp1.losses(), saved.losses()[2:]), (cp1.losses(), saved.losses())
    (second / LATEST_FILE).write_text("4")
    # replica 0 loses its second CP rank before the last save: replica 1's first CP rank writes
    again = train(tmp_path, "cp2-again", 4, *CP2, "--load", str(second), "--save",
                  str(tmp_path / "third"), "--save-interval", "6", "--no-ckpt-fully-parallel-save",
                  "--recover-spares", "off", "--inject-fault", "kill:rank=1,iter=6,phase=forward",
                  launcher_args=[])
    assert close(again.losses(), saved.losses()[4:]), (again.losses(), saved.losses())
    assert "loaded checkpoint" in again.stdout
    assert again.records[-1]["live_replicas"] == [1]
    assert read_latest(tmp_path / "third") == 6
    assert distcp_files(tmp_path / "third" / "iter_0000006") == ["__0_0.distcp"]  # one writer
