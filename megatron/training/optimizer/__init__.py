"""AdamW on fp32 main params over megatron-core's parameter groups, fp16 loss scaling,
megatron-core's LR/WD scheduler, and gradient finalisation that is correct across TP and PP
(tied-embedding and sequence-parallel sync, global-norm clipping, the overflow check).

megatron-core's `get_megatron_optimizer`, its mixed-precision optimizer and its grad scalers
allocate on CUDA; these small equivalents keep Megatron's semantics and run anywhere.
"""
from __future__ import annotations

import math
from typing import Callable, Protocol, Sequence

import torch
import torch.distributed as dist

from megatron.training.optimizer.shards import ShardDomain
from megatron.training.optimizer.sums import fixed_point_norm
from recover_patches.recovery.grad_buffer import FlatLayout


class Optimizer(Protocol):
    """What the step, checkpoints, joins and recovery ask of an optimizer. Both implement it:
    `MainParamsAdamW` (every replica holds all of it; the sharding methods are no-ops) and
    `ShardedAdamW` (--use-distributed-optimizer)."""
    scaler: LossScaler | None
    model_params: list[torch.Tensor]  # the order gradients come in
    main_params: list[torch.Tensor]  # fp32 (the model's own in fp32 training)

    @property
    def layout(self) -> FlatLayout | None:
        """The gradient buffer's layout (None: one made from the flags)."""

    @property
    def param_groups(self) -> list[dict]: ...

    def step(self, grads: Sequence[torch.Tensor]) -> None: ...

    def shards_gradients(self) -> bool:
        """Takes the gradients reduce-scattered into its ranges while every replica is live."""

    def grad_norm(self, grads: Sequence[torch.Tensor], replica_group, tp_rank: int,
                  exact: bool = False) -> float:
        """The global norm of `grads` (with sharded gradients: of this rank's ranges, summed);
        `exact`: in fixed point, the same bits however the elements are split over ranks."""

    def count_zeros(self, grads: Sequence[torch.Tensor], replica_group, tp_rank: int) -> float: ...

    def watch_gathers(self, before: Callable[[], None], overlap_with: torch.nn.Module | None
                      ) -> None:
        """`before` runs before each weight all-gather; with a model, the gathers overlap with
        its next forward (--overlap-param-gather)."""

    def finish_gather(self) -> None:
        """The weights in place before anything but a forward reads them (PeerFailure if a
        gather failed)."""

    def reshard(self, dense: ShardDomain, experts: ShardDomain | None = None) -> int:
        """Take this rank's part for the live holders (`ParallelGroups.optimizer_domains`: of
        the dense weights' shards and, with expert parallelism, the experts'); the bytes
        received."""

    def forget(self) -> None:
        """This rank's replica broke: what it holds of sharded state is out of date."""

    def reload_model_params(self) -> None: ...

    def state_dict(self) -> dict: ...

    def load_state_dict(self, state: dict) -> None: ...

    def replicated_state_dict(self) -> dict: ...

    def load_replicated_state_dict(self, state: dict) -> None: ...


