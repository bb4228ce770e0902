"""Layer 3, the versatile-workload policy: microbatch quotas per live replica (design.md §7)."""

from recover_patches.workload.policy import (
    PlanInputError,
    even_plan,
    plan,
    predicted_time,
    quotas_of,
)
from recover_patches.workload.throughput import (
    UNKNOWN_WIRE,
    MicrobatchTimer,
    from_wire,
    timings_from_wire,
)

__all__ = [
    "PlanInputError", "even_plan", "plan", "predicted_time", "quotas_of",
    "UNKNOWN_WIRE", "MicrobatchTimer", "from_wire", "timings_from_wire",
]
