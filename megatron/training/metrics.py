"""Megatron-style iteration log lines and a JSONL metrics file (one record per iteration)."""
from __future__ import annotations

import json
import math
import os
import sys
import time
from typing import IO


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
        f"loss scale: {rec.get('loss_scale', 1.0):.1f}",
        f"grad norm: {rec['grad_norm']:.3f}",
        f"number of skipped iterations: {skipped_since_last_line:3d}",
        f"tokens/s: {rec['tokens_per_second']:.0f}",
    ]
    return " | ".join(parts) + " |"


# JSONL key -> Megatron's TensorBoard tag
TENSORBOARD_TAGS = {"lm_loss": "lm loss", "lr": "learning-rate", "global_batch_size": "batch-size",
                    "grad_norm": "grad-norm", "loss_scale": "loss-scale",
                    "ms_per_iteration": "iteration-time", "tokens_per_second": "throughput",
                    "valid_lm_loss": "lm loss validation"}


class TensorBoardWriter:
    """--tensorboard-dir: the records' scalars under Megatron's tags, plus ReCoVer's
    `live-replicas`. Opened by whichever rank logs; a successor appends to the same directory."""

    def __init__(self, log_dir: str):
        from torch.utils.tensorboard import SummaryWriter  # needs the tensorboard package

        self.writer = SummaryWriter(log_dir=log_dir)

    def write(self, record: dict) -> None:
        step = record["iteration"]
        for key, tag in TENSORBOARD_TAGS.items():
            value = record.get(key)
            if isinstance(value, (int, float)) and math.isfinite(value):
                self.writer.add_scalar(tag, value, step)
        if "live_replicas" in record:
            self.writer.add_scalar("live-replicas", len(record["live_replicas"]), step)
        self.writer.flush()

    def close(self) -> None:
        self.writer.close()


class MetricsWriter:
    """Appends one JSON object per line; flushed every record so a killed job keeps its history.
    With a TensorBoard directory the same records also go there."""

    def __init__(self, path: str | None, tensorboard_dir: str | None = None):
        self.path = path
        self.tensorboard_dir = tensorboard_dir
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
        if self.tensorboard_dir and self._tensorboard is None:
            self._tensorboard = TensorBoardWriter(self.tensorboard_dir)
        if self._tensorboard is not None:
            self._tensorboard.write(record)

    def last_iteration(self) -> int:
        """The highest iteration already in the file (0 if none): after the logging rank dies,
        its successor appends the records it missed."""
        if self._file is not None:
            self._file.flush()
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


def print_rank_line(text: str) -> None:
    """One line in one write: ranks share the launcher's stdout, and a line written in pieces
    can be cut by another rank's line."""
    sys.stdout.flush()
    sys.stdout.write(text + "\n")
    sys.stdout.flush()
