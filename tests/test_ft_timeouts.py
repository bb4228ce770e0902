"""--enable-ft-package / --calc-ft-timeouts / --ft-num-warmup-iters the ReCoVer way: rank 0 times
the intervals between iterations' ends past the warm-up and writes 5 x the longest to
SAVE/recover_timeout.json; the next run with --enable-ft-package takes it as --recover-timeout.
(A launch that uses it with the coordinator: tests/test_checkpoint_reshard.py.)"""
from __future__ import annotations

import json

import pytest

from megatron.training.checkpointing import ft_timeouts
from megatron.training.checkpointing import Checkpointer
from megatron.training.config.io import CheckpointConfig, FtConfig
from megatron.training.checkpointing.ft_timeouts import TimeoutRecorder, recover_timeout
from tests.test_checkpoint_dist import GPTTrainer, make_args, run


@pytest.fixture(scope="module", autouse=True)
def _one_rank(one_rank_group):
    yield


def test_the_warm_up_is_not_timed_and_the_timeout_is_five_times_the_longest(tmp_path,
                                                                              monkeypatch):
    clock = iter([0.0, 100.0, 101.0, 103.0, 103.5])  # iteration 2 took 100 s: warm-up
    monkeypatch.setattr(ft_timeouts.time, "monotonic", lambda: next(clock))
    config = FtConfig(True, True, 2, str(tmp_path))
    recorder = TimeoutRecorder(config)
    assert recorder.store() is None  # nothing timed yet
    for _ in range(5):
        recorder.iteration_ended()
    assert recorder.longest == 2.0  # iterations 3..5: 1 s, 2 s, 0.5 s
    assert recorder.store() == 10.0
    stored = json.loads((tmp_path / "recover_timeout.json").read_text())
    assert stored["recover_timeout"] == 10.0 and stored["safety_factor"] == 5.0
    assert recover_timeout(config, 30.0, rank=0) == 10.0
    assert recover_timeout(FtConfig(False, False, 5, str(tmp_path)), 30.0, rank=0) == 30.0
    (tmp_path / "recover_timeout.json").write_text("{torn")
    assert recover_timeout(config, 30.0, rank=0) == 30.0


def test_the_checkpointer_writes_the_timeout_after_each_save(tmp_path):
    args = make_args(tmp_path, "--enable-ft-package", "--calc-ft-timeouts",
                     "--ft-num-warmup-iters", "1")
    run(GPTTrainer(args), Checkpointer(CheckpointConfig.from_args(args), 0, 1), 4)
    stored = json.loads((tmp_path / "ck" / "recover_timeout.json").read_text())
    assert stored["recover_timeout"] >= 1.0 and stored["iterations_seen"] == 4
    assert stored["recover_timeout"] == max(5 * stored["longest_interval_s"], 1.0)
    plain = make_args(tmp_path / "plain", "--enable-ft-package")  # no --calc-ft-timeouts
    run(GPTTrainer(plain), Checkpointer(CheckpointConfig.from_args(plain), 0, 1), 2)
    assert not (tmp_path / "plain" / "ck" / "recover_timeout.json").exists()


def test_enable_ft_package_needs_save(capsys):
    from megatron.training.arguments import parse_and_validate
    from tests._launch_util import TINY_GPT
    with pytest.raises(SystemExit) as exit_info:
        parse_and_validate([*TINY_GPT, "--train-iters", "2", "--enable-ft-package"], 1)
    assert exit_info.value.code == 2
    assert capsys.readouterr().err.startswith(
        "pretrain_gpt_recover.py: error: --enable-ft-package: ")
