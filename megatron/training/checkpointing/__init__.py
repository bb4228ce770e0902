"""Checkpoints (--save/--load/--save-interval, --ckpt-format, --async-save) and
--exit-signal-handler.

Formats. --ckpt-format torch_dist (the default, as in Megatron) is Megatron's distributed
checkpoint (`torch_dist`): any TP/PP/DP layout loads it. --ckpt-format torch is one file per
(tp, pp). Loading reads whichever format --load holds, as Megatron does, including checkpoints
written by stock Megatron-LM (without ReCoVer's own records, which are optional).

Layout of the torch format (Megatron's, plus one JSON file):
    SAVE/latest_checkpointed_iteration.txt            the last *committed* iteration, e.g. "6"
    SAVE/iter_0000006/recover_metadata.json           topology and contents; read before any
                                                      process group exists, to reject bad --load
    SAVE/iter_0000006/mp_rank_TT[_PPP]/model_optim_rng.pt   one file per (tp, pp); the _PPP part
                                                      only when PP > 1, as Megatron names them

Writer choice: DP replicas hold identical state, so the file of (tp, pp) is written by that
coordinate's rank in the lowest-numbered live replica; a torch_dist checkpoint is written by all
live replicas, each its share (`checkpoint_writers`; --no-ckpt-fully-parallel-save: by the lowest
one). The (tp 0, pp 0) rank of the lowest live replica is the *leader*: it prepares the temp
directory, writes the metadata and commits.

Commit protocol (a crash at any point leaves the previous checkpoint loadable):
    1. leader removes any leftover SAVE/.tmp_iter_N (a crashed save) and recreates it   barrier
    2. writers write + fsync their file there; fault-injection point "checkpoint"       barrier
    3. leader renames .tmp_iter_N -> iter_N, then replaces `latest` atomically          barrier
The barriers are the trainer's: through the coordinator's store among the live ranks when
recovery is on (a rank dying mid-save abandons that save; the last good checkpoint stays and
training goes on), on the bootstrap default group otherwise.

--async-save (torch_dist): step 2 blocks only for a host copy of the state and the write plan;
the writing replica's ranks write on a background thread while training goes on. The next save,
the end of training or an exit lands it: the writers' results meet (DCP's `.metadata`) and the
leader commits, so `latest` moves only once every part is on disk. If a writer dies meanwhile the
save is abandoned (a rank that leaves its broken replica drops it): its temp directory never
becomes a checkpoint and the next save removes it.
"""
from __future__ import annotations

import argparse
import logging
import os
import shutil
import threading
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import torch

from megatron.training.checkpointing import torch_dist as ckd
from megatron.training.checkpointing.files import (drop_unretained, fsync_dir, integrity_failure,
                                                   keep_only_latest, write_atomically,
                                                   write_integrity_manifest)
from megatron.training.checkpointing.local import LocalCheckpoints, due
from megatron.training.checkpointing.writers import Writers, writer_rank
from megatron.training.config.io import CheckpointConfig
from megatron.training.checkpointing.ft_timeouts import TimeoutRecorder
from megatron.training.checkpointing.stopping import ExitConditions, TrainingStopped
from megatron.training.checkpointing.format import (LATEST_FILE, METADATA_FILE,
                                                    RANK_FILE, CheckpointError, iter_dir_name)
from megatron.training.checkpointing.resume import (NON_PERSISTENT_DIR, CkptFormat, ResumePoint,
                                                    find_resume_point, global_non_persistent_point,
                                                    newer, rank_dir_name, read_latest, torch_metadata)
from megatron.training.checkpointing.state import (CheckpointHost, apply_rank_state,
                                                from_stock_megatron, rank_state, rng_state)
from recover_patches.collectives.errors import PeerFailure
from recover_patches.topology import Topology

logger = logging.getLogger(__name__)
LAST_SAVE_ATTEMPTS = 8  # the job's last save, made again after each failure that abandoned it

__all__ = ["CheckpointError", "Checkpointer", "LATEST_FILE", "find_resume_point", "iter_dir_name",
           "rank_dir_name", "read_latest", "writer_rank"]


