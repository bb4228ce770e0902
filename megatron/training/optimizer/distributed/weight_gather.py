"""The distributed optimizer's weight all-gathers: after each step every rank's updated ranges go
to every member of its instance, bucket by bucket. With --overlap-param-gather the step only
starts them and each module's forward first waits for its parameters' buckets (Megatron's
overlap); anything else that reads the weights first calls `finish`. A failed wait is a
PeerFailure where it happens, and it stays failed -- every later wait raises it -- until `reset`
(the re-shard gathers afresh)."""
from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence

import torch
import torch.distributed as dist

from recover_patches.collectives import PeerFailure
from recover_patches.recovery.grad_buffer import FlatLayout


class WeightGather:
    """Each bucket gathers over the group its caller names (the optimizer's instance, or with
    expert parallelism the instance's holders of the same experts; they change when replicas die
    or join)."""

    def __init__(self, model_params: list[torch.Tensor], layout: FlatLayout):
        self.model_params, self.layout = model_params, layout
        # the bucket of each parameter, and the parameters of each bucket
        self.bucket_of = [next(b for b, (s, e) in enumerate(layout.buckets)
                               if s <= layout.offsets[p] < e) for p in model_params]
        self._bucket_params = [[i for i, c in enumerate(self.bucket_of) if c == b]
                               for b in range(len(layout.buckets))]
        self._before: Callable[[], None] = lambda: None  # fault injection point
        self._overlap = False  # --overlap-param-gather: a step only starts the all-gathers
        # by bucket: (the work, the gathered buffer, this rank's chunk, where it sits in it)
        self._pending: dict[int, tuple[dist.Work | None, torch.Tensor, torch.Tensor, int]] = {}
        self._failure: PeerFailure | None = None

    def watch(self, before: Callable[[], None], overlap_with: torch.nn.Module | None) -> None:
        """`before` runs before each step's gathers; with a model they overlap its forward."""
        self._before = before
        if overlap_with is not None:
            self._overlap = True
            self._wait_in_forward(overlap_with)

    def after_step(self, chunks: Iterable[torch.Tensor], groups: Sequence) -> None:
        """Gather the step's weights (`chunks`: this rank's chunk of each bucket, gathered over
        `groups[b]`); with overlap, only start."""
        self._before()
        self.start(chunks, groups)
        if not self._overlap:
            self.finish()

    def start(self, chunks: Iterable[torch.Tensor], groups: Sequence) -> None:
        for b, mine in enumerate(chunks):
            at = 0 if groups[b] is None else groups[b].rank() * mine.numel()
            self._pending[b] = (*self.all_gather(mine, groups[b], async_op=True), mine, at)

    def finish_bucket(self, b: int) -> None:
        """Wait for bucket b's all-gather, if one is under way, and take its weights."""
        if self._failure is not None:
            raise self._failure
        entry = self._pending.pop(b, None)
        if entry is None:
            return
        work, whole, mine, at = entry
        if work is not None:
            try:
                work.wait()
            except PeerFailure as err:
                self._failure = err
                raise
            # this rank's own range from what it sent, not from the gather's output: an aborted
            # gather (NCCL: its wait had returned) leaves that half-written, and with fp32 weights
            # the range is the optimizer's only copy of its main params, which a recovery keeps
            whole[at:at + mine.numel()].copy_(mine)
        s = self.layout.buckets[b][0]
        with torch.no_grad():
            for i in self._bucket_params[b]:
                p, o = self.model_params[i], self.layout.offsets[self.model_params[i]]
                p.view(-1).copy_(whole[o - s:o - s + p.numel()])

    def finish(self, buckets: Sequence[int] | None = None) -> None:
        """The buckets' weights in place (all: before anything but a forward reads them)."""
        for b in range(len(self.layout.buckets)) if buckets is None else buckets:
            self.finish_bucket(b)

    def reset(self) -> None:
        """Forget gathers under way and a failed one: the ranges are about to change."""
        self._pending.clear()
        self._failure = None

    @staticmethod
    def all_gather(mine: torch.Tensor, group,
                   async_op: bool = False) -> tuple[dist.Work | None, torch.Tensor]:
        """The group's chunks, in rank order: (the work still under way, or None; the buffer)."""
        size = 1 if group is None else group.size()
        if size == 1:
            return None, mine
        whole = torch.empty(size * mine.numel(), dtype=mine.dtype, device=mine.device)
        return dist.all_gather_single(whole, mine, group=group, async_op=async_op), whole

    def whole(self, chunks: Iterable[torch.Tensor], groups: Sequence) -> list[torch.Tensor]:
        """Per-parameter tensors from each bucket's chunks gathered over `groups[b]`."""
        result: list[torch.Tensor] = [torch.empty(0)] * len(self.model_params)
        for b, mine in enumerate(chunks):
            _, whole = self.all_gather(mine, groups[b])
            s = self.layout.buckets[b][0]
            for i in self._bucket_params[b]:
                p, o = self.model_params[i], self.layout.offsets[self.model_params[i]]
                result[i] = whole[o - s:o - s + p.numel()].view_as(p).clone()
        return result

    def _wait_in_forward(self, model: torch.nn.Module) -> None:
        bucket_of = dict(zip(self.model_params, self.bucket_of))
        for module in model.modules():
            buckets = sorted({bucket_of[p] for p in module.parameters(recurse=False)
                              if p in bucket_of})
            if buckets:
                module.register_forward_pre_hook(
                    lambda _module, _args, buckets=buckets: self.finish(buckets))
