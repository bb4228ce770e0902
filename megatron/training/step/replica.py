"""This rank's part of one replica in an iteration: the `ReplicaStep` the transaction in
`recover_patches/recovery/iteration.py` drives, phase by phase. It owns what a step touches -- the
gradient buffer, the optimizer, the pipeline link, the compute clock and layer 3's timings --
while the Trainer (`training.py`) keeps the loop, the records and evaluation.
"""
from __future__ import annotations

import dataclasses
import logging
import math
from dataclasses import dataclass, field
from typing import Any, Callable, Mapping

import torch
import torch.distributed as dist
from megatron.core.optimizer_param_scheduler import OptimizerParamScheduler

from megatron.training.checkpointing.state import Progress
from megatron.training.config import StepConfig
from megatron.training.step.commit_vote import confirm
from megatron.training.step.exact_reduction import calibrate_once, fixed_point_overflow
from megatron.training.step.execute_clock import ExecuteClock
from megatron.training.step.finalise import finalise
from megatron.training.initialize import ParallelGroups
from megatron.training.model.moe_metrics import RouterReport, router_report
from megatron.training.step.parts import pad_for_unit
from megatron.training.rerun import (ALARM_LARGE_GRADS, ALARM_NOT_FINITE, ALARM_SPIKY,
                                     SPIKE_INJECTED, Position, SpikeDetector, injected, resolve,
                                     resolve_large_grads, resolve_spike)
from megatron.training.rerun.stats import DeterminismStats, compare_once, report
from megatron.training.step.weight_check import agreed_mismatch, check_due, weight_fingerprint
from megatron.training.optimizer import (Optimizer, clip_factor, global_grad_norm,
                                         tp_partial_grads)
from recover_patches.collectives import NO_PROBE, PeerFailure, Probe, Regrouped
from recover_patches.recovery.grad_buffer import GradBuffer, ReducedGradients, Scatter
from recover_patches.recovery.iteration import LiveReplicas
from recover_patches.recovery.reduce import Totals
from recover_patches.pipeline.sampler import first_microbatch_id
from recover_patches.pipeline.schedule import PipelineSchedule, ScheduleResult
from recover_patches.pipeline.stage import GPTStage
from recover_patches.workload.policy import even_plan, stable_plan, unit_plan, unit_timings
from recover_patches.workload.throughput import MicrobatchTimer, timings_from_wire

logger = logging.getLogger(__name__)


