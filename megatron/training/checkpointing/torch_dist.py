"""--ckpt-format torch_dist: Megatron's distributed checkpoint, readable by Megatron's tools and
loadable at another TP / PP / DP layout.

What is in it, as Megatron lays it out (the keys are megatron-core's, so a stock Megatron
checkpoint loads here and ours loads there):
    iter_N/metadata.json   {"sharded_backend": "torch_dist", ...}   megatron-core's format marker
    iter_N/common.pt       args, iteration, checkpoint_version, opt_param_scheduler, the
                           optimizer's hyperparameters and step; ReCoVer's own state under
                           "recover" (optional on load)
    iter_N/.metadata, __K_0.distcp   torch.distributed.checkpoint: every tensor by its *global*
                           key and offsets (the model's `sharded_state_dict()`; Adam's moments and
                           fp32 main weights as `optimizer.state.{exp_avg,exp_avg_sq,fp32_param}.`
                           + the weight's key), the RNG state per (pp, tp)

Who writes: the live replicas share the writing, or the lowest one writes (`checkpoint_writers`);
the plan and the gather of results are collectives among the writers, the write itself is not
(`ShardedWrite`), so an --async-save can write on a background thread while the job trains.
Loading is megatron-core's `dist_checkpointing.load` on every rank at start-up: each rank reads
the slices its own layout needs, whatever layout wrote them.
"""
from __future__ import annotations

import argparse
import json
import pickle
import re
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING

import torch
from megatron.core.dist_checkpointing import ShardedObject, ShardedTensor
from megatron.core.dist_checkpointing import load as mcore_load
from megatron.core.dist_checkpointing.core import CONFIG_FNAME, CheckpointingException
from megatron.core.dist_checkpointing.dict_utils import dict_list_map_inplace, nested_values
from megatron.core.dist_checkpointing.mapping import ShardedTensorFactory
from megatron.core.dist_checkpointing.optimizer import (make_sharded_optimizer_tensor,
                                                        optim_state_to_sharding_state)
from megatron.core.dist_checkpointing.state_dict_utils import save_preprocess
from megatron.core.dist_checkpointing.strategies.common import COMMON_STATE_FNAME
from megatron.core.dist_checkpointing.strategies.torch import (MCoreSavePlanner,
                                                                _replace_state_dict_keys_with_sharded_keys,
                                                                mcore_to_pyt_state_dict)
from torch.distributed.checkpoint import FileSystemWriter
from torch.distributed.checkpoint.metadata import Metadata

from megatron.training.checkpointing import reshardable as dopt
from megatron.training.checkpointing.format import (CHECKPOINT_VERSION, GRAD_EXPONENTS,
                                                    with_megatron_args)
from megatron.training.checkpointing.writers import Writers
from megatron.training.model import checkpoint_keys, model_chunks

if TYPE_CHECKING:  # it imports this module
    from megatron.training.checkpointing.state import TrainingState

CONFIG = {"sharded_backend": "torch_dist", "sharded_backend_version": 1,
          "common_backend": "torch", "common_backend_version": 1}
DCP_METADATA = ".metadata"
_MOMENTS = ("exp_avg", "exp_avg_sq")


def is_torch_dist(directory: Path) -> bool:
    try:
        return json.loads((directory / CONFIG_FNAME).read_text()).get("sharded_backend") == "torch_dist"
    except (OSError, ValueError):
        return False


# -- what goes in ---------------------------------------------------------------------------------
def model_sharded(training: TrainingState) -> dict:
    """{"model": ...} or, with model chunks, {"model0": ..., "model1": ...} as in Megatron; the
    sharded keys inside are global (layer numbers include a chunk's offset), so a checkpoint loads
    into any TP/PP/VP layout. The DP part of every replica id is 0 (Megatron's DP x CP rank):
    `checkpoint_writers` picks who writes each item among the ranks that hold it, and on load
    every rank needs every slice of its own layout, whatever its CP index."""
    metadata = {"dp_cp_group": training.groups.self_group}
    return {key: chunk.sharded_state_dict(metadata=metadata)
            for key, chunk in zip(checkpoint_keys(training.model), model_chunks(training.model))}


