"""Named large-job scenarios. Sizes and failure counts are public figures; costs are assumptions.

* paper: the ReCoVer paper's setting (arXiv 2605.11215): 512 GPUs, 256 GPUs lost spread across the run.
  Assumptions: 8-GPU replicas (TP 4 x PP 2, one node), so 32 failures remove 256 GPUs; the failures are
  evenly spaced over an 8-hour run (one every 15 min); no spares, no repair; small-job C/R costs.
* llama3: Llama 3 405B pre-training (Meta, 2024): 16,384 GPUs (TP 8 x PP 16 x DP 128), 419 unexpected
  interruptions in 54 days, i.e. a per-GPU MTBF of 16,384 * 54 * 24 / 419 hours. Assumptions: a 16M-token
  batch every 6 s, 256 spare GPUs, 24 h repair, C/R costs picked so C/R lands near the ~90% effective
  training time Meta reported.
* 100k: 100,000 GPUs (TP 8 x PP 10 x DP 1,250) with Llama 3's per-GPU failure rate for 30 days,
  1% spares; same cost assumptions as llama3.
"""

from __future__ import annotations

from dataclasses import dataclass

from scripts.sim.config import SimConfig

LLAMA3_GPUS, LLAMA3_DAYS, LLAMA3_INTERRUPTIONS = 16_384, 54, 419
LLAMA3_GPU_MTBF_HOURS = LLAMA3_GPUS * LLAMA3_DAYS * 24 / LLAMA3_INTERRUPTIONS


@dataclass(frozen=True)
class Scenario:
    name: str
    description: str
    config: SimConfig


def paper() -> Scenario:
    run_hours, failures = 8.0, 32
    trace = tuple((k + 0.5) * run_hours / failures for k in range(failures))
    config = SimConfig(
        tp=4, pp=2, dp=64, iteration_seconds=6.0, tokens_per_iteration=1024 * 2048, run_hours=run_hours,
        failure_times_hours=trace, recovery_seconds=20.0,
        checkpoint_save_seconds=30.0, checkpoint_load_seconds=30.0, restart_seconds=120.0)
    return Scenario("paper", "512 GPUs, 256 GPUs (32 replicas) lost evenly over 8 h, no spares", config)


def _llama3_costs() -> dict:
    return dict(recovery_seconds=60.0, rejoin_seconds=600.0, repair_hours=24.0,
                checkpoint_save_seconds=30.0, checkpoint_load_seconds=60.0, restart_seconds=300.0)


def llama3() -> Scenario:
    config = SimConfig(
        tp=8, pp=16, dp=128, iteration_seconds=6.0, tokens_per_iteration=16 * 2**20,
        run_hours=LLAMA3_DAYS * 24.0, gpu_mtbf_hours=LLAMA3_GPU_MTBF_HOURS, spare_gpus=256,
        **_llama3_costs())
    return Scenario("llama3", "16,384 GPUs, 419 interruptions expected in 54 days, 256 spares", config)


def hundred_k() -> Scenario:
    config = SimConfig(
        tp=8, pp=10, dp=1250, iteration_seconds=6.0, tokens_per_iteration=16 * 2**20,
        run_hours=30 * 24.0, gpu_mtbf_hours=LLAMA3_GPU_MTBF_HOURS, spare_gpus=1000, **_llama3_costs())
    return Scenario("100k", "100,000 GPUs at Llama 3's per-GPU failure rate for 30 days, 1% spares", config)


SCENARIOS = {"paper": paper, "llama3": llama3, "100k": hundred_k}
