"""Megatron-style iteration log lines and a JSONL metrics file (one record per iteration)."""
from __future__ import annotations

import hashlib
import json
import math
import os
import resource
import time
from pathlib import Path
from typing import IO

import torch

from megatron.training.config import ModelConfig
from megatron.training.config.io import TensorBoardConfig, WandbConfig


def log_line(rec: dict, train_iters: int, skipped_since_last_line: int = 0) -> str:
    """Megatron's iteration line; the skipped count is per log interval, as Megatron prints it
    (the JSONL's `skipped_iterations` is the running total)."""
    parts = [
        f" [{time.strftime('%Y-%m-%d %H:%M:%S')}] iteration {rec['iteration']:8d}/{train_iters:8d}",
        f"consumed samples: {rec['consumed_samples']:12d}",
        f"elapsed time per iteration (ms): {rec['ms_per_iteration']:.1f}",
        f"learning rate: {rec['lr']:.6E}",
        f"global batch size: {rec['global_batch_size']:5d}",
        f"lm loss: {rec['lm_loss']:.6E}",
        # MoE's auxiliary losses, by Megatron's names and format (per-layer ones: TensorBoard)
        *(f"{name}: {value:.6E}" for name, value in rec.get("moe_losses", {}).items()
          if not name.startswith("moe/")),
        f"loss scale: {rec.get('loss_scale', 1.0):.1f}",
        f"grad norm: {rec['grad_norm']:.3f}",
        f"number of skipped iterations: {skipped_since_last_line:3d}",
        f"tokens/s: {rec['tokens_per_second']:.0f}",
    ]
    if "tflops_per_gpu" in rec:  # --log-throughput
        parts.insert(4, f"throughput per GPU (TFLOP/s/GPU): {rec['tflops_per_gpu']:.1f}")
    if "num_zeros" in rec:  # --log-num-zeros-in-grad
        parts.append(f"num zeros: {rec['num_zeros']:.1f}")
    if "params_norm" in rec:  # --log-params-norm
        parts.append(f"params norm: {rec['params_norm']:.3f}")
    return " | ".join(parts) + " |"


# JSONL key -> Megatron's TensorBoard tag
TENSORBOARD_TAGS = {"lm_loss": "lm loss", "lr": "learning-rate", "global_batch_size": "batch-size",
                    "grad_norm": "grad-norm", "loss_scale": "loss-scale",
                    "ms_per_iteration": "iteration-time", "tflops_per_gpu": "throughput",
                    "params_norm": "params-norm", "num_zeros": "num-zeros",
                    "valid_lm_loss": "lm loss validation",
                    # ReCoVer's own
                    "tokens_per_second": "tokens-per-second"}
# phase of the iteration transaction -> Megatron-style timer tag, and the --timing-log-level it needs
TIMER_TAGS = {"execute": ("forward-backward-time", 0), "step": ("optimizer-time", 0),
              "reduce": ("grads-all-reduce-time", 1), "commit": ("recover-commit-time", 1)}


class TensorBoardWriter:
    """--tensorboard-dir: the records' scalars under Megatron's tags, plus ReCoVer's
    (`live-replicas`, `recovery-seconds`, `microbatches-recomputed`, `quota/replica-R`,
    `tokens-per-second`). Opened by whichever rank logs; a successor appends to the same run."""

    def __init__(self, config: TensorBoardConfig):
        from torch.utils.tensorboard import SummaryWriter  # needs the tensorboard package

        self.config = config
        self.writer = SummaryWriter(log_dir=config.log_dir, max_queue=config.queue_size)

    @staticmethod
    def last_step(log_dir: str) -> int:
        """The last iteration the run's `lm loss` holds (0 if none): read back at a takeover."""
        from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

        if not os.path.isdir(log_dir):
            return 0
        events = EventAccumulator(log_dir, size_guidance={"scalars": 0})
        events.Reload()
        if "lm loss" not in events.Tags()["scalars"]:
            return 0
        return max(e.step for e in events.Scalars("lm loss"))

    def write(self, record: dict) -> None:
        step = record["iteration"]
        if "lm_loss" in record and step % self.config.log_interval:
            return
        for tag, value in scalars(record, self.config).items():
            self.writer.add_scalar(tag, value, step)
        self.writer.flush()

    def close(self) -> None:
        self.writer.close()


def scalars(record: dict, config: TensorBoardConfig) -> dict[str, float]:
    """A record's scalars under Megatron's tags and ReCoVer's (TensorBoard and W&B alike)."""
    out = {tag: record.get(key) for key, tag in TENSORBOARD_TAGS.items()}
    if config.validation_ppl and "valid_lm_loss" in record:
        out["lm loss validation ppl"] = math.exp(min(20.0, record["valid_lm_loss"]))
    if "live_replicas" in record:
        out["live-replicas"] = len(record["live_replicas"])
    if "recoveries" in record:
        out["recovery-seconds"] = sum(sum(r["seconds"].values()) for r in record["recoveries"])
        out["microbatches-recomputed"] = sum(len(r["lost_ids"]) for r in record["recoveries"])
    out.update(record.get("moe_losses", {}))  # Megatron's tags: the names themselves
    for replica, quota in record.get("quotas", {}).items():
        out[f"quota/replica-{replica}"] = quota
    if config.timers:
        for phase, seconds in record.get("phase_seconds", {}).items():
            tag, level = TIMER_TAGS.get(phase, (None, 3))
            if tag is not None and level <= config.timing_level:
                out[tag] = seconds * 1000.0  # ms, as Megatron writes its timers
    if config.memory:
        out.update(record.get("memory", {}))
    return {tag: float(v) for tag, v in out.items()
            if isinstance(v, (int, float)) and math.isfinite(v)}


