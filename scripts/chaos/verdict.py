"""What a chaos run is judged on, and the numbers it reports.

* Every training record of every launch (an iteration re-run after a restart included) against
  the failure-free run's record of that iteration, field by field in what the trajectory is
  made of: with --recover-exact-reduction they must be equal to the bit.
* The final checkpoints (parameters and optimizer state), tensor by tensor.
* Recoveries inside the job and their latency, restarts, hangs, and goodput: the tokens the job
  committed over what the failure-free run would have done in the same wall time.
"""
from __future__ import annotations

import json
import statistics
import tempfile
from collections import Counter
from dataclasses import dataclass
from pathlib import Path

from scripts.chaos.launches import JobHistory

TRAJECTORY = ("lm_loss", "grad_norm", "microbatches", "tokens", "id_sum", "lr", "loss_scale",
              "skipped_iterations", "consumed_samples")
PHASES = ("detection", "rebuild", "recompute")


def training_records(path: Path, start: int = 0, end: int | None = None) -> list[dict]:
    lines = path.read_text().splitlines()[start:end] if path.exists() else []
    records = []
    for line in lines:
        try:
            record = json.loads(line)
        except ValueError:  # a line cut short by a killed writer
            continue
        if "lm_loss" in record:
            records.append(record)
    return records


@dataclass
class Comparison:
    compared: int
    equal: int
    first_difference: str | None
    missing: list[int]  # iterations of the reference no launch committed


def differs(mine, theirs, rtol: float) -> bool:
    """Bitwise at rtol 0; else floats within rtol (without exact reduction the order of the
    additions, which a recovery changes, moves the last bits)."""
    if rtol == 0 or not isinstance(mine, float) or not isinstance(theirs, float):
        return mine != theirs
    return abs(mine - theirs) > rtol * max(abs(theirs), 1e-12)


def compare_records(reference: list[dict], records: list[dict], rtol: float = 0.0) -> Comparison:
    by_iteration = {r["iteration"]: r for r in reference}
    equal, first = 0, None
    for record in records:
        ref = by_iteration.get(record["iteration"])
        diff = [k for k in TRAJECTORY if ref is None or differs(record.get(k), ref.get(k), rtol)]
        if not diff:
            equal += 1
        elif first is None:
            first = (f"iteration {record['iteration']}: " + ", ".join(
                f"{k} {record.get(k)!r} vs {None if ref is None else ref.get(k)!r}" for k in diff))
    seen = {r["iteration"] for r in records}
    return Comparison(len(records), equal, first, sorted(set(by_iteration) - seen))


def final_state(checkpoint: Path) -> dict:
    """Every tensor of a torch_dist checkpoint (model and optimizer), read in this process."""
    import torch
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save
    with tempfile.TemporaryDirectory() as scratch:
        dcp_to_torch_save(str(checkpoint), f"{scratch}/state.pt")
        return torch.load(f"{scratch}/state.pt", weights_only=False)


# per process, not per job: the randomness a microbatch draws is seeded from its id (design.md
# §8), so these streams differ with whichever rank saved and what it ran last, and a resume
# re-seeds them; the exact reduction's exponents, kept beside them, are the job's and compared
PROCESS_STREAMS = ("torch_rng_state", "rng_tracker_states", "random_rng_state", "np_rng_state",
                   "cuda_rng_state")


def without_streams(value):
    """A checkpoint value less the per-process random streams inside it."""
    if isinstance(value, dict):
        return {k: without_streams(v) for k, v in value.items() if k not in PROCESS_STREAMS}
    if isinstance(value, (list, tuple)):
        return [without_streams(v) for v in value]
    return value


def compare_states(reference: Path, final: Path) -> str | None:
    """None when both checkpoints hold the same parameters, optimizer state and exact-reduction
    exponents, bit for bit; else what differs."""
    if not final.is_dir():
        return f"no final checkpoint {final}"
    ours, theirs = (without_streams(final_state(path)) for path in (final, reference))
    if set(ours) != set(theirs):
        return f"keys differ: {sorted(set(ours) ^ set(theirs))[:4]}"
    for key in sorted(ours):
        if not same_value(ours[key], theirs[key]):
            return f"{key} differs"
    return None


def same_value(a, b) -> bool:
    """Equal to the bit, through the dicts and lists a checkpoint nests its tensors in."""
    import torch
    if isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor):
        return isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor) and \
            a.dtype == b.dtype and torch.equal(a, b)
    if isinstance(a, dict) and isinstance(b, dict):
        return a.keys() == b.keys() and all(same_value(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)) and isinstance(b, (list, tuple)):
        return len(a) == len(b) and all(same_value(x, y) for x, y in zip(a, b))
    return a == b


def percentile(values: list[float], q: float) -> float:
    if not values:
        return 0.0
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


def latencies(records: list[dict]) -> dict[str, list[float]]:
    """Seconds of each recovery phase over every in-job recovery, and their sum."""
    out: dict[str, list[float]] = {p: [] for p in (*PHASES, "total")}
    for record in records:
        for recovery in record.get("recoveries", []):
            seconds = recovery.get("seconds", {})
            for p in PHASES:
                out[p].append(seconds.get(p, 0.0))
            out["total"].append(sum(seconds.values()))
    return out


def goodput(history: JobHistory, reference: list[dict], reference_wall: float,
            train_iters: int) -> float:
    """Tokens of the iterations the job committed (each once) over what the failure-free run
    commits in the chaos run's wall time, at its own rate (start-up included in both)."""
    if not history.launches or reference_wall <= 0:
        return 0.0
    per_iteration = statistics.mean(r["tokens"] for r in reference)
    committed = per_iteration * (train_iters if history.completed else 0)
    rate = sum(r["tokens"] for r in reference) / reference_wall
    wall = history.launches[-1].ended - history.launches[0].started
    return committed / (rate * wall)


def summary_line(history: JobHistory, records: list[dict], comparison: Comparison,
                 state: str | None, good: float) -> str:
    kinds = Counter(fault.name for fault, _ in history.fired)
    lat = latencies(records)
    spans = ", ".join(f"{p} {percentile(lat[p], 0.5):.2f}/{percentile(lat[p], 0.99):.2f} s"
                      for p in (*PHASES, "total"))
    return (f"chaos: {len(history.fired)} faults ("
            + ", ".join(f"{k} {n}" for k, n in sorted(kinds.items())) + f"), "
            f"{len(history.unfired)} planned never fired; {len(lat['total'])} in-job "
            f"recoveries, {history.restarts} restarts, {history.hangs} hangs, "
            f"{history.unexpected_ends} unexpected ends; recovery p50/p99 "
            f"{spans}; goodput {good:.2f}; records bitwise on the failure-free run: "
            f"{comparison.equal} of {comparison.compared}"
            + (f", iterations never committed {comparison.missing}" if comparison.missing else "")
            + f"; final parameters and optimizer state: {state or 'bitwise'}; "
            f"job {'completed' if history.completed else 'did not complete'}")
