"""Building one replica's parts for `step.replica.GPTReplicaStep`: its pipeline stages, its
gradient buffer, its pipeline schedule and its commit vote."""
from __future__ import annotations

from typing import Callable

import torch
import torch.distributed as dist
from megatron.core.fusions.fused_cross_entropy import fused_vocab_parallel_cross_entropy
from megatron.core.transformer.moe.moe_utils import MoEAuxLossAutoScaler

from megatron.training.config import ModelConfig
from megatron.training.config.io import DataConfig
from megatron.training.model.context_parallel import batch_for_cp_rank
from megatron.training.initialize import ParallelGroups
from megatron.training.model import model_chunks
from megatron.training.model.moe_metrics import RouterMeter, router_report
from megatron.training.optimizer import LossScaler, Optimizer
from recover_patches.pipeline.loss import vocab_parallel_cross_entropy
from recover_patches.pipeline.p2p import ChunkP2P, StageLink
from recover_patches.pipeline.schedule import Interleaved, OneFOneB, PipelineSchedule
from recover_patches.pipeline.sampler import MicrobatchSampler
from recover_patches.pipeline.stage import GPTStage
from recover_patches.recovery.agreement import ReplicaLink
from recover_patches.recovery.fixed_point import FixedPointScales, loss_quantum
from recover_patches.recovery.grad_buffer import GradBuffer


def build_stages(data: DataConfig, micro_batch_size: int, groups: ParallelGroups, model,
                 dataset, tracker, scaler: LossScaler | None = None, exact: bool = False
                 ) -> list[GPTStage]:
    """One GPTStage per model chunk; chunk c of pipeline rank r is virtual stage c * PP + r (its
    dropout seeds: with one chunk, the pipeline stage). `exact`: --recover-exact-reduction (the
    loss sums on a grid)."""
    whole = MicrobatchSampler(dataset, micro_batch_size, with_mask=data.reset_attention_mask)
    sampler: Callable[[int], dict] = whole
    if groups.topology.cp > 1:  # context parallel: each CP rank computes its chunks
        cp, cp_rank = groups.topology.cp, groups.coord.cp
        sampler = lambda microbatch: batch_for_cp_rank(whole(microbatch), cp, cp_rank)  # noqa: E731
    chunks = model_chunks(model)
    pp, last = groups.topology.pp, groups.topology.pp * len(chunks) - 1
    stages = []
    # --cross-entropy-loss-fusion: megatron-core's fused kernel (it takes the TP group as given)
    fused = chunks[0].config.cross_entropy_loss_fusion
    report = router_report(chunks[0].config)  # MoE: each microbatch's router records
    for c, chunk in enumerate(chunks):
        device = next(chunk.parameters()).device
        virtual = c * pp + groups.coord.pp
        stages.append(GPTStage(chunk, sampler, tp_group=groups.tp, tracker=tracker,
                               seed=data.seed, pp_stage=virtual, tp_rank=groups.coord.tp,
                               is_first=virtual == 0, is_last=virtual == last, device=device,
                               loss_scale=None if scaler is None else (lambda: scaler.scale),
                               cross_entropy=fused_vocab_parallel_cross_entropy if fused
                               else vocab_parallel_cross_entropy,
                               before_backward=aux_loss_scaling(
                                   chunk.config, micro_batch_size * data.seq_length),
                               meter=None if report is None else
                               RouterMeter(report, chunk, device),
                               loss_grid=loss_quantum(micro_batch_size * data.seq_length)
                               if exact else None))
    return stages


def aux_loss_scaling(config, tokens: int) -> Callable[[float], None] | None:
    """MoE's load-balancing and z-losses: megatron-core scales their gradient by a class-wide
    factor. The language-model loss here is a sum over tokens, divided by the iteration's tokens
    after the reduction; an auxiliary loss weighted by a microbatch's nominal `tokens` (micro
    batch x sequence) thus enters as in Megatron (a mean over the microbatches, when no token is
    masked), whichever replica computes the microbatch: the factor is not the replica's quota."""
    if not config.num_moe_experts:
        return None
    return lambda scale: MoEAuxLossAutoScaler.set_loss_scale(torch.tensor(float(tokens * scale)))


