"""--use-distributed-optimizer with --num-distributed-optimizer-instances K (Megatron's flags): fp32
main params and Adam moments sharded over the replicas of an instance, and re-sharded in-step when
replicas die or join.

The DP replicas form K instances of S = DP / K consecutive replicas (`optimizer_shards.py` says
who holds what). Every rank still receives the whole reduced gradient (ReCoVer's out-of-place
all-reduce, which also carries the commit bookkeeping), but keeps main params and moments only for
its slice of the flat parameter space (the gradient buffer's layout, `flat_offsets`). After its
step each rank all-gathers the other slices' updated weights from its instance. Adam is
elementwise, so the weights are bitwise those of the unsharded optimizer, and every instance holds
a whole copy of the optimizer state.

When the live replicas change (`reshard`, called with every rebuild of the groups), each live rank
takes its new slice: what it lacks comes point to point from a live rank that holds it -- from its
own instance's survivors, or from another instance for the slices that died. A rank keeps its old
slice until it has the whole new one, so a failure during the move leaves every rank holding some
valid range and the next attempt plans from there.

Not yet as the issue asks: the gradient is all-reduced, not reduce-scattered (2x the traffic of
Megatron's reduce-scatter for the gradients), and the all-gather is not overlapped
(--overlap-param-gather is refused).

Checkpoints keep the unsharded format: `state_dict()` gathers the instance's shards (every member
of the instance must call it), `load_state_dict()` takes its slice, so any K loads any checkpoint.
"""
from __future__ import annotations

from typing import Callable, Sequence

import torch
import torch.distributed as dist

from megatron.training.optimizer import LossScaler
from megatron.training.optimizer_shards import (ShardLost, instance_positions, plan_transfers,
                                                shard_range)
from recover_patches.recovery.iteration import TooFewReplicas

_MOMENTS = ("exp_avg", "exp_avg_sq")
# Elements per point-to-point message (64 MiB of fp32): each must finish within --recover-timeout.
_CHUNK = 1 << 24


