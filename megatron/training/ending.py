"""How a run that cannot go on ends: which error means what, the one line it prints and its exit
status. The entry point acts on the answer (prints, closes the membership, exits)."""
from __future__ import annotations

import enum

from megatron.training.checkpointing import CheckpointError
from megatron.training.errors import EXIT_RESTART
from megatron.training.rerun import ResultRejected, ResultReproduced
from megatron.training.step.weight_check import WeightMismatch
from recover_patches.collectives.errors import PeerFailure
from recover_patches.recovery.agreement import RecoveryStalled
from recover_patches.recovery.grow import JobComplete, JobStopped
from recover_patches.recovery.iteration import StepInterrupted, TooFewReplicas


class EarlyEnd(enum.Enum):
    USER_ERROR = "a user error found late: one line, exit status 2"
    FENCED = "this rank ends like a dead one: its replica is lost, the others go on"


def early_end(err: Exception, restart_from: str, one_optimizer_copy: str,
              recovering: bool) -> tuple[int, str] | EarlyEnd:
    """(exit status, the line to print) of an error that ends the run early, or how else it
    ends; an error none of these is a crash and is raised again."""
    if isinstance(err, CheckpointError):  # found only when reading the files (a damaged archive)
        return EarlyEnd.USER_ERROR
    if isinstance(err, (ResultRejected, StepInterrupted)):
        return EarlyEnd.FENCED
    if isinstance(err, JobComplete):  # a spare never needed
        return 0, f"{err}: exiting"
    if isinstance(err, JobStopped):
        return EXIT_RESTART, f"stopping: the job stopped while this rank waited as a spare ({err})"
    if isinstance(err, WeightMismatch):  # every rank raises it together
        return EXIT_RESTART, f"stopping: {err}. Restart with --load {restart_from}"
    if isinstance(err, ResultReproduced):  # likewise (--rerun-mode validate_results)
        return EXIT_RESTART, f"stopping: {err}"
    if isinstance(err, (TooFewReplicas, RecoveryStalled)):  # likewise
        reason = str(err)
        if one_optimizer_copy:  # (why one replica's loss ends this job)
            reason += f" ({one_optimizer_copy})"
        return EXIT_RESTART, f"stopping: {reason}. Restart with --load {restart_from}"
    if isinstance(err, PeerFailure):
        where = ("outside the recoverable training iteration, e.g. in evaluation" if recovering
                 else "in-job recovery is off")
        return EXIT_RESTART, f"stopping: {err} ({where}). Restart with --load {restart_from}"
    raise err