def _by_param(model_sd: dict, params: list[torch.Tensor]) -> dict[int, ShardedTensor]:
    """Optimizer index i (its order: `optimizer.model_params`) -> the weight's sharded tensor."""
    by_id = {id(sh.data): sh for sh in nested_values(model_sd)
             if isinstance(sh, (ShardedTensor, ShardedTensorFactory))}
    return {i: by_id[id(p)] for i, p in enumerate(params)}


def optimizer_sharded(optimizer_state: dict, model_sd: dict, params: list[torch.Tensor]) -> dict:
    """Megatron's Float16OptimizerWithFloat16Params layout of `optimizer_state` (our optimizers'
    unsharded dict, indexed like `params`): moments and fp32 weights keyed by the weight's global
    key, one shared step, hyperparameters in common.pt. Modifies `optimizer_state`."""
    id_map = _by_param(model_sd, params)
    inner = optimizer_state["optimizer"]
    steps = {float(s["step"]) for s in inner["state"].values() if "step" in s}
    halves = [i for i, p in enumerate(params) if p.dtype != torch.float32]
    optimizer_state["fp32_from_fp16_params"] = [
        make_sharded_optimizer_tensor(id_map[i], t, prefix="optimizer.state.fp32_param")
        for i, t in zip(halves, optimizer_state["fp32_from_fp16_params"])]
    optim_state_to_sharding_state(inner, id_map, exclude_keys=("step",))
    if steps:
        inner["state"]["common_step"] = steps.pop()
    return optimizer_state


def optimizer_template(params: list[torch.Tensor], param_groups: list[dict],
                       moments: bool) -> dict:
    """The unsharded optimizer dict of this layout with empty fp32 tensors, to be loaded into
    (`moments`: Adam had stepped; fp16 can save before its first step that did not overflow).
    The groups' `params` come back from here (they are not saved); the rest from common.pt."""
    state = {i: {n: torch.empty(p.shape, dtype=torch.float32, device=p.device) for n in _MOMENTS}
             for i, p in enumerate(params)} if moments else {}
    index, groups = 0, []
    for group in param_groups:
        groups.append({"params": list(range(index, index + len(group["params"])))})
        index += len(group["params"])
    return {"optimizer": {"state": state, "param_groups": groups},
            "fp32_from_fp16_params": [torch.empty(p.shape, dtype=torch.float32, device=p.device)
                                      for p in params if p.dtype != torch.float32]}


def rng_sharded(training: TrainingState, rng: dict) -> ShardedObject:
    """ReCoVer's RNG state (`state.rng_state()`) under Megatron's key names, one object
    per (pp, tp) position; with --recover-exact-reduction also the position's gradient exponents
    (per parameter, like the RNG streams: the same at any DP size)."""
    topo, coord = training.groups.topology, training.groups.coord
    megatron = {"torch_rng_state": rng["torch_cpu"], "rng_tracker_states": rng["tracker"]}
    if training.grad_scales is not None:
        megatron[GRAD_EXPONENTS] = training.grad_scales.state_dict()
    return ShardedObject("rng_state", [megatron], (topo.pp, topo.tp), (coord.pp, coord.tp),
                         replica_id=0)


def checkpoint_state(training: TrainingState, megatron_args: argparse.Namespace,
                     optimizer_state: dict | None, rng: dict | None,
                     fully_reshardable: bool = False) -> dict:
    """This rank's whole checkpoint in Megatron's torch_dist layout (with ShardedTensors);
    `megatron_args`: the run's flags, stored under "args" as Megatron stores them;
    `fully_reshardable`: the optimizer in the distributed optimizer's layout of that name."""
    model_sd = model_sharded(training)
    st = training.progress
    state: dict = {
        "args": with_megatron_args(megatron_args, st.iteration, st.consumed_samples),
        "checkpoint_version": CHECKPOINT_VERSION, "iteration": st.iteration, **model_sd,
        "recover": {"consumed_samples": st.consumed_samples,
                    "topology": vars(training.groups.topology).copy()}}
    if optimizer_state is not None:
        state["optimizer"] = _optimizer_layout(optimizer_state, model_sd,
                                               training.optimizer.model_params, fully_reshardable)
        if fully_reshardable:
            state[dopt.CONTENT_METADATA] = dopt.content_metadata()
        state["opt_param_scheduler"] = training.scheduler.state_dict()
    if rng is not None:
        state["rng_state"] = rng_sharded(training, rng)
    return state


