"""Live state transfer for a joining replica (DESIGN §15): what a donor rank sends the rank of
the same (tp, pp) slot in a re-formed replica, and how that rank takes it on.

The state is what a checkpoint of the slot holds -- weights, fp32 main params and Adam state
(optimizer state dict, loss scaler included), LR schedule, iteration, consumed samples, RNG --
plus what only a live job has: the per-replica microbatch times the quota plan is computed from
(every rank must plan alike from the next iteration on) and the skipped-iteration count. It goes
as one serialized buffer over the rebuilt data-parallel group: two p2p messages (size, bytes).
Exact bytes: after the join every replica's weights are bitwise identical.
"""
from __future__ import annotations

import io

import torch
import torch.distributed as dist

from megatron.training.checkpointing import cpu_tracker


def live_state(trainer) -> dict:
    return {
        "model": trainer.model.state_dict(),
        "optimizer": trainer.optimizer.state_dict(),
        "opt_param_scheduler": trainer.scheduler.state_dict(),
        "iteration": trainer.state.iteration,
        "consumed_samples": trainer.state.consumed_samples,
        "skipped_iterations": trainer.state.skipped_iterations,
        "timings": {int(r): t for r, t in trainer.timings.items()},
        "rng_state": {"torch_cpu": torch.get_rng_state(), "tracker": cpu_tracker().get_states()},
    }


def apply_live_state(trainer, state: dict) -> None:
    trainer.model.load_state_dict(state["model"], strict=True)
    trainer.optimizer.load_state_dict(state["optimizer"])
    # megatron-core's scheduler *adds* the saved step count to its own (made for fresh ones, as
    # at a checkpoint load): a spare that trained before its replica broke must start from 0
    trainer.scheduler.num_steps = 0
    trainer.scheduler.load_state_dict(state["opt_param_scheduler"])
    trainer.state.iteration = state["iteration"]
    trainer.state.consumed_samples = state["consumed_samples"]
    trainer.state.skipped_iterations = state["skipped_iterations"]
    trainer.timings = dict(state["timings"])
    torch.set_rng_state(state["rng_state"]["torch_cpu"])
    cpu_tracker().set_states(state["rng_state"]["tracker"])
    trainer.grads.zero()  # whatever a spare had accumulated when its replica broke


def _peer(trainer, replica: int) -> int:
    """The data-parallel group index of `replica`'s rank in this rank's (tp, pp) slot."""
    topo, c = trainer.groups.topology, trainer.groups.coord
    return dist.get_group_rank(trainer.groups.dp, topo.rank(c.tp, replica, c.pp))


def send_state(trainer, to_replica: int) -> int:
    """Donor side: returns the bytes sent. PeerFailure if the joiner or the group fails."""
    buffer = io.BytesIO()
    torch.save(live_state(trainer), buffer)
    payload = torch.frombuffer(bytearray(buffer.getbuffer()), dtype=torch.uint8).to(trainer.device)
    size = torch.tensor([payload.numel()], dtype=torch.int64, device=trainer.device)
    peer = _peer(trainer, to_replica)
    dist.send(size, group=trainer.groups.dp, group_dst=peer)
    dist.send(payload, group=trainer.groups.dp, group_dst=peer)
    return payload.numel()


def receive_state(trainer, from_replica: int) -> int:
    """Joiner side: receive the donor's state and take it on; returns the bytes received."""
    peer = _peer(trainer, from_replica)
    size = torch.zeros(1, dtype=torch.int64, device=trainer.device)
    dist.recv(size, group=trainer.groups.dp, group_src=peer)
    payload = torch.empty(int(size.item()), dtype=torch.uint8, device=trainer.device)
    dist.recv(payload, group=trainer.groups.dp, group_src=peer)
    state = torch.load(io.BytesIO(payload.cpu().numpy().tobytes()), map_location="cpu",
                       weights_only=True)
    apply_live_state(trainer, state)
    return payload.numel()