# -- the object the Trainer calls ----------------------------------------------------------------
@dataclass
class PendingSave:
    """A writer's part of a torch_dist save, planned; written inline or, with --async-save, on
    a thread while training goes on."""
    iteration: int
    tmp: Path
    final: Path
    is_leader: bool
    write: ckd.ShardedWrite
    epoch: int  # the membership epoch it was planned in
    written: Callable[[], object] | None = None  # async: waits for the background write
    error: BaseException | None = None

    def run(self, faults) -> None:
        try:
            faults.at("checkpoint", self.iteration)  # iter=I in --inject-fault means "saving I"
            self.write.write()
        except BaseException as err:  # re-raised by the main thread when it lands the save
            self.error = err


class Checkpointer:
    """Built before any process group (it validates --load then), used by Trainer.train()."""

    def __init__(self, config: CheckpointConfig, rank: int, world_size: int) -> None:
        self.config, self.rank = config, rank
        self.format = CkptFormat(config.format)
        self.async_save = config.async_save
        self.topology = Topology.from_world(world_size, config.tensor_parallel,
                                            config.pipeline_parallel, config.tp_pp_dp_mapping,
                                            config.context_parallel)
        local = config.non_persistent
        self.non_persistent_dir = (  # --non-persistent-ckpt-type global saves here
            None if local.kind != "global" or not config.save else
            Path(local.global_dir) if local.global_dir else Path(config.save) / NON_PERSISTENT_DIR)
        self.resume = newer(find_resume_point(config, self.topology),
                            global_non_persistent_point(config, self.topology))
        if config.save and Path(config.save).exists() and not Path(config.save).is_dir():
            raise CheckpointError("--save", f"{config.save} exists and is not a directory",
                                  "pass a directory path to --save")
        self.exits = ExitConditions(config)
        self.timeouts = TimeoutRecorder(config.ft) if config.ft.calculate and rank == 0 else None
        self.last_saved: int | None = None
        self.pending: PendingSave | None = None
        self.worker: ThreadPoolExecutor | None = None  # --use-persistent-ckpt-worker
        # --ckpt-assume-constant-structure: the save plan, reused while the writers stay
        self.plans = ckd.SavePlans() if config.assume_constant_structure else None
        self.local = (LocalCheckpoints(local.local_dir, local.interval, config, self.topology, rank)
                      if local.kind == "local" and local.local_dir else None)

    def load(self, host: CheckpointHost) -> None:
        point = self.resume
        if self.local is not None and self.config.load and self.local.restore(host, point):
            return
        if point is None:
            if self.config.load and self.rank == 0:
                logger.info(f"no checkpoint in {self.config.load} yet: starting from scratch")
            return
        if point.format is CkptFormat.TORCH_DIST:
            state = self._read_torch_dist(host, point)
        else:
            state = self._read_torch(host, point)
        apply_rank_state(host.training_state, state, self.config)
        if self.rank == 0:
            logger.info(f"loaded checkpoint {point.directory} (iteration {point.iteration}), "
                        f"format {point.format.value}"
                        f"{'' if point.by_recover else ', written by Megatron-LM'}"
                        f"{', weights only: --finetune' if self.config.finetune else ''}")

    def _read_torch(self, host: CheckpointHost, point: ResumePoint) -> dict:
        coord = host.training_state.groups.coord
        path = point.directory / rank_dir_name(coord.tp, coord.pp, self.topology.pp) / RANK_FILE
        try:
            with torch.serialization.safe_globals([argparse.Namespace]):
                state = torch.load(path, map_location="cpu", weights_only=True)
        except Exception as err:  # torch raises several types for a damaged archive
            raise CheckpointError("--load", f"cannot read {path} ({err})",
                                  "point --load at an intact checkpoint directory") from None
        return state if point.by_recover else self._without_rng(from_stock_megatron(state), point)

    def _read_torch_dist(self, host: CheckpointHost, point: ResumePoint) -> dict:
        config = self.config
        if config.verify_integrity:
            self._verify_integrity(host, point)
        # RNG streams are per (tp, pp) position: they exist only in a checkpoint of this layout
        same_layout = (point.tp, point.pp) == (self.topology.tp, self.topology.pp)
        read_rng = same_layout and point.by_recover and config.load_rng and not config.finetune
        template = ckd.load_template(host.training_state, config.load_optim and not config.finetune,
                                     point.adam_started, rng_state() if read_rng else None,
                                     point.fully_reshardable)

        def error(detail: str) -> CheckpointError:
            return CheckpointError("--load", f"cannot load {point.directory} into this model "
                                   f"({detail})", "load a checkpoint of this model's shape")
        optimizer = host.training_state.optimizer
        state = ckd.as_rank_state(ckd.load(template, point.directory, config.strictness, error),
                                  optimizer.model_params,
                                  [len(g["params"]) for g in optimizer.param_groups])
        return state if read_rng else self._without_rng(state, point)

    def _verify_integrity(self, host: CheckpointHost, point: ResumePoint) -> None:
        """--verify-integrity: the ranks split the hashing; a failure anywhere stops them all."""
        failure = integrity_failure(point.directory, (self.rank, self.topology.world_size))
        if host.any_rank(failure is not None, f"verify-integrity/{point.iteration}"):
            raise CheckpointError("--verify-integrity", f"{point.directory} fails its integrity "
                                  f"check: {failure or 'another rank found a file that differs'}",
                                  "load an intact checkpoint (or drop --verify-integrity)")

    def _without_rng(self, state: dict, point: ResumePoint) -> dict:
        state.pop("rng_state", None)
        if self.rank == 0 and self.config.load_rng and not self.config.finetune:
            logger.info(f"RNG state of {point.directory} not restored (written by another layout "
                        "or by Megatron-LM); dropout is seeded per microbatch, so the trajectory "
                        "does not depend on it")
        return state

    def after_iteration(self, host: CheckpointHost,
                        regroup: Callable[[str, PeerFailure], object] | None = None) -> None:
        """Save, locally or not, if due; stop if an exit condition holds. `regroup` (recovery
        on): how the survivors re-form their groups after a failure outside an iteration."""
        iteration, config = host.training_state.progress.iteration, self.config
        if self.timeouts is not None:
            self.timeouts.iteration_ended()
        stop = self.exits.reason(host)
        interval = config.save_interval or 0  # set whenever --save is (the argument checks)
        persistent = config.save and ((interval and iteration % interval == 0)
                                      or iteration == config.train_iters)
        if (persistent or stop) and config.save:
            last = bool(stop) or iteration == config.train_iters
            self._save_landing(host, regroup if last else None)
            if last:
                self.finish_pending(host)  # the job ends: the last save must land
            if self.timeouts is not None:  # as Megatron-LM updates them: after each save
                self.timeouts.store()
        elif config.save and self.local is not None and self.local.due(iteration):
            self.local.save(host)
        elif self.non_persistent_dir is not None and due(config.non_persistent.interval,
                                                         iteration):
            self.save(host, self.non_persistent_dir)
        if stop:
            if self.rank == 0:
                logger.info(f"exiting after iteration {iteration}: {stop}"
                            + ("" if config.save else ", no --save so no checkpoint"))
            host.close_metrics()
            raise TrainingStopped(stop)

    def _save_landing(self, host: CheckpointHost,
                      regroup: Callable[[str, PeerFailure], object] | None) -> None:
        """A save; the job's last (`regroup` given) is made again once the survivors regrouped."""
        for attempt in range(LAST_SAVE_ATTEMPTS):
            failure = self.save(host)
            if failure is None or regroup is None:
                return
            regroup(f"save{host.training_state.progress.iteration}/{attempt}", failure)
        logger.error(f"the last checkpoint (iteration {host.training_state.progress.iteration}) did not land in {LAST_SAVE_ATTEMPTS} attempts")  # noqa: E501

    def save(self, host: CheckpointHost, save_dir: Path | None = None) -> PeerFailure | None:
        """A checkpoint in --save (or `save_dir`: the global non-persistent one's); the failure
        that made it abandoned, if one did."""
        self.finish_pending(host)  # one save at a time, in order
        start = time.perf_counter()
        assert self.config.save is not None  # saves happen only with --save
        try:
            self._save(host, save_dir or Path(self.config.save))
        except PeerFailure as err:  # a rank died mid-save: the previous checkpoint stays latest
            self.last_saved = None
            self._abandon(host.training_state.progress.iteration, err)
            return err
        if self.rank == 0:  # the save's cost to training (scripts/bench/effective_throughput.py)
            logger.info(f"checkpoint stall: iteration {host.training_state.progress.iteration}, "
                        f"{(time.perf_counter() - start) * 1e3:.1f} ms"
                        f"{' (async: the write goes on in the background)' if self.async_save else ''}")
        return None

    def _abandon(self, iteration: int, why) -> None:
        logger.warning(f"checkpoint of iteration {iteration} abandoned ({why}); the last good "
                       "checkpoint stays")

    def _save(self, host: CheckpointHost, save_dir: Path) -> None:
        iteration = host.training_state.progress.iteration
        if self.last_saved == iteration:
            return
        tmp, final = save_dir / f".tmp_{iter_dir_name(iteration)}", save_dir / iter_dir_name(iteration)
        coord, live = host.training_state.groups.coord, host.live_replicas
        is_leader = self.rank == writer_rank(self.topology, live, 0, 0)
        is_writer = self.rank == writer_rank(self.topology, live, coord.tp, coord.pp) or (
            self.format is CkptFormat.TORCH_DIST and self.config.fully_parallel_save)
        if is_leader:
            for leftover in save_dir.glob(".tmp_iter_*"):  # saves that crashed or were abandoned
                shutil.rmtree(leftover, ignore_errors=True)
            tmp.mkdir(parents=True)
        host.barrier(f"ckpt/{iteration}/prepared")
        host.weights_ready()
        # on every rank: the distributed optimizer gathers its instance's shards (a collective)
        optimizer_state = host.training_state.optimizer.state_dict() if self.config.save_optim else None
        self.last_saved = iteration
        pending = None
        if self.format is CkptFormat.TORCH and is_writer:
            self._write_rank_file(host, tmp / rank_dir_name(coord.tp, coord.pp, self.topology.pp),
                                  optimizer_state)
        elif self.format is CkptFormat.TORCH_DIST and is_writer:
            pending = PendingSave(iteration, tmp, final, is_leader,
                                  self._plan_torch_dist(host, tmp, optimizer_state, is_leader),
                                  host.membership_epoch)
        if is_leader and self.format is CkptFormat.TORCH:
            write_atomically(tmp / METADATA_FILE, torch_metadata(
                self.topology, host, self.config.save_optim, self.config.save_rng).encode())
        if self.async_save:  # torch_dist only (validated): the writers go on in the background
            if pending is None:
                host.faults.at("checkpoint", iteration)
            else:
                pending.written = self._in_background(pending, host.faults)
                self.pending = pending
            return
        if pending is None:
            host.faults.at("checkpoint", iteration)  # iter=I in --inject-fault: "saving I"
        else:
            pending.run(host.faults)
        host.barrier(f"ckpt/{iteration}/written")
        if pending is not None:
            self._land(pending)
        elif is_leader:
            self._commit(tmp, final, iteration)
        host.barrier(f"ckpt/{iteration}/committed")
        if self.rank == 0:
            logger.info(f"saved checkpoint {final} (iteration {iteration})")

    def _plan_torch_dist(self, host: CheckpointHost, tmp: Path, optimizer_state: dict | None,
                         is_leader: bool) -> ckd.ShardedWrite:
        """The writing replica's collective part: Megatron's layout, and DCP's write plan."""
        config = self.config
        state = ckd.checkpoint_state(host.training_state, config.megatron_args, optimizer_state,
                                     rng_state() if config.save_rng else None,
                                     config.optimizer_fully_reshardable)
        sharded, common = ckd.sharded_and_common(state)
        if self.async_save:
            sharded = ckd.to_host(sharded)  # what the training loop waits for
        if is_leader:
            ckd.write_common(tmp, common)
        groups = host.training_state.groups
        writers = Writers(groups.save_positions,
                          groups.dp if config.fully_parallel_save else None,
                          is_leader, next(host.training_state.model.parameters()).device,
                          groups.expert_dp if config.fully_parallel_save else None)
        return ckd.ShardedWrite(sharded, tmp, writers, self.plans)

    def _in_background(self, pending: PendingSave, faults) -> Callable[[], object]:
        """Start the write; return what waits for it. --use-persistent-ckpt-worker: on the one
        long-lived writer thread; else on a thread of its own per save (Megatron forks a process
        per save there; a thread shares the host copy without pickling it)."""
        if self.config.persistent_worker:
            if self.worker is None:
                self.worker = ThreadPoolExecutor(1, thread_name_prefix="recover-ckpt-writer")
            return self.worker.submit(pending.run, faults).result
        thread = threading.Thread(target=pending.run, args=(faults,), daemon=True,
                                  name=f"recover-async-save-{pending.iteration}")
        thread.start()
        return thread.join

    def _land(self, pending: PendingSave) -> None:
        """A writer's end of a torch_dist save: its part is on disk (or the error it hit is
        raised); the writers' results meet and the leader writes DCP's .metadata and commits."""
        if pending.written is not None:
            pending.written()
        if pending.error is not None:
            raise pending.error
        pending.write.finish()
        if pending.is_leader:
            if self.config.verify_integrity:  # every file is complete: hash them
                write_integrity_manifest(pending.tmp)
            self._commit(pending.tmp, pending.final, pending.iteration)

    def finish_pending(self, host: CheckpointHost) -> None:
        """Land the --async-save in flight on this rank, if any (its writing replica's ranks
        reach here together: at the next save, the last iteration or an exit)."""
        pending, self.pending = self.pending, None
        if pending is None:
            return
        if self.config.fully_parallel_save and pending.epoch != host.membership_epoch:
            # every live rank wrote a share: a failure or a join since then changed the writers
            # (and rebuilt the groups the results would meet in), alike on every rank
            return self._abandon(pending.iteration, "the writers changed while it was written")
        try:
            self._land(pending)
        except PeerFailure as err:  # a writer died: the last good checkpoint stays latest
            return self._abandon(pending.iteration, err)
        if pending.is_leader:
            logger.info(f"saved checkpoint {pending.final} (iteration {pending.iteration}, "
                        "written in the background)")

    def drop_pending(self) -> None:
        """This rank's replica broke: its writing replica's save cannot land; forget it (its
        thread may still write into the temp directory, which the next save removes)."""
        self.pending = None

    def _write_rank_file(self, host: CheckpointHost, directory: Path,
                         optimizer_state: dict | None) -> None:
        directory.mkdir(parents=True, exist_ok=True)
        with open(directory / RANK_FILE, "wb") as f:
            torch.save(rank_state(host.training_state, self.config, optimizer_state), f)
            f.flush()
            os.fsync(f.fileno())
        fsync_dir(directory)


    def _commit(self, tmp: Path, final: Path, iteration: int) -> None:
        previous = read_latest(final.parent)  # named by `latest` until it moves
        if final.exists():  # e.g. a run resumed from before a save that crashed after its rename
            old = final.with_name(f".old_{final.name}")
            shutil.rmtree(old, ignore_errors=True)
            os.rename(final, old)
            os.rename(tmp, final)
            shutil.rmtree(old, ignore_errors=True)
        else:
            os.rename(tmp, final)
        fsync_dir(final.parent)
        write_atomically(final.parent / LATEST_FILE, f"{iteration}\n".encode())
        if final.parent == self.non_persistent_dir:  # only the newest of these is kept
            keep_only_latest(final.parent)
        elif self.config.retain_interval:
            drop_unretained(final.parent, previous, iteration, self.config.retain_interval)
