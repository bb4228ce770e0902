"""Megatron-style iteration log lines and a JSONL metrics file (one record per iteration)."""
from __future__ import annotations

import json
import os
import sys
import time
from typing import IO


def log_line(rec: dict, train_iters: int) -> str:
    parts = [
        f" [{time.strftime('%Y-%m-%d %H:%M:%S')}] iteration {rec['iteration']:8d}/{train_iters:8d}",
        f"consumed samples: {rec['consumed_samples']:12d}",
        f"elapsed time per iteration (ms): {rec['ms_per_iteration']:.1f}",
        f"learning rate: {rec['lr']:.6E}",
        f"global batch size: {rec['global_batch_size']:5d}",
        f"lm loss: {rec['lm_loss']:.6E}",
        f"grad norm: {rec['grad_norm']:.3f}",
        f"tokens/s: {rec['tokens_per_second']:.0f}",
    ]
    return " | ".join(parts) + " |"


class MetricsWriter:
    """Appends one JSON object per line; flushed every record so a killed job keeps its history."""

    def __init__(self, path: str | None):
        self.path = path
        self._file: IO[str] | None = None

    def write(self, record: dict) -> None:
        """Opened on first use: only the logging rank (the lowest live one) ever writes, and
        after a failure another rank may take over appending to the same file."""
        if self.path and self._file is None:
            os.makedirs(os.path.dirname(os.path.abspath(self.path)), exist_ok=True)
            self._file = open(self.path, "a", encoding="utf-8")
        if self._file is not None:
            self._file.write(json.dumps(record, sort_keys=True) + "\n")
            self._file.flush()

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


def print_rank_line(text: str) -> None:
    print(text, file=sys.stdout, flush=True)
