"""Live state transfer for a joining replica (design.md §11): what a donor rank sends the rank of
the same (tp, pp) slot in a re-formed replica, and how that rank takes it on.

The state is what a checkpoint of the slot holds -- weights, fp32 main params and Adam state
(optimizer state dict, loss scaler included), LR schedule, iteration, consumed samples, RNG --
plus what only a live job has: the per-replica microbatch times the quota plan is computed from
(every rank must plan alike from the next iteration on), the skipped-iteration count, and the
donor's last metrics records (a joiner can become the logging rank, and must then write the one
its predecessor committed but died before writing: it was a spare then and has no record of it). It goes
over the rebuilt data-parallel group as a small serialized skeleton (the non-tensor state, and the
dtype and shape of each tensor), then the tensors, one buffer per dtype sent in 64 MiB messages:
no pickling of the weights, no copy beyond one concatenation per dtype. Exact bytes: after the join every
replica's weights are bitwise identical.
"""
from __future__ import annotations

import io
from typing import Mapping, Sequence

import torch
import torch.distributed as dist

from megatron.training.checkpointing.state import TrainingState, cpu_tracker
from megatron.training.initialize import ParallelGroups


RECENT_RECORDS = 8  # what a successor may lack: the iterations since its predecessor's last write


def live_state(training: TrainingState, timings: Mapping[int, float | None],
               records: Sequence[dict] = ()) -> dict:
    return {
        "model": training.model.state_dict(),
        # the distributed optimizer's shards come by re-sharding when the groups are rebuilt
        "optimizer": training.optimizer.replicated_state_dict(),
        "opt_param_scheduler": training.scheduler.state_dict(),
        "iteration": training.progress.iteration,
        "consumed_samples": training.progress.consumed_samples,
        "skipped_iterations": training.progress.skipped_iterations,
        "timings": {int(r): t for r, t in timings.items()},
        "grad_scales": None if training.grad_scales is None else training.grad_scales.state_dict(),
        "rng_state": {"torch_cpu": torch.get_rng_state(), "tracker": cpu_tracker().get_states()},
        "records": list(records)[-RECENT_RECORDS:],
    }


def apply_live_state(training: TrainingState, state: dict
                     ) -> tuple[dict[int, float | None], list[dict]]:
    """Take the donor's state on; returns its microbatch timings and its last records (the
    trainer's to adopt)."""
    training.model.load_state_dict(state["model"], strict=True)
    training.optimizer.load_replicated_state_dict(state["optimizer"])
    # megatron-core's scheduler *adds* the saved step count to its own (made for fresh ones, as
    # at a checkpoint load): a spare that trained before its replica broke must start from 0
    training.scheduler.num_steps = 0
    training.scheduler.load_state_dict(state["opt_param_scheduler"])
    training.progress.iteration = state["iteration"]
    training.progress.consumed_samples = state["consumed_samples"]
    training.progress.skipped_iterations = state["skipped_iterations"]
    if training.grad_scales is not None:  # the exponents the next iteration agrees on
        training.grad_scales.load_state_dict(state["grad_scales"])
    torch.set_rng_state(state["rng_state"]["torch_cpu"])
    cpu_tracker().set_states(state["rng_state"]["tracker"])
    return state["timings"], state["records"]


def _peer(groups: ParallelGroups, replica: int) -> int:
    """The reduction group index of `replica`'s rank in this rank's (tp, pp, cp) slot."""
    topo, c = groups.topology, groups.coord
    return dist.get_group_rank(groups.dp, topo.rank(c.tp, replica, c.pp, c.cp))


