"""What a save costs the training loop: a blocking torch_dist save, --async-save, and a local
non-persistent save (--non-persistent-ckpt-type local), side by side.

    OMP_NUM_THREADS=1 python scripts/bench/checkpoint_cost.py --saves 5            # tiny + ~100M
    python scripts/bench/checkpoint_cost.py --sizes 100m --device cuda --bf16      # on a GPU

One process, the real Checkpointer, model, optimizer (Adam state after one step) and schedule.
For each model size it alternates blocking and async saves into a temporary directory and times:
  stall   the time save() holds the training loop (blocking: everything; async: the optimizer's
          state dict, the host copy, the write plan, common.pt and starting the writer thread),
  write   async only: the background write, landed by finish_pending().
  local   a local checkpoint: this rank's state serialized and written to its own file (here into
          the same temporary directory's disk: on a cluster, the node's own SSD or RAM disk).
Prints the median per mode, the async/blocking and local/blocking stall ratios, and a JSON line
with every number.
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from megatron.training.arguments import parse_and_validate  # noqa: E402
from megatron.training.checkpointing import Checkpointer  # noqa: E402
from megatron.training.initialize import build_groups, torch_group_factory  # noqa: E402
from megatron.training.config import ModelConfig, OptimizerSetup, ScheduleConfig  # noqa: E402
from megatron.training.config.io import CheckpointConfig  # noqa: E402
from megatron.training.model import build_model  # noqa: E402
from megatron.training.optimizer.setup import build_optimizer, build_scheduler  # noqa: E402
from megatron.training.checkpointing.state import TrainingState, Progress  # noqa: E402
from recover_patches.pipeline.rng import install_rng_tracker  # noqa: E402
from recover_patches.topology import Topology  # noqa: E402

SIZES = {  # name -> model flags (vocab 32000 for "100m": 12 x 768 layers, ~110M parameters)
    "tiny": ["--num-layers", "4", "--hidden-size", "64", "--num-attention-heads", "4",
             "--vocab-size", "250"],
    "100m": ["--num-layers", "12", "--hidden-size", "768", "--num-attention-heads", "12",
             "--vocab-size", "32000"],
}


class BenchTrainer:
    """The Trainer attributes a save reads, around the real model, optimizer and schedule."""

    def __init__(self, args, device: torch.device):
        self.groups = build_groups(Topology(1, 1, 1), 0, torch_group_factory)
        install_rng_tracker(device, args.seed)
        vocab = args.vocab_size + (-args.vocab_size) % 128
        self.model = build_model(ModelConfig.from_args(args, vocab), self.groups.pg_collection(),
                                 0, 0, device)
        self.optimizer = build_optimizer(self.model, OptimizerSetup.from_args(args), self.groups)
        self.scheduler = build_scheduler(self.optimizer, ScheduleConfig.from_args(args))
        self.optimizer.step([torch.full_like(p, 1e-3, dtype=torch.float32)  # Adam state exists
                             for p in self.optimizer.model_params])
        self.state, self.device = Progress(iteration=1), device
        self.faults = self

    def at(self, phase, iteration, microbatch=None) -> None:  # no fault injection here
        pass

    def barrier(self, key: str) -> None:
        dist.barrier()

    def weights_ready(self) -> None:
        pass

    def any_rank(self, flag: bool, key: str) -> bool:
        return flag

    @property
    def training_state(self) -> TrainingState:
        return TrainingState(self.model, self.optimizer, self.scheduler, self.state, self.groups,
                             self.device)

    @property
    def live_replicas(self) -> list[int]:
        return [0]

    @property
    def membership_epoch(self) -> int:
        return 0

    def close_metrics(self) -> None:
        pass

    def parameters(self) -> int:
        return sum(p.numel() for p in self.model.parameters())


def measure(size: str, saves: int, device: torch.device, extra: list[str]) -> dict:
    with tempfile.TemporaryDirectory() as tmp:
        argv = [*SIZES[size], "--seq-length", "128", "--max-position-embeddings", "128",
                "--micro-batch-size", "1", "--global-batch-size", "1", "--lr", "1e-4",
                "--train-iters", "1000000", "--mock-data", "--tokenizer-type", "NullTokenizer",
                "--save", tmp, "--save-interval", "1", *extra]
        local = ["--non-persistent-ckpt-type", "local", "--non-persistent-save-interval", "1",
                 "--non-persistent-local-ckpt-dir", str(Path(tmp) / "local")]
        mode_flags = {"blocking": [], "async": ["--async-save"], "local": local}
        args = {mode: parse_and_validate(argv + flags, 1) for mode, flags in mode_flags.items()}
        trainer = BenchTrainer(args["blocking"], device)
        checkpointers = {mode: Checkpointer(CheckpointConfig.from_args(a), 0, 1)
                         for mode, a in args.items()}
        stalls: dict[str, list[float]] = {mode: [] for mode in mode_flags}
        writes: list[float] = []
        for i in range(saves):
            for mode, checkpointer in checkpointers.items():
                trainer.state.iteration += 1
                sync()
                start = time.perf_counter()
                if mode == "local":
                    checkpointer.local.save(trainer)
                else:
                    checkpointer.save(trainer)
                sync()
                stalls[mode].append(time.perf_counter() - start)
                if mode == "async":
                    start = time.perf_counter()
                    checkpointer.finish_pending(trainer)
                    writes.append(time.perf_counter() - start + stalls[mode][-1])
        return {"size": size, "parameters": trainer.parameters(), "saves": saves,
                "blocking_stall_s": statistics.median(stalls["blocking"]),
                "async_stall_s": statistics.median(stalls["async"]),
                "async_total_s": statistics.median(writes),
                "local_stall_s": statistics.median(stalls["local"]),
                "ratio_async_to_blocking": statistics.median(stalls["async"])
                / statistics.median(stalls["blocking"]),
                "ratio_local_to_blocking": statistics.median(stalls["local"])
                / statistics.median(stalls["blocking"])}


def sync() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes", nargs="+", default=list(SIZES), choices=list(SIZES))
    parser.add_argument("--saves", type=int, default=5, help="saves per mode (median reported)")
    parser.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    parser.add_argument("--bf16", action="store_true")
    opts = parser.parse_args()
    torch.set_num_threads(1)
    device = torch.device(opts.device)
    if device.type == "cuda":
        torch.cuda.set_device(0)
    dist.init_process_group("nccl" if device.type == "cuda" else "gloo", store=dist.HashStore(),
                            rank=0, world_size=1)
    extra = ["--bf16"] if opts.bf16 else []
    for size in opts.sizes:
        r = measure(size, opts.saves, device, extra)
        print(f"{size}: {r['parameters'] / 1e6:.1f}M parameters, {opts.device}"
              f"{' bf16' if opts.bf16 else ''}: blocking save stalls {r['blocking_stall_s']*1e3:.0f} ms, "
              f"async stalls {r['async_stall_s']*1e3:.0f} ms (x{r['ratio_async_to_blocking']:.3f}); "
              f"async write done after {r['async_total_s']*1e3:.0f} ms; local stalls "
              f"{r['local_stall_s']*1e3:.0f} ms (x{r['ratio_local_to_blocking']:.3f})", flush=True)
        print(json.dumps({**r, "device": opts.device, "bf16": opts.bf16}), flush=True)


if __name__ == "__main__":
    main()
