"""--tensorboard-dir writes real event files with Megatron's tags, appended by a new writer
(a new logging rank) to the same run."""
from __future__ import annotations

import pytest
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

from megatron.training.config.io import TensorBoardConfig
from megatron.training.metrics import MetricsWriter, gpt_flops, log_line
from tests._launch_util import TINY_GPT, launch


def record(i: int, loss: float) -> dict:
    return {"iteration": i, "lm_loss": loss, "lr": 1e-3, "global_batch_size": 8, "grad_norm": 1.5,
            "loss_scale": 256.0, "ms_per_iteration": 10.0, "tokens_per_second": 100.0,
            "tflops_per_gpu": 12.5, "live_replicas": [0, 1], "consumed_samples": 8 * i,
            "skipped_iterations": 0, "phase_seconds": {"execute": 0.5, "reduce": 0.1,
                                                       "commit": 0.01, "step": 0.2},
            "quotas": {"0": 4, "1": 4}, "recoveries": []}


def test_tensorboard_scalars_survive_a_change_of_logging_rank(tmp_path):
    config = TensorBoardConfig(str(tmp_path / "tb"), validation_ppl=True, timers=True)
    first = MetricsWriter(str(tmp_path / "m.jsonl"), config)
    first.write(record(1, 5.0))
    first.close()
    successor = MetricsWriter(str(tmp_path / "m.jsonl"), config)
    successor.write(record(2, 4.5))
    successor.write({"iteration": 2, "valid_lm_loss": 4.7})
    successor.close()
    events = EventAccumulator(str(tmp_path / "tb"))
    events.Reload()
    tags = set(events.Tags()["scalars"])
    assert {"lm loss", "learning-rate", "batch-size", "grad-norm", "loss-scale", "iteration-time",
            "throughput", "live-replicas", "lm loss validation", "lm loss validation ppl",
            "forward-backward-time", "optimizer-time", "quota/replica-1", "recovery-seconds",
            "tokens-per-second"} <= tags
    assert "grads-all-reduce-time" not in tags  # --timing-log-level 0 (the default)
    assert [(e.step, e.value) for e in events.Scalars("lm loss")] == [(1, 5.0), (2, 4.5)]
    assert events.Scalars("throughput")[0].value == 12.5  # TFLOP/s per GPU, as Megatron's tag


def test_without_a_metrics_file_a_successor_resumes_after_the_last_tensorboard_step(tmp_path):
    config = TensorBoardConfig(str(tmp_path / "tb"))
    assert MetricsWriter(None, config).last_iteration() == 0  # no run yet
    first = MetricsWriter(None, config)
    for i in (1, 2, 3):
        first.write(record(i, 5.0 - i / 10))
    first.close()
    assert MetricsWriter(None, config).last_iteration() == 3


def test_the_flop_count_is_the_papers_closed_form():
    """Narayanan et al. (2021), eq. 3: 72 B s l h^2 (1 + s / 6h + V / 12 l h) for a GPT with
    ffn = 4h, no query groups, no gated MLP."""
    from megatron.training.arguments import parse_args, validate_args
    from megatron.training.config import ModelConfig
    b, s, l, h, v, heads = 8, 2048, 24, 1024, 51200, 16
    args = validate_args(parse_args([
        "--num-layers", str(l), "--hidden-size", str(h), "--num-attention-heads", str(heads),
        "--seq-length", str(s), "--max-position-embeddings", str(s), "--micro-batch-size", "1",
        "--train-iters", "1", "--mock-data", "--tokenizer-type", "NullTokenizer",
        "--vocab-size", str(v), "--lr", "1e-4"]), 1)
    paper = 72 * b * s * l * h * h * (1 + s / (6 * h) + v / (12 * l * h))
    assert abs(gpt_flops(ModelConfig.from_args(args, v), b) - paper) <= 1e-9 * paper


def test_log_line_has_megatrons_fields():
    line = log_line({**record(3, 4.0), "params_norm": 25.5, "num_zeros": 3.0}, 10,
                    skipped_since_last_line=2)
    assert "loss scale: 256.0" in line and "number of skipped iterations:   2" in line
    assert "throughput per GPU (TFLOP/s/GPU): 12.5" in line
    assert "params norm: 25.500" in line and "num zeros: 3.0" in line


