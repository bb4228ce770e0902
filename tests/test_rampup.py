"""Batch-size ramp-up (`--rampup-batch-size START INCR SAMPLES`) with `--train-iters`, which
Megatron-LM rejects and ReCoVer supports: the iteration's microbatch count, its global ids, the
consumed samples and the LR schedule all follow the ramp -- also across a rank failure.

The expected values come from Megatron's rule, written out here independently of the trainer:
batch = START + INCR * floor(consumed / (SAMPLES / ((GLOBAL - START) / INCR))), capped at GLOBAL,
and GLOBAL once more than SAMPLES samples were consumed.
"""
from __future__ import annotations

import math
import re
from fractions import Fraction

import pytest

from megatron.training.arguments import parse_and_validate
from megatron.training.config import BatchSchedule
from megatron.training.config.batch import parse_step_schedule
from tests._launch_util import TINY_GPT, launch


def megatron_rampup_batch(start: int, incr: int, samples: int, final: int, consumed: int) -> int:
    """Exact arithmetic (Fraction), so a float rounding slip in the trainer would show."""
    if consumed > samples:
        return final
    per_increment = Fraction(samples) / Fraction(final - start, incr)
    return min(final, start + incr * math.floor(Fraction(consumed) / per_increment))


def ramp(start: int, incr: int, samples: int, final: int) -> BatchSchedule:
    return BatchSchedule(micro_batch_size=1, global_batch_size=final, rampup=(start, incr, samples))


