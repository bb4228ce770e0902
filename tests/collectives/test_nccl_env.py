"""NCCL: torch's own NCCL machinery stays out of recovery. The launcher gives every rank the
environment before any group exists; a user's TORCH_NCCL_* setting that would break recovery is
one line and exit 2, from the launcher and from the entry point."""
from __future__ import annotations

import os
import subprocess
import sys

import pytest

from recover_patches.collectives import nccl_env
from recover_patches.launch import main as launch_main
from tests._launch_util import REPO, TINY_GPT


def test_a_conflicting_setting_is_named_with_its_fix():
    lines = nccl_env.conflicts({"TORCH_NCCL_ASYNC_ERROR_HANDLING": "3",
                                "TORCH_NCCL_ENABLE_MONITORING": "0",  # agrees: fine
                                "TORCH_NCCL_DUMP_ON_TIMEOUT": "false"})
    assert lines == ["TORCH_NCCL_ASYNC_ERROR_HANDLING=3: with in-job recovery torch's watchdog "
                     "would end a survivor whose peer failed. Fix: unset it (ReCoVer sets "
                     "TORCH_NCCL_ASYNC_ERROR_HANDLING=0)"]
    assert nccl_env.conflicts({"TORCH_NCCL_NONBLOCKING_TIMEOUT": "1800"})  # a 30-minute hang
    assert nccl_env.conflicts({"TORCH_NCCL_BLOCKING_WAIT": "1"})


def test_applied_settings_turn_off_what_would_end_a_survivor():
    environ: dict[str, str] = {}
    with pytest.raises(RuntimeError, match="before the recovery environment was set"):
        nccl_env.check_applied(environ)  # what building a NCCL group without it raises
    nccl_env.apply(environ)
    nccl_env.check_applied(environ)
    for key in ("TORCH_NCCL_ASYNC_ERROR_HANDLING", "TORCH_NCCL_ENABLE_MONITORING",
                "TORCH_NCCL_DUMP_ON_TIMEOUT", "TORCH_NCCL_WAIT_TIMEOUT_DUMP_MILSEC"):
        assert environ[key] == "0"
    assert nccl_env.cpp_timeout(30.0) >= 10 * 30.0  # torch's own op timeout never acts first


def test_the_launcher_refuses_a_conflicting_setting_before_starting_anything(
        tmp_path, monkeypatch, capsys):
    script = tmp_path / "rank.py"
    script.write_text("open(__file__ + '.ran', 'w').close()\n")
    monkeypatch.setenv("TORCH_NCCL_ENABLE_MONITORING", "1")
    assert launch_main(["--nproc-per-node", "1", str(script)]) == 2
    err = capsys.readouterr().err
    assert "TORCH_NCCL_ENABLE_MONITORING=1" in err and "Fix: unset it" in err
    assert not (tmp_path / "rank.py.ran").exists()
    # (that the ranks get the settings: rank_scenarios.py checks them in test_resilient_group)


@pytest.mark.timeout(120)
def test_the_entry_point_refuses_it_for_a_rank_started_without_our_launcher(tmp_path):
    env = {**os.environ, "RANK": "0", "WORLD_SIZE": "1", "RECOVER_COORDINATOR": "127.0.0.1:1",
           "TORCH_NCCL_ASYNC_ERROR_HANDLING": "3", "PYTHONWARNINGS": "ignore"}
    metrics = tmp_path / "metrics.jsonl"
    proc = subprocess.run([sys.executable, str(REPO / "pretrain_gpt_recover.py"), *TINY_GPT,
                           "--train-iters", "2", "--metrics-file", str(metrics)],
                          cwd=REPO, env=env, capture_output=True, text=True, timeout=110)
    assert proc.returncode == 2, proc.stderr[-2000:]
    errors = [line for line in proc.stderr.splitlines() if "error:" in line]
    assert len(errors) == 1 and "TORCH_NCCL_ASYNC_ERROR_HANDLING=3" in errors[0], proc.stderr
    assert not metrics.exists()
