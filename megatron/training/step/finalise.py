"""Megatron's gradient finalisation (its `finalize_model_grads`), done at the end of the reduce
phase: the tied embedding's and the TP-partial gradients summed, every gradient divided by the
global token count (design.md §8) and the loss scale, then the norm, and the zero count of
--log-num-zeros-in-grad, measured.

All of it before the commit vote, for two reasons. A rank rolling forward (`settle.py`) steps
from what its reduction left, so that must be final. And with sharded gradients (the distributed
optimizer while every replica lives) the norm's sums span the optimizer instance, whose members
are other replicas: a member lost after the commit would leave this replica unable to step
while the other instances stepped. On gloo its survivors then recovered an iteration apart and
the job stopped; on NCCL the norm read what the aborted gather left and the step clipped with
it. Before the vote such a loss is one more failure of the reduce phase, and the vote's wait for
the device raises what the norm's groups latched.
"""
from __future__ import annotations

from typing import Sequence

import torch

from megatron.training.initialize import ParallelGroups
from megatron.training.optimizer import (Optimizer, count_zeros, global_grad_norm,
                                         sync_sequence_parallel_grads, sync_tied_embedding_grads)
from recover_patches.recovery.grad_buffer import GradBuffer, ReducedGradients


def finalise(buffer: GradBuffer, optimizer: Optimizer, groups: ParallelGroups,
             params: Sequence[torch.Tensor], tp_partial, reduced: ReducedGradients, *,
             exact: bool, log_num_zeros: bool) -> tuple[float, dict]:
    """Finalise the reduced gradients in place; returns their norm and the record's extras."""
    grads = [buffer.reduced_grad(p) for p in params]
    sync_tied_embedding_grads(params, grads, groups.embedding)
    sync_sequence_parallel_grads(grads, tp_partial, groups.tp)
    scaler = optimizer.scaler
    buffer.divide_gradients(max(reduced.totals.tokens, 1) * (1.0 if scaler is None
                                                             else scaler.scale))
    tp_rank, extra, group = groups.coord.tp, {}, groups.replica_positions
    if reduced.scattered or exact:  # only this rank's ranges hold reduced gradients
        grad_norm = optimizer.grad_norm(grads, group, tp_rank, exact)  # (exact: the optimizer's)
        if log_num_zeros:  # before clipping, as Megatron counts them
            extra["num_zeros"] = optimizer.count_zeros(grads, group, tp_rank)
    else:
        grad_norm = global_grad_norm(params, grads, group, tp_rank)
        if log_num_zeros:
            extra["num_zeros"] = count_zeros(params, grads, group, tp_rank)
    return grad_norm, extra
