"""Megatron-FSDP's sharded parameters (ZeRO-3, `--data-parallel-sharding-strategy
optim_grads_params`): between uses a rank holds only its chunk of each bucket -- the distributed
optimizer's range, in the model's dtype -- and each module's parameters are gathered over the
shard group when its forward starts, freed when it ends, gathered again when its backward starts
and freed once its gradients are in. A module here is a transformer layer whole, or a module with
parameters outside the layers (`shard_units`); the gradient layout gives each its own bucket
(`optimizer.setup.flat_layout_for`), so a gather brings one module.

Every member of a shard group runs the same modules in the same order (the same number of
microbatches: `step.parts.pad_for_unit`), so their gathers pair up. A failed gather is a
PeerFailure where it happens: the group is broken and leaves the iteration as one unit.

A parameter read outside its own module's forward (the tied embedding, which the output layer
also reads) stays whole. So do the weights whenever something outside a forward asks for them
(`finish`: a save, a join's donor, --log-params-norm); the next forward frees them again. Loading
a state dict into the model (a checkpoint, a join) first gives every parameter its storage back."""
from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass

import torch

from recover_patches.collectives import PeerFailure
from recover_patches.recovery.grad_buffer import FlatLayout
from megatron.training.optimizer.distributed.weight_gather import WeightGather


def _free(param: torch.Tensor) -> None:
    # (.data: an alias autograd does not track, so a weight saved for backward keeps its version)
    param.data.untyped_storage().resize_(0)


def _allocate(param: torch.Tensor) -> None:
    param.data.untyped_storage().resize_(param.numel() * param.element_size())


def _owns_its_storage(param: torch.Tensor) -> bool:
    storage = param.untyped_storage()
    return param.storage_offset() == 0 and param.is_contiguous() and \
        storage.nbytes() == param.numel() * param.element_size()


@dataclass(frozen=True)
class ShardingRules:
    """Which parameters stay whole (read outside their module), which modules gather whole."""
    keep_whole: Callable[[torch.Tensor], bool]
    is_layer: Callable[[torch.nn.Module], bool] = lambda module: False


def shard_units(model: torch.nn.Module, is_layer: Callable[[torch.nn.Module], bool]
                ) -> list[tuple[torch.nn.Module, list[torch.Tensor]]]:
    """What gathers as one (Megatron-FSDP's units), in the model's order, with its parameters:
    each module `is_layer` names (a transformer layer) with every parameter under it, and each
    other module outside those with the parameters of its own (embeddings, final norm, output
    layer)."""
    units: list[tuple[torch.nn.Module, list[torch.Tensor]]] = []
    taken: set[torch.Tensor] = set()
    for module in model.modules():  # (a layer comes before its submodules: they find all taken)
        params: list[torch.Tensor] = [p for p in module.parameters(recurse=is_layer(module))
                                      if p not in taken]
        if params:
            units.append((module, params))
            taken.update(params)
    return units


