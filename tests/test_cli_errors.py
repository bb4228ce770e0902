"""Bad input to the entry point: one line naming the flag and the fix, exit status 2, and nothing
written (no metrics file, no checkpoint directory)."""
from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from tests._launch_util import REPO, TINY_GPT

BASE = [a for a in TINY_GPT if a != "--mock-data"]


def cases(tmp):
    data = ["--mock-data"]
    return {
        "missing data files": (["--data-path", str(tmp / "nope_text_document"),
                                "--tokenizer-type", "NullTokenizer", "--vocab-size", "250"],
                               "--data-path"),
        "bad fault spec": (data + ["--inject-fault", "explode:rank=0"], "--inject-fault"),
        "heads not divisible by TP": (data + ["--tensor-model-parallel-size", "3"],
                                      "--tensor-model-parallel-size"),
        "missing checkpoint": (data + ["--load", str(tmp / "no_ckpt"), "--save", str(tmp / "ck"),
                                       "--save-interval", "2"], "--load"),
        "bf16 and fp16": (data + ["--bf16", "--fp16"], "--bf16"),
        "transformer_engine here": (data + ["--transformer-impl", "transformer_engine"],
                                    "--transformer-impl"),
        "fp16 with a zero minimum loss scale": (data + ["--fp16", "--min-loss-scale", "0"],
                                                "--min-loss-scale"),
        "a misspelt flag": (data + ["--hiden-size", "64"], "did you mean --hidden-size?"),
    }


@pytest.mark.timeout(120)
@pytest.mark.parametrize("case", ["missing data files", "bad fault spec",
                                  "heads not divisible by TP", "missing checkpoint", "bf16 and fp16",
                                  "transformer_engine here", "fp16 with a zero minimum loss scale",
                                  "a misspelt flag"])
def test_user_error_is_one_line_exit_2_nothing_written(tmp_path, case):
    flags, flag = cases(tmp_path)[case]
    env = {**os.environ, "RANK": "0", "WORLD_SIZE": "3" if "TP" in case else "1",
           "PYTHONWARNINGS": "ignore", "OMP_NUM_THREADS": "1"}
    metrics = tmp_path / "metrics.jsonl"
    proc = subprocess.run([sys.executable, str(REPO / "pretrain_gpt_recover.py"), *BASE,
                           "--train-iters", "2", *flags, "--metrics-file", str(metrics)],
                          cwd=REPO, env=env, capture_output=True, text=True, timeout=110)
    assert proc.returncode == 2, proc.stderr[-2000:]
    errors = [line for line in proc.stderr.splitlines() if "error:" in line]
    assert len(errors) == 1 and flag in errors[0], proc.stderr[-2000:]
    assert "Fix:" in errors[0] or "expected kind:" in errors[0], errors[0]  # says how to fix it
    assert not metrics.exists() and not (tmp_path / "ck").exists()


@pytest.mark.timeout(120)
def test_without_a_launcher_it_runs_as_one_process(tmp_path):
    """`python pretrain_gpt_recover.py ...` with none of the launcher's env: world size 1."""
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK",
                                                            "MASTER_ADDR", "MASTER_PORT")}
    env.update(PYTHONWARNINGS="ignore", OMP_NUM_THREADS="1")
    metrics = tmp_path / "metrics.jsonl"
    proc = subprocess.run([sys.executable, str(REPO / "pretrain_gpt_recover.py"), *TINY_GPT,
                           "--train-iters", "2", "--metrics-file", str(metrics),
                           "--num-workers", "8"],
                          cwd=tmp_path, env=env, capture_output=True, text=True, timeout=110)
    assert proc.returncode == 0, proc.stderr[-2000:]
    records = [json.loads(line) for line in metrics.read_text().splitlines()]
    assert [r["iteration"] for r in records if "lm_loss" in r] == [1, 2]
    # an accepted flag that changes nothing says so, in one line naming it
    assert "--num-workers 8 has no effect" in proc.stdout
