"""Checkpoints: layout, exact resume, crash safety, bad --load, --exit-signal-handler.

Unit tests drive the real Checkpointer in this process on a 1-rank gloo group with a small
model; the multi-process tests launch the trainer (few on purpose: each costs ~10-15 s of CPU).
"""
from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from argparse import Namespace
from dataclasses import dataclass, field
from pathlib import Path

import pytest
import torch
from megatron.core.optimizer_param_scheduler import OptimizerParamScheduler

from megatron.training.checkpointing import (
    LATEST_FILE, CheckpointError, Checkpointer, TrainingStopped, find_resume_point, iter_dir_name,
    rank_dir_name, read_latest, writer_rank)
from megatron.training.config.io import CheckpointConfig
from megatron.training.optimizer import MainParamsAdamW
from megatron.training.checkpointing.state import Progress
from recover_patches.pipeline.rng import install_rng_tracker
from recover_patches.topology import Coord, Topology
from tests._checkpoint_host import OneProcessHost
from tests._launch_util import REPO, TINY_GPT, launch, read_metrics


# -- in-process fixtures --------------------------------------------------------------------------
@pytest.fixture(scope="module", autouse=True)
def _one_rank(one_rank_group):  # conftest's: save/load coordinate on the default group
    yield


class Crash(Exception):
    """Stands in for the process dying at the fault-injection point."""


@dataclass
class Faults:
    crash_at: tuple[str, int] | None = None

    def at(self, phase: str, iteration: int, microbatch: int | None = None) -> None:
        if (phase, iteration) == self.crash_at:
            raise Crash(f"{phase} {iteration}")


@dataclass
class Groups:
    topology: Topology = field(default_factory=lambda: Topology(1, 1, 1))
    rank: int = 0
    coord: Coord = Coord(tp=0, replica=0, pp=0)


class Metrics:
    closed = False

    def close(self) -> None:
        self.closed = True


def make_args(tmp: Path, **over) -> CheckpointConfig:
    base = dict(tensor_model_parallel_size=1, pipeline_model_parallel_size=1,
                context_parallel_size=1, save=str(tmp / "ck"),
                load=None, save_interval=2, train_iters=100, no_save_optim=None, no_save_rng=None,
                no_load_optim=None, no_load_rng=None, finetune=False, exit_signal_handler=False,
                use_tp_pp_dp_mapping=False, exit_interval=None, exit_duration_in_mins=None,
                ckpt_format="torch", async_save=False, dist_ckpt_strictness="assume_ok_unexpected",
                use_persistent_ckpt_worker=False, dist_ckpt_optim_fully_reshardable=False,
                ckpt_step=None, exit_on_missing_checkpoint=False, ckpt_assume_constant_structure=False,
                ckpt_fully_parallel_save=True, non_persistent_ckpt_type=None,
                non_persistent_save_interval=None, non_persistent_local_ckpt_dir=None,
                non_persistent_global_ckpt_dir=None, verify_integrity=False,
                enable_ft_package=False, calc_ft_timeouts=False, ft_num_warmup_iters=5,
                use_distributed_optimizer=False, num_layers=None, hidden_size=None,
                num_attention_heads=None, ffn_hidden_size=None, save_retain_interval=None)
    return CheckpointConfig.from_args(Namespace(**{**base, **over}))