@dataclass
class GPTReplicaStep:
    config: StepConfig
    groups: ParallelGroups
    model: torch.nn.Module
    optimizer: Optimizer
    scheduler: OptimizerParamScheduler
    grads: GradBuffer
    stages: list[GPTStage]  # one per model chunk
    schedule: PipelineSchedule
    live: LiveReplicas  # read here; changed only by the transaction and the join
    progress: Progress  # the trainer's counters: read here, advanced by the trainer
    probe: Probe = NO_PROBE
    timer: MicrobatchTimer = field(init=False)
    # layer 3's per-replica seconds per microbatch, as published in the last commit
    timings: dict[int, float | None] = field(default_factory=dict)
    # the distributed optimizer's all-gather failed after a commit: this replica's weights
    # miss slices that other instances hold (replica-agreed at the end of the step)
    weights_stale: bool = False
    _finalised: tuple[float, dict] = (math.nan, {})  # the last reduction's norm and zero count
    _injected_at: int = 0  # --error-injection-rate: the iteration last injected into
    spikes: SpikeDetector | None = field(init=False)  # --check-for-spiky-loss, last stage
    grad_spikes: SpikeDetector | None = field(init=False)  # --check-for-large-grads, every rank
    aux_report: RouterReport | None = field(init=False)
    determinism: DeterminismStats = field(default_factory=DeterminismStats)  # report_stats

    def __post_init__(self):
        self.params = self.optimizer.model_params  # the order the optimizer takes gradients in
        self.tp_partial = tp_partial_grads(self.model, self.params)  # summed over TP
        self.device = self.grads.device
        self.timer = MicrobatchTimer(pipeline_depth=self.groups.topology.pp,
                                     chunks=self.config.chunks, group=self.config.vp_group)
        self.clock = ExecuteClock(self.device)  # compute time for layer 3's balance
        self.optimizer.watch_gathers(lambda: self.probe.at("param_gather"), self.model if (  # FSDP
            self.config.overlap_param_gather or self.groups.topology.fsdp > 1) else None)
        self.grads.scatter_into(self.scatter_while(self.live.live_replicas))
        self.spikes = (SpikeDetector() if self.config.rerun.checks_spikes
                       and self.groups.is_last_stage else None)
        self.grad_spikes = SpikeDetector() if self.config.rerun.checks_grads else None
        self.aux_report = router_report(self.stages[0].model.config)  # MoE's records

    # -- the phases, in the transaction's order ----------------------------------------------
    def plan(self, ids, replicas):
        return unit_plan(ids, replicas, self.groups.topology.unit_size, self._place)

    def _place(self, ids, replicas):  # (over units, each by its first replica, with EP > 1)
        topo = self.groups.topology
        if self.config.drop_lost:  # the replica-dropping baseline: dead replicas' shares are lost
            return even_plan(ids, range(0, topo.dp, topo.unit_size))
        if self.config.even_balance:
            return even_plan(ids, replicas)
        return stable_plan(ids, replicas, unit_timings(self.timings, topo.unit_size), topo.pp,
                           min_gain=0.10, chunks=self.config.chunks, group=self.config.vp_group)

    def first_id(self) -> int:
        """The iteration's first microbatch id: the same on every replica, whatever the plan."""
        return first_microbatch_id(self.progress.consumed_samples, self.config.micro_batch_size)

    def refresh(self) -> None:
        if self.weights_stale:
            raise PeerFailure(self.live.epoch, (), "distopt.param_gather",
                              "the last step's weight all-gather failed in this replica")

    def execute(self, ids: list[int]) -> ScheduleResult:
        ids = pad_for_unit(ids, self.groups, self.device)  # MoE: the unit runs in step
        self.model.train()
        calibrate_once(self.grads, lambda first: self._schedule(first, lambda *_: None),
                       self.first_id)  # (the first exponents, before anything counts)
        self.clock.start()
        done = self._schedule(ids, self.grads.arm)
        self.clock.stop(len(ids))
        self._empty_cache(1)
        iteration = self.progress.iteration + 1
        if self._injected_at != iteration and self.config.rerun.injects(
                iteration, self.groups.coord.replica, self.groups.topology.dp):
            self._injected_at = iteration  # the replica's first computation of the iteration
            done = dataclasses.replace(done, loss_sum=injected(
                done.loss_sum, self.config.rerun, iteration, self.groups.coord.replica,
                self.groups.topology.dp))
            if self.config.rerun.checks_grads:
                self.grads.amplify_local(SPIKE_INJECTED)
        return done

    def _schedule(self, ids: list[int], arm: Callable[..., None]) -> ScheduleResult:
        return self.schedule.train(ids, self.stages, self.probe, arm)

    def _empty_cache(self, level: int) -> None:
        """--empty-unused-memory-level: 1 after the passes, 2 also after the step (Megatron's)."""
        if self.config.empty_cache_level >= level and self.params[0].is_cuda:
            torch.cuda.empty_cache()

    def reduce(self, local: Totals) -> ReducedGradients:
        self.probe.at("dp_reduce")
        # each replica's microbatch time rides in the last bucket, one slot per replica, and so
        # does the weights' fingerprint when a check is due
        fingerprint = 0
        if self.weight_check_due():
            self.weights_ready()
            fingerprint = weight_fingerprint(self.params)
        time_wire, alarm = self._measured_time(), self._alarm(local)
        if self.groups.coord.cp:  # the reduction spans DP x CP: a replica's CP ranks add
            # their tokens and losses, its first CP rank alone its ids and its replica's slots
            local = Totals(0, local.tokens, 0, 0, local.loss_sum, local.measures)
            time_wire, fingerprint, alarm = 0.0, 0, 0.0
        reduced = self.grads.reduce(local, self.groups.coord.replica, time_wire, fingerprint,
                                    alarm)
        self.probe.at("reduced")
        # NCCL: the reduction's own failure first (a wait returned before the device finished),
        # not a finalisation's collective that waits on a replica-mate gone to recover from it
        self.groups.raise_latched()
        # Megatron's finalisation and the norm, before the vote (`finalise.py` says why)
        self._finalised = finalise(self.grads, self.optimizer, self.groups, self.params,
                                   self.tp_partial, reduced, exact=self.config.exact_reduction,
                                   log_num_zeros=self.config.log_num_zeros)
        return reduced

    def confirm(self, news: bool) -> bool:
        """4: the ack over the DP group, then the exchange over the replica's group
        (`step/commit_vote.py`)."""
        return confirm(self.groups, self.device, self.probe, news, self.live.epoch)

    def _alarm(self, local: Totals) -> float | torch.Tensor:
        """--rerun-mode validate_results: ALARM_NOT_FINITE if this replica's own loss sum is not
        finite, ALARM_SPIKY if its loss per token spikes (--check-for-spiky-loss),
        ALARM_LARGE_GRADS if a rank's gradient norm does (--check-for-large-grads), on the device
        (no host wait); the replica's ranks share the largest (PP > 1: the last stage holds the
        loss) before the reduction, where a failure is any failure of the reduce phase."""
        if not self.config.rerun.validating:
            return 0.0
        loss = torch.as_tensor(local.loss_sum, dtype=torch.float64, device=self.device)
        alarm = (~torch.isfinite(loss)).to(torch.float32).reshape(1) * ALARM_NOT_FINITE
        if self.spikes is not None:
            spiky = self.spikes.spiky(loss / max(local.tokens, 1)).reshape(1)
            alarm = torch.maximum(alarm, spiky.to(alarm.dtype) * ALARM_SPIKY)
        if self.grad_spikes is not None:  # this rank's shard, per microbatch, unscaled
            scaler = self.optimizer.scaler
            per = max(local.microbatches, 1) * (1.0 if scaler is None else scaler.scale)
            large = self.grad_spikes.spiky(self.grads.local_norm() / per).reshape(1)
            alarm = torch.maximum(alarm, large.to(alarm.dtype) * ALARM_LARGE_GRADS)
        topo = self.groups.topology  # (the last stage holds the loss; CP ranks each a part)
        if self.groups.replica.size() > 1 and (topo.pp > 1 or topo.cp > 1
                                               or self.grad_spikes is not None):
            dist.all_reduce(alarm, op=dist.ReduceOp.MAX, group=self.groups.replica)
        return alarm[0]

    def check_reduced(self) -> None:
        self.groups.raise_latched()

    def validate(self, reduced: ReducedGradients, local: Totals,
                 assignment: Mapping[int, list[int]]) -> None:
        """--rerun-mode validate_results: a replica whose own loss was not finite (its alarm
        rode in the reduction) has its microbatches re-run on another replica (`rerun.py`)."""
        alarms = reduced.replica_alarms
        not_finite = [r for r, alarm in enumerate(alarms) if alarm == ALARM_NOT_FINITE]
        spiky = [r for r, alarm in enumerate(alarms) if alarm == ALARM_SPIKY]
        large = [r for r, alarm in enumerate(alarms) if alarm == ALARM_LARGE_GRADS]
        c, topo = self.groups.coord, self.groups.topology
        at = Position(self.progress.iteration + 1, c.replica, tuple(self.live.live_replicas),
                      topo.dp, self.live.epoch, self.groups.is_last_stage,
                      c.tp + topo.tp * c.pp, topo.tp * topo.pp, topo.unit_size)
        if self.config.rerun.mode == "report_stats":  # every iteration: one replica re-run
            self.determinism.record(compare_once(self, at, dict(assignment), local.loss_sum))
            report(self.determinism, at.iteration, self.groups.rank == min(self.live.members()))
        if not self.config.rerun.validating or not (not_finite or spiky or large):
            return
        if not_finite:  # first: a non-finite loss stops or fences on its own
            resolve(self, self.config.rerun, at, not_finite, dict(assignment))
        elif large:
            resolve_large_grads(self, self.config.rerun, at, large, dict(assignment),
                                float(self.grads.local_norm()))
        else:
            resolve_spike(self, self.config.rerun, at, spiky, dict(assignment), local.loss_sum)

    def rerun(self, ids: list[int]) -> Any:
        return self._rerun(ids, lambda done, before: done.loss_sum)

    def rerun_gradient_norm(self, ids: list[int]) -> float:
        return self._rerun(ids, lambda done, before: float(self.grads.local_norm(since=before)))

    def _rerun(self, ids: list[int], result: Callable[[ScheduleResult, Any], Any]) -> Any:
        before = self.snapshot()
        # a re-run is never the injected computation
        self._injected_at = self.progress.iteration + 1
        try:
            return result(self.execute(ids), before)
        finally:
            self.restore(before)

    def share(self, values: list[float]) -> list[float]:
        wire = torch.tensor(values, dtype=torch.float64, device=self.device)
        if self.groups.dp.size() > 1:
            dist.all_reduce(wire, group=self.groups.dp)
        if self.groups.replica.size() > 1:
            dist.all_reduce(wire, op=dist.ReduceOp.MAX, group=self.groups.replica)
        return wire.tolist()

    def ranks_of(self, replica: int) -> list[int]:
        return self.live.replica_ranks(replica)

    def step(self, reduced: ReducedGradients) -> dict:
        """Megatron's order, from the norm `reduce` measured before the vote (`finalise.py`):
        the overflow check, clip, step -- or skip it on an fp16 overflow (`skipped_step`)."""
        checked = self.check_weights_agree(reduced) if self.weight_check_due() else {}
        grads = [self.grads.reduced_grad(p) for p in self.params]
        tokens = max(reduced.totals.tokens, 1)
        scaler = self.optimizer.scaler
        scale = 1.0 if scaler is None else scaler.scale
        # NCCL: the norm's host read returned once the watchdog or an epoch aborted a stuck
        # collective, with whatever its buffer held; `check_reduced` and the vote raised that
        # failure before any commit, so a step never uses such a norm
        grad_norm, extra = self._finalised[0], dict(self._finalised[1])
        overflow = not math.isfinite(grad_norm)
        if scaler is not None:
            scaler.update(overflow)
        skipped = overflow and scaler is not None  # same norm on every rank: same decision
        skipped = fixed_point_overflow(self.grads, reduced) or skipped  # (then the same)
        if not skipped:
            factor = clip_factor(grad_norm, self.config.clip_grad)
            if factor != 1.0:
                self.grads.scale_gradients(factor)
            self._optimizer_step(grads, reduced.totals.microbatches)
            self._empty_cache(2)
        if self.config.log_params_norm:  # the fp32 main params, after the step
            extra["params_norm"] = global_grad_norm(self.params, self.optimizer.main_params,
                                                    self.groups.replica_positions,
                                                    self.groups.coord.tp)
        self.grads.zero()
        loss, aux = self._share_loss_and_times(reduced)
        return {"lm_loss": loss / tokens, **({"moe_losses": aux} if aux else {}),
                "grad_norm": grad_norm,
                "lr": self.optimizer.param_groups[0]["lr"], "loss_scale": scale,
                "skipped_step": skipped, **extra,
                **checked,
                **({"reduce_scattered": True} if reduced.scattered else {})}

    def _optimizer_step(self, grads: list, microbatches: int) -> None:
        self.probe.at("optimizer")
        try:
            self.optimizer.step(grads)
            if self.config.log_params_norm:
                self.weights_ready()
        except PeerFailure as err:  # only the distributed optimizer's weight all-gathers
            if not self.config.recovering:
                raise
            # committed and stepped: every slice's new state lives in some instance, and
            # the next iteration's recovery re-shards it (`rebuild`) before computing
            logger.warning(f"weights incomplete until the next recovery: {err}")
            self.weights_stale = True
        self.scheduler.step(increment=microbatches * self.config.micro_batch_size)

    def _share_loss_and_times(self, reduced: ReducedGradients) -> tuple[float, dict]:
        """The loss lives on the last stage, the times are the slowest stage's: the replica's
        ranks take the largest of each (and MoE's router records, `model/moe_metrics.py`). Returns
        the loss sum and the auxiliary losses' values; keeps the timings."""
        report, tp, tp_rank = self.aux_report, self.groups.topology.tp, self.groups.coord.tp
        rows = report.rows(reduced.totals.measures, tp, tp_rank) if report else []
        shared = torch.tensor([reduced.totals.loss_sum, float(self.weights_stale), *rows,
                               *reduced.replica_times], dtype=torch.float64, device=self.device)
        if self.groups.replica.size() > 1:
            dist.all_reduce(shared, op=dist.ReduceOp.MAX, group=self.groups.replica)
        values = shared.tolist()
        self.groups.raise_latched_of(self.groups.replica)  # (as the norm's, in `step`)
        self.weights_stale = bool(values[1])  # all of the replica's ranks recover together
        self.timings = timings_from_wire(dict(enumerate(values[2 + len(rows):])))
        aux = report.conclude(values[2:2 + len(rows)], tp, reduced.totals.microbatches,
                              self.model) if report else {}  # (and the experts' biases move)
        return values[0], aux

    # -- recovery ------------------------------------------------------------------------------
    def abandon(self, phase: str = "execute") -> None:
        self.groups.abandon(phase)

    def rebuild(self, live_replicas: list[int], epoch: int, key: str) -> Regrouped:
        """Groups for the agreed live replicas (only what broke is rebuilt); the distributed
        optimizer's shards follow."""
        regrouped = self.groups.regroup(live_replicas, epoch, key)
        self.grads.scatter_into(self.scatter_while(live_replicas))
        self.optimizer.reshard(*self.groups.optimizer_domains(live_replicas))
        self.weights_stale = False  # the reshard gathered every slice afresh
        return regrouped

    def mend(self, epoch: int, key: str) -> Regrouped:
        return self.groups.mend(epoch, key)

    def weights_torn(self) -> bool:  # (the weights' all-gathers, --use-distributed-optimizer)
        return any(g.broke("allgather") for g in self.groups.resilient_groups())

    def replica_any(self, flag: bool) -> bool:
        """True on every rank of this replica if any of them passes True (recovery only)."""
        value = torch.tensor([int(flag)], dtype=torch.int32, device=self.device)
        if self.groups.replica.size() > 1:
            dist.all_reduce(value, op=dist.ReduceOp.MAX, group=self.groups.replica)
        return bool(value.item())

    def reset(self) -> None:
        self.grads.zero()

    def snapshot(self) -> Any:
        return self.grads.snapshot()

    def restore(self, state: Any) -> None:
        self.grads.restore(state)

    # -- around the phases ---------------------------------------------------------------------
    def scatter_while(self, live_replicas: list[int]) -> Scatter | None:
        """The distributed optimizer reduce-scatters the gradients while every replica is live
        (the instances then split every bucket alike); otherwise it takes them all-reduced."""
        g = self.groups
        if not self.optimizer.shards_gradients() or len(live_replicas) < g.topology.dp:
            return None
        dense, experts = g.optimizer_sharding()  # MoE: the experts' over their own holders
        expert = None if experts is None else Scatter(experts.instance, g.position, experts.shard,
                                                      experts.shards)
        return Scatter(dense.instance, g.position, dense.shard, dense.shards, expert)

    def weights_ready(self) -> None:
        """Before reading the weights outside a forward (save, evaluate, a join, a check): the
        overlapped all-gathers of --overlap-param-gather land first (PeerFailure if one failed)."""
        self.optimizer.finish_gather()

    def adopt_timings(self, timings: dict[int, float | None]) -> None:
        """A joining replica takes the donor's published timings (its plans must match)."""
        self.timings = dict(timings)

    def weight_check_due(self) -> bool:
        return check_due(self.config.weight_check_interval, self.progress.iteration)

    def check_weights_agree(self, reduced: ReducedGradients) -> dict:
        """Each DP group compares its shard among the replicas holding the same experts (EP);
        the replica group agrees on the verdict, so every rank stops, not only the shard's.
        Returns the record's entries: when, and this rank's shard's fingerprint."""
        hashes = {r: reduced.replica_weight_hashes[r] for r in self.live.live_replicas}
        done = self.progress.iteration
        agreed_mismatch(hashes, self.groups.topology.ep, self.groups.replica, self.device, done)
        return {"weights_checked_after": done,
                "weights_fingerprint": f"{hashes[self.groups.coord.replica]:016x}"}

    def _measured_time(self) -> float:
        seconds, executed = self.clock.take()
        if executed and seconds > 0:
            self.timer.update(seconds, executed)
        return self.timer.to_wire()
