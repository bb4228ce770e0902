"""megatron-core's alltoall token dispatcher on a CPU.

The dispatcher copies its split sizes to the host on a CUDA side stream, which it creates when
it is built, and waits for that copy at a later point. On a CPU every tensor is already on the
host: the subclass takes the sizes as arrays at the copy point and has nothing to wait for.
Everything else (the permutations, the all-to-alls over the expert-parallel group, which run
through layer 1's `all_to_all_single`) is megatron-core's own.
"""
from __future__ import annotations

from typing import Optional

import torch
from megatron.core.transformer.moe import moe_layer
from megatron.core.transformer.moe.token_dispatcher import MoEAlltoAllTokenDispatcher


class HostAlltoAllTokenDispatcher(MoEAlltoAllTokenDispatcher):
    """megatron-core's alltoall dispatcher without its device-to-host stream."""

    def _maybe_dtoh_and_synchronize(self, point: str,
                                    tokens_per_expert: Optional[torch.Tensor] = None
                                    ) -> torch.Tensor:
        if self.drop_and_pad or point != self.cuda_dtoh_point:
            return tokens_per_expert  # type: ignore[return-value]
        for name in ("input_splits", "output_splits", "output_splits_tp"):
            sizes = getattr(self, name)
            if torch.is_tensor(sizes):  # host arrays, as the stock copy makes them
                setattr(self, name, sizes.numpy())
        return tokens_per_expert  # type: ignore[return-value]


def use_host_alltoall() -> None:
    """On a CPU build: MoE layers built from now on take the host dispatcher. The stock one's
    class-wide stream slot gets a placeholder, so no CUDA stream is asked for."""
    if MoEAlltoAllTokenDispatcher.cuda_dtoh_stream is None:
        MoEAlltoAllTokenDispatcher.cuda_dtoh_stream = "host"
    moe_layer.MoEAlltoAllTokenDispatcher = HostAlltoAllTokenDispatcher
