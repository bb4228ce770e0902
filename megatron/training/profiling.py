"""Megatron-LM's --profile: iterations --profile-step-start .. --profile-step-end profiled on the
--profile-ranks (all by default), as Megatron-LM's training loop does it:

* with --use-pytorch-profiler: torch.profiler over the loop with Megatron-LM's schedule (wait
  start - 1 steps, warm up one, then end - start active ones, a step at the top of every
  iteration: with start S > 0 the trace holds iterations S .. E - 1, as Megatron-LM's does), one
  chrome trace per rank written to <--tensorboard-dir>/../torch_profile/rank-R.json.gz
  (--pytorch-profiler-collect-shapes / -callstack: shapes and stacks in it);
* without it: the CUDA profiler's range (cudaProfilerStart/Stop) around iterations S+1 .. E, for
  `nsys --capture-range=cudaProfilerApi`; a GPU-only mechanism, said at start-up on a CPU.
"""
from __future__ import annotations

import argparse
import logging
from dataclasses import dataclass
from pathlib import Path

import torch

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class ProfilingConfig:
    enabled: bool = False  # --profile
    start: int = 10  # --profile-step-start
    end: int = 12  # --profile-step-end
    pytorch: bool = False  # --use-pytorch-profiler
    shapes: bool = False  # --pytorch-profiler-collect-shapes
    callstack: bool = False  # --pytorch-profiler-collect-callstack
    ranks: tuple[int, ...] = ()  # --profile-ranks (empty: every rank)
    trace_dir: Path = Path("torch_profile")  # <--tensorboard-dir>/../torch_profile

    def __post_init__(self):
        if self.enabled and not 0 <= self.start < self.end:
            raise ValueError(f"profile iterations {self.start}..{self.end}")

    @classmethod
    def from_args(cls, args: argparse.Namespace) -> ProfilingConfig:
        return cls(bool(args.profile), args.profile_step_start, args.profile_step_end,
                   bool(args.use_pytorch_profiler), bool(args.pytorch_profiler_collect_shapes),
                   bool(args.pytorch_profiler_collect_callstack), tuple(args.profile_ranks),
                   Path(args.tensorboard_dir or ".") / ".." / "torch_profile")

    def profiles(self, rank: int) -> bool:
        return self.enabled and (not self.ranks or rank in self.ranks)


class Profiler:
    """Started before the loop; `before(done)` at the top of each iteration (`done`: iterations
    completed, Megatron's `iteration` there), `after(done)` once it is counted."""

    def __init__(self, config: ProfilingConfig, rank: int, cuda: bool):
        self.config, self.rank, self.cuda = config, rank, cuda
        self.active = config.profiles(rank)
        self.torch_profiler: torch.profiler.profile | None = None
        if self.active and config.pytorch:
            self.torch_profiler = torch.profiler.profile(
                schedule=torch.profiler.schedule(wait=max(config.start - 1, 0),
                                                 warmup=1 if config.start > 0 else 0,
                                                 active=config.end - config.start, repeat=1),
                on_trace_ready=self._write_trace, record_shapes=config.shapes,
                with_stack=config.callstack)
            self.torch_profiler.start()

    def _write_trace(self, profile: torch.profiler.profile) -> None:
        self.config.trace_dir.mkdir(parents=True, exist_ok=True)
        path = self.config.trace_dir / f"rank-{self.rank}.json.gz"
        profile.export_chrome_trace(str(path))
        logger.info(f"profile trace written: {path}")

    def before(self, done: int) -> None:
        if not self.active:
            return
        if self.torch_profiler is not None:
            self.torch_profiler.step()
        elif done == self.config.start and self.cuda:
            torch.cuda.cudart().cudaProfilerStart()

    def after(self, done: int) -> None:
        if not self.active or done != self.config.end:
            return
        if self.torch_profiler is not None:
            self.torch_profiler.stop()
            self.torch_profiler = None
        elif self.cuda:
            torch.cuda.cudart().cudaProfilerStop()

    def close(self) -> None:
        """A run that ends inside the range still writes what it profiled."""
        if self.torch_profiler is not None:
            self.torch_profiler.stop()
            self.torch_profiler = None