class TinyTrainer(OneProcessHost):
    """The Trainer attributes the Checkpointer touches, around a real model/optimizer/scheduler."""

    def __init__(self, faults: Faults | None = None, dtype: torch.dtype = torch.float32):
        torch.manual_seed(0)
        self.model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.Dropout(0.5),
                                         torch.nn.Linear(8, 1)).to(dtype)
        self.optimizer = MainParamsAdamW([{"params": list(self.model.parameters())}], lr=1e-2,
                                         betas=(0.9, 0.999), eps=1e-8, weight_decay=0.01)
        self.scheduler = OptimizerParamScheduler(
            self.optimizer, init_lr=0.0, max_lr=1e-2, min_lr=1e-3, lr_warmup_steps=2, lr_decay_steps=10,
            lr_decay_style="cosine", start_wd=0.01, end_wd=0.01, wd_incr_steps=10, wd_incr_style="constant")
        self.groups = Groups()
        self.state, self.faults, self.metrics = Progress(), faults or Faults(), Metrics()
        self.tracker = install_rng_tracker()
        self.tracker.add("model-parallel-rng", 7)

    def train_step(self) -> float:
        """One iteration whose result depends on weights, Adam moments, LR and both RNG streams."""
        x = torch.randn(4, 8)
        with self.tracker.fork():
            x = x + torch.rand(4, 8)
        dtype = next(self.model.parameters()).dtype
        loss = self.model(x.to(dtype)).float().pow(2).mean()
        loss.backward()
        self.optimizer.step([p.grad.float() for p in self.optimizer.model_params])
        self.scheduler.step(increment=1)
        self.model.zero_grad(set_to_none=True)
        self.state.iteration += 1
        self.state.consumed_samples += 4
        return loss.item()


def run(trainer: TinyTrainer, checkpointer: Checkpointer, iters: int) -> list[float]:
    losses = []
    for _ in range(iters):
        losses.append(trainer.train_step())
        checkpointer.after_iteration(trainer)
    return losses


# -- unit tests -----------------------------------------------------------------------------------
def test_megatron_names():
    assert iter_dir_name(6) == "iter_0000006"
    assert rank_dir_name(1, 2, pp_size=4) == "mp_rank_01_002"
    assert rank_dir_name(1, 0, pp_size=1) == "mp_rank_01"  # Megatron omits the stage when PP == 1


def test_writer_is_the_lowest_live_replica():
    topo = Topology(tp=2, pp=2, dp=3)
    assert writer_rank(topo, [0, 1, 2], 1, 1) == topo.rank(1, 0, 1)
    assert writer_rank(topo, [2, 1], 0, 1) == topo.rank(0, 1, 1)


def test_resume_is_exact(tmp_path):
    args = make_args(tmp_path)
    first = TinyTrainer()
    reference = run(first, Checkpointer(args, 0, 1), 4)  # saves at 2 and 4
    assert read_latest(tmp_path / "ck") == 4
    (tmp_path / "ck" / LATEST_FILE).write_text("2\n")  # resume from the middle of that run

    resumed = TinyTrainer()
    torch.manual_seed(123)  # a fresh process would not share the first one's RNG position
    checkpointer = Checkpointer(make_args(tmp_path, load=str(tmp_path / "ck")), 0, 1)
    checkpointer.load(resumed)
    assert (resumed.state.iteration, resumed.state.consumed_samples) == (2, 8)
    assert resumed.scheduler.num_steps == 2
    assert run(resumed, checkpointer, 2) == reference[2:]  # bitwise
    for a, b in zip(first.model.state_dict().values(), resumed.model.state_dict().values()):
        assert torch.equal(a, b)


def test_crash_during_save_leaves_the_last_good_checkpoint(tmp_path):
    args = make_args(tmp_path)
    trainer = TinyTrainer(Faults(crash_at=("checkpoint", 4)))
    with pytest.raises(Crash):
        run(trainer, Checkpointer(args, 0, 1), 4)
    ck = tmp_path / "ck"
    assert read_latest(ck) == 2 and not (ck / iter_dir_name(4)).exists()
    assert (ck / ".tmp_iter_0000004" / "mp_rank_00" / "model_optim_rng.pt").is_file()  # written, not committed

    again = TinyTrainer()
    Checkpointer(make_args(tmp_path, load=str(ck)), 0, 1).load(again)
    assert again.state.iteration == 2
    # the next save of iteration 4 replaces the leftover and commits
    run(again, Checkpointer(make_args(tmp_path, load=str(ck)), 0, 1), 2)
    assert read_latest(ck) == 4 and not (ck / ".tmp_iter_0000004").exists()


