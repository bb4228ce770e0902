"""--log-straggler, ReCoVer's way: Megatron-LM's straggler detector (NVIDIA Resiliency Extension)
times every rank's GPU kernels and prints the slowest and fastest ranks. ReCoVer already measures
what its balance needs -- each replica's seconds per microbatch, riding in every reduction -- so
the report names the slowest and fastest replicas from those, at every log line, at no cost.
--straggler-minmax-count: how many of each; --disable-straggler-on-startup: no report (Megatron
then waits for a toggle on --straggler-ctrlr-port; ReCoVer has no control server)."""
from __future__ import annotations

import argparse
import statistics
from dataclasses import dataclass
from typing import Mapping


@dataclass(frozen=True)
class StragglerConfig:
    report: bool = False  # --log-straggler and not --disable-straggler-on-startup
    count: int = 1  # --straggler-minmax-count

    @classmethod
    def from_args(cls, args: argparse.Namespace) -> StragglerConfig:
        return cls(bool(args.log_straggler and not args.disable_straggler_on_startup),
                   args.straggler_minmax_count)


def straggler_line(timings: Mapping[int, float | None], count: int) -> str | None:
    """The slowest and fastest `count` replicas by seconds per microbatch, against the median;
    None until two replicas have been measured."""
    measured = sorted((t, r) for r, t in timings.items() if t is not None)
    if len(measured) < 2:
        return None
    median = statistics.median(t for t, _ in measured)

    def named(entries) -> str:
        return ", ".join(f"replica {r} {t * 1000:.1f} ms ({t / median:.2f}x)" for t, r in entries)
    return (f"stragglers (ms per microbatch, median {median * 1000:.1f}): slowest "
            f"{named(measured[::-1][:count])} | fastest {named(measured[:count])}")