def _strip(obj, tensors: list[torch.Tensor]):
    """The state with every tensor replaced by its index in `tensors` (a small skeleton)."""
    if isinstance(obj, torch.Tensor):
        tensors.append(obj.detach().contiguous())
        return {_TENSOR: len(tensors) - 1}
    if isinstance(obj, dict):
        return {k: _strip(v, tensors) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return type(obj)(_strip(v, tensors) for v in obj)
    return obj


def _dress(obj, tensors: list[torch.Tensor]):
    if isinstance(obj, dict):
        if set(obj) == {_TENSOR}:
            return tensors[obj[_TENSOR]]
        return {k: _dress(v, tensors) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return type(obj)(_dress(v, tensors) for v in obj)
    return obj


_TENSOR = "__recover_tensor__"
# Elements per message (64 MiB of fp32): each p2p operation must finish within --recover-timeout,
# which a multi-GiB state in one message would not on a slow link.
CHUNK = 1 << 24


def send_state(training: TrainingState, timings: Mapping[int, float | None],
               to_replica: int, records: Sequence[dict] = ()) -> int:
    """Donor side (its weights ready): a small serialized skeleton (sizes, dtypes, the
    non-tensor state), then every tensor as it is -- no pickling of the weights. Returns the
    bytes sent. PeerFailure if the joiner or the group fails."""
    tensors: list[torch.Tensor] = []
    skeleton = _strip(live_state(training, timings, records), tensors)
    buffer = io.BytesIO()
    torch.save({"skeleton": skeleton, "specs": [(str(t.dtype), tuple(t.shape), t.device.type)
                                                for t in tensors]}, buffer)
    device = training.device
    header = torch.frombuffer(bytearray(buffer.getbuffer()), dtype=torch.uint8).to(device)
    size = torch.tensor([header.numel()], dtype=torch.int64, device=device)
    group, peer = training.groups.dp, _peer(training.groups, to_replica)
    dist.send(size, group=group, group_dst=peer)
    dist.send(header, group=group, group_dst=peer)
    for dtype in _dtypes(tensors):  # one buffer per dtype: few large sends, one copy
        flat = torch.cat([t.reshape(-1).to(device) for t in tensors if t.dtype == dtype])
        for chunk in flat.split(CHUNK):
            dist.send(chunk, group=group, group_dst=peer)
    return header.numel() + sum(t.numel() * t.element_size() for t in tensors)


def _dtypes(tensors: list[torch.Tensor]) -> list[torch.dtype]:
    """The dtypes of the non-empty tensors, in first-seen order (both sides compute the same)."""
    return list(dict.fromkeys(t.dtype for t in tensors if t.numel()))


def receive_state(training: TrainingState, from_replica: int
                  ) -> tuple[int, dict[int, float | None], list[dict]]:
    """Joiner side: receive the donor's state and take it on; returns the bytes received, the
    donor's microbatch timings and its last records."""
    group, peer = training.groups.dp, _peer(training.groups, from_replica)
    size = torch.zeros(1, dtype=torch.int64, device=training.device)
    dist.recv(size, group=group, group_src=peer)
    header = torch.empty(int(size.item()), dtype=torch.uint8, device=training.device)
    dist.recv(header, group=group, group_src=peer)
    meta = torch.load(io.BytesIO(header.cpu().numpy().tobytes()), weights_only=True)
    tensors = [torch.empty(shape, dtype=getattr(torch, dtype.removeprefix("torch.")),
                           device=training.device) for dtype, shape, _ in meta["specs"]]
    for dtype in _dtypes(tensors):
        members = [i for i, t in enumerate(tensors) if t.dtype == dtype and t.numel()]
        flat = torch.empty(sum(tensors[i].numel() for i in members), dtype=dtype,
                           device=training.device)
        for chunk in flat.split(CHUNK):
            dist.recv(chunk, group=group, group_src=peer)
        # copies, not views: a view would pin the whole buffer (weights included) for as long
        # as the optimizer keeps its moments, i.e. forever
        for i, part in zip(members, flat.split([tensors[i].numel() for i in members])):
            tensors[i] = part.view(tensors[i].shape).clone()
        del flat
    tensors = [t.cpu() if where == "cpu" else t for t, (_, _, where) in zip(tensors, meta["specs"])]
    timings, records = apply_live_state(training, _dress(meta["skeleton"], tensors))
    return header.numel() + sum(t.numel() * t.element_size() for t in tensors), timings, records
