"""The commit bookkeeping that rides in the gradient reduction: the tail of the last bucket.

In the default fp32 buffer, integers are exact only below 2**24, so they travel as base-256
limbs: a sum of DP limbs stays exact for DP < 65793 replicas, and 7 limbs carry 56 bits. The loss
(float64) travels as two fp32 parts (hi + lo). Per-replica values (the time per microbatch, a
fingerprint of the weights when asked for) have one slot per replica, written only by that
replica, so the sum delivers each one exactly. So does each replica's alarm (1: its own loss sum
is not finite; --rerun-mode validate_results re-runs its microbatches elsewhere). MoE's router
records (`measures`) are summed. With --recover-exact-reduction the tail is float64 like the
buffer: the loss (a sum of values on the stage's loss grid) travels whole, and each parameter's
encoded largest fixed-point integer follows (`fixed_point.py`).

Layout: [4 integers x 7 limbs | loss hi, lo | time per replica | weight hash per replica x 4 |
alarm per replica | measures | fixed-point peaks].
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Sequence

import torch

from recover_patches.recovery.fixed_point import FixedPointScales, Verdict
from recover_patches.recovery.reduce import Totals

LIMB_BITS, LIMBS = 8, 7
_INT_FIELDS = 4  # microbatches, tokens, id_sum, id_hash_sum
_LOSS_SLOTS = 2  # hi, lo
HASH_LIMBS, HASH_LIMB_BITS = 4, 16  # a 64-bit weight fingerprint per replica


def _limbs(value: int) -> list[float]:
    if not 0 <= value < 1 << (LIMB_BITS * LIMBS):
        raise ValueError(f"{value} does not fit {LIMBS} limbs of {LIMB_BITS} bits")
    return [float((value >> (LIMB_BITS * i)) & 0xFF) for i in range(LIMBS)]


def _from_limbs(values: Sequence[float]) -> int:
    return sum(int(round(v)) << (LIMB_BITS * i) for i, v in enumerate(values))


@dataclass
class ReducedGradients:
    """What the reduction returns besides the gradients (which stay in the buffer)."""
    totals: Totals
    replica_times: list[float]  # wire values of each replica's time per microbatch
    replica_weight_hashes: list[int] = field(default_factory=list)  # 0: not sent
    replica_alarms: list[float] = field(default_factory=list)  # > 0: that replica raised one
    scattered: bool = False  # only this rank's ranges of each bucket are reduced (`Scatter`)
    fixed_point: Verdict | None = None  # --recover-exact-reduction: overflow, next exponents


class TailLayout:
    """Where each value sits in a tail for `replicas` replicas, `measure_slots` MoE records and
    `scale_slots` fixed-point peaks."""

    def __init__(self, replicas: int, measure_slots: int = 0, scale_slots: int = 0):
        self.replicas = replicas
        self._times_at = _INT_FIELDS * LIMBS + _LOSS_SLOTS
        self._hashes_at = self._times_at + replicas
        self._alarms_at = self._hashes_at + replicas * HASH_LIMBS
        self._measures_at = self._alarms_at + replicas
        self._scales_at = self._measures_at + measure_slots
        self.size = self._scales_at + scale_slots

    def write(self, tail: torch.Tensor, totals: Totals, replica: int, time_wire: float,
              weight_hash: int, alarm: float | torch.Tensor,
              peaks: torch.Tensor | None) -> None:
        """This replica's entries (the others' slots zero). `alarm`, the loss, the measures and
        the encoded peaks may be device tensors: written there, so nothing waits for the device."""
        ints = [totals.microbatches, totals.tokens, totals.id_sum, totals.id_hash_sum]
        host = [v for i in ints for v in _limbs(i)] + [0.0] * (self.size - _INT_FIELDS * LIMBS)
        host[self._times_at + replica] = time_wire
        for k in range(HASH_LIMBS):
            host[self._hashes_at + replica * HASH_LIMBS + k] = float(
                (weight_hash >> (HASH_LIMB_BITS * k)) & 0xFFFF)
        tail.copy_(torch.tensor(host, dtype=tail.dtype), non_blocking=True)
        tail[self._alarms_at + replica] = alarm
        loss = torch.as_tensor(totals.loss_sum, dtype=torch.float64, device=tail.device)
        hi = loss.to(tail.dtype)  # (float64: the whole loss, lo 0)
        tail[_INT_FIELDS * LIMBS] = hi
        tail[_INT_FIELDS * LIMBS + 1] = (loss - hi.double()).to(tail.dtype)
        if totals.measures is not None:
            tail[self._measures_at:self._scales_at].copy_(totals.measures.reshape(-1))
        if peaks is not None:
            tail[self._scales_at:].copy_(peaks)

    def read(self, tail: torch.Tensor, scales: FixedPointScales | None) -> ReducedGradients:
        values = tail.double().tolist()  # the one host read the commit needs
        ints = [_from_limbs(values[i * LIMBS:(i + 1) * LIMBS]) for i in range(_INT_FIELDS)]
        loss = values[_INT_FIELDS * LIMBS] + values[_INT_FIELDS * LIMBS + 1]
        times = values[self._times_at:self._hashes_at]
        limbs = values[self._hashes_at:self._alarms_at]
        hashes = [sum(int(round(limbs[r * HASH_LIMBS + k])) << (HASH_LIMB_BITS * k)
                      for k in range(HASH_LIMBS)) for r in range(self.replicas)]
        alarms = values[self._alarms_at:self._measures_at]
        measures = torch.tensor(values[self._measures_at:self._scales_at], dtype=torch.float64) \
            if self._scales_at > self._measures_at else None
        verdict = None if scales is None else scales.verdict(values[self._scales_at:])
        return ReducedGradients(Totals(ints[0], ints[1], ints[2], ints[3], loss, measures), times,
                                hashes, alarms, fixed_point=verdict)
