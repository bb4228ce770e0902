"""ReCoVer's drop-in for Megatron-LM's `pretrain_gpt.py`: same flags, plus `--recover-*`.

    python -m recover_patches.launch --nproc-per-node 4 pretrain_gpt_recover.py <Megatron flags>

A rank whose replica breaks waits as a spare (--recover-spares on) until its replica is re-formed,
with replacement processes the launcher starts for the dead ranks (--max-replacements); a
replacement process (RECOVER_INCARNATION > 0) starts as such a spare. A standby process
(RECOVER_STANDBY, from `launch --standby`) first waits for the coordinator to give it a dead
rank's slot, then starts as that slot's replacement.

Exit status: 0 done (also: a survivor of a broken replica that left cleanly), 2 user error,
3 the job stopped because too few complete replicas remain (or a rank died with --recover off, or
the replicas' weights differ under --check-weight-hash-across-dp-replicas-interval): restart from
the checkpoint named in the message.
"""
from __future__ import annotations

import faulthandler
import logging
import os
import signal
import sys
import warnings
from typing import Any, NamedTuple

from megatron.training.errors import EXIT_RESTART, EXIT_USER_ERROR
from recover_patches.log import configure, hide_library_notes, set_level

hide_library_notes()
warnings.filterwarnings("ignore", message=".*full scope.*")  # megatron-core's own default

logger = logging.getLogger(__name__)


def _user_error(text: str) -> int:
    print(f"pretrain_gpt_recover.py: error: {text}", file=sys.stderr, flush=True)
    return EXIT_USER_ERROR


def _report_epochs(membership) -> None:
    """Every rank logs the moment it learns of a new membership epoch, naming the dead ranks, so
    each survivor's log shows when it knew (tests time these lines). Runs on the membership
    watcher thread, which must never die of a logging error."""
    def report(epoch: int, dead: frozenset[int]) -> None:
        try:
            logger.info(f"membership epoch {epoch}: dead ranks {sorted(dead)}")
        except Exception:
            pass
    membership.add_listener(report)


def _wait_as_standby(standby: str) -> int | None:
    """A standby process waits for a slot; None once it has one (it is now that rank), else
    the exit status: the job completed or stopped without needing it."""
    from recover_patches.collectives.errors import CoordinatorError
    from recover_patches.collectives.standby import JobEnded, become, wait_for_slot
    logger.info(f"standby {standby}: waiting for the slot of a dead rank")
    try:
        outcome = wait_for_slot(standby)
    except CoordinatorError as err:
        logger.info(f"standby {standby}: stopping: {err}")
        return EXIT_RESTART
    if outcome is JobEnded.COMPLETE:
        logger.info(f"standby {standby}: the job completed without needing it: exiting")
        return 0
    if outcome is JobEnded.STOPPED:
        logger.info(f"standby {standby}: the job stopped (no replica holds the training state): exiting")
        return EXIT_RESTART
    become(outcome)
    configure(outcome.rank, stream="stdout")
    logger.info(f"standby {standby} takes this rank (incarnation {outcome.incarnation})")
    return None


class _Exit(Exception):
    """Start-up ends here with this exit status (a user error was already printed)."""

    def __init__(self, status: int):
        super().__init__(status)
        self.status = status


def main(argv: list[str] | None = None) -> int:
    """Parse and check everything a user can get wrong, join the membership, build the trainer,
    train; the exit status says how it ended."""
    # a stuck rank's threads, on request (a bounded run's last look before its kill; the exit
    # signal's handler, installed later, replaces this one if it is the same signal)
    faulthandler.register(signal.SIGUSR2, all_threads=True)
    try:
        args, layout = _parse(argv)
        inputs = _check_inputs(args, layout)  # the run's configuration, built once
        del args  # from here on: inputs.run (the Namespace goes on only in checkpoints)
        incarnation = int(os.environ.get("RECOVER_INCARNATION", "0"))  # > 0: a replacement
        membership = _join_membership(inputs.run, incarnation)
    except _Exit as done:
        return done.status
    trainer = _build_trainer(inputs.run, membership, incarnation, inputs)
    return _train(inputs.run, trainer, membership, incarnation)


