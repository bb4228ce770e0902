"""Checkpoints (--save/--load/--save-interval, --ckpt-format torch) and --exit-signal-handler.

Layout (Megatron-like):
    SAVE/latest_checkpointed_iteration.txt            the last *committed* iteration, e.g. "6"
    SAVE/iter_0000006/recover_metadata.json           topology and contents; read before any
                                                      process group exists, to reject bad --load
    SAVE/iter_0000006/mp_rank_TT[_PPP]/model_optim_rng.pt   one file per (tp, pp); the _PPP part
                                                      only when PP > 1, as Megatron names them

Writer choice: DP replicas hold identical state, so the file of (tp, pp) is written by that
coordinate's rank in the lowest-numbered live replica. The (tp 0, pp 0) rank of that replica is
the *leader*: it prepares the temp directory, writes the metadata and commits.

Commit protocol (a crash at any point leaves the previous checkpoint loadable):
    1. leader removes any leftover SAVE/.tmp_iter_N (a crashed save) and recreates it   barrier
    2. writers write + fsync their file there; fault-injection point "checkpoint"       barrier
    3. leader renames .tmp_iter_N -> iter_N, then replaces `latest` atomically          barrier
The barriers are the trainer's: through the coordinator's store among the live ranks when
recovery is on (a rank dying mid-save abandons that save; the last good checkpoint stays and
training goes on), on the bootstrap default group otherwise.
"""
from __future__ import annotations

import json
import logging
import os
import shutil
import signal
import time
import zipfile
from dataclasses import dataclass
from pathlib import Path

import torch

from megatron.training.arguments_errors import UserError
from recover_patches.collectives.errors import PeerFailure
from recover_patches.topology import Topology

logger = logging.getLogger(__name__)

LATEST_FILE = "latest_checkpointed_iteration.txt"
METADATA_FILE = "recover_metadata.json"
RANK_FILE = "model_optim_rng.pt"
FORMAT = "recover-torch-1"


class CheckpointError(UserError):
    """A user-facing checkpoint problem (exit code 2)."""


# -- names and small file helpers -----------------------------------------------------------------
def iter_dir_name(iteration: int) -> str:
    return f"iter_{iteration:07d}"


def rank_dir_name(tp: int, pp: int, pp_size: int) -> str:
    return f"mp_rank_{tp:02d}" if pp_size == 1 else f"mp_rank_{tp:02d}_{pp:03d}"


def writer_rank(topology: Topology, live_replicas: list[int], tp: int, pp: int) -> int:
    """Deterministic: every rank agrees without communication on who writes (tp, pp)."""
    return topology.rank(tp, min(live_replicas), pp)


def live_replicas_of(trainer) -> list[int]:
    """The replicas alive now (the Trainer keeps them in `live`, older versions in `live_replicas`)."""
    live = getattr(trainer, "live", None)
    return list(live.live_replicas if live is not None else trainer.live_replicas)


def fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def write_atomically(path: Path, data: bytes) -> None:
    """Readers see the old file or the new one, never a torn one."""
    tmp = path.with_name(f".{path.name}.tmp")
    with open(tmp, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
    fsync_dir(path.parent)


# -- finding and validating what --load points at (no process group needed) ----------------------
@dataclass(frozen=True)
class ResumePoint:
    iteration: int
    directory: Path
    metadata: dict


def read_latest(load_dir: Path) -> int | None:
    """The committed iteration, or None when nothing was ever saved there."""
    path = load_dir / LATEST_FILE
    if not path.is_file():
        return None
    text = path.read_text(errors="replace").strip()
    if not text.isdigit():
        raise CheckpointError("--load", f"{path} is corrupt (holds {text[:40]!r}, not an iteration)",
                              "restore the file or write the iteration of a complete iter_* directory into it")
    return int(text)


def find_resume_point(args, topology: Topology) -> ResumePoint | None:
    """Validate --load against this run; None means start from scratch. Raises CheckpointError."""
    if not args.load:
        return None
    load_dir = Path(args.load)
    iteration = read_latest(load_dir) if load_dir.is_dir() else None
    if iteration is None:
        never_saved = not load_dir.exists() or not any(load_dir.glob("iter_*"))
        if never_saved and args.save and Path(args.save).resolve() == load_dir.resolve():
            return None  # the usual `--save C --load C` on a job's first run (Megatron does the same)
        what = "does not exist" if not load_dir.exists() else f"has no {LATEST_FILE}"
        raise CheckpointError("--load", f"{load_dir} {what}",
                              "point --load at a directory written by --save, or drop --load")
    directory = load_dir / iter_dir_name(iteration)
    try:
        metadata = json.loads((directory / METADATA_FILE).read_text())
        if metadata.get("format") != FORMAT or metadata.get("iteration") != iteration:
            raise ValueError("unexpected format or iteration")
    except (OSError, ValueError) as err:
        raise CheckpointError("--load", f"checkpoint {directory} named by {LATEST_FILE} is missing or "
                              f"corrupt ({err})", "point --load at an intact checkpoint directory") from None
    check_compatible(metadata, topology, args, directory)
    for tp in range(topology.tp):
        for pp in range(topology.pp):
            path = directory / rank_dir_name(tp, pp, topology.pp) / RANK_FILE
            if not zipfile.is_zipfile(path):  # also catches truncation: the zip index is at the end
                raise CheckpointError("--load", f"{path} is missing or truncated",
                                      "point --load at an intact checkpoint directory")
    return ResumePoint(iteration, directory, metadata)


def check_compatible(metadata: dict, topology: Topology, args, directory: Path) -> None:
    saved = metadata["topology"]
    if (saved["tp"], saved["pp"]) != (topology.tp, topology.pp):
        raise CheckpointError(
            "--load", f"checkpoint {directory} was saved with TP={saved['tp']}, PP={saved['pp']} but "
            f"this run has TP={topology.tp}, PP={topology.pp} (DP may differ: replicas are identical)",
            f"run with --tensor-model-parallel-size {saved['tp']} --pipeline-model-parallel-size "
            f"{saved['pp']}, or load another checkpoint")
    if args.finetune:
        return
    if not metadata["has_optimizer"] and not args.no_load_optim:
        raise CheckpointError("--load", f"{directory} has no optimizer state (saved with --no-save-optim)",
                              "add --no-load-optim or --finetune")
    if not metadata["has_rng"] and not args.no_load_rng:
        raise CheckpointError("--load", f"{directory} has no RNG state (saved with --no-save-rng)",
                              "add --no-load-rng or --finetune")


# -- what one rank's file holds ------------------------------------------------------------------
def cpu_tracker():
    from megatron.core.tensor_parallel.random import get_cuda_rng_tracker
    return get_cuda_rng_tracker()  # recover_patches.rng installs its device tracker in its place


def rank_state(trainer, args, optimizer_state: dict | None = None) -> dict:
    topo, coord = trainer.groups.topology, trainer.groups.coord
    state = {
        "format": FORMAT, "iteration": trainer.state.iteration,
        "consumed_samples": trainer.state.consumed_samples,
        "topology": {"tp": topo.tp, "pp": topo.pp, "dp": topo.dp, "world_size": topo.world_size},
        "coord": {"rank": trainer.groups.rank, "tp": coord.tp, "pp": coord.pp, "replica": coord.replica},
        "model": trainer.model.state_dict(),
    }
    if not args.no_save_optim:
        state["optimizer"] = (trainer.optimizer.state_dict() if optimizer_state is None
                              else optimizer_state)
        state["opt_param_scheduler"] = trainer.scheduler.state_dict()
    if not args.no_save_rng:
        state["rng_state"] = {"torch_cpu": torch.get_rng_state(), "tracker": cpu_tracker().get_states()}
    return state


def apply_rank_state(trainer, state: dict, args) -> None:
    """Weights always; optimizer, schedule, RNG and progress unless --finetune / --no-load-*.
    Dropout is reseeded per microbatch (recover_patches.rng), so exact resume needs the iteration
    and consumed samples; the RNG streams are restored for anything else drawing from them."""
    trainer.model.load_state_dict(state["model"], strict=True)
    if args.finetune or args.no_load_optim:
        trainer.optimizer.reload_model_params()  # bf16/fp16: main params follow
    if args.finetune:
        return
    trainer.state.iteration = state["iteration"]
    trainer.state.consumed_samples = state["consumed_samples"]
    if not args.no_load_optim:
        trainer.optimizer.load_state_dict(state["optimizer"])
        try:
            trainer.scheduler.load_state_dict(state["opt_param_scheduler"])
        except AssertionError as err:  # megatron-core refuses a changed LR schedule this way
            raise CheckpointError(
                "--load", f"the LR schedule flags differ from the checkpoint's ({err})",
                "pass the checkpoint's --lr/--min-lr/decay/warmup/--train-iters values, or "
                "--use-checkpoint-opt_param-scheduler to take its schedule, or "
                "--override-opt_param-scheduler to keep yours") from None
    if not args.no_load_rng:
        torch.set_rng_state(state["rng_state"]["torch_cpu"])
        cpu_tracker().set_states(state["rng_state"]["tracker"])


# -- SIGTERM: agreed on by all ranks at the end of an iteration -----------------------------------
class TermSignal:
    """Remembers a SIGTERM; `agreed(trainer)` is true on every rank once any rank got one."""

    def __init__(self) -> None:
        self.received = False
        signal.signal(signal.SIGTERM, self._on_signal)

    def _on_signal(self, _signum, _frame) -> None:
        self.received = True

    def agreed(self, trainer) -> bool:
        return trainer.any_rank(self.received, f"sigterm/{trainer.state.iteration}")


# -- the object the Trainer calls ----------------------------------------------------------------
class Checkpointer:
    """Built before any process group (it validates --load then), used by Trainer.train()."""

    def __init__(self, args, rank: int, world_size: int) -> None:
        self.args, self.rank = args, rank
        self.topology = Topology.from_world(world_size, args.tensor_model_parallel_size,
                                            args.pipeline_model_parallel_size,
                                            args.use_tp_pp_dp_mapping)
        self.resume = find_resume_point(args, self.topology)
        if args.save and Path(args.save).exists() and not Path(args.save).is_dir():
            raise CheckpointError("--save", f"{args.save} exists and is not a directory",
                                  "pass a directory path to --save")
        self.term = TermSignal() if args.exit_signal_handler else None
        self.started = time.monotonic()  # for --exit-duration-in-mins
        self.last_saved: int | None = None

    def load(self, trainer) -> None:
        if self.resume is None:
            if self.args.load and self.rank == 0:
                logger.info(f"no checkpoint in {self.args.load} yet: starting from scratch")
            return
        coord = trainer.groups.coord
        path = self.resume.directory / rank_dir_name(coord.tp, coord.pp, self.topology.pp) / RANK_FILE
        try:
            state = torch.load(path, map_location="cpu", weights_only=True)
        except Exception as err:  # torch raises several types for a damaged archive
            raise CheckpointError("--load", f"cannot read {path} ({err})",
                                  "point --load at an intact checkpoint directory") from None
        apply_rank_state(trainer, state, self.args)
        if self.rank == 0:
            logger.info(f"loaded checkpoint {self.resume.directory} (iteration {self.resume.iteration}"
                        f"{', weights only: --finetune' if self.args.finetune else ''})")

    def after_iteration(self, trainer) -> None:
        iteration, args = trainer.state.iteration, self.args
        stop = self._stop_reason(trainer)
        due = args.save and (iteration % args.save_interval == 0 or iteration == args.train_iters)
        if (due or stop) and args.save:
            self.save(trainer)
        if stop:
            if self.rank == 0:
                logger.info(f"exiting after iteration {iteration}: {stop}"
                            + ("" if args.save else ", no --save so no checkpoint"))
            trainer.metrics.close()
            raise SystemExit(0)

    def _stop_reason(self, trainer) -> str | None:
        """Why every live rank exits after this iteration (the same answer on all of them)."""
        iteration, args = trainer.state.iteration, self.args
        if self.term is not None and self.term.agreed(trainer):
            return "SIGTERM (--exit-signal-handler)"
        if args.exit_interval and iteration % args.exit_interval == 0:
            return f"--exit-interval {args.exit_interval}"
        if args.exit_duration_in_mins is not None:
            over = (time.monotonic() - self.started) / 60 > args.exit_duration_in_mins
            if trainer.any_rank(over, f"exit-duration/{iteration}"):  # clocks differ: agree
                return f"--exit-duration-in-mins {args.exit_duration_in_mins:g}"
        return None

    def save(self, trainer) -> None:
        try:
            self._save(trainer)
        except PeerFailure as err:  # a rank died mid-save: the previous checkpoint stays latest
            logger.warning(f"checkpoint of iteration {trainer.state.iteration} abandoned ({err}); "
                           "the last good checkpoint stays")

    def _save(self, trainer) -> None:
        iteration = trainer.state.iteration
        if self.last_saved == iteration:
            return
        save_dir = Path(self.args.save)
        tmp, final = save_dir / f".tmp_{iter_dir_name(iteration)}", save_dir / iter_dir_name(iteration)
        coord, live = trainer.groups.coord, live_replicas_of(trainer)
        is_writer = self.rank == writer_rank(self.topology, live, coord.tp, coord.pp)
        is_leader = self.rank == writer_rank(self.topology, live, 0, 0)
        if is_leader:
            shutil.rmtree(tmp, ignore_errors=True)
            tmp.mkdir(parents=True)
        trainer.barrier(f"ckpt/{iteration}/prepared")
        trainer.weights_ready()
        # on every rank: the distributed optimizer gathers its instance's shards (a collective)
        optimizer_state = None if self.args.no_save_optim else trainer.optimizer.state_dict()
        if is_writer:
            self._write_rank_file(trainer, tmp / rank_dir_name(coord.tp, coord.pp, self.topology.pp),
                                  optimizer_state)
        if is_leader:
            write_atomically(tmp / METADATA_FILE, self._metadata(trainer).encode())
        trainer.faults.at("checkpoint", iteration)  # iter=I in --inject-fault means "saving I"
        trainer.barrier(f"ckpt/{iteration}/written")
        if is_leader:
            self._commit(tmp, final, iteration)
        trainer.barrier(f"ckpt/{iteration}/committed")
        self.last_saved = iteration
        if self.rank == 0:
            logger.info(f"saved checkpoint {final} (iteration {iteration})")

    def _write_rank_file(self, trainer, directory: Path, optimizer_state: dict | None) -> None:
        directory.mkdir(parents=True, exist_ok=True)
        with open(directory / RANK_FILE, "wb") as f:
            torch.save(rank_state(trainer, self.args, optimizer_state), f)
            f.flush()
            os.fsync(f.fileno())
        fsync_dir(directory)

    def _metadata(self, trainer) -> str:
        topo = self.topology
        return json.dumps({
            "format": FORMAT, "iteration": trainer.state.iteration,
            "consumed_samples": trainer.state.consumed_samples,
            "topology": {"tp": topo.tp, "pp": topo.pp, "dp": topo.dp, "world_size": topo.world_size},
            "live_replicas": sorted(live_replicas_of(trainer)),
            "writers": {rank_dir_name(t, p, topo.pp): writer_rank(topo, live_replicas_of(trainer), t, p)
                        for t in range(topo.tp) for p in range(topo.pp)},
            "has_optimizer": not self.args.no_save_optim, "has_rng": not self.args.no_save_rng,
        }, indent=1, sort_keys=True)

    @staticmethod
    def _commit(tmp: Path, final: Path, iteration: int) -> None:
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
