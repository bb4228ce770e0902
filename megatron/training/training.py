"""The training loop: build the iteration transaction from its parts, run it, log, evaluate.

Reads top to bottom: `Trainer.train()` is the loop; `execute`, `reduce` and `step` are the parts
the transaction in `recover_patches/recovery/iteration.py` calls in order.
"""
from __future__ import annotations

import gc
import logging
import time
from collections import deque
from dataclasses import dataclass, field
from typing import Callable

import torch
import torch.distributed as dist
from megatron.core.optimizer_param_scheduler import OptimizerParamScheduler

from megatron.training.checkpointing.state import Progress
from megatron.training.checkpointing import Checkpointer
from megatron.training.config import ModelConfig, StepConfig, TrainingConfig
from megatron.training.initialize import ParallelGroups
from megatron.training.live_job import LiveJob
from megatron.training.metrics import MetricsWriter, gpt_flops, log_line, memory_scalars
from megatron.training.optimizer import Optimizer
from megatron.training.profiling import Profiler
from megatron.training.step.parts import pad_for_unit
from megatron.training.step.probe import Mark, TrainingProbe, no_mark
from megatron.training.step.replica import GPTReplicaStep
from megatron.training.straggler import straggler_line
from megatron.training.step.weight_check import corrupt_a_weight, weight_fingerprint
from recover_patches.collectives import PeerFailure
from recover_patches.faults import FaultInjector
from recover_patches.recovery.agreement import StoreAgreement
from recover_patches.recovery.grad_buffer import GradBuffer
from recover_patches.recovery.grow import GrowBack, JoinRecord, Membership
from recover_patches.recovery.iteration import IterationOutcome, IterationTransaction, LiveReplicas
from recover_patches.recovery.reduce import Totals
from recover_patches.pipeline.sampler import first_microbatch_id
from recover_patches.pipeline.schedule import PipelineSchedule
from recover_patches.pipeline.stage import GPTStage
from recover_patches.workload.policy import even_plan, unit_plan
from recover_patches.log import PLAIN

logger = logging.getLogger(__name__)


