"""Finding and validating what --load points at, before any process group exists, so a bad
--load stops the job with one line (exit 2) before anything runs or is written.

Three kinds of checkpoint directory (`iter_N/` named by `latest_checkpointed_iteration.txt`):
torch_dist (megatron-core's `metadata.json`), ReCoVer's torch format (`recover_metadata.json`),
and stock Megatron-LM's torch format (`mp_rank_*/model_optim_rng.pt` only).
"""
from __future__ import annotations

import enum
import json
import zipfile
from dataclasses import dataclass, replace
from pathlib import Path
from typing import TYPE_CHECKING

from megatron.training.checkpointing import torch_dist as ckd
from megatron.training.checkpointing.reshardable import is_fully_reshardable
from megatron.training.checkpointing.format import (FORMAT, LATEST_FILE, METADATA_FILE,
                                                    RANK_FILE, CheckpointError, iter_dir_name)
from megatron.training.checkpointing.writers import writer_rank
from megatron.training.config.io import CheckpointConfig
from recover_patches.topology import Topology

if TYPE_CHECKING:  # (state.py's host: the running job, not read here beyond its progress)
    from megatron.training.checkpointing.state import CheckpointHost


def rank_dir_name(tp: int, pp: int, pp_size: int) -> str:
    return f"mp_rank_{tp:02d}" if pp_size == 1 else f"mp_rank_{tp:02d}_{pp:03d}"


# -- finding and validating what --load points at (no process group needed) ----------------------
class CkptFormat(enum.Enum):
    TORCH = "torch"
    TORCH_DIST = "torch_dist"


@dataclass(frozen=True)
class ResumePoint:
    iteration: int
    directory: Path
    format: CkptFormat
    tp: int  # the layout that wrote it
    pp: int
    has_optimizer: bool
    has_rng: bool
    by_recover: bool  # False: stock Megatron-LM wrote it (no ReCoVer records)
    adam_started: bool = True  # torch_dist: it holds Adam's moments (fp16 may save before any)
    fully_reshardable: bool = False  # torch_dist: the optimizer in Megatron's fully_reshardable


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


def _damaged(what: str) -> CheckpointError:
    return CheckpointError("--load", what, "point --load at an intact checkpoint directory")


def find_resume_point(config: CheckpointConfig, topology: Topology) -> ResumePoint | None:
    """Validate --load against this run; None means start from scratch. Raises CheckpointError."""
    if not config.load:
        return None
    load_dir = Path(config.load)
    iteration = read_latest(load_dir) if load_dir.is_dir() else None
    if config.ckpt_step is not None:  # Megatron's --ckpt-step: this iteration, not the latest
        if not (load_dir / iter_dir_name(config.ckpt_step)).is_dir():
            raise CheckpointError("--ckpt-step", f"{load_dir / iter_dir_name(config.ckpt_step)} "
                                  "does not exist", "pass an iteration saved under --load")
        iteration = config.ckpt_step
    if iteration is None and config.exit_on_missing:
        raise CheckpointError("--exit-on-missing-checkpoint", f"no checkpoint under --load "
                              f"{load_dir} (no {LATEST_FILE})", "point --load at a saved "
                              "checkpoint, or drop --exit-on-missing-checkpoint to start fresh")
    if iteration is None:
        never_saved = not load_dir.exists() or not any(load_dir.glob("iter_*"))
        if never_saved and config.save and Path(config.save).resolve() == load_dir.resolve():
            return None  # the usual `--save C --load C` on a job's first run (Megatron does the same)
        what = "does not exist" if not load_dir.exists() else f"has no {LATEST_FILE}"
        raise CheckpointError("--load", f"{load_dir} {what}",
                              "point --load at a directory written by --save, or drop --load")
    directory = load_dir / iter_dir_name(iteration)
    if ckd.is_torch_dist(directory):
        point = _torch_dist_point(directory, iteration, dict(config.model_shape))
    elif (directory / METADATA_FILE).is_file() or not any(directory.glob("mp_rank_*")):
        point = _torch_point(directory, iteration)
    else:
        point = _stock_torch_point(directory, iteration)
    check_compatible(point, topology, config)
    return point


def _torch_point(directory: Path, iteration: int) -> ResumePoint:
    try:
        metadata = json.loads((directory / METADATA_FILE).read_text())
        if metadata.get("format") != FORMAT or metadata.get("iteration") != iteration:
            raise ValueError("unexpected format or iteration")
    except (OSError, ValueError) as err:
        raise _damaged(f"checkpoint {directory} named by {LATEST_FILE} is missing or corrupt "
                       f"({err})") from None
    saved = metadata["topology"]
    _check_rank_files(directory, saved["tp"], saved["pp"])
    return ResumePoint(iteration, directory, CkptFormat.TORCH, saved["tp"], saved["pp"],
                       metadata["has_optimizer"], metadata["has_rng"], by_recover=True)


def _stock_torch_point(directory: Path, iteration: int) -> ResumePoint:
    """Megatron-LM's own torch format: the layout is in the directory names."""
    names = [p.name.split("_")[2:] for p in directory.glob("mp_rank_*")]
    tp = 1 + max(int(n[0]) for n in names)
    pp = 1 + max((int(n[1]) for n in names if len(n) > 1), default=0)
    _check_rank_files(directory, tp, pp)
    return ResumePoint(iteration, directory, CkptFormat.TORCH, tp, pp, has_optimizer=True,
                       has_rng=True, by_recover=False)