def _optimizer_layout(optimizer_state: dict, model_sd: dict, params: list[torch.Tensor],
                      fully_reshardable: bool) -> dict:
    if fully_reshardable:
        return dopt.fully_reshardable(optimizer_state, _by_param(model_sd, params), params)
    return optimizer_sharded(optimizer_state, model_sd, params)


def load_template(training: TrainingState, with_optimizer: bool, moments: bool,
                  rng: dict | None, fully_reshardable: bool = False) -> dict:
    """What this rank reads: its layout's slices of the model (and Adam, and its RNG), the
    optimizer in the layout the checkpoint has."""
    model_sd = model_sharded(training)
    template: dict = dict(model_sd)
    if with_optimizer:
        params = training.optimizer.model_params
        empty = optimizer_template(params, training.optimizer.param_groups, moments)
        template["optimizer"] = (
            dopt.fully_reshardable(empty, _by_param(model_sd, params), params, loading=True)
            if fully_reshardable else optimizer_sharded(empty, model_sd, params))
    if rng is not None:
        template["rng_state"] = rng_sharded(training, rng)
    return template


def as_rank_state(loaded: dict, params: list[torch.Tensor] | None = None,
                  group_sizes: list[int] | None = None) -> dict:
    """A loaded torch_dist checkpoint in the shape `checkpointing.state.apply_rank_state` takes (the
    torch format's). Consumed samples: ReCoVer's own record, else Megatron's args."""
    recover = loaded.get("recover") or {}
    saved_args = loaded.get("args")
    consumed = recover.get("consumed_samples", getattr(saved_args, "consumed_train_samples", 0))
    state = {"iteration": int(loaded["iteration"]), "consumed_samples": int(consumed),
             **{key: value for key, value in loaded.items() if re.fullmatch(r"model\d*", key)}}
    if "optimizer" in loaded and "param_state" in loaded["optimizer"]:  # fully_reshardable
        assert params is not None and group_sizes is not None, "a fully_reshardable optimizer"
        state["optimizer"] = dopt.unsharded(loaded["optimizer"], params, group_sizes)
        state["opt_param_scheduler"] = loaded["opt_param_scheduler"]
    elif "optimizer" in loaded:
        optimizer = loaded["optimizer"]
        inner = optimizer["optimizer"]
        step = inner["state"].pop("common_step", None)
        for param_state in inner["state"].values():
            param_state["step"] = torch.tensor(float(step or 0))
        state["optimizer"] = optimizer
        state["opt_param_scheduler"] = loaded["opt_param_scheduler"]
    if "rng_state" in loaded:
        rng = loaded["rng_state"][0]
        state["rng_state"] = {"torch_cpu": rng["torch_rng_state"],
                              "tracker": rng["rng_tracker_states"],
                              **({GRAD_EXPONENTS: rng[GRAD_EXPONENTS]} if GRAD_EXPONENTS in rng
                                 else {})}
    return state


# -- writing: plan (collective), write (not), finish (collective) ---------------------------------
class SavePlans:
    """--ckpt-assume-constant-structure: the global save plan of the last writing group. A save
    by other ranks (the writing replica changed after a failure), or of other keys, plans again;
    that the other writers' keys did not change either is the user's promise, as in Megatron-LM."""

    def __init__(self) -> None:
        self._writers: tuple | None = None
        self._plan: tuple[list, Metadata] | None = None

    def get(self, writers: tuple) -> tuple[list, Metadata] | None:
        return self._plan if writers == self._writers else None

    def keep(self, writers: tuple, plan: tuple[list, Metadata]) -> None:
        self._writers, self._plan = writers, plan


