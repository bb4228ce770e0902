"""The global batch of each iteration: constant, ramped up (--rampup-batch-size) or stepped
(--step-batch-size-schedule), each by Megatron-LM's rule. An iteration's M microbatches follow it
whatever the replicas alive (design.md: the schedule deals them out)."""
from __future__ import annotations

import argparse
from dataclasses import dataclass

SUFFIXES = {"K": 10**3, "M": 10**6, "B": 10**9, "T": 10**12}


def _count(text: str) -> int:
    """A schedule's number, with Megatron-LM's suffixes K, M, B, T (powers of 1000)."""
    text = text.strip().upper()
    multiplier = SUFFIXES.get(text[-1:], 1)
    return int(float(text[:-1] if multiplier > 1 else text) * multiplier)


def parse_step_schedule(text: str, seq_length: int | None) -> tuple[tuple[int, int], ...]:
    """--step-batch-size-schedule "THRESHOLD:BATCH ...": (first sample, global batch) pairs,
    sorted. As Megatron-LM reads it: commas or spaces between entries, thresholds in tokens
    (turned into samples by the sequence length) unless there is none. ValueError: why not."""
    steps = []
    for entry in text.replace(",", " ").split():
        threshold, sep, batch = entry.partition(":")
        if not sep:
            raise ValueError(f'entry "{entry}" is not THRESHOLD:BATCH_SIZE')
        try:
            samples, size = _count(threshold), _count(batch)
        except ValueError:
            raise ValueError(f'entry "{entry}" has a value that is not a number') from None
        steps.append((samples // seq_length if seq_length else samples, size))
    steps.sort()
    if not steps or steps[0][0] != 0:
        raise ValueError("the first entry must start at threshold 0")
    if any(a[0] >= b[0] for a, b in zip(steps, steps[1:])):
        raise ValueError("thresholds must be strictly increasing (in samples)")
    if any(size <= 0 for _, size in steps):
        raise ValueError("every batch size must be positive")
    return tuple(steps)


@dataclass(frozen=True)
class BatchSchedule:
    """The global batch per iteration: --global-batch-size, ramped up from START in steps of
    INCR over SAMPLES consumed samples by --rampup-batch-size, or stepped at sample thresholds
    by --step-batch-size-schedule (Megatron's rules)."""
    micro_batch_size: int
    global_batch_size: int  # with steps: the last step's
    rampup: tuple[int, int, int] | None  # START INCR SAMPLES
    steps: tuple[tuple[int, int], ...] | None = None  # (first sample, global batch), sorted

    def __post_init__(self):
        for size in [self.global_batch_size] + [size for _, size in self.steps or ()]:
            if size % self.micro_batch_size:
                raise ValueError(f"global batch {size} is not a multiple of the micro batch "
                                 f"{self.micro_batch_size}")
        if self.rampup is not None and self.steps is not None:
            raise ValueError("a ramp-up and a step schedule together")

    @classmethod
    def from_args(cls, args: argparse.Namespace) -> BatchSchedule:
        rampup = None if args.rampup_batch_size is None else tuple(args.rampup_batch_size)
        steps = None if args.step_batch_size_schedule is None else \
            parse_step_schedule(args.step_batch_size_schedule, args.seq_length)
        return cls(args.micro_batch_size, args.global_batch_size, rampup, steps)

    def global_batch_size_at(self, consumed_samples: int) -> int:
        """Global batch of the iteration starting after `consumed_samples` samples: the ramp
        goes up in equal steps, each lasting an equal share of SAMPLES; then the full batch."""
        if self.steps is not None:  # the last step whose threshold was reached
            return [size for first, size in self.steps if first <= consumed_samples][-1]
        final = self.global_batch_size
        if self.rampup is None:
            return final
        start, incr, ramp_samples = self.rampup
        steps = (final - start) // incr
        if steps == 0 or ramp_samples <= 0 or consumed_samples > ramp_samples:
            return final
        samples_per_step = ramp_samples / steps
        return min(final, start + int(consumed_samples / samples_per_step) * incr)
