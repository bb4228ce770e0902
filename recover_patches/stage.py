"""One pipeline stage of a GPT replica: what a forward and a backward of one microbatch mean.

Every rank can compute any microbatch: data comes from the id-addressed sampler, dropout from
generators seeded by the id (DESIGN §7), and the loss is a *sum* over tokens, normalised only after
the DP reduction.
"""
from __future__ import annotations

from typing import Callable

import torch

from recover_patches.loss import masked_loss_sum, vocab_parallel_cross_entropy
from recover_patches.rng import CpuRNGStatesTracker, seed_microbatch


class GPTStage:
    def __init__(self, model, sampler: Callable[[int], dict], *, tp_group, tracker: CpuRNGStatesTracker,
                 seed: int, pp_stage: int, tp_rank: int, is_first: bool, is_last: bool):
        self.model = model
        self.sampler = sampler
        self.tp_group = tp_group
        self.tracker = tracker
        self.seed = seed
        self.pp_stage = pp_stage
        self.tp_rank = tp_rank
        self.is_first = is_first
        self.is_last = is_last
        self._token_counts: dict[int, int] = {}

    def forward(self, microbatch_id: int, input_tensor: torch.Tensor | None) -> torch.Tensor:
        seed_microbatch(self.tracker, self.seed, microbatch_id, self.pp_stage, self.tp_rank)
        batch = self.sampler(microbatch_id)
        self._token_counts[microbatch_id] = int(batch["loss_mask"].sum().item())
        if not self.is_first:
            self.model.set_input_tensor(input_tensor)
        output = self.model(
            batch["tokens"] if self.is_first else None,
            batch["position_ids"] if self.is_first else None,
            None,  # causal mask: SDPACoreAttention uses is_causal
        )
        if not self.is_last:
            return output
        token_loss = vocab_parallel_cross_entropy(output, batch["labels"], self.tp_group)
        loss_sum, _ = masked_loss_sum(token_loss, batch["loss_mask"])
        return loss_sum

    def backward(self, input_tensor: torch.Tensor | None, output: torch.Tensor,
                 output_grad: torch.Tensor | None) -> torch.Tensor | None:
        if self.is_last:
            torch.autograd.backward(output)
        else:
            torch.autograd.backward(output, grad_tensors=output_grad)
        return None if input_tensor is None else input_tensor.grad

    def tokens(self, microbatch_id: int) -> int:
        return self._token_counts.pop(microbatch_id)