@dataclass
class Trainer:
    config: TrainingConfig
    step_config: StepConfig
    model_config: ModelConfig  # the FLOP count reads it
    groups: ParallelGroups
    model: torch.nn.Module
    optimizer: Optimizer
    scheduler: OptimizerParamScheduler
    grads: GradBuffer
    train_stages: list[GPTStage]  # one per model chunk (several: the interleaved schedule)
    valid_stages: list[GPTStage] | None
    schedule: PipelineSchedule  # 1F1B or interleaved, chosen once (step.parts.schedule_for)
    faults: FaultInjector
    metrics: MetricsWriter
    checkpointer: Checkpointer | None = None
    agreement: StoreAgreement | None = None  # recovery on
    log_failure: Callable[[PeerFailure, str], None] | None = None  # printed by every rank
    # where this rank is, for the coordinator's progress verdict (MembershipClient.mark)
    mark: Mark = no_mark
    grow: GrowBack | None = None  # spares and replacements rejoin (recovery on, coordinator)
    # this rank's operations on the coordinator's store so far (MembershipClient.store_ops)
    store_ops: Callable[[], int] | None = None  # None: no coordinator
    # the training thread's host reads so far (the emulated NCCL counts them; None: uncounted)
    host_syncs: Callable[[], int] | None = None
    state: Progress = field(default_factory=Progress)
    # recent records on every rank, so a new logging rank can write what a dead one missed
    history: deque = field(default_factory=lambda: deque(maxlen=1000))

    def __post_init__(self):
        topo, c = self.groups.topology, self.groups.coord
        self.device = self.grads.device
        self.probe = TrainingProbe(self.state, self.faults, self.mark)  # marks and faults
        self.live = LiveReplicas(replica=c.replica, live_replicas=list(range(topo.dp)), epoch=0,
                                 replica_ranks=topo.replica_ranks, unit_ranks=topo.unit_ranks,
                                 # one instance of the distributed optimizer: its shards die
                                 # with their replica
                                 min_replicas=topo.dp if self.one_optimizer_copy
                                 else self.config.min_replicas, replicas=topo.dp)
        self.replica = GPTReplicaStep(
            self.step_config, self.groups,
            self.model, self.optimizer, self.scheduler, self.grads, self.train_stages, self.schedule,
            self.live, self.state, self.probe)
        self.job = LiveJob(self.live, self.replica, self.groups, self.agreement, self.faults,
                           self.metrics, self.model, self.optimizer, self.scheduler, self.state,
                           self.grads, self.history)  # what checkpoints and joins see of the job
        self._was_logging = False
        self._counted: dict[str, int] = {}  # store_ops() and host_syncs() at the last record
        self._skipped_at_last_line = 0
        self.faults.set_actions(inf=self.grads.poison,
                                corrupt=lambda: corrupt_a_weight(self.optimizer))

    @property
    def one_optimizer_copy(self) -> str:
        return self.config.one_optimizer_copy

    @property
    def is_logging_rank(self) -> bool:
        return self.groups.rank == min(self.live.members())

    def writes_records(self) -> bool:
        """Whether this rank writes the metrics records now (the logging rank). One that just
        took over from a lost logging rank first appends the iterations that rank did not
        write, from its own history: whichever record it writes first (an iteration's, a
        join's after the iteration the old one was lost in, an evaluation's)."""
        if not self.is_logging_rank:
            self._was_logging = False
            return False
        if not self._was_logging:
            written = self.metrics.last_iteration()
            for missed in self.history:
                if missed["iteration"] > written:
                    self.metrics.write(missed)
            self._was_logging = True
        return True

    def grow_back_with(self, membership: Membership) -> None:
        """Spares and replacement processes rejoin (recovery on, with the coordinator)."""
        assert self.agreement is not None
        self.grow = GrowBack(live=self.live, agreement=self.agreement, membership=membership,
                             replica=self.job, probe=self.probe, unit_size=self.groups.topology.unit_size)

    def transaction(self) -> IterationTransaction:
        return IterationTransaction(live=self.live, replica=self.replica,
                                    agreement=self.agreement,
                                    drop_lost=self.step_config.drop_lost,
                                    on_failure=self.log_failure, probe=self.probe)

    def regroup(self, label: str, failure: PeerFailure) -> None:
        """The survivors re-form their groups after a failure outside an iteration (the job's
        last save); the transaction is built only then, not after every iteration."""
        self.transaction().regroup(label, failure)

    def counts_since_last_record(self) -> dict[str, int]:
        """store_ops (from every thread) and host_syncs since the last record, or since the loop
        started: the first iteration's are its own, not start-up's (connects, rendezvous)."""
        counts = {}
        for name, counter in (("store_ops", self.store_ops), ("host_syncs", self.host_syncs)):
            if counter is not None:
                now = counter()
                counts[name], self._counted[name] = now - self._counted.get(name, 0), now
        return counts

    # -- the loop --------------------------------------------------------------------------
    def microbatch_ids(self) -> list[int]:
        """The M global ids of the next iteration; M follows --rampup-batch-size or
        --step-batch-size-schedule if given."""
        batches = self.config.batches
        mbs = batches.micro_batch_size
        first = first_microbatch_id(self.state.consumed_samples, mbs)
        m = batches.global_batch_size_at(self.state.consumed_samples) // mbs
        return list(range(first, first + m))

    def train(self, load: bool = True) -> deque:
        """The loop. load=False: a joined spare, whose state came from a live replica."""
        config = self.config
        if self.checkpointer is not None and load:
            self.checkpointer.load(self.job)
        if config.manual_gc:  # Megatron's: no automatic collection pauses inside iterations
            gc.disable()
            gc.collect()
        transaction = self.transaction()
        self.counts_since_last_record()  # start-up's operations are not the first iteration's
        profiler = Profiler(config.profiling, self.groups.rank, self.device.type == "cuda")
        settled = False
        while self.state.iteration < config.train_iters:
            profiler.before(self.state.iteration)
            start = time.perf_counter()
            ids = self.microbatch_ids()
            outcome = transaction.run(self.state.iteration + 1, ids)
            self.state.iteration += 1
            self.state.skipped_iterations += outcome.step.pop("skipped_step")
            self.state.consumed_samples += len(ids) * config.batches.micro_batch_size
            self.record(outcome, time.perf_counter() - start)
            if not settled:  # start-up's longer bounds end with the first commit
                self.groups.settle()
                settled = True
            if self.grow is not None and self.grow.due(outcome.sync):
                self.record_join(self.grow.at_boundary(self.state.iteration, outcome.sync))
            self.finish_iteration()
            profiler.after(self.state.iteration)
        profiler.close()
        self.finish_training()
        return self.history

    def finish_training(self) -> None:
        """With the weight check on: the last step's weights, checked nowhere else, leave their
        fingerprint (the logging rank's shard) in the metrics, to compare across runs."""
        if self.step_config.weight_check_interval:
            self.replica.weights_ready()
            if self.writes_records():
                self.metrics.write({"iteration": self.state.iteration, "final_weights_fingerprint":
                                    f"{weight_fingerprint(self.optimizer.model_params):016x}"})

    def finish_iteration(self) -> None:
        """What every live rank does together after an iteration (and its join, if any): save if
        due, evaluate if due. A spare that just joined runs it too, for the join's iteration."""
        config = self.config
        if config.manual_gc and config.manual_gc_interval \
                and self.state.iteration % config.manual_gc_interval == 0:
            gc.collect()
        if self.checkpointer is not None:  # (the last save, interrupted: regroup and save again)
            self.checkpointer.after_iteration(
                self.job, None if self.agreement is None else self.regroup)
        if config.eval_interval and self.valid_stages is not None \
                and self.state.iteration % config.eval_interval == 0:
            collect = config.manual_gc and config.manual_gc_eval
            if collect:
                gc.collect()
            self.evaluate()
            if collect:
                gc.collect()

    def record(self, outcome: IterationOutcome, seconds: float) -> None:
        config = self.config
        rec = {
            "iteration": self.state.iteration,
            "consumed_samples": self.state.consumed_samples,
            "global_batch_size": len(outcome.ids) * config.batches.micro_batch_size,
            "microbatches": outcome.totals.microbatches,
            "id_sum": outcome.totals.id_sum,
            "tokens": outcome.totals.tokens,
            "ms_per_iteration": seconds * 1000.0,
            "tokens_per_second": outcome.totals.tokens / max(seconds, 1e-9),
            "live_replicas": list(self.live.live_replicas),
            "quotas": {str(r): len(q) for r, q in outcome.assignment.items()},
            "phase_seconds": outcome.seconds,
            "recoveries": [vars(r) for r in outcome.recoveries],
            **outcome.step,
            "skipped_iterations": self.state.skipped_iterations,
        }
        if config.log_throughput:  # per live GPU: the job's GPUs shrink when replicas die
            gpus = len(self.live.live_replicas) * self.groups.topology.tp * self.groups.topology.pp
            rec["tflops_per_gpu"] = gpt_flops(self.model_config, rec["global_batch_size"]) / max(
                seconds, 1e-9) / gpus / 1e12
        if config.log_memory:  # every rank: a successor logs what it recorded
            rec["memory"] = memory_scalars(self.device)
        rec.update(self.counts_since_last_record())
        writes = self.writes_records()  # (catching up on the history before this record)
        self.history.append(rec)
        if not writes:
            return
        self.metrics.write(rec)
        for r in outcome.recoveries:
            logger.info(
                f"iteration {self.state.iteration} round {r.round}: {r.failure} "
                f"(seen in {r.phase}) | epoch {r.epoch}, dead ranks {r.dead}, lost replicas "
                f"{r.lost_replicas} | lost microbatches {r.lost_ids} -> "
                + (", ".join(f"replica {k}: {v}" for k, v in r.replanned.items() if v)
                   or ("none: committed, this rank stepped with the sum it held" if r.rolled_forward
                       else "dropped"))
                + " | " + ", ".join(f"{k} {v * 1000:.0f} ms" for k, v in r.seconds.items())
                + f" | groups kept {len(r.groups_kept)}, shrunk {len(r.groups_shrunk)}, "
                f"rebuilt {len(r.groups_rebuilt)}")
        if self.state.iteration % config.log_interval == 0 or self.state.iteration == 1 \
                or outcome.recoveries:
            skipped = self.state.skipped_iterations
            logger.info(log_line(rec, config.train_iters, skipped - self._skipped_at_last_line),
                        extra=PLAIN)  # Megatron's line, as Megatron prints it
            report = straggler_line(self.replica.timings, config.straggler.count)
            if config.straggler.report and report is not None:
                logger.info(report)
            self._skipped_at_last_line = skipped

    def record_join(self, join: JoinRecord) -> None:
        """Every rank of a join logs it (survivors: their pause; donors: the bandwidth)."""
        if not join.joined and not join.dropped and not join.abandoned:
            return
        pause, transfer = join.seconds.get("pause", 0.0), join.seconds.get("transfer", 0.0)
        moved = ""
        if join.bytes_sent:
            moved = (f", {join.bytes_sent / 2**20:.2f} MiB sent in {transfer * 1000:.0f} ms, "
                     f"{join.bytes_sent / 2**20 / max(transfer, 1e-9):.1f} MiB/s")
        elif join.bytes_received:
            moved = f", {join.bytes_received / 2**20:.2f} MiB received"
        logger.info(
            f"after iteration {join.iteration}, epoch "
            f"{join.epoch}: replicas {join.joined} joined (state from replica {join.donor}{moved}), "
            f"dropped {join.dropped}"
            f"{f', join of {join.abandoned} abandoned' if join.abandoned else ''}; live {join.live}; "
            f"pause {pause * 1000:.0f} ms, "
            f"{join.attempts} attempt(s)")
        if self.writes_records():
            self.metrics.write({"iteration": join.iteration, "join": vars(join)})

    def evaluate(self) -> float | None:
        """Forward-only loss over `--eval-iters` global batches of the validation set. With
        recovery on, a failure costs only this evaluation: the live ranks vote on it like on a
        commit, and if any rank's evaluation broke, all of them skip it (one log line, one
        metrics record) and adopt the new membership before the next iteration."""
        failure: PeerFailure | None = None
        try:
            self.replica.weights_ready()
            loss = self._evaluate()
        except PeerFailure as err:
            if self.agreement is None:
                raise
            self.groups.abandon()  # ranks still blocked on us fail at once
            loss, failure = None, err
        if self.agreement is None or self._evaluation_agreed(failure is None):
            assert loss is not None
            if self.writes_records():
                logger.info(f" validation loss at iteration {self.state.iteration} | "
                            f"lm loss value: {loss:.6E} |", extra=PLAIN)
                self.metrics.write({"iteration": self.state.iteration, "valid_lm_loss": loss})
            return loss
        self.groups.abandon()
        assert self.grow is not None  # recovery is on
        self.record_join(self.grow.at_boundary(self.state.iteration, sync=True, key="eval"))
        reason = str(failure) if failure is not None else "another rank's evaluation failed"
        if self.writes_records():
            logger.warning(f"evaluation at iteration {self.state.iteration} skipped: {reason} | "
                           f"live replicas {self.live.live_replicas}")
            self.metrics.write({"iteration": self.state.iteration, "valid_skipped": reason})
        return None

    def _evaluation_agreed(self, ok: bool) -> bool:
        """Every live rank's evaluation completed (the same answer on all of them)."""
        assert self.agreement is not None
        try:
            return self.agreement.commit_vote(f"eval/{self.state.iteration}", self.live.members(),
                                              reduced_ok=ok).committed
        except PeerFailure:  # gave up waiting for a member: abort was decided for everyone
            return False

    def _evaluate(self) -> float:
        config = self.config
        self.model.eval()
        m = config.batches.global_batch_size // config.batches.micro_batch_size
        assert config.eval_interval  # evaluate() runs only at an evaluation interval
        first = (self.state.iteration // config.eval_interval - 1) * config.eval_iters * m
        total, topo = Totals.of_ids([]), self.groups.topology
        assert self.valid_stages is not None  # train() evaluates only with a validation set
        with torch.no_grad():
            for k in range(config.eval_iters):
                ids = list(range(first + k * m, first + (k + 1) * m))
                mine = pad_for_unit(unit_plan(ids, self.live.live_replicas, topo.unit_size, even_plan).get(
                    self.groups.coord.replica, []), self.groups, self.device)
                done = self.schedule.forward_only(mine, self.valid_stages,
                                                  self.probe.of_evaluation())
                total = total + Totals.of_ids(done.ids, done.tokens, done.loss_sum)
        stats = total.as_tensor().to(self.device)
        if self.groups.dp.size() > 1:
            dist.all_reduce(stats, group=self.groups.dp)
        total = Totals.from_tensor(stats)
        loss_sum = torch.tensor([total.loss_sum], dtype=torch.float64, device=self.device)
        if self.groups.pp.size() > 1:  # the loss lives on the last stage
            dist.all_reduce(loss_sum, group=self.groups.pp)
        return float(loss_sum) / max(total.tokens, 1)