def test_save_retain_interval_keeps_its_multiples_and_the_latest(tmp_path):
    """--save-interval 2 --save-retain-interval 4, ten iterations: Megatron-LM's rule deletes
    the checkpoint `latest` named before once a newer one is committed, unless a multiple of 4."""
    run(TinyTrainer(), Checkpointer(make_args(tmp_path, save_retain_interval=4), 0, 1), 10)
    ck = tmp_path / "ck"
    assert sorted(p.name for p in ck.glob("iter_*")) == [iter_dir_name(i) for i in (4, 8, 10)]
    assert read_latest(ck) == 10
    run(TinyTrainer(), Checkpointer(make_args(tmp_path / "all"), 0, 1), 6)  # without: all kept
    assert len(list((tmp_path / "all" / "ck").glob("iter_*"))) == 3


def test_finetune_loads_weights_only(tmp_path):
    run(TinyTrainer(), Checkpointer(make_args(tmp_path), 0, 1), 2)
    tuned = TinyTrainer()
    Checkpointer(make_args(tmp_path, load=str(tmp_path / "ck"), finetune=True), 0, 1).load(tuned)
    assert tuned.state.iteration == 0 and not tuned.optimizer.inner.state and tuned.scheduler.num_steps == 0
    saved = torch.load(tmp_path / "ck" / "iter_0000002" / "mp_rank_00" / "model_optim_rng.pt",
                       weights_only=False)  # it carries Megatron's `args` (a Namespace)
    assert torch.equal(tuned.model[0].weight, saved["model"]["0.weight"])


def test_a_changed_lr_schedule_is_one_clear_error(tmp_path):
    """Megatron's rule, as build_scheduler sets it up: a schedule that differs from the
    checkpoint's stops the load, naming --load and the two flags that settle it."""
    run(TinyTrainer(), Checkpointer(make_args(tmp_path), 0, 1), 2)
    longer = TinyTrainer()
    longer.scheduler = OptimizerParamScheduler(
        longer.optimizer, init_lr=0.0, max_lr=1e-2, min_lr=1e-3, lr_warmup_steps=2,
        lr_decay_steps=20, lr_decay_style="cosine", start_wd=0.01, end_wd=0.01, wd_incr_steps=10,
        wd_incr_style="constant", use_checkpoint_opt_param_scheduler=False)
    with pytest.raises(CheckpointError) as err:
        Checkpointer(make_args(tmp_path, load=str(tmp_path / "ck")), 0, 1).load(longer)
    assert err.value.flag == "--load" and "--override-opt_param-scheduler" in str(err.value)


def _saved_dir(tmp_path: Path, **over) -> Path:
    run(TinyTrainer(), Checkpointer(make_args(tmp_path, **over), 0, 1), 2)
    return tmp_path / "ck"


def _error(args, topology=Topology(1, 1, 1)) -> str:
    with pytest.raises(CheckpointError) as err:
        find_resume_point(args, topology)
    assert err.value.flag == "--load"
    return str(err.value)


def test_bad_load_dirs_are_clear_errors(tmp_path):
    assert "does not exist" in _error(make_args(tmp_path, load=str(tmp_path / "nope")))
    # --save C --load C on a job's first run starts from scratch, as in Megatron-LM
    assert find_resume_point(make_args(tmp_path, load=str(tmp_path / "ck")), Topology(1, 1, 1)) is None
    ck = _saved_dir(tmp_path)
    (ck / LATEST_FILE).write_text("garbage")
    assert "corrupt" in _error(make_args(tmp_path, load=str(ck)))
    (ck / LATEST_FILE).write_text("8")
    assert "missing or corrupt" in _error(make_args(tmp_path, load=str(ck)))
    (ck / LATEST_FILE).unlink()
    assert "has no latest" in _error(make_args(tmp_path, load=str(ck)))
    (ck / LATEST_FILE).write_text("2")
    rank_file = ck / "iter_0000002" / "mp_rank_00" / "model_optim_rng.pt"
    rank_file.write_bytes(rank_file.read_bytes()[:-100])
    assert "truncated" in _error(make_args(tmp_path, load=str(ck)))