class WandbWriter:
    """The same scalars to Weights & Biases (works offline: WANDB_MODE=offline). The run id is
    derived from project, name and directory, so a new logging rank resumes the same run."""

    def __init__(self, config: WandbConfig, scalars_config: TensorBoardConfig):
        import wandb  # the `wandb` extra

        run_id = hashlib.sha256(f"{config.project}/{config.exp_name}/{os.path.abspath(config.save_dir)}"
                                .encode()).hexdigest()[:16]
        self.config = scalars_config
        self.run = wandb.init(project=config.project, name=config.exp_name or None,
                              dir=config.save_dir, entity=config.entity or None, id=run_id,
                              resume="allow", config=config.run_config)

    def write(self, record: dict) -> None:
        step = record["iteration"]
        if "lm_loss" in record and step % self.config.log_interval:
            return
        self.run.log(scalars(record, self.config), step=step)

    def close(self) -> None:
        self.run.finish()


def memory_scalars(device: torch.device) -> dict[str, float]:
    """--log-memory-to-tensorboard: Megatron's tags on CUDA; the process's peak and current RSS on
    CPU (current: what is held now, which a peak reached at start-up hides)."""
    if device.type == "cuda":
        stats = torch.cuda.memory_stats(device)
        return {"mem-reserved-bytes": stats["reserved_bytes.all.current"],
                "mem-allocated-bytes": stats["allocated_bytes.all.current"],
                "mem-max-allocated-bytes": stats["allocated_bytes.all.peak"],
                "mem-allocated-count": stats["allocation.all.current"]}
    scalars: dict[str, float] = {"mem-max-rss-bytes": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024}
    statm = Path("/proc/self/statm")  # (Linux: pages, resident second)
    if statm.exists():
        scalars["mem-rss-bytes"] = int(statm.read_text().split()[1]) * resource.getpagesize()
    return scalars


def gpt_flops(model: ModelConfig, batch_size: int) -> float:
    """FLOPs of one training iteration over `batch_size` sequences: Megatron-LM's formula for a
    dense GPT (Narayanan et al. 2021, appendix): 12 = 3 (forward, two backward GEMMs) x 2 (GEMMs in
    pairs) x 2 (multiply-add); attention with query groups; a gated MLP counts 3/2; the logits."""
    t, seq = model.transformer, model.seq_length
    heads, hidden, layers = t.num_attention_heads, t.hidden_size, t.num_layers
    groups = t.num_query_groups or heads
    query_ratio = t.kv_channels * heads / hidden
    gated = 1.5 if t.gated_linear_unit else 1.0
    per_token_layer = ((1 + groups / heads + seq / hidden) * query_ratio
                       + t.ffn_hidden_size / hidden * gated
                       + model.padded_vocab_size / (2 * layers * hidden))
    return 12.0 * batch_size * seq * layers * hidden * hidden * per_token_layer


class MetricsWriter:
    """Appends one JSON object per line; flushed every record so a killed job keeps its history.
    With a TensorBoard directory the same records also go there."""

    def __init__(self, path: str | None, tensorboard: TensorBoardConfig | None = None,
                 wandb: WandbConfig | None = None):
        self.path = path
        self.tensorboard = tensorboard
        self.wandb = wandb
        self._wandb: WandbWriter | None = None
        self._file: IO[str] | None = None
        self._tensorboard: TensorBoardWriter | None = None

    def write(self, record: dict) -> None:
        """Opened on first use: only the logging rank (the lowest live one) ever writes, and
        after a failure another rank may take over appending to the same file."""
        if self.path and self._file is None:
            os.makedirs(os.path.dirname(os.path.abspath(self.path)), exist_ok=True)
            self._file = open(self.path, "a", encoding="utf-8")
        if self._file is not None:
            self._file.write(json.dumps(record, sort_keys=True) + "\n")
            self._file.flush()
        if self.tensorboard is not None and self._tensorboard is None:
            self._tensorboard = TensorBoardWriter(self.tensorboard)
        if self._tensorboard is not None:
            self._tensorboard.write(record)
        if self.wandb is not None and self._wandb is None:
            self._wandb = WandbWriter(self.wandb, self.tensorboard or TensorBoardConfig(""))
        if self._wandb is not None:
            self._wandb.write(record)

    def last_iteration(self) -> int:
        """The highest iteration already in the file (0 if none): after the logging rank dies,
        its successor appends the records it missed."""
        if self._file is not None:
            self._file.flush()
        if not self.path and self.tensorboard is not None:  # the run's only record
            return TensorBoardWriter.last_step(self.tensorboard.log_dir)
        if not self.path or not os.path.exists(self.path):
            return 0
        last = 0
        with open(self.path, encoding="utf-8") as f:
            for line in f:
                try:
                    last = max(last, int(json.loads(line).get("iteration", 0)))
                except ValueError:  # a line cut short by a killed writer
                    continue
        return last

    def close(self) -> None:
        if self._file is not None:
            self._file.close()
            self._file = None
        if self._tensorboard is not None:
            self._tensorboard.close()
            self._tensorboard = None
        if self._wandb is not None:
            self._wandb.close()
            self._wandb = None
