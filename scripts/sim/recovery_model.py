"""One in-job recovery at scale from its parts, instead of one assumed number.

The simulator charges each failure the broken replica's share of the iteration in progress (its
microbatches, recomputed by the survivors: `elastic.py`) plus `recovery_seconds`. Here that pause
is built as verdict + group rebuild:

* verdict: how long the coordinator takes to name the failed rank. A killed process is reported
  by its launcher within milliseconds; a lost node or a hang only after T + 0.5 s of silence plus
  the beat's path. The model charges every failure the lost-node case (conservative), as measured
  by `scripts/bench/coordinator_load.py` at 12,500 nodes x 8 ranks with one beat per node:
  T + 0.81 s at the default T = 10 s (BENCHMARKS, "Node beats judged per node": the storm's last
  rank named, on a 2-core machine shared with the beats' generators, so an upper bound; T + 2.46 s
  before the coordinator judged node lines per node).
* rebuild, two models of the NCCL rebuild:
  - `kept`: the survivors keep every group that lost no member (their TP and PP groups); each
    data-parallel group that lost one is shrunk without a store bootstrap (NCCL's
    ncclCommShrink, `torch.distributed.shrink_group`): 1.4-2.0 s published for 32 to 1,024 GPUs,
    as design.md §13 records it (not re-checked against its source here); 2.0 s taken, though the
    groups of a 100,000-GPU job are larger than the largest measured;
  - `rebuilt`: every survivor re-creates each of its communicators from a store bootstrap: 1-10 s
    per communicator across nodes (design.md §13); a rank holds 4 (TP, PP, DP, embedding) and builds
    them one after another: 4 x 10 s.
The replica's state transfer on growing back is `rejoin_seconds`, not part of this pause.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from scripts.sim.config import SimConfig

DEFAULT_RECOVER_TIMEOUT = 10.0  # seconds: --recover-timeout's default
MEASURED_VERDICT_EXCESS = 0.81  # seconds past T at 12,500 nodes (coordinator_load.py, node beats)
SHRINK_SECONDS = 2.0  # the top of the published 1.4-2.0 s
FULL_INIT_SECONDS = 10.0  # the top of the published 1-10 s per communicator across nodes
COMMUNICATORS_PER_RANK = 4  # TP, PP, DP, embedding


@dataclass(frozen=True)
class RecoveryModel:
    name: str
    verdict_seconds: float
    rebuild_seconds: float

    @property
    def recovery_seconds(self) -> float:
        return self.verdict_seconds + self.rebuild_seconds


def models(recover_timeout: float = DEFAULT_RECOVER_TIMEOUT) -> dict[str, RecoveryModel]:
    verdict = recover_timeout + MEASURED_VERDICT_EXCESS
    return {"kept": RecoveryModel("kept", verdict, SHRINK_SECONDS),
            "rebuilt": RecoveryModel("rebuilt", verdict, COMMUNICATORS_PER_RANK * FULL_INIT_SECONDS)}


def with_recovery_model(config: SimConfig, name: str) -> SimConfig:
    """The scenario with its assumed recovery pause replaced by a model's (`assumed`: as is)."""
    if name == "assumed":
        return config
    return dataclasses.replace(config, recovery_seconds=models()[name].recovery_seconds)