class ShardedParameters(WeightGather):
    """WeightGather whose step keeps each bucket's chunk instead of gathering it: the bucket is
    gathered on use (`finish_bucket`) and freed after (`release`)."""

    def __init__(self, model_params: list[torch.Tensor], layout: FlatLayout, rules: ShardingRules):
        super().__init__(model_params, layout)
        self._is_layer, keep_whole = rules.is_layer, rules.keep_whole
        buckets = range(len(layout.buckets))
        # whole for good: a bucket with a parameter read outside its module, or one sharing its
        # storage with another tensor (freeing it would free that too)
        self._kept = {b for b in buckets if any(
            keep_whole(model_params[i]) or not _owns_its_storage(model_params[i])
            for i in self._bucket_params[b])}
        self._held: dict[int, tuple[torch.Tensor, object]] = {}  # bucket: (chunk, group)
        self._freed: set[int] = set()
        self._waiting = [0] * len(layout.buckets)  # gradients still to come in this backward

    def after_step(self, chunks: Iterable[torch.Tensor], groups: Sequence) -> None:
        self._before()
        self.start(chunks, groups)

    def start(self, chunks: Iterable[torch.Tensor], groups: Sequence) -> None:
        """Hold the step's chunks and free the weights; the kept buckets gather at once."""
        for b, mine in enumerate(chunks):
            self._held[b] = (mine, groups[b])
            self._freed.discard(b)  # (its values are out of date: gathered again below or later)
            if b in self._kept:
                self._gather_now(b)
            else:
                self._free_bucket(b)

    def finish_bucket(self, b: int) -> None:
        if b in self._freed:
            self._gather_now(b)

    def _gather_now(self, b: int) -> None:
        if self._failure is not None:
            raise self._failure
        mine, group = self._held[b]
        try:
            _, whole = self.all_gather(mine, group)
        except PeerFailure as err:
            self._failure = err
            raise
        s = self.layout.buckets[b][0]
        with torch.no_grad():
            for i in self._bucket_params[b]:
                p, o = self.model_params[i], self.layout.offsets[self.model_params[i]]
                if b in self._freed:
                    _allocate(p)
                p.data.view(-1).copy_(whole[o - s:o - s + p.numel()])
        self._freed.discard(b)

    def _free_bucket(self, b: int) -> None:
        for i in self._bucket_params[b]:
            _free(self.model_params[i])
        self._freed.add(b)

    def release(self, buckets: Iterable[int]) -> None:
        """Free gathered buckets (not the kept ones, nor any before a step gave them chunks)."""
        for b in buckets:
            if b in self._held and b not in self._kept and b not in self._freed:
                self._free_bucket(b)

    def reset(self) -> None:
        """Every parameter whole again (storage back, values as they were or to be written: a
        re-shard writes them, a load overwrites them); no chunks held."""
        super().reset()
        for b in sorted(self._freed):
            for i in self._bucket_params[b]:
                _allocate(self.model_params[i])
        self._freed.clear()
        self._held.clear()

    def watch(self, before: Callable[[], None], overlap_with: torch.nn.Module | None) -> None:
        """Gather and free around every module's forward and backward (`overlap_with`: the
        model, always given here)."""
        self._before = before
        assert overlap_with is not None, "sharded parameters are gathered by the model's hooks"
        bucket_of = dict(zip(self.model_params, self.bucket_of))
        for module, params in shard_units(overlap_with, self._is_layer):
            self._hook_module(module, sorted({bucket_of[p] for p in params if p in bucket_of}))
            # on each unit, not the root: a load may start at a model chunk (a checkpoint's);
            # the first unit it reaches comes before any parameter is written
            module.register_load_state_dict_pre_hook(lambda *_: self.reset())
        for p in self.model_params:
            if p.requires_grad:
                p.register_post_accumulate_grad_hook(
                    lambda param, b=bucket_of[p]: self._gradient_in(b))

    def _hook_module(self, module: torch.nn.Module, buckets: list[int]) -> None:
        def before_backward(grad: torch.Tensor) -> None:
            self.finish(buckets)
            for b in buckets:
                self._waiting[b] = sum(self.model_params[i].requires_grad
                                       for i in self._bucket_params[b])

        def after_forward(_module, _args, output) -> None:
            for tensor in output if isinstance(output, tuple) else (output,):
                # (not on a returned parameter, a leaf: `read_outside_their_unit` keeps it)
                if isinstance(tensor, torch.Tensor) and tensor.grad_fn is not None:
                    tensor.register_hook(before_backward)
            self.release(buckets)
        module.register_forward_pre_hook(lambda _module, _args: self.finish(buckets))
        module.register_forward_hook(after_forward)

    def _gradient_in(self, b: int) -> None:
        if self._waiting[b] > 0:
            self._waiting[b] -= 1
            if self._waiting[b] == 0:
                self.release([b])