def build_grad_buffer(groups: ParallelGroups, optimizer: Optimizer, overlap: bool, model,
                      exact: bool = False) -> GradBuffer:
    """The buffer takes the layout `build_optimizer` made (the distributed optimizer shards the
    same one); `overlap`: --overlap-grad-reduce; `exact`: --recover-exact-reduction."""
    assert optimizer.layout is not None, "an optimizer from optimizer_setup.build_optimizer"
    report = router_report(model_chunks(model)[0].config)
    return GradBuffer(optimizer.model_params, replicas=groups.topology.dp, dp_group=groups.dp,
                      device=optimizer.model_params[0].device, layout=optimizer.layout,
                      overlap=overlap, expert_dp_group=groups.expert_dp,
                      measure_slots=report.slots if report else 0,
                      scales=FixedPointScales(len(optimizer.model_params)) if exact else None)


def schedule_for(model: ModelConfig, micro_batch_size: int, groups: ParallelGroups, device, *,
                 vp_group: int, overlap_warmup_flush: bool) -> PipelineSchedule:
    """The one place the pipeline schedule is chosen: 1F1B over the stage link, or, with model
    chunks, the interleaved schedule over their channels. Activations between stages: [seq (this
    CP rank's chunks; a TP shard of them with sequence parallelism), micro batch, hidden], in the
    training dtype."""
    t = model.transformer
    seq = model.seq_length // t.context_parallel_size  # context parallel: this CP rank's chunks
    seq //= t.tensor_model_parallel_size if t.sequence_parallel else 1
    shape = (seq, micro_batch_size, t.hidden_size)
    if model.model_chunks is not None:
        return Interleaved(ChunkP2P(groups.channels, groups.coord.pp, groups.topology.pp,
                                    model.model_chunks, shape, dtype=t.params_dtype, device=device),
                           rank=groups.coord.pp, stages=groups.topology.pp, group=vp_group,
                           overlap_warmup_flush=overlap_warmup_flush)
    return OneFOneB(StageLink(groups.pp, groups.coord.pp, groups.topology.pp, shape,
                              dtype=t.params_dtype, device=device))


def replica_vote(groups: ParallelGroups, device) -> ReplicaLink:
    """The commit vote by replica: its ranks agree over the replica's group, its first rank votes
    (with expert parallelism the group spans the unit, and the unit votes as one)."""
    group, topo = groups.replica, groups.topology

    def voter_of(rank: int) -> int:
        return topo.replica_of(rank) // topo.unit_size
    if group.size() == 1:
        return ReplicaLink(voter_of, True, lambda news: news, lambda code: code)

    def exchange(news: bool) -> bool:
        flag = torch.tensor([int(news)], dtype=torch.int32, device=device)
        dist.all_reduce(flag, op=dist.ReduceOp.MAX, group=group)
        return bool(flag.item())

    def share(code: int) -> int:
        value = torch.tensor([code], dtype=torch.int32, device=device)
        dist.broadcast(value, group=group, group_src=0)
        return int(value.item())
    return ReplicaLink(voter_of, group.rank() == 0, exchange, share)


def pad_for_unit(ids: list[int], groups: ParallelGroups, device) -> list[int]:
    """A unit's replicas meet in every layer of every microbatch (expert parallelism's token
    exchanges, Megatron-FSDP's parameter gathers), so each computes as many microbatches as the
    unit's longest quota, the short ones fillers (`stage.py`). Agreed over the unit's group (the
    replica group, not the dispatcher's: its fault-injection point stays the dispatcher's own)."""
    if groups.topology.unit_size == 1:
        return ids
    longest = torch.tensor([len(ids)], dtype=torch.int64, device=device)
    dist.all_reduce(longest, op=dist.ReduceOp.MAX, group=groups.replica)
    return ids + [-1 - k for k in range(int(longest.item()) - len(ids))]