def _parse(argv: list[str] | None) -> tuple:
    """The flags (exit 2 on a bad one); a standby process first waits here for its slot."""
    import torch

    from megatron.training.arguments import parse_and_validate
    from megatron.training.config import RunLayout
    from megatron.training.initialize import env_rank_world
    from recover_patches.collectives.standby import standby_id

    env_rank, world = env_rank_world()
    configure(None if standby_id() is not None else env_rank, stream="stdout")
    device = "cuda" if torch.cuda.is_available() else "cpu"
    args = parse_and_validate(argv, world_size=world, device=device)
    level = os.environ.get("MEGATRON_LOGGING_LEVEL")  # the flag wins, as in Megatron-LM
    level = args.logging_level if args.logging_level is not None else level
    if level is not None:
        set_level(int(level))
    if args.coordinator_addr:  # the flags win over the launcher's env
        os.environ["RECOVER_COORDINATOR"] = args.coordinator_addr
    if args.job_token:
        os.environ["RECOVER_JOB_TOKEN"] = args.job_token
    if standby_id() is not None:
        if not args.recover:
            raise _Exit(_user_error(
                "RECOVER_STANDBY: a standby process takes over a dead rank in the running job, "
                "which needs --recover on. Fix: drop --recover off or start no standby nodes"))
        if (ended := _wait_as_standby(str(standby_id()))) is not None:
            raise _Exit(ended)
    return args, RunLayout.from_args(args, world, device)  # a standby's slot is known now


class _Inputs(NamedTuple):
    """The run's configuration and what it reads, checked once."""
    run: Any  # RunConfig
    tokenizer: Any
    faults: Any  # FaultInjector
    checkpointer: Any  # its --load validated


def _check_inputs(args, layout) -> _Inputs:
    """User errors first, before any process group exists or anything is written: the tokenizer,
    the data, the fault specs, --load. One line and exit 2 each. The run's configuration is
    built here, once the tokenizer says how large the vocabulary is."""
    from megatron.training.errors import UserError
    from megatron.training.checkpointing import Checkpointer
    from megatron.training.config.io import TokenizerConfig
    from megatron.training.config.run import RunConfig
    from megatron.training.data.datasets import validate_data
    from megatron.training.data.tokenizer import build_tokenizer, padded_vocab_size
    from recover_patches.faults import FaultInjector, FaultSpecError
    try:
        tokenizer = build_tokenizer(TokenizerConfig.from_args(args))
        vocab = padded_vocab_size(tokenizer.vocab_size, args.make_vocab_size_divisible_by,
                                  args.tensor_model_parallel_size)
        run = RunConfig.from_args(args, layout, vocab, recovering=bool(
            args.recover and os.environ.get("RECOVER_COORDINATOR")))
        for line in validate_data(run.data, tokenizer):  # --fim-data's tokens
            if layout.rank == 0:
                logger.info(line)
        faults = FaultInjector.from_specs(list(run.fault_tolerance.inject_fault), layout.rank)
        # validates --load before anything runs
        checkpointer = Checkpointer(run.checkpoint, layout.rank, layout.world_size)
    except UserError as err:  # data, tokenizer, checkpoint: one line, exit 2
        raise _Exit(_user_error(f"{err.flag}: {err.message}. Fix: {err.fix}")) from None
    except FaultSpecError as err:
        raise _Exit(_user_error(str(err))) from None
    return _Inputs(run, tokenizer, faults, checkpointer)


def _join_membership(run, incarnation: int):
    """The coordinator's membership client (None: no coordinator, recovery off). torch's NCCL
    settings go into the environment first: torch reads them when a group is made."""
    from recover_patches.collectives.errors import CoordinatorError, SlotTaken
    recover = run.fault_tolerance.recover  # --coordinator-addr is in the environment by now
    if incarnation and not (recover and os.environ.get("RECOVER_COORDINATOR")):
        raise _Exit(_user_error(
            "RECOVER_INCARNATION: a replacement process needs in-job recovery (--recover on) and "
            "the coordinator. Fix: start it with `python -m recover_patches.launch "
            "--max-replacements K`"))
    if not os.environ.get("RECOVER_COORDINATOR"):
        if recover:
            logger.info("no coordinator (RECOVER_COORDINATOR unset, e.g. under torchrun): in-job "
                        "recovery is off; start with `python -m recover_patches.launch` to enable "
                        "it")
        return None
    from megatron.training.checkpointing.ft_timeouts import recover_timeout
    from recover_patches.collectives import nccl_env
    from recover_patches.collectives.membership import MembershipClient
    refused = nccl_env.conflicts(os.environ)  # a rank started without our launcher
    if refused:
        raise _Exit(_user_error(refused[0]))
    nccl_env.apply(os.environ)  # before any process group exists: torch reads it then
    layout = run.layout
    topology = run.parallel.topology(layout.world_size)
    try:  # the coordinator learns which slots' deaths break this rank's replica (its unit)
        membership = MembershipClient.from_env(timeout=recover_timeout(
            run.fault_tolerance.ft, run.fault_tolerance.timeout, layout.rank),
            startup=run.parallel.startup_seconds,
            unit=topology.unit_ranks(topology.replica_of(layout.rank)))
    except SlotTaken as err:  # our launcher's replacement came after a standby took the slot
        logger.info(f"{err}: leaving")
        raise _Exit(0) from None
    except CoordinatorError as err:
        raise _Exit(_user_error(f"--coordinator-addr / RECOVER_COORDINATOR: {err}")) from None
    _report_epochs(membership)
    return membership