class MainParamsAdamW:
    """AdamW over fp32 main params (Megatron's Float16OptimizerWithFloat16Params). With fp32
    training the main params *are* the model's; with bf16/fp16 they are fp32 copies and the model's
    half-precision params are refreshed from them after each step. Gradients come in per step as
    views of the reduced fp32 buffer: nothing is copied."""

    def __init__(self, groups: list[dict], *, lr: float, betas: tuple[float, float], eps: float,
                 weight_decay: float, scaler: "LossScaler | None" = None,
                 layout: FlatLayout | None = None):
        self.scaler = scaler  # fp16 only; checkpointed with the optimizer, as in Megatron
        self.layout = layout
        self.model_params: list[torch.Tensor] = []
        self.main_params: list[torch.Tensor] = []
        main_groups = []
        for group in groups:
            mains = []
            for p in group["params"]:
                main = p if p.dtype == torch.float32 else torch.nn.Parameter(
                    p.detach().float(), requires_grad=False)
                self.model_params.append(p)
                self.main_params.append(main)
                mains.append(main)
            main_groups.append({**group, "params": mains})
        self.inner = torch.optim.AdamW(main_groups, lr=lr, betas=betas, eps=eps,
                                       weight_decay=weight_decay)
        self.copies = any(m is not p for m, p in zip(self.main_params, self.model_params))

    @property
    def param_groups(self) -> list[dict]:
        return self.inner.param_groups

    def step(self, grads: Sequence[torch.Tensor]) -> None:
        """`grads[i]` is the final fp32 gradient of `model_params[i]`."""
        for main, grad in zip(self.main_params, grads):
            main.grad = grad
        self.inner.step()
        for main in self.main_params:
            main.grad = None  # the views belong to the gradient buffer, not to autograd
        if self.copies:
            with torch.no_grad():
                torch._foreach_copy_(self.model_params, self.main_params)

    def shards_gradients(self) -> bool:
        return False

    def grad_norm(self, grads: Sequence[torch.Tensor], replica_group, tp_rank: int,
                  exact: bool = False) -> float:
        if exact:
            return fixed_point_norm([(counted_once(self.model_params, grads, tp_rank), None, True)],
                                    replica_group, grads[0].device)
        return global_grad_norm(self.model_params, grads, replica_group, tp_rank)

    def count_zeros(self, grads: Sequence[torch.Tensor], replica_group, tp_rank: int) -> float:
        return count_zeros(self.model_params, grads, replica_group, tp_rank)

    def watch_gathers(self, before: Callable[[], None], overlap_with: torch.nn.Module | None
                      ) -> None:
        pass  # nothing is gathered: every replica steps all of it

    def finish_gather(self) -> None:
        pass

    def reshard(self, dense: ShardDomain, experts: ShardDomain | None = None) -> int:
        return 0

    def forget(self) -> None:
        pass

    def reload_model_params(self) -> None:
        """The model's weights were replaced (a checkpoint loaded without its optimizer state):
        take the fp32 main params from them, or the next step would bring the old ones back."""
        with torch.no_grad():
            for m, p in zip(self.main_params, self.model_params):
                if m is not p:
                    m.copy_(p)

    def state_dict(self) -> dict:
        """Megatron's keys: the inner optimizer, plus the fp32 copies of half-precision params."""
        state = {"optimizer": self.inner.state_dict(),
                 "fp32_from_fp16_params": [m for m, p in zip(self.main_params, self.model_params)
                                           if m is not p]}
        if self.scaler is not None:
            state["grad_scaler"] = self.scaler.state_dict()
        return state

    def load_state_dict(self, state: dict) -> None:
        if "optimizer" not in state:  # written before main params existed: a plain AdamW's
            state = {"optimizer": state, "fp32_from_fp16_params": []}
        self.inner.load_state_dict(state["optimizer"])
        if self.scaler is not None and "grad_scaler" in state:
            self.scaler.load_state_dict(state["grad_scaler"])
        saved = iter(state["fp32_from_fp16_params"])
        with torch.no_grad():
            for m, p in zip(self.main_params, self.model_params):
                if m is not p:
                    m.copy_(next(saved))
                    p.copy_(m)


    def replicated_state_dict(self) -> dict:
        """What a joining replica takes from a live one: all of it (nothing is sharded)."""
        return self.state_dict()

    def load_replicated_state_dict(self, state: dict) -> None:
        self.load_state_dict(state)


class LossScaler:
    """fp16 loss scaling with Megatron's rules (megatron-core's grad scalers live on CUDA).
    Dynamic: after `hysteresis` overflowing iterations the scale halves (not below `min_scale`);
    after `window` clean iterations in a row it doubles. Static (`--loss-scale`): never changes.
    Every rank feeds it the same overflow decision, so every rank holds the same scale."""

    def __init__(self, initial: float, *, dynamic: bool, min_scale: float = 1.0,
                 window: float = 1000, hysteresis: int = 2):
        self.scale, self.dynamic = float(initial), dynamic
        self.min_scale, self.window, self.hysteresis = min_scale, window, hysteresis
        self._clean, self._left = 0, hysteresis

    def update(self, overflow: bool) -> None:
        if not self.dynamic:
            return
        if overflow:
            self._clean = 0
            self._left -= 1
            if self._left <= 0:
                self.scale = max(self.scale / 2.0, self.min_scale)
            return
        self._clean += 1
        if self._clean == self.window:
            self._clean, self._left = 0, self.hysteresis
            self.scale *= 2.0

    def state_dict(self) -> dict:
        return {"scale": self.scale, "growth_tracker": self._clean, "hysteresis_tracker": self._left}

    def load_state_dict(self, state: dict) -> None:
        self.scale, self._clean, self._left = (float(state["scale"]), int(state["growth_tracker"]),
                                               int(state["hysteresis_tracker"]))


def sync_tied_embedding_grads(params: Sequence[torch.Tensor], grads: Sequence[torch.Tensor],
                              embedding_group) -> None:
    """With PP > 1 the first and last stage each hold a copy of the tied word embeddings; their
    gradients are summed so both copies take the same step."""
    if embedding_group is None or embedding_group.size() < 2:
        return
    for p, g in zip(params, grads):
        if getattr(p, "tied_embedding_copy", False):
            dist.all_reduce(g, group=embedding_group)


