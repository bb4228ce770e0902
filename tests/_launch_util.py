"""Run the trainer through the launcher in a subprocess, bounded in time, and read its metrics.

The launcher runs in its own session; whatever happens, the whole process group is killed, so no
rank can outlive the test.
"""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]

TINY_GPT = [
    "--num-layers", "4", "--hidden-size", "64", "--num-attention-heads", "4",
    "--seq-length", "32", "--max-position-embeddings", "32",
    "--micro-batch-size", "1", "--global-batch-size", "8",
    "--lr", "1e-3", "--clip-grad", "1.0", "--hidden-dropout", "0", "--attention-dropout", "0",
    "--mock-data", "--tokenizer-type", "NullTokenizer", "--vocab-size", "250",
    "--log-interval", "1", "--eval-interval", "1000", "--eval-iters", "1",
]


@dataclass
class Run:
    returncode: int
    stdout: str
    stderr: str
    records: list[dict]

    def losses(self) -> list[float]:
        return [r["lm_loss"] for r in self.records if "lm_loss" in r]


def read_metrics(path: Path) -> list[dict]:
    if not path.exists():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def launch(nproc: int, args: list[str], metrics: Path, *, timeout: float = 240,
           env: dict | None = None, launcher_args: list[str] | None = None,
           script: tuple[str, ...] = (str(REPO / "pretrain_gpt_recover.py"),)) -> Run:
    """`script`: the rank script and its leading arguments (a wrapper, then the entry point)."""
    cmd = [sys.executable, "-m", "recover_patches.launch", "--nproc-per-node", str(nproc),
           "--master-port", "0", *(["--no-coordinator"] if launcher_args is None else launcher_args),
           *script, *args, "--metrics-file", str(metrics)]
    # megatron-core writes NVTE_*_ATTN into os.environ when it builds a model for the attention
    # backend (in-process tests do) and asserts they agree in the next model: not inherited
    inherited = {k: v for k, v in os.environ.items() if not k.startswith("NVTE_")}
    full_env = {**inherited, "OMP_NUM_THREADS": "1", "PYTHONWARNINGS": "ignore", **(env or {})}
    proc = subprocess.Popen(cmd, cwd=REPO, env=full_env, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, start_new_session=True)
    try:
        out, err = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        out, err = "", f"timed out after {timeout}s"
    finally:
        try:
            os.killpg(proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        proc.wait()
    return Run(proc.returncode, out, err, read_metrics(metrics))
