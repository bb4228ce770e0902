"""One pipeline stage of a GPT replica: what a forward and a backward of one microbatch mean.

Every rank can compute any microbatch: data comes from the id-addressed sampler, dropout from
generators seeded by the id (design.md §8), and the loss is a *sum* over tokens, normalised only after
the DP reduction.

A negative id is a *filler* (expert parallelism): a unit's replicas run their experts
together, so one with a shorter quota than its unit's longest computes sample ~id with a loss and
an auxiliary-loss scale of zero: its experts answer the others' tokens, it adds nothing itself.
"""
from __future__ import annotations

from typing import Callable, Protocol

import torch

from recover_patches.pipeline.loss import (masked_loss_sum, on_grid,
                                           vocab_parallel_cross_entropy)
from recover_patches.pipeline.rng import DeviceRNGStatesTracker, seed_microbatch


class ForwardMeter(Protocol):
    """Values the model records while it runs (MoE's auxiliary losses and token counts):
    `start` before a microbatch's forward or backward, `take` after it; a recomputed module
    records in the backward, so the microbatch's values are the two takes' sum."""

    def start(self) -> None: ...

    def take(self) -> torch.Tensor: ...


class GPTStage:
    def __init__(self, model, sampler: Callable[[int], dict], *, tp_group, tracker: DeviceRNGStatesTracker,
                 seed: int, pp_stage: int, tp_rank: int, is_first: bool, is_last: bool,
                 device: torch.device | str = "cpu", loss_scale: Callable[[], float] | None = None,
                 cross_entropy: Callable = vocab_parallel_cross_entropy,
                 before_backward: Callable[[float], None] | None = None,
                 meter: ForwardMeter | None = None, loss_grid: float | None = None):
        """`loss_scale`: fp16's current loss scale, multiplied into the loss before backward;
        `cross_entropy(logits, labels, tp_group)`: the per-token loss over vocabulary shards;
        `before_backward(scale)`: before each backward, with that loss scale (MoE's auxiliary
        losses take their gradient scale from it); `meter`: what the model records in a
        microbatch's forward and backward, kept per id (none for a filler) until the schedule
        takes it; `loss_grid`: the loss sum's value is rounded to a multiple of it (float64: sums
        of such values are exact in any order), its gradient unchanged."""
        self.loss_grid = loss_grid
        self.before_backward = before_backward
        self.meter = meter
        self._measures: dict[int, torch.Tensor] = {}
        self.model = model
        self.device = torch.device(device)
        self.loss_scale = loss_scale
        self.cross_entropy = cross_entropy
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
        filler = microbatch_id < 0
        sample = ~microbatch_id if filler else microbatch_id
        seed_microbatch(self.tracker, self.seed, sample, self.pp_stage, self.tp_rank)
        batch = self.sampler(sample)
        # counted on the host copy: reading it back from the GPU would stall the pipeline
        self._token_counts[microbatch_id] = 0 if filler else int(batch["loss_mask"].sum().item())
        batch = {k: v.to(self.device, non_blocking=True) for k, v in batch.items()}
        if not self.is_first:
            self.model.set_input_tensor(input_tensor)
        if self.meter is not None:
            self.meter.start()
        output = self.model(
            batch["tokens"] if self.is_first else None,
            batch["position_ids"] if self.is_first else None,
            batch.get("attention_mask"),  # None: plain causal (SDPA's is_causal)
        )
        if self.meter is not None and not filler:
            self._measures[microbatch_id] = self.meter.take()
        if not self.is_last:
            return output
        token_loss = self.cross_entropy(output, batch["labels"], self.tp_group)
        loss = masked_loss_sum(token_loss, batch["loss_mask"])
        if self.loss_grid is not None:
            loss = on_grid(loss, self.loss_grid)
        return loss * 0.0 if filler else loss

    def backward(self, microbatch_id: int, input_tensor: torch.Tensor | None,
                 output: torch.Tensor, output_grad: torch.Tensor | None
                 ) -> torch.Tensor | None:
        scale = 1.0 if self.loss_scale is None else self.loss_scale()
        if self.before_backward is not None:  # a filler's auxiliary losses weigh nothing
            self.before_backward(0.0 if microbatch_id < 0 else scale)
        if self.meter is not None:  # a recomputed forward (--recompute-modules moe) records
            self.meter.start()     # in the backward: it belongs to this microbatch too
        if self.is_last:
            torch.autograd.backward(output * scale if scale != 1.0 else output)
        else:
            torch.autograd.backward(output, grad_tensors=output_grad)
        if self.meter is not None and microbatch_id >= 0:
            self._measures[microbatch_id] = self._measures[microbatch_id] + self.meter.take()
        return None if input_tensor is None else input_tensor.grad

    def tokens(self, microbatch_id: int) -> int:
        return self._token_counts.pop(microbatch_id)

    def measured(self, microbatch_id: int) -> torch.Tensor | None:
        return self._measures.pop(microbatch_id, None)