def _check_rank_files(directory: Path, tp: int, pp: int) -> None:
    for t in range(tp):
        for p in range(pp):
            path = directory / rank_dir_name(t, p, pp) / RANK_FILE
            if not zipfile.is_zipfile(path):  # also catches truncation: the zip index is at the end
                raise _damaged(f"{path} is missing or truncated")


def _torch_dist_point(directory: Path, iteration: int, shape: dict[str, int | None]
                      ) -> ResumePoint:
    try:
        metadata = ckd.read_dcp_metadata(directory)
        common = ckd.load_common(directory)
    except Exception as err:  # pickle and torch raise many types for a damaged file
        raise _damaged(f"checkpoint {directory} named by {LATEST_FILE} is missing or corrupt "
                       f"({type(err).__name__}: {str(err)[:120]})") from None
    short = ckd.truncated_file(directory, metadata)
    if short is not None:
        raise _damaged(f"{short} is missing or truncated")
    saved_args = common.get("args")
    for flag, mine in shape.items():
        saved = getattr(saved_args, flag, None)
        if saved is not None and mine is not None and saved != mine:
            option = "--" + flag.replace("_", "-")
            raise CheckpointError("--load", f"{directory} holds another model shape: it was saved "
                                  f"with {option} {saved}, this run has {option} {mine}",
                                  f"run with {option} {saved}, or load a checkpoint of this model")
    keys = metadata.state_dict_metadata
    recover = common.get("recover") or {}
    topo = recover.get("topology", {})
    return ResumePoint(
        iteration, directory, CkptFormat.TORCH_DIST,
        topo.get("tp", getattr(saved_args, "tensor_model_parallel_size", 1)),
        topo.get("pp", getattr(saved_args, "pipeline_model_parallel_size", 1)),
        has_optimizer=any(k.startswith("optimizer.") for k in keys),
        has_rng=any(k.startswith("rng_state") for k in keys), by_recover=bool(recover),
        adam_started=any(k.startswith("optimizer.state.exp_avg.") for k in keys),
        fully_reshardable=is_fully_reshardable(common))


def check_compatible(point: ResumePoint, topology: Topology, config: CheckpointConfig) -> None:
    layout_differs = (point.tp, point.pp) != (topology.tp, topology.pp)
    if point.format is CkptFormat.TORCH and layout_differs:
        raise CheckpointError(
            "--load", f"checkpoint {point.directory} was saved with TP={point.tp}, PP={point.pp} "
            f"but this run has TP={topology.tp}, PP={topology.pp} (DP may differ: replicas are "
            f"identical; a torch_dist checkpoint loads at any layout)",
            f"run with --tensor-model-parallel-size {point.tp} --pipeline-model-parallel-size "
            f"{point.pp}, or load another checkpoint")
    if config.finetune:
        return
    if not point.has_optimizer and config.load_optim:
        raise CheckpointError("--load", f"{point.directory} has no optimizer state (saved with "
                              "--no-save-optim)", "add --no-load-optim or --finetune")
    if not point.has_rng and config.load_rng:
        raise CheckpointError("--load", f"{point.directory} has no RNG state (saved with "
                              "--no-save-rng)", "add --no-load-rng or --finetune")


NON_PERSISTENT_DIR = "non_persistent"  # Megatron's subdirectory for global non-persistent saves


def newer(persistent: ResumePoint | None, non_persistent: ResumePoint | None
          ) -> ResumePoint | None:
    """Megatron's rule: a non-persistent checkpoint at least as new as --load's wins."""
    if non_persistent is None or (persistent is not None
                                  and non_persistent.iteration < persistent.iteration):
        return persistent
    return non_persistent


def global_non_persistent_point(config: CheckpointConfig, topology: Topology
                                ) -> ResumePoint | None:
    """With --load and --non-persistent-ckpt-type global: the newest such checkpoint (in
    --non-persistent-global-ckpt-dir, else LOAD/non_persistent), where Megatron looks for it."""
    local = config.non_persistent
    if local.kind != "global" or not config.load:
        return None
    directory = Path(local.global_dir) if local.global_dir else Path(config.load) / NON_PERSISTENT_DIR
    if read_latest(directory) is None:
        return None
    return find_resume_point(replace(config, load=str(directory), ckpt_step=None), topology)


def torch_metadata(topology: Topology, host: CheckpointHost, save_optim: bool,
                   save_rng: bool) -> str:
    """The torch format's `recover_metadata.json`: the layout, and who wrote each position."""
    live = host.live_replicas
    return json.dumps({
        "format": FORMAT, "iteration": host.training_state.progress.iteration,
        "consumed_samples": host.training_state.progress.consumed_samples,
        "topology": {"tp": topology.tp, "pp": topology.pp, "dp": topology.dp,
                     "world_size": topology.world_size},
        "live_replicas": sorted(live),
        "writers": {rank_dir_name(t, p, topology.pp): writer_rank(topology, live, t, p)
                    for t in range(topology.tp) for p in range(topology.pp)},
        "has_optimizer": save_optim, "has_rng": save_rng,
    }, indent=1, sort_keys=True)