class ShardedAdamW:
    """MainParamsAdamW's interface over this rank's slice [lo, hi) of the flat parameter space."""

    def __init__(self, groups: list[dict], *, offsets: dict[torch.Tensor, int], shard: int,
                 shards: int, instance_group, lr: float, betas: tuple[float, float], eps: float,
                 weight_decay: float, scaler: LossScaler | None = None):
        self.scaler, self.instance_group = scaler, instance_group
        self.model_params: list[torch.Tensor] = [p for g in groups for p in g["params"]]
        self.main_params = self.model_params  # what --log-params-norm and faults read: whole
        self.offsets, self.numel = offsets, sum(p.numel() for p in self.model_params)
        self.copies = any(p.dtype != torch.float32 for p in self.model_params)
        self._groups_params = [list(g["params"]) for g in groups]
        self._groups_hyper = [{k: v for k, v in g.items() if k != "params"} for g in groups]
        self._lr, self._betas, self._eps, self._weight_decay = lr, betas, eps, weight_decay
        self.before_gather: Callable[[], None] = lambda: None  # fault injection point
        self.shards = shards
        lo, hi = shard_range(self.numel, shard, shards)
        self._place(lo, hi, self._from_weights(lo, hi), None, 0)

    @property
    def _device(self) -> torch.device:
        """Where collectives' tensors live: NCCL takes only the GPU's (checkpoints load on CPU)."""
        return self.model_params[0].device

    @property
    def chunk(self) -> int:
        return -(-self.numel // self.shards)

    def _overlap(self, p: torch.Tensor) -> tuple[int, int]:
        o = self.offsets[p]
        return max(self.lo, o) - o, min(self.hi, o + p.numel()) - o

    def _from_weights(self, lo: int, hi: int) -> torch.Tensor:
        flat = torch.empty(hi - lo, dtype=torch.float32, device=self._device)
        for p in self.model_params:
            o = self.offsets[p]
            a, b = max(lo, o), min(hi, o + p.numel())
            if a < b:
                flat[a - lo:b - lo].copy_(p.detach().view(-1)[a - o:b - o])
        return flat

    def _place(self, lo: int, hi: int, main: torch.Tensor,
               moments: tuple[torch.Tensor, torch.Tensor] | None, step: int) -> None:
        """Hold [lo, hi): fragments with `main`'s values (flat fp32 over the range, also written
        into the model's weights there), and Adam's moments and step if it has stepped. The
        hyperparameters the scheduler set on the previous inner optimizer carry over."""
        self.lo, self.hi = lo, hi
        # per parameter overlapping the slice: (index in model_params, start, end in the param)
        self.pieces: list[tuple[int, int, int]] = []
        self.fragments: list[torch.nn.Parameter] = []
        fragment_groups, states, index = [], [], -1
        with torch.no_grad():
            for params, hyper in zip(self._groups_params, self._groups_hyper):
                fragments = []
                for p in params:
                    index += 1
                    start, end = self._overlap(p)
                    if start >= end:
                        continue
                    at = self.offsets[p] + start - lo
                    values = main[at:at + end - start]
                    weights = p.detach().view(-1)[start:end]
                    weights.copy_(values)
                    # fp32: the fragment is a view, the step writes the model's weights in place
                    fragment = torch.nn.Parameter(weights if p.dtype == torch.float32
                                                  else values, requires_grad=False)
                    self.pieces.append((index, start, end))
                    self.fragments.append(fragment)
                    fragments.append(fragment)
                    if moments is not None:
                        states.append((fragment, {"step": torch.tensor(float(step)), **{
                            n: m[at:at + end - start] for n, m in zip(_MOMENTS, moments)}}))
                fragment_groups.append({**hyper, "params": fragments})
        previous = getattr(self, "inner", None)  # None while __init__ places the first slice
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
        A PeerFailure can come only from the weights' all-gather, after this slice stepped."""
        for fragment, (i, start, end) in zip(self.fragments, self.pieces):
            fragment.grad = grads[i].view(-1)[start:end]
        self.inner.step()
        for fragment in self.fragments:
            fragment.grad = None
        self.before_gather()
        self.gather_weights()

    def gather_weights(self) -> None:
        """Every slice's updated weights to every member of the instance."""
        dtype = self.model_params[0].dtype
        mine = torch.zeros(self.chunk, dtype=dtype, device=self._device)
        with torch.no_grad():
            for fragment, (i, start, end) in zip(self.fragments, self.pieces):
                at = self.offsets[self.model_params[i]] + start - self.lo
                mine[at:at + end - start].copy_(fragment)
            whole = self._all_gather(mine)
            for p in self.model_params:
                o = self.offsets[p]
                p.view(-1).copy_(whole[o:o + p.numel()])

    def _all_gather(self, mine: torch.Tensor) -> torch.Tensor:
        size = 1 if self.instance_group is None else self.instance_group.size()
        if size == 1:
            return mine
        whole = torch.empty(size * mine.numel(), dtype=mine.dtype, device=mine.device)
        dist.all_gather_single(whole, mine, group=self.instance_group)
        return whole

    def _flat(self, of_fragment) -> torch.Tensor:
        """A per-fragment fp32 tensor (a moment, a main param) as one flat tensor over [lo, hi)."""
        flat = torch.zeros(self.hi - self.lo, dtype=torch.float32, device=self._device)
        for fragment, (i, start, end) in zip(self.fragments, self.pieces):
            at = self.offsets[self.model_params[i]] + start - self.lo
            flat[at:at + end - start].copy_(of_fragment(fragment))
        return flat

    def _whole(self, of_fragment) -> list[torch.Tensor]:
        """A per-fragment fp32 tensor gathered over the instance into whole per-param ones."""
        mine = torch.zeros(self.chunk, dtype=torch.float32, device=self._device)
        mine[:self.hi - self.lo].copy_(self._flat(of_fragment))
        whole = self._all_gather(mine)
        return [whole[self.offsets[p]:self.offsets[p] + p.numel()].view_as(p).clone()
                for p in self.model_params]

    def reload_model_params(self) -> None:
        with torch.no_grad():
            for fragment, (i, start, end) in zip(self.fragments, self.pieces):
                fragment.copy_(self.model_params[i].view(-1)[start:end])

    def state_dict(self) -> dict:
        """MainParamsAdamW's (unsharded) state dict; a collective over the instance."""
        inner = self.inner.state_dict()
        state: dict = {}
        if self._any_started():  # every member calls every collective below, or none
            step = self._step_count()
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

    def _any_started(self) -> bool:
        flag = torch.tensor([float(bool(self.inner.state))], device=self._device)
        if self.instance_group is not None and self.instance_group.size() > 1:
            dist.all_reduce(flag, op=dist.ReduceOp.MAX, group=self.instance_group)
        return bool(flag.item())

    def _step_count(self) -> float:
        """Adam's step, the same on every fragment; a rank with no fragment learns it."""
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
            for fragment, (i, start, end) in zip(self.fragments, self.pieces):
                fragment.copy_(mains[i].view(-1)[start:end])
                if self.copies:
                    self.model_params[i].view(-1)[start:end].copy_(fragment)
                saved_state = saved["state"].get(i, saved["state"].get(str(i)))
                if saved_state is not None:
                    self.inner.state[fragment] = {
                        "step": torch.tensor(float(saved_state["step"])),
                        **{n: saved_state[n].reshape(-1)[start:end].to(fragment.device, torch.float32,
                                                                      copy=True) for n in _MOMENTS}}
        if self.copies:  # the other slices' weights: from their owners
            self.gather_weights()

    # -- the replicas changed -------------------------------------------------------------------
    def reshard(self, live_replicas: Sequence[int], per_instance: int, dp_group) -> int:
        """Take this rank's slice for the live replicas `live_replicas` (instances of
        `per_instance` consecutive replicas), then gather the instance's weights. A collective over
        `dp_group`: one rank per live replica, in replica order, each taking part. Pieces move
        point to point from the lowest rank holding them; a rank's old slice stays until the
        whole new one arrived. TooFewReplicas if some piece died with every rank that held it.
        Returns the bytes this rank received."""
        live = sorted(live_replicas)
        me, size = (0, 1) if dp_group is None else (dp_group.rank(), dp_group.size())
        positions = instance_positions(live, per_instance)
        wanted = [shard_range(self.numel, j, n) for j, n in positions]
        held, step = self._held_ranges(dp_group, size)
        try:
            transfers = plan_transfers(held, wanted)
        except ShardLost as lost:
            raise TooFewReplicas(
                f"the distributed optimizer's state {lost} of this stage's flat parameters was "
                f"held only by lost replicas (live: {live}); "
                "--num-distributed-optimizer-instances K keeps K copies") from None
        lo, hi = wanted[me]
        started = step > 0
        fresh = [torch.zeros(hi - lo, dtype=torch.float32, device=self._device)
                 for _ in range(1 + 2 * started)]
        inner, mine = self.inner, []
        if held[me][0] < held[me][1]:  # this rank's valid slice: main params, then moments
            mine = [self._flat(lambda f: f)] + [
                self._flat(lambda f, n=n: inner.state[f][n]) for n in _MOMENTS if started]
            a, b = max(lo, self.lo), min(hi, self.hi)
            for new, old in zip(fresh, mine):
                if a < b:
                    new[a - lo:b - lo].copy_(old[a - self.lo:b - self.lo])
        for t in transfers:
            if me == t.src:
                for part in mine:
                    section = part[t.lo - self.lo:t.hi - self.lo]
                    for piece in section.split(_CHUNK):
                        dist.send(piece, group=dp_group, group_dst=t.dst)
            elif me == t.dst:
                for new in fresh:
                    for piece in new[t.lo - lo:t.hi - lo].split(_CHUNK):
                        dist.recv(piece, group=dp_group, group_src=t.src)
        self.shards = positions[me][1]
        self._place(lo, hi, fresh[0], (fresh[1], fresh[2]) if started else None, step)
        self.gather_weights()
        return 4 * len(fresh) * sum(t.hi - t.lo for t in transfers if t.dst == me)

    def _held_ranges(self, dp_group, size: int) -> tuple[list[tuple[int, int]], int]:
        """Every group rank's slice and Adam step; a rank behind the newest step (a spare's old
        state) counts as holding nothing."""
        step = max((int(s["step"]) for s in self.inner.state.values()), default=0)
        mine = torch.tensor([self.lo, self.hi, step], dtype=torch.int64, device=self._device)
        every = mine
        if size > 1:
            every = torch.empty(3 * size, dtype=torch.int64, device=self._device)
            dist.all_gather_single(every, mine, group=dp_group)
        rows = every.view(size, 3).tolist()
        newest = max(row[2] for row in rows)
        return [(lo, hi) if s == newest else (0, 0) for lo, hi, s in rows], newest

    def forget(self) -> None:
        """This rank's replica broke: whatever it held is out of date by the time it rejoins."""
        self._place(0, 0, torch.empty(0, device=self._device), None, 0)

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
