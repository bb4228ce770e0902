"""Per-replica measured time per microbatch, as input to :func:`policy.plan`.

Each replica keeps an exponentially weighted moving average (EWMA) of its seconds per microbatch,
updated at commit, and publishes it to all replicas with an all-gather. Plans must be computed from the
*gathered* values on every rank (including a replica's own entry) so that all ranks see identical floats.

The estimate is consistent with the policy's cost model: an iteration of q microbatches on a pipeline
of depth P takes (q + P - 1) * t with 1F1B (the interleaved schedule: `policy.finish_factor`), so the
measured seconds are divided by that factor, not by q.

Torch-free on purpose (layer 3 stays pure); the caller builds the all-gather tensor, one float64 value
per replica from :meth:`MicrobatchTimer.to_wire`, and turns the gathered values back with
:func:`timings_from_wire`.
"""

from __future__ import annotations

import math
from collections.abc import Mapping

from recover_patches.workload.policy import finish_factor

# Wire value of "no measurement yet". Valid timings are > 0, so any negative value means unknown.
UNKNOWN_WIRE = -1.0


class MicrobatchTimer:
    """EWMA of one replica's seconds per microbatch; value is None until the first measurement."""

    def __init__(self, alpha: float = 0.3, pipeline_depth: int = 1, chunks: int = 1,
                 group: int = 0) -> None:
        if not 0.0 < alpha <= 1.0:
            raise ValueError(f"alpha must be in (0, 1], got {alpha}")
        if pipeline_depth < 1:
            raise ValueError(f"pipeline_depth must be >= 1, got {pipeline_depth}")
        self.alpha = alpha
        self.pipeline_depth = pipeline_depth
        self.chunks, self.group = chunks, group  # the interleaved schedule's (1: plain 1F1B)
        self.value: float | None = None

    def update(self, seconds: float, microbatches: int) -> None:
        """Fold in one committed iteration: `seconds` spent on `microbatches` microbatches.

        An iteration with 0 microbatches measured nothing and leaves the estimate unchanged.
        """
        if microbatches < 0:
            raise ValueError(f"microbatches must be >= 0, got {microbatches}")
        if not math.isfinite(seconds) or seconds <= 0.0:
            raise ValueError(f"seconds must be finite and > 0, got {seconds}")
        if microbatches == 0:
            return
        sample = seconds / finish_factor(microbatches, self.pipeline_depth, self.chunks, self.group)
        if self.value is None:
            self.value = sample
        else:
            self.value = self.alpha * sample + (1.0 - self.alpha) * self.value

    def to_wire(self) -> float:
        """This replica's entry for the all-gather tensor."""
        return UNKNOWN_WIRE if self.value is None else float(self.value)


def from_wire(value: float) -> float | None:
    """One gathered entry back to a timing, None when the replica had no measurement."""
    value = float(value)
    return value if math.isfinite(value) and value > 0.0 else None


def timings_from_wire(values: Mapping[int, float]) -> dict[int, float | None]:
    """{replica: wire value} as gathered -> {replica: seconds or None}, ready for policy.plan."""
    return {replica: from_wire(value) for replica, value in values.items()}
