"""The training loop: build the iteration transaction from its parts, run it, log, evaluate.

Reads top to bottom: `Trainer.train()` is the loop, `Trainer.step()` is DESIGN §4 step 5.
"""
from __future__ import annotations

import time
from dataclasses import dataclass, field

import torch
import torch.distributed as dist

from megatron.training.arguments import global_batch_size_at
from megatron.training.initialize import ParallelGroups
from megatron.training.metrics import MetricsWriter, log_line, print_rank_line
from megatron.training.optimizer import clip_grads, sync_tied_embedding_grads
from recover_patches.p2p import StageLink
from recover_patches.recovery.iteration import IterationOutcome, IterationTransaction
from recover_patches.recovery.reduce import ReducedGradients, Totals, reduce_gradients
from recover_patches.sampler import MicrobatchSampler, first_microbatch_id
from recover_patches.schedule import run_1f1b, run_forward_only
from recover_patches.stage import GPTStage
from recover_patches.workload.policy import even_plan


@dataclass
class TrainState:
    iteration: int = 0
    consumed_samples: int = 0


@dataclass
class Trainer:
    args: object
    groups: ParallelGroups
    model: torch.nn.Module
    optimizer: torch.optim.Optimizer
    scheduler: object
    train_stage: GPTStage
    valid_stage: GPTStage | None
    link: StageLink
    faults: object  # recover_patches.faults.FaultInjector: `.at(phase, iteration, microbatch)`
    metrics: MetricsWriter
    checkpointer: object | None = None  # `.load(trainer)`, `.after_iteration(trainer)`
    state: TrainState = field(default_factory=TrainState)
    history: list[dict] = field(default_factory=list)

    def __post_init__(self):
        self.params = [p for p in self.model.parameters() if p.requires_grad]
        self.live_replicas = list(range(self.groups.topology.dp))
        self.is_logging_rank = self.groups.rank == 0

    def hook(self, phase: str, microbatch: int | None = None) -> None:
        """Injection/observation point; iterations are numbered from 1 as in the logs."""
        self.faults.at(phase, self.state.iteration + 1, microbatch)

    # -- the pieces of the transaction -------------------------------------------------------
    def execute(self, ids: list[int]):
        self.model.train()
        return run_1f1b(ids, self.train_stage, self.link, self.hook)

    def reduce(self, local: Totals) -> ReducedGradients:
        self.hook("dp_reduce")
        return reduce_gradients(self.params, local, self.groups.dp)

    def step(self, reduced: ReducedGradients) -> dict:
        reduced.write_to(self.params)
        sync_tied_embedding_grads(self.params, self.groups.embedding)
        tokens = max(reduced.totals.tokens, 1)
        for p in self.params:
            p.grad.div_(tokens)  # the global token mean: DESIGN §7
        grad_norm = clip_grads(self.params, self.args.clip_grad, self.groups.replica,
                               self.groups.coord.tp)
        self.hook("optimizer")
        self.optimizer.step()
        self.scheduler.step(increment=reduced.totals.microbatches * self.args.micro_batch_size)
        self.optimizer.zero_grad(set_to_none=True)
        loss = self._stage_sum(reduced.totals.loss_sum) / tokens
        return {"lm_loss": loss, "grad_norm": grad_norm,
                "lr": self.optimizer.param_groups[0]["lr"]}

    def _stage_sum(self, value: float) -> float:
        """Only the last stage holds the loss; sum over the pipeline so every rank knows it."""
        t = torch.tensor([value], dtype=torch.float64)
        if self.groups.pp.size() > 1:
            dist.all_reduce(t, group=self.groups.pp)
        return float(t)

    # -- the loop --------------------------------------------------------------------------
    def microbatch_ids(self) -> list[int]:
        """The M global ids of the next iteration; M follows --rampup-batch-size if given."""
        mbs = self.args.micro_batch_size
        first = first_microbatch_id(self.state.consumed_samples, mbs)
        return list(range(first, first + global_batch_size_at(self.args, self.state.consumed_samples) // mbs))

    def train(self) -> list[dict]:
        args = self.args
        transaction = IterationTransaction(
            replica=self.groups.coord.replica, live_replicas=self.live_replicas,
            plan=even_plan, execute=self.execute, reduce=self.reduce, step=self.step)
        if self.checkpointer is not None:
            self.checkpointer.load(self)
        while self.state.iteration < args.train_iters:
            start = time.perf_counter()
            outcome = transaction.run(self.state.iteration, self.microbatch_ids())
            self.state.iteration += 1
            self.state.consumed_samples += len(outcome.ids) * args.micro_batch_size
            self.record(outcome, time.perf_counter() - start)
            if self.checkpointer is not None:
                self.checkpointer.after_iteration(self)
            if args.eval_interval and self.valid_stage is not None \
                    and self.state.iteration % args.eval_interval == 0:
                self.evaluate()
        return self.history

    def record(self, outcome: IterationOutcome, seconds: float) -> None:
        args = self.args
        rec = {
            "iteration": self.state.iteration,
            "consumed_samples": self.state.consumed_samples,
            "global_batch_size": len(outcome.ids) * args.micro_batch_size,
            "microbatches": outcome.totals.microbatches,
            "tokens": outcome.totals.tokens,
            "ms_per_iteration": seconds * 1000.0,
            "tokens_per_second": outcome.totals.tokens / max(seconds, 1e-9),
            "quotas": {str(r): len(q) for r, q in outcome.assignment.items()},
            "phase_seconds": outcome.seconds,
            **outcome.step,
        }
        self.history.append(rec)
        if self.is_logging_rank:
            self.metrics.write(rec)
            if self.state.iteration % args.log_interval == 0 or self.state.iteration == 1:
                print_rank_line(log_line(rec, args.train_iters))

    def evaluate(self) -> float:
        """Forward-only loss over `--eval-iters` global batches of the validation set."""
        args = self.args
        self.model.eval()
        m = args.num_microbatches_per_iteration
        first = (self.state.iteration // args.eval_interval - 1) * args.eval_iters * m
        total = Totals.of_ids([])
        with torch.no_grad():
            for k in range(args.eval_iters):
                ids = list(range(first + k * m, first + (k + 1) * m))
                mine = even_plan(ids, self.live_replicas).get(self.groups.coord.replica, [])
                done = run_forward_only(mine, self.valid_stage, self.link)
                total = total + Totals.of_ids(done.ids, done.tokens, done.loss_sum)
        stats = total.as_tensor()
        if self.groups.dp.size() > 1:
            dist.all_reduce(stats, group=self.groups.dp)
        total = Totals.from_tensor(stats)
        loss = self._stage_sum(total.loss_sum) / max(total.tokens, 1)
        if self.is_logging_rank:
            print_rank_line(f" validation loss at iteration {self.state.iteration} | "
                            f"lm loss value: {loss:.6E} |")
            self.metrics.write({"iteration": self.state.iteration, "valid_lm_loss": loss})
        return loss


def build_stage(args, groups: ParallelGroups, model, dataset, tracker) -> GPTStage:
    return GPTStage(model, MicrobatchSampler(dataset, args.micro_batch_size), tp_group=groups.tp,
                    tracker=tracker, seed=args.seed, pp_stage=groups.coord.pp,
                    tp_rank=groups.coord.tp, is_first=groups.is_first_stage,
                    is_last=groups.is_last_stage)