def tp_partial_grads(model: torch.nn.Module, params: Sequence[torch.Tensor]) -> list[bool]:
    """For each of `params`: does each TP rank hold only a part of its gradient? Picked as
    megatron-core's finalize_model_grads picks them: the parameters flagged `sequence_parallel`
    (norms and row-parallel biases under sequence parallelism; ReCoVer's per-head q/k norms
    whenever TP > 1) and the q/k norms by name, since transformer-engine flags its q/k norms
    only under sequence parallelism, though each sees only its TP rank's heads. Multi-latent
    attention's latent norms (`latent_norm`: whole on every TP rank) are not per head, whatever
    megatron-core names them."""
    names = {id(p): name for name, p in model.named_parameters()}
    return [getattr(p, "sequence_parallel", False)
            or (any(norm in names.get(id(p), "") for norm in ("q_layernorm", "k_layernorm"))
                and not getattr(p, "latent_norm", False))
            for p in params]


def sync_sequence_parallel_grads(grads: Sequence[torch.Tensor], partial: Sequence[bool],
                                 tp_group) -> None:
    """The gradients each TP rank holds only a part of (`tp_partial_grads`: a sequence shard's
    or its heads' part) summed over TP, all in one collective."""
    shared = [g for g, part in zip(grads, partial, strict=True) if part]
    if not shared or tp_group is None or tp_group.size() < 2:
        return
    flat = torch.cat([g.reshape(-1) for g in shared])
    dist.all_reduce(flat, group=tp_group)
    for g, part in zip(shared, flat.split([g.numel() for g in shared])):
        g.copy_(part.view_as(g))


def is_counted(p: torch.Tensor, tp_rank: int, once_per_unit: bool = True) -> bool:
    """Whether this rank counts `p` in norms, so that the replica counts each parameter once:
    TP-replicated ones only on TP rank 0, the last stage's tied-embedding copy not at all, and
    with expert parallelism (norms over the unit) dense ones only on its first replica
    (unless not `once_per_unit`: the distributed optimizer's shards, which split them)."""
    return not getattr(p, "tied_embedding_is_duplicate", False) \
        and not (once_per_unit and getattr(p, "unit_duplicate", False)) \
        and (getattr(p, "tensor_model_parallel", False) or tp_rank == 0)


def counted_once(params: Sequence[torch.Tensor], tensors: Sequence[torch.Tensor],
                 tp_rank: int) -> list[torch.Tensor]:
    """The tensors (one per param) of the parameters this rank counts (`is_counted`)."""
    return [t for p, t in zip(params, tensors) if is_counted(p, tp_rank)]


def count_zeros(params: Sequence[torch.Tensor], grads: Sequence[torch.Tensor],
                model_parallel_group, tp_rank: int) -> float:
    """--log-num-zeros-in-grad: zero entries of the replica's gradient, each parameter once."""
    counted = counted_once(params, grads, tp_rank)
    device = grads[0].device if grads else torch.device("cpu")
    zeros = torch.tensor([float(sum(int((g == 0).sum()) for g in counted))], dtype=torch.float64,
                         device=device)
    if model_parallel_group is not None and model_parallel_group.size() > 1:
        dist.all_reduce(zeros, group=model_parallel_group)
    return float(zeros)


def grad_norm_squared_local(params: Sequence[torch.Tensor], grads: Sequence[torch.Tensor],
                            tp_rank: int) -> torch.Tensor:
    """This rank's share of the replica's squared gradient norm (`counted_once`)."""
    counted = counted_once(params, grads, tp_rank)
    if not counted:
        device = grads[0].device if grads else torch.device("cpu")
        return torch.zeros(1, dtype=torch.float64, device=device)
    norms = torch._foreach_norm(counted, 2.0)
    return torch.stack(norms).double().pow(2).sum().reshape(1)


def global_grad_norm(params: Sequence[torch.Tensor], grads: Sequence[torch.Tensor],
                     model_parallel_group, tp_rank: int) -> float:
    """The gradient norm over the replica's TP x PP ranks (inf or nan when any gradient is:
    the fp16 overflow check rides on this one collective). Gradients are identical on every
    replica after the DP reduction, so is the norm."""
    norm_sq = grad_norm_squared_local(params, grads, tp_rank)
    if model_parallel_group is not None and model_parallel_group.size() > 1:
        dist.all_reduce(norm_sq, group=model_parallel_group)
    value = float(norm_sq)  # one host read (each is a device sync on a GPU)
    return math.sqrt(value) if math.isfinite(value) else value


def clip_factor(norm: float, max_norm: float) -> float:
    """Scale that brings the global norm down to max_norm (1.0 when it already is, or clip off)."""
    if max_norm and max_norm > 0 and norm > max_norm:
        return max_norm / (norm + 1e-6)
    return 1.0