def test_other_tp_pp_is_refused_but_other_dp_is_fine(tmp_path):
    ck = _saved_dir(tmp_path)
    message = _error(make_args(tmp_path, load=str(ck), tensor_model_parallel_size=2), Topology(2, 1, 1))
    assert "saved with TP=1, PP=1" in message and "this run has TP=2, PP=1" in message
    assert "--tensor-model-parallel-size 1" in message
    point = find_resume_point(make_args(tmp_path, load=str(ck)), Topology(1, 1, 4))
    assert point is not None and point.iteration == 2


def test_half_precision_finetune_steps_from_the_loaded_weights(tmp_path):
    """--finetune loads bf16 weights without the optimizer: the fp32 main params must follow them,
    or the first step would write the fresh model's weights back."""
    run(TinyTrainer(dtype=torch.bfloat16), Checkpointer(make_args(tmp_path), 0, 1), 2)
    tuned = TinyTrainer(dtype=torch.bfloat16)
    Checkpointer(make_args(tmp_path, load=str(tmp_path / "ck"), finetune=True), 0, 1).load(tuned)
    for main, param in zip(tuned.optimizer.main_params, tuned.optimizer.model_params):
        assert main is not param and torch.equal(main, param.float())
    fresh = TinyTrainer(dtype=torch.bfloat16).model.state_dict()
    assert any(not torch.equal(fresh[k], v) for k, v in tuned.model.state_dict().items())


def test_missing_optimizer_or_rng_needs_the_no_load_flag(tmp_path):
    ck = _saved_dir(tmp_path, no_save_optim=True, no_save_rng=True)
    assert "--no-load-optim" in _error(make_args(tmp_path, load=str(ck)))
    assert "--no-load-rng" in _error(make_args(tmp_path, load=str(ck), no_load_optim=True))
    args = make_args(tmp_path, load=str(ck), no_load_optim=True, no_load_rng=True)
    trainer = TinyTrainer()
    Checkpointer(args, 0, 1).load(trainer)
    assert trainer.state.iteration == 2 and not trainer.optimizer.inner.state


def test_sigterm_saves_at_the_end_of_the_iteration_and_exits_0(tmp_path):
    previous = signal.getsignal(signal.SIGTERM)
    try:
        trainer = TinyTrainer()
        checkpointer = Checkpointer(make_args(tmp_path, exit_signal_handler=True, save_interval=50), 0, 1)
        run(trainer, checkpointer, 1)
        os.kill(os.getpid(), signal.SIGTERM)
        trainer.train_step()
        with pytest.raises(TrainingStopped, match="SIGTERM"):
            checkpointer.after_iteration(trainer)
        assert trainer.metrics.closed
        assert read_latest(tmp_path / "ck") == 2
    finally:
        signal.signal(signal.SIGTERM, previous)


# -- multi-process: the real trainer --------------------------------------------------------------
DROPOUT = ["--hidden-dropout", "0.1", "--attention-dropout", "0.1"]  # resume must restore the masks
BOUNDED = ["--distributed-timeout-minutes", "1"]  # survivors of a killed rank cannot wait 10 min


def _layout(tp: int, pp: int) -> list[str]:
    return ["--tensor-model-parallel-size", str(tp), "--pipeline-model-parallel-size", str(pp)]


def _ckpt_args(ck: Path) -> list[str]:
    return ["--save", str(ck), "--load", str(ck), "--save-interval", "3", "--train-iters", "6"]