class ShardedWrite:
    """One rank's part of a torch_dist save into `directory` (`writers`: who writes which items,
    and the exchange among them). `state` must not change until the write is done (an async save
    passes a host copy)."""

    def __init__(self, state: dict, directory: Path, writers: Writers,
                 plans: SavePlans | None = None) -> None:
        """`plans`: --ckpt-assume-constant-structure's cache: the global plan is made once per
        set of writers and reused (the local plans are not exchanged again)."""
        flat, _, _ = _replace_state_dict_keys_with_sharded_keys(state, keep_only_main_replica=True)
        flat = writers.share(flat)
        self.writers = writers
        self.planner = MCoreSavePlanner(dedup_replicated_tensors=False, flatten_state_dict=False)
        self.writer = FileSystemWriter(directory, single_file_per_rank=True, sync_files=True,
                                       thread_count=1)
        self.planner.set_up_planner(mcore_to_pyt_state_dict(flat, False),
                                    is_coordinator=writers.is_coordinator)
        self.writer.set_up_storage_writer(writers.is_coordinator)
        local = self.writer.prepare_local_plan(self.planner.create_local_plan())
        # the writing ranks, and this rank's keys: fp16 can save before Adam has moments, and a
        # later save then holds more (every rank of the replica alike)
        key = (writers.ranks, hash(tuple(sorted(item.index.fqn for item in local.items))))
        cached = None if plans is None else plans.get(key)
        if cached is None:
            # every rank runs the (deterministic) global planning: no scatter needed
            global_plans, metadata = self.planner.create_global_plan(self._all_gather(local))
            cached = (self.writer.prepare_global_plan(global_plans), metadata)
            if plans is not None:
                plans.keep(key, cached)
        self.metadata = cached[1]
        self.plan = self.planner.finish_plan(cached[0][writers.index])
        self.results: list | None = None

    def write(self) -> None:
        """The files of this rank; no communication, so any thread may run it."""
        future = self.writer.write_data(self.plan, self.planner)
        future.wait()
        self.results = future.value()

    def finish(self) -> None:
        """Every writer's results to the coordinator, which writes `.metadata` (the checkpoint
        is readable only from then on)."""
        assert self.results is not None, "finish() before write()"
        results = self._all_gather(self.results)
        if self.writers.is_coordinator:
            self.writer.finish(self.metadata, results)

    def _all_gather(self, obj) -> list:
        return self.writers.all_gather(obj)


def sharded_and_common(state: dict) -> tuple[dict, dict]:
    """megatron-core's split: ShardedTensors/Objects for DCP, the rest for common.pt."""
    return save_preprocess(state, validate_access_integrity=False)


def write_common(directory: Path, common: dict) -> None:
    torch.save(common, directory / COMMON_STATE_FNAME)
    (directory / CONFIG_FNAME).write_text(json.dumps(CONFIG))


def to_host(state: dict) -> dict:
    """A copy of every tensor in host memory: what an async save blocks for."""
    def copy(x):
        if isinstance(x, torch.Tensor):
            return x.detach().to("cpu", copy=True)
        if isinstance(x, (ShardedTensor, ShardedObject)) and isinstance(x.data, torch.Tensor):
            x.data = x.data.detach().to("cpu", copy=True)
        return x
    dict_list_map_inplace(copy, state)
    return state


# -- reading --------------------------------------------------------------------------------------
def read_dcp_metadata(directory: Path) -> Metadata:
    with open(directory / DCP_METADATA, "rb") as f:
        return pickle.load(f)


def truncated_file(directory: Path, metadata: Metadata) -> Path | None:
    """A data file shorter than the bytes `.metadata` says it holds (a torn or cut copy)."""
    needed: dict[str, int] = {}
    for info in metadata.storage_data.values():
        needed[info.relative_path] = max(needed.get(info.relative_path, 0), info.offset + info.length)
    for name, size in sorted(needed.items()):
        path = directory / name
        if not path.is_file() or path.stat().st_size < size:
            return path
    return None


def load_common(directory: Path) -> dict:
    """common.pt, whose `args` is an argparse.Namespace (Megatron's too)."""
    with torch.serialization.safe_globals([argparse.Namespace]):
        return torch.load(directory / COMMON_STATE_FNAME, map_location="cpu", weights_only=True)


def load(template: dict, directory: Path, strict: str,
         on_error: Callable[[str], Exception]) -> dict:
    """megatron-core's loader into `template`, with --dist-ckpt-strictness `strict`; a shape or
    key mismatch becomes `on_error(detail)`."""
    try:
        with torch.serialization.safe_globals([argparse.Namespace]):  # common.pt's args
            loaded = mcore_load(template, str(directory), validate_access_integrity=False,
                                strict=strict)
    except (CheckpointingException, KeyError, RuntimeError, ValueError) as err:
        raise on_error(str(err).splitlines()[0][:300]) from None
    return loaded[0] if isinstance(loaded, tuple) else loaded  # return_*: (state, missing, unexpected)
