"""The demo's verdict: it must fail when the trajectory or the committed batch differs."""
from __future__ import annotations

import json

from scripts.compare_runs import main


def write(path, losses, microbatches=8, recoveries_at=()):
    path.write_text("".join(json.dumps({
        "iteration": i + 1, "lm_loss": loss, "microbatches": microbatches,
        "recoveries": [{"dead": [3], "lost_replicas": [1], "lost_ids": [1, 2]}]
        if i + 1 in recoveries_at else []}) + "\n" for i, loss in enumerate(losses)))
    return path


def test_same_trajectory_passes_and_draws(tmp_path, capsys):
    ref = write(tmp_path / "ref.jsonl", [5.0, 4.0, 3.0])
    run = write(tmp_path / "run.jsonl", [5.0, 4.0 * (1 + 1e-7), 3.0], recoveries_at=(2,))
    assert main(["--reference", str(ref), "--run", str(run), "--out", str(tmp_path / "l.png")]) == 0
    assert (tmp_path / "l.png").stat().st_size > 1000
    assert "iteration 2: dead ranks [3]" in capsys.readouterr().out


def test_drift_or_a_smaller_batch_fails(tmp_path):
    ref = write(tmp_path / "ref.jsonl", [5.0, 4.0, 3.0])
    drifted = write(tmp_path / "drift.jsonl", [5.0, 4.01, 3.0])
    shrunk = write(tmp_path / "shrunk.jsonl", [5.0, 4.0, 3.0], microbatches=6)
    for run in (drifted, shrunk):
        assert main(["--reference", str(ref), "--run", str(run),
                     "--out", str(tmp_path / "x.png")]) == 1
