"""The chaos harness: a ReCoVer job under seeded random faults, judged on the failure-free run.

    python scripts/chaos.py --nodes N --nproc-per-node P --faults K --seed S [--emulate-nccl] \
        -- <pretrain_gpt_recover.py flags, with --metrics-file, --save, --save-interval>

It runs the failure-free job first (one launcher of N x P ranks), then the same job over N
launchers on this machine (one session each: a node), plus standby launchers for lost nodes'
slots, with K faults drawn from the seed (`scripts/chaos/plan.py`): a rank killed, hung,
stalled or exiting, a node killed whole, the coordinator killed, and faults during a recovery,
a join, a checkpoint save and an evaluation, each at a random iteration and phase. When a fault
leaves no complete copy, the job ends with status 3 and the harness starts it again from its
last checkpoint, as SLURM's --requeue would. Every launch appends its records to the
--metrics-file; with --recover-exact-reduction each must equal the failure-free run's record of
its iteration to the bit, and so must the final checkpoint. The last line counts the faults by
kind, the in-job recoveries and restarts, the hangs, recovery latency p50/p99 and goodput; the
exit status is 0 when all held, 1 when not, 2 for a bad command line. OUT (--out) holds every
launch's logs, the plan, summary.json and chaos.png.
"""
from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the repo root: `scripts.*`

from scripts.chaos.run import main  # noqa: E402  (after the path)

if __name__ == "__main__":
    sys.exit(main())