def _crash_then_resume(tmp: Path, tp: int, pp: int, dp: int, kill_rank: int,
                       ckpt_format: str = "torch_dist"):
    # even balance: throughput balancing follows wall-clock timings, so even an uninterrupted run
    # would not repeat its DP reduction order (hence its bits) from one launch to the next
    ck = tmp / "ck"
    flags = [*TINY_GPT, *DROPOUT, *BOUNDED, *_layout(tp, pp), "--recover-balance", "even",
             "--ckpt-format", ckpt_format]
    crashed = launch(tp * pp * dp, [*flags, *_ckpt_args(ck), "--inject-fault",
                                    f"kill:rank={kill_rank},iter=6,phase=checkpoint"], tmp / "crash.jsonl")
    state_after_crash = (read_latest(ck), sorted(p.name for p in ck.iterdir()))
    resumed = launch(tp * pp * dp, [*flags, *_ckpt_args(ck)], tmp / "resume.jsonl")
    return crashed, state_after_crash, resumed


def _check(crashed, state_after_crash, resumed, kill_rank: int):
    assert crashed.returncode != 0, crashed.stderr[-2000:]
    assert f"rank {kill_rank} (pid" in crashed.stderr and "killed by signal SIGKILL" in crashed.stderr
    assert [r["iteration"] for r in crashed.records] == [1, 2, 3, 4, 5, 6]  # the reference losses
    assert state_after_crash == (3, [".tmp_iter_0000006", "iter_0000003", LATEST_FILE])

    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert "loaded checkpoint" in resumed.stdout and "(iteration 3)" in resumed.stdout
    assert [r["iteration"] for r in resumed.records] == [4, 5, 6]
    assert resumed.losses() == crashed.losses()[3:]  # bitwise, dropout included
    assert [r["lr"] for r in resumed.records] == [r["lr"] for r in crashed.records[3:]]


@pytest.mark.multiprocess
@pytest.mark.timeout(600)
def test_tp2_pp2_crash_in_save_keeps_last_good_and_resume_is_exact(tmp_path):
    # torch format: rank 0 writes mp_rank_00_000 and commits; killed after writing, before the rename
    _check(*_crash_then_resume(tmp_path, 2, 2, 1, kill_rank=0, ckpt_format="torch"), kill_rank=0)
    ck = tmp_path / "ck"
    assert sorted(p.name for p in (ck / "iter_0000006").iterdir()) == [
        "mp_rank_00_000", "mp_rank_00_001", "mp_rank_01_000", "mp_rank_01_001", "recover_metadata.json"]

    # the same checkpoint under another TP/PP: one clear line, exit 2, nothing written
    other = tmp_path / "other"
    bad = launch(4, [*TINY_GPT, *_layout(1, 2), "--load", str(ck), "--save", str(other / "ck"),
                     "--save-interval", "3", "--train-iters", "6", "--ckpt-format", "torch"],
                 other / "m.jsonl", timeout=180)
    assert bad.returncode == 2  # the ranks' user error is the launcher's status too
    assert bad.stderr.count("stopped on a user error (status 2)") == 1
    assert bad.stderr.count("exit code 2") == 4
    assert "error: --load: checkpoint" in bad.stderr
    assert "saved with TP=2, PP=2 but this run has TP=1, PP=2" in bad.stderr
    assert not other.exists()


@pytest.mark.multiprocess
@pytest.mark.timeout(600)
def test_tp1_pp2_dp2_crash_of_a_writer_outside_the_leaders_replica_and_resume_is_exact(tmp_path):
    # torch_dist (the default): rank 1 is replica 1's first stage, whose share of the save is
    # lost with it: the leader (replica 0) must not commit
    _check(*_crash_then_resume(tmp_path, 1, 2, 2, kill_rank=1), kill_rank=1)
    directory = tmp_path / "ck" / "iter_0000006"
    assert sorted(p.name for p in directory.iterdir()) == [  # both replicas' two stages wrote
        ".metadata", *(f"__{i}_0.distcp" for i in range(4)), "common.pt", "metadata.json"]


def _children(pid: int) -> list[int]:
    text = Path(f"/proc/{pid}/task/{pid}/children").read_text()
    return [int(p) for p in text.split()]