def _build_trainer(run, membership, incarnation: int, inputs: _Inputs):
    """Groups, model, optimizer, buffers and the trainer around them; with recovery on, the
    commit agreement and growing back."""
    from megatron.training.data.datasets import build_datasets
    from megatron.training.metrics import MetricsWriter
    from megatron.training.optimizer.setup import build_scheduler
    from megatron.training.step.parts import build_stages, replica_vote, schedule_for
    from megatron.training.collective_backend import host_sync_counter
    from megatron.training.training import Trainer
    from recover_patches.recovery.agreement import StoreAgreement

    device, groups, tracker, model, optimizer, grads = _build_model_parts(run, membership,
                                                                         incarnation)
    data, step, model_config = run.data, run.step, run.model
    train_ds, valid_ds, _ = build_datasets(data, inputs.tokenizer)
    recovering = membership is not None and run.fault_tolerance.recover
    assert recovering == step.recovering  # decided with the configuration, before the join

    def stages(dataset, scaler=None):
        return build_stages(data, step.micro_batch_size, groups, model, dataset, tracker, scaler,
                            step.exact_reduction)
    trainer = Trainer(
        config=run.training, step_config=step, model_config=model_config,
        groups=groups, model=model, optimizer=optimizer,
        scheduler=build_scheduler(optimizer, run.schedule), grads=grads,
        train_stages=stages(train_ds, optimizer.scaler),
        valid_stages=None if valid_ds is None else stages(valid_ds),
        schedule=schedule_for(model_config, step.micro_batch_size, groups, device,
                              vp_group=step.vp_group,
                              overlap_warmup_flush=step.overlap_warmup_flush),
        faults=inputs.faults, checkpointer=inputs.checkpointer,
        metrics=MetricsWriter(run.metrics_file, run.tensorboard, run.wandb),
        agreement=StoreAgreement(membership, timeout=membership.timeouts.operation,
                                 verdict_wait=membership.timeouts.verdict_wait,
                                 replica=replica_vote(groups, device)) if recovering else None,
        log_failure=lambda err, phase: logger.info(f"peer failure in {phase}: {err}"),
        host_syncs=host_sync_counter(),
        **({} if membership is None else {"mark": membership.mark,
                                          "store_ops": lambda: membership.store_ops}))
    if recovering:
        trainer.grow_back_with(membership)
    groups.before_parallel_ops(trainer.probe)
    return trainer


def _build_model_parts(run, membership, incarnation: int) -> tuple:
    """(device, groups, RNG tracker, model, optimizer, gradient buffer), with the start-up
    notes."""
    import torch

    from megatron.training.collective_backend import resilient_groups
    from megatron.training.initialize import (build_groups, gather_switches, init_default_group,
                                              torch_group_factory)
    from megatron.training.model import build_model, mark_unit_duplicates
    from megatron.training.optimizer.setup import build_optimizer
    from megatron.training.step.parts import build_grad_buffer
    from recover_patches.pipeline.rng import install_rng_tracker

    layout, parallel = run.layout, run.parallel
    torch.set_num_threads(1)
    device = torch.device("cpu")
    if layout.device == "cuda":  # Megatron's rule: one GPU per local rank
        device = torch.device("cuda", layout.local_rank)
        torch.cuda.set_device(device)
    if parallel.deterministic:
        torch.use_deterministic_algorithms(True)
    # Under recovery the default group carries no training traffic: gloo, so no NCCL
    # communicator (nor torch's heartbeat monitor of group uid 0) spans a rank that may die.
    rank, world = init_default_group("gloo" if membership is not None else parallel.backend,
                                     parallel.startup_seconds / 60, joining=incarnation > 0)
    switches = gather_switches(layout.node_size, joining=incarnation > 0)  # the start-up line's
    topology = parallel.topology(world)
    make_group = torch_group_factory if membership is None else resilient_groups(
        parallel, layout, membership, incarnation == 0, topology)
    groups = build_groups(topology, rank, make_group, parallel.optimizer_instances,
                          channels=None if not parallel.model_chunks
                          else "shared" if membership is None else "groups",
                          resilient=membership is not None)
    tracker = install_rng_tracker(device, parallel.seed)
    model = build_model(run.model, groups.pg_collection(), groups.coord.pp, groups.coord.tp,
                        device)
    if groups.coord.replica % topology.fsdp and groups.replica_positions is groups.replica:
        mark_unit_duplicates(model)  # norms summed over a shard group: its first replica counts
    optimizer = build_optimizer(model, run.optimizer, groups)
    grads = build_grad_buffer(groups, optimizer, run.optimizer.overlap_grad_reduce, model,
                              run.step.exact_reduction)
    if rank == 0:
        _startup_notes(run, model, grads, topology, switches)
    return device, groups, tracker, model, optimizer, grads


