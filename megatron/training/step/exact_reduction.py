"""--recover-exact-reduction's two moments in a step (`fixed_point.py` holds the representation):
the first exponents, measured on one microbatch every replica computes alike, and the verdict of
each reduction -- the next exponents, and a skipped step when a microbatch overflowed."""
from __future__ import annotations

import logging
from typing import Any, Callable

from recover_patches.recovery.grad_buffer import GradBuffer, ReducedGradients

logger = logging.getLogger(__name__)


def calibrate_once(grads: GradBuffer, run: Callable[[list[int]], Any],
                   first_id: Callable[[], int]) -> None:
    """Before the first accumulation (a fresh run, a resume without exponents): compute
    microbatch `first_id()` (the iteration's first: the same on every replica, whatever the
    partition) at exponent 0, take each parameter's largest |g| and drop the gradients. A failure
    on the way leaves the exponents unset, so the iteration's next attempt measures again."""
    scales = grads.scales
    if scales is None or scales.exponents is not None:
        return
    before, first = grads.snapshot(), first_id()
    scales.calibrate(None)  # exponent 0 while measuring
    try:
        run([first])
        peaks = grads.take_peaks()
    except BaseException:
        scales.forget()
        raise
    finally:
        grads.restore(before)
    scales.calibrate(peaks)
    exponents = scales.exponents or [0]
    logger.info(f"exact reduction: {len(exponents)} parameters' exponents in "
                f"[{min(exponents)}, {max(exponents)}] (from microbatch {first})")


def fixed_point_overflow(grads: GradBuffer, reduced: ReducedGradients) -> bool:
    """Take the reduction's exponents for the next iteration; True (skip the step) if a
    microbatch's gradient left the fixed-point range (the same verdict on every rank)."""
    verdict, scales = reduced.fixed_point, grads.scales
    if verdict is None or scales is None:
        return False
    scales.adopt(verdict)
    if verdict.overflow:
        logger.warning(f"exact reduction: a microbatch's gradient left the fixed-point range in "
                       f"{len(verdict.overflowed)} parameter(s) (by index: "
                       f"{verdict.overflowed[:8]}): step skipped, their exponents lowered")
    return verdict.overflow