@pytest.mark.multiprocess
@pytest.mark.timeout(300)
def test_sigterm_to_one_rank_saves_and_every_rank_exits_0(tmp_path):
    metrics, ck = tmp_path / "m.jsonl", tmp_path / "ck"
    cmd = [sys.executable, "-m", "recover_patches.launch", "--nproc-per-node", "2", "--master-port", "0",
           "--no-coordinator", str(REPO / "pretrain_gpt_recover.py"), *TINY_GPT, *_layout(1, 1),
           "--train-iters", "1000", "--save", str(ck), "--save-interval", "500",
           "--exit-signal-handler", "--metrics-file", str(metrics)]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONWARNINGS": "ignore"}
    proc = subprocess.Popen(cmd, cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True, start_new_session=True)
    try:
        deadline = time.monotonic() + 200
        while len(read_metrics(metrics)) < 2 and proc.poll() is None and time.monotonic() < deadline:
            time.sleep(0.2)
        ranks = _children(proc.pid)
        assert len(ranks) == 2, "the launcher should have forked 2 ranks"
        os.kill(ranks[1], signal.SIGTERM)  # only rank 1: the ranks must agree among themselves
        _out, err = proc.communicate(timeout=120)
    finally:
        try:
            os.killpg(proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        proc.wait()
    assert proc.returncode == 0 and "all 2 rank(s) exited 0" in err, err[-3000:]
    last = read_metrics(metrics)[-1]["iteration"]
    assert 2 <= last < 1000 and read_latest(ck) == last


@pytest.mark.multiprocess
@pytest.mark.timeout(300)
def test_fp16_resume_restores_main_params_and_the_loss_scaler(tmp_path):
    """fp32 main params and the loss scaler's state travel in the optimizer state: a resumed fp16
    run continues bitwise, with the scale it had reached (it changes every iteration here)."""
    fp16 = [*TINY_GPT, "--fp16", "--initial-loss-scale", "65536", "--hysteresis", "1",
            "--loss-scale-window", "2"]
    whole = launch(1, [*fp16, "--train-iters", "6"], tmp_path / "whole.jsonl")
    ck = ["--save", str(tmp_path / "ck"), "--load", str(tmp_path / "ck"), "--save-interval", "3"]
    first = launch(1, [*fp16, *ck, "--train-iters", "3"], tmp_path / "first.jsonl")
    # a longer run than the checkpoint's: its LR schedule is taken from the checkpoint
    resumed = launch(1, [*fp16, *ck, "--train-iters", "6", "--use-checkpoint-opt_param-scheduler"],
                     tmp_path / "resumed.jsonl")
    for run in (whole, first, resumed):
        assert run.returncode == 0, run.stderr[-3000:]
    scales = [r["loss_scale"] for r in whole.records]
    assert scales[3] != scales[0]  # the scale moved before the save: restoring it matters
    assert [r["iteration"] for r in resumed.records] == [4, 5, 6]
    assert [r["loss_scale"] for r in resumed.records] == scales[3:]
    assert resumed.losses() == whole.losses()[3:]


def test_a_last_save_that_never_lands_says_so(tmp_path, caplog):
    """The job's last save is made again after each regroup until it lands; after
    LAST_SAVE_ATTEMPTS it ends without it, and says so (it used to give up in silence)."""
    from types import SimpleNamespace

    from megatron.training.checkpointing import LAST_SAVE_ATTEMPTS, Checkpointer
    from recover_patches.collectives import PeerFailure

    class NeverLands(Checkpointer):
        def save(self, host, save_dir=None):
            return PeerFailure(0, {1}, "checkpoint", "rank 1 died mid-save")
    host = SimpleNamespace(training_state=SimpleNamespace(progress=SimpleNamespace(iteration=7)))
    regroups: list[str] = []
    NeverLands(make_args(tmp_path), 0, 1)._save_landing(
        host, lambda key, failure: regroups.append(key))
    assert regroups == [f"save7/{a}" for a in range(LAST_SAVE_ATTEMPTS)]
    assert f"the last checkpoint (iteration 7) did not land in {LAST_SAVE_ATTEMPTS} attempts" \
        in caplog.text