def _startup_notes(run, model, grads, topology, switches: tuple[str, ...]) -> None:
    from megatron.training.model import memory_note
    from recover_patches.placement import startup_line
    parallel, world = run.parallel, topology.world_size
    logger.info(startup_line(parallel.asked_topology(world), parallel.nodes(world, switches),
                             parallel.placement, run.training.min_replicas,
                             bool(run.training.one_optimizer_copy)))
    instances = run.parallel.optimizer_instances
    memory_note(model, grads.extra_bytes_per_param(),
                optimizer_shards=1 if instances is None else topology.dp // instances,
                weights_sharded=topology.fsdp > 1)
    for line in run.megatron_notes:
        logger.info(line)


def _train(run, trainer, membership, incarnation: int) -> int:
    """Train (a replacement first waits as a spare); a broken replica's ranks leave or wait as
    spares; anything that ends the job early is one line and its exit status."""
    import torch

    from megatron.training.checkpointing.stopping import TrainingStopped
    from recover_patches.recovery.iteration import ReplicaLost
    spare, load = incarnation > 0, True
    try:
        while True:
            try:
                if spare:
                    _wait_as_spare(trainer)
                    load = False  # the state came from a live replica
                trainer.train(load)
                break
            except ReplicaLost as err:  # raised only by recovery, which needs the membership client
                assert membership is not None
                if not run.fault_tolerance.spares:
                    logger.info(f"{err}; this replica is broken, leaving cleanly (the others go on)")
                    membership.close(leave=True)
                    os._exit(0)  # peers may still hold sockets to us; do not linger in teardown
                logger.info(f"{err}; this replica is broken")
                spare = True
    except TrainingStopped:  # --exit-interval, --exit-duration-in-mins, the exit signal
        pass  # done: below, the job is declared complete like one that reached --train-iters
    except Exception as err:  # noqa: BLE001 -- `_stopping` re-raises what it does not know
        return _stopping(err, run, trainer, membership)
    finally:
        trainer.metrics.close()
    if membership is not None:
        membership.declare_complete()
        membership.close()
    else:
        torch.distributed.destroy_process_group()
    return 0


def _wait_as_spare(trainer) -> None:
    assert trainer.grow is not None
    trainer.optimizer.forget()  # sharded state is out of date when the replica re-forms
    if trainer.checkpointer is not None:
        trainer.checkpointer.drop_pending()  # its writing replica broke with it
    logger.info("waiting as a spare until this rank's replica is re-formed")
    join = trainer.grow.wait_as_spare()
    trainer.record_join(join)
    if join.after == "boundary":  # with the others: the join iteration's save/eval (a join
        trainer.finish_iteration()  # made when an evaluation failed comes after both)


def _stopping(err: Exception, run, trainer, membership) -> int:
    """How the job ends early: one line and the exit status (the process exits at once where
    peers may still hold sockets to it). Anything else is a crash and is raised again."""
    from megatron.training.ending import EarlyEnd, early_end
    end = early_end(err, run.restart_from, trainer.one_optimizer_copy,
                    trainer.agreement is not None)
    if end is EarlyEnd.USER_ERROR:
        return _user_error(str(err))
    if end is EarlyEnd.FENCED:
        logger.error(f"fenced: {err}")  # it exits like a dead rank: its replica is lost
        os._exit(1)
    status, line = end
    logger.info(line)
    if membership is not None:
        membership.close(leave=True)
    os._exit(status)


if __name__ == "__main__":
    sys.exit(main())