@pytest.mark.parametrize("start, incr, samples, final", [
    (2, 2, 24, 8),            # the run below: 3 increments of 8 samples each
    (16, 16, 5859375, 1536),  # GPT-3 175B: 95 increments of 61677.63... samples
    (4, 4, 10, 16),           # samples not a multiple of the increment count
    (3, 6, 100, 21),
])
def test_global_batch_size_follows_megatrons_rule(start, incr, samples, final):
    schedule = ramp(start, incr, samples, final)
    per_increment = samples / ((final - start) // incr)
    probes = set(range(0, 3 * final)) | {samples - 1, samples, samples + 1, 10 * samples}
    for k in range(1, (final - start) // incr + 1):  # both sides of every step
        edge = math.ceil(k * per_increment)
        probes |= {edge - 1, edge, edge + 1}
    for consumed in sorted(c for c in probes if c >= 0):
        assert schedule.global_batch_size_at(consumed) == \
            megatron_rampup_batch(start, incr, samples, final, consumed), consumed


def test_gpt3_175b_ramp_edges():
    at = ramp(16, 16, 5859375, 1536).global_batch_size_at
    assert at(0) == 16
    assert at(61677) == 16 and at(61678) == 32
    assert at(5859375) == 1536  # the last step is reached at SAMPLES
    assert at(5859374) == 1520
    assert BatchSchedule(1, 1536, None).global_batch_size_at(0) == 1536


START, INCR, SAMPLES, GLOBAL, MICRO, ITERS = 2, 2, 24, 8, 1, 10
WARMUP_ITERS, LR = 8, 1e-3  # warmup = 8 * GLOBAL = 64 samples, longer than the 44 the run uses
KILL_ITER = 6  # during the ramp: rank 1 (replica 1) dies in iteration 6


def expected_iterations() -> list[dict]:
    consumed, out = 0, []
    for _ in range(ITERS):
        batch = megatron_rampup_batch(START, INCR, SAMPLES, GLOBAL, consumed)
        first = consumed // MICRO
        consumed += batch
        out.append({"global_batch_size": batch, "microbatches": batch // MICRO,
                     "id_sum": sum(range(first, first + batch // MICRO)),
                     "consumed_samples": consumed})
    return out


@pytest.mark.multiprocess
@pytest.mark.timeout(400)
def test_rampup_run_follows_the_ramp_across_a_failure(tmp_path):
    args = [*TINY_GPT, "--rampup-batch-size", str(START), str(INCR), str(SAMPLES),
            "--micro-batch-size", str(MICRO), "--global-batch-size", str(GLOBAL),
            "--train-iters", str(ITERS), "--lr", str(LR), "--lr-warmup-iters", str(WARMUP_ITERS),
            "--lr-decay-iters", "20", "--recover-balance", "even",
            "--inject-fault", f"kill:rank=1,iter={KILL_ITER},phase=backward"]
    run = launch(2, args, tmp_path / "metrics.jsonl", launcher_args=[], timeout=300)
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    records = [r for r in run.records if "lm_loss" in r]
    expected = expected_iterations()
    assert [r["iteration"] for r in records] == list(range(1, ITERS + 1)), run.stdout[-3000:]
    assert expected[-1]["consumed_samples"] == 44  # sanity of the expectation itself
    for rec, want in zip(records, expected):
        got = {k: rec[k] for k in want}
        assert got == want, (rec["iteration"], got, want)
        # the scheduler advances by the samples actually used: linear warmup over 64 samples
        assert rec["lr"] == pytest.approx(LR * want["consumed_samples"] / (WARMUP_ITERS * GLOBAL),
                                          rel=1e-9), rec["iteration"]
    assert records[KILL_ITER - 1]["recoveries"], "the injected failure was not recovered from"
    assert all(r["live_replicas"] == [0] for r in records[KILL_ITER - 1:])
    logged = {int(i): int(b) for i, b in re.findall(
        r"iteration\s+(\d+)/\s*\d+ \|.*?global batch size:\s+(\d+) \|", run.stdout)}
    assert logged == {i + 1: e["global_batch_size"] for i, e in enumerate(expected)}


# --- --step-batch-size-schedule -----------------------------------------------------------------

def megatron_step_batch(schedule: list[tuple[int, int]], consumed: int) -> int:
    """Megatron-LM's rule, written out: the batch of the last threshold reached."""
    batch = schedule[0][1]
    for threshold, size in schedule:
        if consumed >= threshold:
            batch = size
    return batch


def test_a_step_schedule_is_read_as_megatron_reads_it():
    steps = parse_step_schedule("0:768, 250B:1536 500B:3072 750b:6144", seq_length=2048)
    assert steps == ((0, 768), (250 * 10**9 // 2048, 1536), (500 * 10**9 // 2048, 3072),
                     (750 * 10**9 // 2048, 6144))
    assert parse_step_schedule("0:8 1.5K:16", seq_length=None) == ((0, 8), (1500, 16))
    for wrong in ("8:16", "0:8 0:16", "0:8 16", "0:8 100:0", "0:eight"):
        with pytest.raises(ValueError):
            parse_step_schedule(wrong, seq_length=None)


def test_the_global_batch_steps_at_each_threshold():
    steps = ((0, 2), (8, 4), (16, 8))
    at = BatchSchedule(micro_batch_size=1, global_batch_size=8, rampup=None,
                       steps=steps).global_batch_size_at
    for consumed in range(40):
        assert at(consumed) == megatron_step_batch(list(steps), consumed), consumed


def without_global_batch() -> list[str]:
    """TINY_GPT without --global-batch-size: a step schedule sets it."""
    flags = list(TINY_GPT)
    at = flags.index("--global-batch-size")
    return flags[:at] + flags[at + 2:]


SCHEDULE = "0:2 256:4 512:8"  # tokens: at seq 32, samples 0, 8 and 16
STEP_ITERS = 8


@pytest.mark.multiprocess
@pytest.mark.timeout(200)
def test_a_step_schedule_run_logs_each_iterations_batch(tmp_path):
    run = launch(1, [*without_global_batch(), "--step-batch-size-schedule", SCHEDULE, "--train-iters",
                     str(STEP_ITERS)], tmp_path / "metrics.jsonl")
    assert run.returncode == 0, run.stderr[-3000:]
    consumed, expected = 0, []
    for _ in range(STEP_ITERS):
        expected.append(megatron_step_batch([(0, 2), (8, 4), (16, 8)], consumed))
        consumed += expected[-1]
    records = [r for r in run.records if "lm_loss" in r]
    assert [r["global_batch_size"] for r in records] == expected == [2, 2, 2, 2, 4, 4, 8, 8]
    assert [r["microbatches"] for r in records] == expected  # micro batch 1


@pytest.mark.parametrize("given, said", [
    (["--global-batch-size", "8"], "exclusive"),
    (["--step-batch-size-schedule", "0:3"], "not a multiple of --micro-batch-size 2"),
    (["--step-batch-size-schedule", "64:4"], "threshold 0")])
def test_a_wrong_step_schedule_is_one_line_naming_the_flag(given, said, capsys):
    flags = [*without_global_batch(), "--train-iters", "2", "--micro-batch-size", "2",
             "--step-batch-size-schedule", "0:4", *given]
    with pytest.raises(SystemExit) as exit_info:
        parse_and_validate(flags, world_size=1)
    err = capsys.readouterr().err
    assert exit_info.value.code == 2 and err.count("\n") == 1, err
    assert "--step-batch-size-schedule" in err and said in err, err
