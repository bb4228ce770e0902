"""Randomness that does not depend on which replica runs a microbatch (design.md §8).

Dropout for global microbatch g is drawn from generators seeded by (seed, g, pp stage) and, for the
model-parallel stream, also the TP rank. A microbatch recomputed on another replica after a failure
therefore draws exactly the masks the failure-free run drew.

megatron-core's RNG tracker keeps CUDA generator states and cannot work on a CPU build, so
`install_rng_tracker(device)` puts in its place a tracker of the *device's* generator states: CPU
states on a CPU, the current GPU's states on a GPU (where dropout draws from the CUDA generator).
"""
from __future__ import annotations

import contextlib
import hashlib

import torch
from megatron.core.tensor_parallel import random as mcore_random

MODEL_PARALLEL_RNG = "model-parallel-rng"  # megatron-core's name for the TP-distinct stream


def derive_seed(*parts: int) -> int:
    """A 63-bit seed from integers; stable across processes and Python versions."""
    digest = hashlib.blake2b(repr(tuple(int(p) for p in parts)).encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") & ((1 << 63) - 1)


class DeviceRNGStatesTracker:
    """Named generator states of one device, swapped into its default generator inside `fork()`.

    Same methods as megatron-core's CudaRNGStatesTracker, so megatron-core layers that call
    `get_cuda_rng_tracker().fork()` (sequence parallel dropout) use it unchanged.
    """

    def __init__(self, device: torch.device | str = "cpu") -> None:
        self.device = torch.device(device)
        self.states_: dict[str, torch.Tensor] = {}

    def _get(self) -> torch.Tensor:
        if self.device.type == "cuda":
            return torch.cuda.get_rng_state(self.device)
        return torch.get_rng_state()

    def _set(self, state: torch.Tensor) -> None:
        if self.device.type == "cuda":
            torch.cuda.set_rng_state(state, self.device)
        else:
            torch.set_rng_state(state)

    def is_initialized(self) -> bool:
        return bool(self.states_)

    def reset(self) -> None:
        self.states_ = {}

    def get_states(self) -> dict[str, torch.Tensor]:
        return {name: state.clone() for name, state in self.states_.items()}

    def set_states(self, states: dict[str, torch.Tensor]) -> None:
        self.states_ = {name: state.clone() for name, state in states.items()}

    def add(self, name: str, seed: int) -> None:
        self.states_[name] = torch.Generator(device=self.device).manual_seed(seed).get_state()

    @contextlib.contextmanager
    def fork(self, name: str = MODEL_PARALLEL_RNG):
        if name not in self.states_:
            raise KeyError(f"RNG state {name!r} was never added")
        outer = self._get()
        self._set(self.states_[name])
        try:
            yield
        finally:
            self.states_[name] = self._get()
            self._set(outer)


def install_rng_tracker(device: torch.device | str = "cpu", seed: int = 0) -> DeviceRNGStatesTracker:
    """Make megatron-core's `get_cuda_rng_tracker()` return our tracker (once per process). The
    model-parallel stream starts seeded, so megatron-core code that forks it before the first
    microbatch (e.g. initialisation) finds it."""
    tracker = DeviceRNGStatesTracker(device)
    tracker.add(MODEL_PARALLEL_RNG, derive_seed(seed, -1))
    if not torch.cuda.is_available():
        # megatron-core's activation recompute saves and restores the CPU state, the tracker's
        # states and the CUDA state; only the last needs CUDA. Without a GPU there is none to keep.
        mcore_random._get_cuda_rng_state = lambda *args, **kwargs: None
        mcore_random._set_cuda_rng_state = lambda *args, **kwargs: None
    mcore_random._CUDA_RNG_STATE_TRACKER = tracker
    mcore_random._CUDA_RNG_STATE_TRACKER_INITIALIZED = True
    return tracker


def seed_microbatch(tracker: DeviceRNGStatesTracker, seed: int, microbatch_id: int,
                    pp_stage: int, tp_rank: int) -> None:
    """Seed every stream a forward pass of `microbatch_id` on this stage draws from.

    The default generator (hidden dropout, identical on all TP ranks because activations are
    replicated there) ignores the TP rank; the model-parallel stream (attention dropout on a TP
    shard of heads) includes it.
    """
    hidden = derive_seed(seed, microbatch_id, pp_stage)
    if tracker.device.type == "cuda":
        torch.manual_seed(hidden)  # the CPU generator and every GPU's
    else:  # torch.manual_seed would also queue a CUDA seeding for a CUDA never initialised,
        torch.default_generator.manual_seed(hidden)  # formatting the stack each time: 3.5 % of
        # a CPU rank's time (py-spy of the trainer)
    tracker.add(MODEL_PARALLEL_RNG, derive_seed(seed, microbatch_id, pp_stage, tp_rank, 1))
