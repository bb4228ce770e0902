"""--use-distributed-optimizer with --num-distributed-optimizer-instances K (Megatron's flags): fp32
main params and Adam moments sharded over the replicas of an instance, and re-sharded in-step when
replicas die or join.

The DP replicas form K instances of S = DP / K consecutive replicas (`optimizer/shards.py` says
who holds what). As in Megatron, each bucket of the gradient buffer's flat layout (`FlatLayout`,
padded to a multiple of S, the tied embedding in a bucket of its own so both pipeline ends shard
it alike) is split evenly over the instance: a rank keeps main params and moments for its range of
every bucket. While every replica is live the gradient buffer reduce-scatters each bucket into
those ranges and sums them across instances (`GradBuffer`'s `Scatter`); after a loss the
instances split buckets unevenly, and every rank takes the whole all-reduced gradient instead.
Each rank steps its ranges; then the instance all-gathers the weights, bucket by bucket (with
--overlap-param-gather the step only starts them: `weight_gather.py`; with Megatron-FSDP's sharded
parameters each module gathers its own when it runs: `sharded_parameters.py`). Adam is
elementwise, so given the same gradients the weights are bitwise those of the unsharded optimizer.

When the live replicas change (`reshard`, called with every rebuild of the groups), each live rank
takes its new ranges: what it lacks comes point to point from a live rank that holds it -- from
its own instance's survivors, or from another instance for the ranges that died. A rank keeps its
old ranges until it has the whole new ones, so a failure during the move leaves every rank holding
valid ranges and the next attempt plans from there. With expert parallelism each expert bucket is
sharded apart, over the instance's holders of those experts (`optimizer/shards.py`).

Checkpoints keep the unsharded format: `state_dict()` gathers the instance's shards (every member
of the instance must call it), `load_state_dict()` takes its ranges, so any K loads any checkpoint.
"""
from __future__ import annotations

import logging
import math
import time
from typing import Callable, Sequence

import torch
import torch.distributed as dist

from megatron.training.optimizer import LossScaler, is_counted
from megatron.training.optimizer.distributed.moves import (keep_own, local_bases, move_pieces,
                                                           plan_domain)
from megatron.training.optimizer.shards import ShardDomain, Sharding, ShardLost, bucket_ranges
from megatron.training.optimizer.sums import fixed_point_norm, instance_sum, squares, zeros
from megatron.training.optimizer.distributed.sharded_parameters import (ShardedParameters,
                                                                       ShardingRules)
from megatron.training.optimizer.distributed.weight_gather import WeightGather
from recover_patches.recovery.grad_buffer import FlatLayout, is_expert
from recover_patches.recovery.iteration import TooFewReplicas

logger = logging.getLogger(__name__)

_MOMENTS = ("exp_avg", "exp_avg_sq")


