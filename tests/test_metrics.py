"""--tensorboard-dir writes real event files with Megatron's tags, appended by a new writer
(a new logging rank) to the same run."""
from __future__ import annotations

from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

from megatron.training.metrics import MetricsWriter, log_line


def record(i: int, loss: float) -> dict:
    return {"iteration": i, "lm_loss": loss, "lr": 1e-3, "global_batch_size": 8, "grad_norm": 1.5,
            "loss_scale": 256.0, "ms_per_iteration": 10.0, "tokens_per_second": 100.0,
            "live_replicas": [0, 1], "consumed_samples": 8 * i, "skipped_iterations": 0}


def test_tensorboard_scalars_survive_a_change_of_logging_rank(tmp_path):
    first = MetricsWriter(str(tmp_path / "m.jsonl"), str(tmp_path / "tb"))
    first.write(record(1, 5.0))
    first.close()
    successor = MetricsWriter(str(tmp_path / "m.jsonl"), str(tmp_path / "tb"))
    successor.write(record(2, 4.5))
    successor.write({"iteration": 2, "valid_lm_loss": 4.7})
    successor.close()
    events = EventAccumulator(str(tmp_path / "tb"))
    events.Reload()
    tags = set(events.Tags()["scalars"])
    assert {"lm loss", "learning-rate", "batch-size", "grad-norm", "loss-scale", "iteration-time",
            "throughput", "live-replicas", "lm loss validation"} <= tags
    assert [(e.step, e.value) for e in events.Scalars("lm loss")] == [(1, 5.0), (2, 4.5)]


def test_log_line_has_megatrons_fields():
    line = log_line(record(3, 4.0), 10, skipped_since_last_line=2)
    assert "loss scale: 256.0" in line and "number of skipped iterations:   2" in line
