"""--recover-exact-reduction: gradients summed as fixed-point integers, so that their sum
depends on neither the order nor the grouping of the microbatches (docs/failures.md: "Bitwise,
if you ask").

Each microbatch's gradient enters the gradient buffer as round(g x 2^e), with one exponent e per
parameter (not per bucket: bucket sizes follow flags and the DP size), every rank of the
parameter's DP group holding the same one. The integers live in float64, which holds every
integer below 2^53 exactly: a microbatch contributes less than 2^LIMIT_BITS in magnitude per
element, so up to 2^(53 - LIMIT_BITS) = 65536 microbatches sum exactly, in any order, on a
replica and then across replicas (all-reduce and reduce-scatter alike). The reduced integers
become fp32 gradients once, by one rounding each; everything after that is elementwise or, for
the norm, fixed-point as well (`shard_sums.fixed_point_norm`). float64 rather than int64 keeps
the reduction's tail as it is (its float slots ride in the same buffer) at 10 bits less range.

The exponent is agreed before use: the previous iteration's largest |g| x 2^e per parameter moves
e so the next largest lands near 2^TARGET_BITS, 6 bits (x64) below the limit. Each replica's
largest rides in the reduction's tail as one float64 per parameter: its binary length, clamped to
a slot k in [0, SLOTS), as 2^(17 k). A sum of fewer than 2^17 such powers lies in
[2^(17 K), 2^(17 K + 17)) for the largest K, so the sum's binary exponent // 17 is the largest
slot, the same whatever the partition (and the summation's rounding never crosses that range).
The first exponents come from one microbatch that every replica computes alike (`calibrate`). A
microbatch at or above 2^LIMIT_BITS (or not finite) is an overflow: the step is skipped and the
exponent lowered, as fp16's loss scale does, never a wrap.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Sequence

import torch

LIMIT_BITS = 37  # a microbatch's |integer| stays below 2^37: 2^16 microbatches sum below 2^53
TARGET_BITS = 31  # where the next iteration's largest |integer| is aimed
LOWEST = -48  # slot 0: the largest was 2^-48 of the target or less (e rises by 48)
SLOTS = LIMIT_BITS - TARGET_BITS + 1 - LOWEST + 1  # ... up to the last: an overflow
SLOT_BITS = 17  # a slot k travels as 2^(17 k): fewer than 2^17 replicas sum without ambiguity
MAX_REPLICAS = (1 << SLOT_BITS) - 1
EXPONENT_RANGE = (-120, 180)  # 2^e stays a normal float64 times any fp32 gradient


@dataclass(frozen=True)
class Verdict:
    """What an iteration's reduction says about the fixed point: whether a microbatch overflowed
    (the step is skipped) and each parameter's exponent for the next iteration."""
    overflow: bool
    exponents: list[int]
    overflowed: list[int]  # the parameters (by index) that overflowed


def bit_length(peak: torch.Tensor) -> torch.Tensor:
    """Per parameter: the power of two just above |peak| (peak < 2^L), as a float64 tensor; +inf
    where the peak is not finite, -inf where it is 0 (nothing to say)."""
    _, exponent = torch.frexp(peak)
    length = exponent.to(torch.float64)
    length = torch.where(peak == 0, torch.full_like(length, -math.inf), length)
    return torch.where(torch.isfinite(peak), length, torch.full_like(length, math.inf))


def loss_quantum(tokens: int) -> float:
    """The grid a microbatch's loss sum is rounded to: a microbatch of `tokens` tokens, each
    below 256 nats, is then less than 2^LIMIT_BITS quanta, and 2^16 microbatches sum exactly."""
    return math.ldexp(1.0, -(LIMIT_BITS - math.ceil(math.log2(max(tokens, 1) * 256))))


class FixedPointScales:
    """The exponent of each parameter of one rank's gradient buffer (in its order); None until
    calibrated."""

    def __init__(self, params: int):
        self.params = params
        self.exponents: list[int] | None = None
        self._multipliers: list[float] = []

    @property
    def slots(self) -> int:
        """Tail entries: one per parameter."""
        return self.params

    def multiplier(self, index: int) -> float:
        """2^e of parameter `index`."""
        return self._multipliers[index]

    def _set(self, exponents: list[int] | None) -> None:
        self.exponents = exponents
        self._multipliers = [] if exponents is None else [math.ldexp(1.0, e) for e in exponents]

    def encode(self, peaks: torch.Tensor) -> torch.Tensor:
        """This replica's largest |integer| per parameter as 2^(17 k) of its slot k (0: nothing
        seen; float64, on the peaks' device)."""
        length = bit_length(peaks)
        slot = torch.clamp(length - TARGET_BITS - LOWEST, 0, SLOTS - 1)
        seen = torch.isfinite(length) | (length > 0)  # -inf: an all-zero parameter says nothing
        return torch.where(seen, torch.exp2(slot * SLOT_BITS), torch.zeros_like(slot))

    def verdict(self, summed: Sequence[float]) -> Verdict:
        """The summed encodings of every replica: the largest slot per parameter, the same on
        every rank whatever the partition, moves its exponent to aim it at TARGET_BITS."""
        assert self.exponents is not None
        low, high = EXPONENT_RANGE
        exponents, overflowed = [], []
        for i, (e, total) in enumerate(zip(self.exponents, summed)):
            if total <= 0:  # no gradient here: keep the exponent
                exponents.append(e)
                continue
            above = (math.frexp(total)[1] - 1) // SLOT_BITS + LOWEST  # bit length - target
            if above > LIMIT_BITS - TARGET_BITS:
                overflowed.append(i)
            exponents.append(min(max(e - above, low), high))
        return Verdict(bool(overflowed), exponents, overflowed)

    def calibrate(self, peaks: torch.Tensor | None) -> None:
        """First exponents from one microbatch's largest |g| per parameter (computed at exponent
        0: `peaks` None sets that), aimed 4 bits lower than the target: the iteration's other
        microbatches may be larger."""
        if peaks is None:
            self._set([0] * self.params)
            return
        low, high = EXPONENT_RANGE
        lengths = bit_length(peaks).tolist()
        self._set([0 if not math.isfinite(n) else min(max(int(TARGET_BITS - 4 - n), low), high)
                   for n in lengths])

    def forget(self) -> None:
        """Uncalibrated again (a calibration that failed half-way)."""
        self._set(None)

    def adopt(self, verdict: Verdict) -> None:
        self._set(list(verdict.exponents))

    def state_dict(self) -> dict:
        return {"exponents": None if self.exponents is None else list(self.exponents)}

    def load_state_dict(self, state: dict) -> None:
        """Exponents of another shape (another model or layout) are dropped: measured afresh."""
        exponents = state["exponents"]
        fits = exponents is not None and len(exponents) == self.params
        self._set([int(e) for e in exponents] if fits else None)