class ShardedAdamW:
    """MainParamsAdamW's interface over this rank's range of each bucket of the flat space."""

    def __init__(self, groups: list[dict], *, layout: FlatLayout, shard: int, shards: int,
                 instance_group, lr: float, betas: tuple[float, float], eps: float,
                 weight_decay: float, scaler: LossScaler | None = None,
                 experts: Sharding | None = None,
                 sharded: ShardingRules | None = None):
        """`shard` of `shards` in `instance_group`: the dense buckets' sharding; `experts`: the
        expert buckets' (expert parallelism), over the instance's holders of the same experts.
        `sharded` (Megatron-FSDP): the weights live only as this rank's chunks between uses, but
        for the parameters its rules keep whole (`sharded_parameters.py`)."""
        self.scaler, self.instance_group = scaler, instance_group
        self.model_params: list[torch.Tensor] = [p for g in groups for p in g["params"]]
        self.main_params = self.model_params  # what --log-params-norm and faults read: whole
        self.layout, self.offsets = layout, layout.offsets
        self._sharded = sharded is not None  # the weights are freed: main params of their own
        self.copies = self._sharded or any(p.dtype != torch.float32 for p in self.model_params)
        self._groups_params = [list(g["params"]) for g in groups]
        self._groups_hyper = [{k: v for k, v in g.items() if k != "params"} for g in groups]
        self._lr, self._betas, self._eps, self._weight_decay = lr, betas, eps, weight_decay
        self._gather = WeightGather(self.model_params, layout) if sharded is None \
            else ShardedParameters(self.model_params, layout, sharded)
        self._bucket = self._gather.bucket_of  # the bucket of each parameter
        experts_in = {self._bucket[i] for i, p in enumerate(self.model_params) if is_expert(p)}
        self._is_expert = [b in experts_in for b in range(len(layout.buckets))]
        assert experts is not None or not experts_in, "expert buckets are sharded apart"
        self._experts_instance = None if experts is None else experts.instance
        # dense weights: the unit's other replicas hold copies, the first counts their norm
        self._counts_dense = not any(getattr(p, "unit_duplicate", False) for p in self.model_params)
        both = (Sharding(shard, shards, instance_group), experts or Sharding(0, 1, None))
        self._bucket_shards = [both[e].shards for e in self._is_expert]
        ranges = [bucket_ranges([bucket], both[e].shard, both[e].shards)[0]
                  for bucket, e in zip(layout.buckets, self._is_expert)]
        self._place(ranges, self._from_weights(ranges), None, 0)

    @property
    def _device(self) -> torch.device:
        """Where collectives' tensors live: NCCL takes only the GPU's (checkpoints load on CPU)."""
        return self.model_params[0].device

    @property
    def held_numel(self) -> int:
        return sum(hi - lo for lo, hi in self.ranges)

    def _pieces(self, tensors: Sequence[torch.Tensor], tp_rank: int
                ) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
        """This rank's pieces of the per-parameter `tensors` it counts: dense, experts."""
        dense: list[torch.Tensor] = []
        experts: list[torch.Tensor] = []
        for i, start, end, _ in self.pieces:
            p = self.model_params[i]
            if is_counted(p, tp_rank, once_per_unit=False):
                (experts if is_expert(p) else dense).append(tensors[i].reshape(-1)[start:end])
        return dense, experts

    def _from_weights(self, ranges: Sequence[tuple[int, int]]) -> torch.Tensor:
        bases = local_bases(ranges)
        flat = torch.empty(sum(hi - lo for lo, hi in ranges), dtype=torch.float32,
                           device=self._device)
        for p, b in zip(self.model_params, self._bucket):
            (lo, hi), o = ranges[b], self.offsets[p]
            a, z = max(lo, o), min(hi, o + p.numel())
            if a < z:
                flat[bases[b] + a - lo:bases[b] + z - lo].copy_(p.detach().view(-1)[a - o:z - o])
        return flat

    def _place(self, ranges: list[tuple[int, int]], main: torch.Tensor,
               moments: tuple[torch.Tensor, torch.Tensor] | None, step: int) -> None:
        """Hold `ranges` (one per bucket): fragments with `main`'s values (the ranges' fp32 values,
        concatenated; also written into the model's weights there), and Adam's moments and step if
        it has stepped. The hyperparameters the scheduler set on the previous inner optimizer
        carry over."""
        self.ranges, self._base = ranges, local_bases(ranges)
        # per parameter overlapping its bucket's range: (index in model_params, start, end in the
        # param, where `start` sits in the local tensors)
        self.pieces: list[tuple[int, int, int, int]] = []
        self.fragments: list[torch.nn.Parameter] = []
        fragment_groups, states, index = [], [], -1
        with torch.no_grad():
            for params, hyper in zip(self._groups_params, self._groups_hyper):
                fragments = []
                for p in params:
                    index += 1
                    b, o = self._bucket[index], self.offsets[p]
                    lo, hi = ranges[b]
                    a, z = max(lo, o), min(hi, o + p.numel())
                    if a >= z:
                        continue
                    at = self._base[b] + a - lo
                    values = main[at:at + z - a]
                    weights = p.detach().view(-1)[a - o:z - o]
                    weights.copy_(values)
                    # fp32: the fragment is a view, the step writes the model's weights in place
                    fragment = torch.nn.Parameter(weights if p.dtype == torch.float32
                                                  and not self._sharded else values,
                                                  requires_grad=False)
                    self.pieces.append((index, a - o, z - o, at))
                    self.fragments.append(fragment)
                    fragments.append(fragment)
                    if moments is not None:
                        states.append((fragment, {"step": torch.tensor(float(step)), **{
                            n: m[at:at + z - a] for n, m in zip(_MOMENTS, moments)}}))
                fragment_groups.append({**hyper, "params": fragments})
        previous = getattr(self, "inner", None)  # None while __init__ places the first ranges
        self.inner: torch.optim.AdamW = torch.optim.AdamW(
            fragment_groups, lr=self._lr, betas=self._betas, eps=self._eps,
            weight_decay=self._weight_decay)
        if previous is not None:
            for group, old in zip(self.inner.param_groups, previous.param_groups):
                group.update({k: v for k, v in old.items() if k != "params"})
        for fragment, state in states:
            self.inner.state[fragment] = state

    @property
    def param_groups(self) -> list[dict]:
        return self.inner.param_groups

    def step(self, grads: Sequence[torch.Tensor]) -> None:
        """`grads[i]`: the final fp32 gradient of `model_params[i]` (whole; only the slice is used).
        A PeerFailure can come only from the weights' all-gathers: the last step's, before
        anything changed, or this step's, after the ranges stepped."""
        if not self._sharded:  # the last step's weights land before this one writes its ranges
            self._gather.finish()
        for fragment, (i, start, end, _) in zip(self.fragments, self.pieces):
            fragment.grad = grads[i].view(-1)[start:end]
        self.inner.step()
        for fragment in self.fragments:
            fragment.grad = None
        self._gather.after_step(self._chunks(lambda f: f, self.model_params[0].dtype),
                                self._bucket_groups())

    def gather_weights(self) -> None:
        """Every range's updated weights to every member of the instance, bucket by bucket."""
        self._gather.start(self._chunks(lambda f: f, self.model_params[0].dtype),
                           self._bucket_groups())
        if not self._sharded:  # (sharded: each module's forward gathers its own)
            self._gather.finish()

    def finish_gather(self) -> None:
        """The weights in place before anything but a forward reads them."""
        self._gather.finish()

    def shards_gradients(self) -> bool:
        return True

    def watch_gathers(self, before: Callable[[], None], overlap_with: torch.nn.Module | None
                      ) -> None:
        self._gather.watch(before, overlap_with)

    def _bucket_groups(self) -> list:
        """Where each bucket's ranges gather: the instance, or the experts' holders in it."""
        return [self._experts_instance if e else self.instance_group for e in self._is_expert]

    def _chunks(self, of_fragment, dtype: torch.dtype):
        """Per bucket: this rank's chunk of a per-fragment tensor, padded to the instance's
        chunk size (a generator: one bucket's buffer at a time)."""
        local = self._flat(of_fragment, dtype)
        for b, ((s, e), (lo, hi)) in enumerate(zip(self.layout.buckets, self.ranges)):
            mine = torch.zeros(-(-(e - s) // self._bucket_shards[b]), dtype=dtype,
                               device=self._device)
            mine[:hi - lo].copy_(local[self._base[b]:self._base[b] + hi - lo])
            yield mine

    def _flat(self, of_fragment, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """A per-fragment tensor (a moment, a main param) as this rank's local tensor: its
        ranges' values, concatenated."""
        flat = torch.zeros(self.held_numel, dtype=dtype, device=self._device)
        for fragment, (_, start, end, at) in zip(self.fragments, self.pieces):
            flat[at:at + end - start].copy_(of_fragment(fragment))
        return flat

    def _whole(self, of_fragment) -> list[torch.Tensor]:
        """A per-fragment fp32 tensor gathered over the instance into whole per-param ones."""
        return self._gather.whole(self._chunks(of_fragment, torch.float32), self._bucket_groups())

    def reload_model_params(self) -> None:
        with torch.no_grad():
            for fragment, (i, start, end, _) in zip(self.fragments, self.pieces):
                fragment.copy_(self.model_params[i].view(-1)[start:end])

    def state_dict(self) -> dict:
        """MainParamsAdamW's (unsharded) state dict; a collective over the instance."""
        inner = self.inner.state_dict()
        state: dict = {}
        step = self._step_count()
        if step > 0:  # every member calls every collective below, or none
            moments = {name: self._whole(lambda f, n=name: self.inner.state[f][n])
                       for name in _MOMENTS}
            for i in range(len(self.model_params)):
                state[i] = {"step": torch.tensor(step), **{n: moments[n][i] for n in _MOMENTS}}
        index, groups = 0, []
        for hyper, params in zip(inner["param_groups"], self._groups_params):
            groups.append({**hyper, "params": list(range(index, index + len(params)))})
            index += len(params)
        mains = self._whole(lambda f: f) if self.copies else []
        result = {"optimizer": {"state": state, "param_groups": groups},
                  "fp32_from_fp16_params": [m for m, p in zip(mains, self.model_params)
                                            if p.dtype != torch.float32]}
        if self.scaler is not None:
            result["grad_scaler"] = self.scaler.state_dict()
        return result

    def _step_count(self) -> float:
        """Adam's step, the same on every fragment (0: not started); a rank with no fragment
        learns it."""
        mine = max((float(s["step"]) for s in self.inner.state.values()), default=0.0)
        step = torch.tensor([mine], device=self._device)
        if self.instance_group is not None and self.instance_group.size() > 1:
            dist.all_reduce(step, op=dist.ReduceOp.MAX, group=self.instance_group)
        return float(step.item())

    def load_state_dict(self, state: dict) -> None:
        """Take this rank's slice of an unsharded state dict (any K, or none, wrote it)."""
        if "optimizer" not in state:
            state = {"optimizer": state, "fp32_from_fp16_params": []}
        saved = state["optimizer"]
        for group, hyper in zip(self.inner.param_groups, saved["param_groups"]):
            group.update({k: v for k, v in hyper.items() if k != "params"})
        halves = iter(state["fp32_from_fp16_params"])
        mains = [next(halves) if p.dtype != torch.float32 else p for p in self.model_params]
        if self.scaler is not None and "grad_scaler" in state:
            self.scaler.load_state_dict(state["grad_scaler"])
        self.inner.state.clear()
        with torch.no_grad():
            for fragment, (i, start, end, _) in zip(self.fragments, self.pieces):
                fragment.copy_(mains[i].view(-1)[start:end])
                if self.copies:
                    self.model_params[i].view(-1)[start:end].copy_(fragment)
                saved_state = saved["state"].get(i, saved["state"].get(str(i)))
                if saved_state is not None:
                    self.inner.state[fragment] = {
                        "step": torch.tensor(float(saved_state["step"])),
                        **{n: saved_state[n].reshape(-1)[start:end].to(fragment.device, torch.float32,
                                                                      copy=True) for n in _MOMENTS}}
        if self.copies:  # the other ranges' weights: from their owners
            self.gather_weights()

    # -- gradients reduce-scattered into the ranges (every replica live) ------------------------
    def grad_norm(self, grads: Sequence[torch.Tensor], replica_group, tp_rank: int,
                  exact: bool = False) -> float:
        """The global gradient norm from this rank's ranges only: the instance's shares are
        gathered and summed in shard order, so every instance computes the same bits (their
        replicas must take the same step), then summed over the replica's TP x PP ranks.
        `exact`: in fixed point, the same bits for any instance size (`fixed_point_norm`)."""
        if exact:
            dense, experts = self._pieces(grads, tp_rank)
            return fixed_point_norm([(dense, self.instance_group, self._counts_dense),
                                     (experts, self._experts_instance, True)], replica_group,
                                    self._device)
        total = self._sharded_sum(grads, tp_rank, squares)
        if replica_group is not None and replica_group.size() > 1:
            dist.all_reduce(total, group=replica_group)
        value = float(total)
        return math.sqrt(value) if math.isfinite(value) else value

    def count_zeros(self, grads: Sequence[torch.Tensor], replica_group, tp_rank: int) -> float:
        """--log-num-zeros-in-grad from this rank's ranges (integers: any order sums exactly)."""
        total = self._sharded_sum(grads, tp_rank, zeros)
        if replica_group is not None and replica_group.size() > 1:
            dist.all_reduce(total, group=replica_group)
        return float(total)

    def _sharded_sum(self, tensors: Sequence[torch.Tensor], tp_rank: int,
                     measure: Callable[[list[torch.Tensor], torch.device], torch.Tensor]
                     ) -> torch.Tensor:
        """`measure` of this rank's pieces of the per-parameter `tensors` it counts, summed over
        the instance. With expert parallelism the replica group spans the unit: the dense sum is
        counted by the unit's first replica, the experts' (summed over their holders) by each."""
        dense, experts = self._pieces(tensors, tp_rank)
        total = instance_sum(measure(dense, self._device), self.instance_group)
        if not self._counts_dense:
            total.zero_()
        if self._experts_instance is not None:
            total += instance_sum(measure(experts, self._device), self._experts_instance)
        return total

    # -- the replicas changed -------------------------------------------------------------------
    def reshard(self, dense: ShardDomain, experts: ShardDomain | None = None) -> int:
        """Take this rank's ranges for the live holders of the dense and (EP > 1) the expert
        buckets (`ParallelGroups.optimizer_domains`), then gather the instance's weights. A
        collective over each domain's group: its ranks in holder order, each taking part. Pieces
        move point to point from the lowest rank holding them; a rank's old ranges stay until
        the whole new ones arrived. TooFewReplicas if some piece died with every rank that held
        it. Returns the bytes this rank received."""
        start = time.perf_counter()
        self._gather.reset()  # the weights are gathered afresh at the end
        assert experts is not None or not any(self._is_expert), "the experts' holders"
        here = max((int(s["step"]) for s in self.inner.state.values()), default=0)
        ranges, shards, old = list(self.ranges), list(self._bucket_shards), self.ranges
        moves, step, holds = [], 0, False
        for domain, kind in ((dense, False), (experts, True)):
            if domain is None:
                continue
            buckets = [b for b, e in enumerate(self._is_expert) if e == kind]
            try:
                plans, newest, valid = plan_domain(domain, self.layout.buckets, buckets,
                                                   self.ranges, here, self._device, ranges, shards)
            except ShardLost as lost:
                raise TooFewReplicas(
                    f"the distributed optimizer's state {lost} of this stage's "
                    f"{'experts' if kind else 'dense weights'} was held only by lost replicas "
                    f"(live holders: {sorted(domain.holders)}); "
                    "--num-distributed-optimizer-instances K keeps K copies") from None
            moves.append((plans, domain.group))
            step, holds = max(step, newest), holds or valid
        bases, started = local_bases(ranges), step > 0
        fresh = [torch.zeros(sum(hi - lo for lo, hi in ranges), dtype=torch.float32,
                             device=self._device) for _ in range(1 + 2 * started)]
        inner, mine = self.inner, []
        if holds:  # valid: main params, then moments
            mine = [self._flat(lambda f: f)] + [
                self._flat(lambda f, n=n: inner.state[f][n]) for n in _MOMENTS if started]
            keep_own(fresh, mine, ranges, bases, old, self._base)
        received = 4 * len(fresh) * sum(
            move_pieces(plans, 0 if group is None else group.rank(), mine, fresh, ranges, bases,
                        old, self._base, group) for plans, group in moves)
        self._bucket_shards = shards
        self._place(ranges, fresh[0], (fresh[1], fresh[2]) if started else None, step)
        self.gather_weights()
        if received:
            logger.info(f"distributed optimizer: {self.held_numel} parameters' state held for "
                        f"live holders {list(dense.holders)}"
                        f"{'' if experts is None else f' (experts: units {list(experts.holders)})'}"
                        f", {received / 2**20:.2f} MiB received, "
                        f"{(time.perf_counter() - start) * 1000:.0f} ms")
        return received

    def forget(self) -> None:
        """This rank's replica broke: whatever it held is out of date by the time it rejoins."""
        self._gather.reset()
        self._place([(s, s) for s, _ in self.layout.buckets], torch.empty(0, device=self._device),
                    None, 0)

    def replicated_state_dict(self) -> dict:
        """What every rank holds whole (a joining replica's copy; the shards come by `reshard`)."""
        state: dict = {"param_groups": [{k: v for k, v in g.items() if k != "params"}
                                        for g in self.inner.param_groups]}
        if self.scaler is not None:
            state["grad_scaler"] = self.scaler.state_dict()
        return state

    def load_replicated_state_dict(self, state: dict) -> None:
        for group, hyper in zip(self.param_groups, state["param_groups"]):
            group.update(hyper)
        if self.scaler is not None and "grad_scaler" in state:
            self.scaler.load_state_dict(state["grad_scaler"])