def test_moe_losses_follow_the_lm_loss_in_megatrons_format_and_tags(tmp_path):
    """MoE: Megatron-LM prints each tracked auxiliary loss right after the lm loss (' {}: {:.6E}
    |') and writes it under its own name; per-layer values go to TensorBoard only."""
    losses = {"load_balancing_loss": 1.0061, "z_loss": 1.9369, "moe/z_loss_layer_0": 0.5}
    line = log_line({**record(3, 4.0), "moe_losses": losses}, 10)
    assert "| lm loss: 4.000000E+00 | load_balancing_loss: 1.006100E+00 | z_loss: 1.936900E+00 " \
           "| loss scale: 256.0 |" in line and "layer_0" not in line
    config = TensorBoardConfig(str(tmp_path / "tb"))
    writer = MetricsWriter(None, config)
    writer.write({**record(1, 5.0), "moe_losses": losses})
    writer.close()
    events = EventAccumulator(str(tmp_path / "tb"))
    events.Reload()
    assert {"load_balancing_loss", "z_loss", "moe/z_loss_layer_0"} <= set(events.Tags()["scalars"])


EVERY_STEP_TAGS = ["lm loss", "learning-rate", "batch-size", "grad-norm", "loss-scale",
                   "iteration-time", "throughput", "params-norm", "num-zeros",
                   "forward-backward-time", "grads-all-reduce-time", "recover-commit-time",
                   "optimizer-time", "mem-max-rss-bytes", "mem-rss-bytes", "live-replicas", "recovery-seconds",
                   "microbatches-recomputed", "tokens-per-second"]


@pytest.mark.multiprocess
@pytest.mark.timeout(300)
def test_a_run_writes_every_tag_for_every_step_across_the_logging_ranks_death(tmp_path):
    """20 iterations at (1,1,4), TensorBoard only (no --metrics-file), every logging flag on; the
    logging rank 0 is killed after iteration 8's commit (the others see it in iteration 9, and
    recover there): its successor (rank 1) finds the last step
    in the event files and writes from there, so no step is missing and none is written twice."""
    tb = tmp_path / "tb"
    run = launch(4, [*TINY_GPT, "--train-iters", "20", "--recover-balance", "even",
                     "--tensorboard-dir", str(tb), "--log-params-norm", "--log-num-zeros-in-grad",
                     "--log-throughput", "--log-timers-to-tensorboard", "--timing-log-level", "2",
                     "--log-memory-to-tensorboard", "--log-validation-ppl-to-tensorboard",
                     "--eval-interval", "5", "--eval-iters", "1",
                     # a kill is seen at once; the longer bound keeps a successor that is slow
                     # to take over the event files under CI's load from being fenced as hung
                     # (one CI run lost a second replica here: live 2, not 3)
                     "--recover-timeout", "30",
                     "--inject-fault", "kill:rank=0,iter=8,phase=optimizer"],
                 tmp_path / "unused.jsonl", launcher_args=[], timeout=280)
    assert run.returncode == 0, run.stderr[-3000:]
    events = EventAccumulator(str(tb), size_guidance={"scalars": 0}, purge_orphaned_data=False)
    events.Reload()
    for tag in EVERY_STEP_TAGS:
        assert [e.step for e in events.Scalars(tag)] == list(range(1, 21)), tag
    for tag in ("lm loss validation", "lm loss validation ppl"):
        assert [e.step for e in events.Scalars(tag)] == [5, 10, 15, 20], tag
    live = [e.value for e in events.Scalars("live-replicas")]
    assert live[:8] == [4] * 8 and live[8:] == [3] * 12  # rank 0's replica lost in iteration 9
    assert [e.step for e in events.Scalars("recovery-seconds") if e.value > 0] == [9]
    assert [e.step for e in events.Scalars("microbatches-recomputed") if e.value > 0] == [9]


@pytest.mark.timeout(120)
def test_wandb_offline_run_holds_the_same_scalar_keys(tmp_path):
    """One process (no launcher), WANDB_MODE=offline: the run's .wandb file holds every scalar
    key the TensorBoard writer uses, logged at every step."""
    import os
    import subprocess
    import sys

    from tests._launch_util import REPO
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE")}
    env.update(WANDB_MODE="offline", WANDB_SILENT="true", PYTHONWARNINGS="ignore",
               OMP_NUM_THREADS="1")
    proc = subprocess.run([sys.executable, str(REPO / "pretrain_gpt_recover.py"), *TINY_GPT,
                           "--train-iters", "3", "--wandb-project", "recover-test",
                           "--wandb-exp-name", "tiny", "--wandb-save-dir", str(tmp_path),
                           "--log-params-norm", "--log-throughput"],
                          cwd=tmp_path, env=env, capture_output=True, text=True, timeout=110)
    assert proc.returncode == 0, proc.stderr[-2000:]
    runs = list((tmp_path / "wandb").glob("offline-run-*/run-*.wandb"))
    assert len(runs) == 1, runs
    data = runs[0].read_bytes()
    for key in ("lm loss", "learning-rate", "batch-size", "grad-norm", "loss-scale",
                "iteration-time", "throughput", "params-norm", "live-replicas",
                "tokens-per-second", "recovery-seconds"):
        assert data.count(key.encode()) >= 3, key  # one history record per step
