"""The emulated-NCCL fault matrix (`scripts/emulated_nccl_matrix.py`'s plan), one test per case:
kill and hang in every phase at (2,1,2), (1,2,2) and (2,2,2), then VP 2, CP 2, EP 2, the
distributed optimizer with K = 2, a replacement joining and a kill in an async save. Each must
finish every iteration with the failure-free losses within its bound.

CI runs the cases in `IN_CI` (with tests/test_emulated_nccl_faults.py, the part of the matrix
CI affords); the others are in the extended set: `RECOVER_TESTS=all bash scripts/test.sh`, or
the script itself, which prints one line per case and a summary.
"""
from __future__ import annotations

import pytest

from scripts.emulated_nccl_matrix import plan, problems_of, reference_key, reference_losses, run_one

pytestmark = pytest.mark.multiprocess

# a (1,2,2) kill in p2p, and K = 2 killed in its weight all-gather (a survivor's torn weights)
IN_CI = ("1x2x2-kill-p2p", "1x1x4-distopt-k2-kill-gather")
CASES = {case[0]: case for case in plan(quick=False)}


@pytest.fixture(scope="module")
def references() -> dict:
    return {}  # one reference per model and layout, shared by the module's cases


@pytest.mark.timeout(600)
@pytest.mark.parametrize("name", [name if name in IN_CI else
                                  pytest.param(name, marks=pytest.mark.extended)
                                  for name in CASES])
def test_the_case_survives_with_the_failure_free_losses(name, references, tmp_path):
    _, layout, model, faults, extra, launcher = CASES[name]
    key = reference_key(layout, model)
    if key not in references:
        references[key] = reference_losses(tmp_path / "reference", layout, model)
    run, _ = run_one(tmp_path, name, layout, model, faults, extra, launcher, 150)
    assert not problems_of(run, references[key]), (problems_of(run, references[key]),
                                                    run.stderr[-3000:])


def test_ci_runs_cases_the_plan_has():
    assert set(IN_CI) <= set(CASES)
