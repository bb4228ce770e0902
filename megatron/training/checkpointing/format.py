"""The checkpoint vocabulary every format shares: file names, version marks, ReCoVer's keys
beside Megatron's, the `args` blob Megatron's loader reads back, and the user-facing error.
Format-neutral, so the torch, torch_dist and local formats and the resume checks all read it
here and none of them imports another for a constant."""
from __future__ import annotations

import argparse

from megatron.training.errors import UserError

LATEST_FILE = "latest_checkpointed_iteration.txt"
METADATA_FILE = "recover_metadata.json"
RANK_FILE = "model_optim_rng.pt"
FORMAT = "recover-torch-1"  # ReCoVer's torch format, as its metadata names it
CHECKPOINT_VERSION = 3.0  # Megatron-LM's current value: its loader checks for it
GRAD_EXPONENTS = "recover_grad_exponents"  # ReCoVer's key beside Megatron's in the RNG object


class CheckpointError(UserError):
    """A user-facing checkpoint problem (exit code 2)."""


def iter_dir_name(iteration: int) -> str:
    return f"iter_{iteration:07d}"


def with_megatron_args(args: argparse.Namespace, iteration: int,
                       consumed_samples: int) -> argparse.Namespace:
    """The args Megatron's loader reads back (consumed samples and iteration among them)."""
    saved = argparse.Namespace(**vars(args))
    saved.consumed_train_samples = consumed_samples
    saved.iteration = iteration
    return saved
