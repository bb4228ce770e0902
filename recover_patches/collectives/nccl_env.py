"""The environment that keeps torch's own NCCL machinery out of ReCoVer's recovery (design.md §13).

torch 2.13's ProcessGroupNCCL reads these when a group is constructed (TORCH_NCCL_NONBLOCKING_TIMEOUT
once per process, at the first communicator), so they must be in the rank's environment before
any group exists: the launcher puts them there, and the entry point again for ranks started
without it (srun with one task per GPU). What each one would do to a survivor otherwise:

  TORCH_NCCL_ASYNC_ERROR_HANDLING=0   default 3 (SkipCleanUp): a work error or timeout is
        rethrown on torch's watchdog thread and the process dies -- the survivor ReCoVer keeps.
  TORCH_NCCL_ENABLE_MONITORING=0      each group's heartbeat monitor ends the process with
        LOG(FATAL) when its watchdog looks stuck (480 s) or after a dump signal; the monitor of
        the group with uid 0 also polls the store every second for another rank's dump signal,
        which torch's watchdog writes into the *underlying* store (the coordinator's) on every
        work error: a replacement whose first group is uid 0 would die 8 minutes after joining.
  TORCH_NCCL_DUMP_ON_TIMEOUT=0        no flight-recorder dumps triggered by that signal.
  TORCH_NCCL_WAIT_TIMEOUT_DUMP_MILSEC=0   after a work error torch's watchdog sleeps 4x this
        (60 s by default) holding the group's work-list mutex: nothing else enqueues meanwhile.
  TORCH_NCCL_BLOCKING_WAIT=0          blocking waits start no watchdog thread and never publish
        a work's result: ReCoVer's watchdog could not tell success from failure.
  TORCH_NCCL_PROPAGATE_ERROR=0        1 broadcasts every error through the group's store.
  TORCH_NCCL_DESYNC_DEBUG=0           1 forces error handling back to SkipCleanUp.
  TORCH_NCCL_NONBLOCKING_TIMEOUT=60   how long a stuck non-blocking init may hold its
        communicator's mutex (default 30 min); ReCoVer stops waiting at the rebuild's own bound,
        this only bounds the thread it leaves behind.

A setting of the user's that differs is refused (one line, exit 2): silently overriding it would
hide that the job does not run as they configured it.
"""
from __future__ import annotations

import os
from collections.abc import Mapping, MutableMapping

NONBLOCKING_TIMEOUT_S = 60  # = ResilientProcessGroup's default build timeout

REQUIRED: dict[str, tuple[str, str]] = {
    "TORCH_NCCL_ASYNC_ERROR_HANDLING": ("0", "torch's watchdog would end a survivor whose peer "
                                             "failed"),
    "TORCH_NCCL_ENABLE_MONITORING": ("0", "torch's heartbeat monitor would end a survivor with "
                                          "LOG(FATAL) minutes after a recovered failure"),
    "TORCH_NCCL_DUMP_ON_TIMEOUT": ("0", "every rank would dump and stall on one rank's failure"),
    "TORCH_NCCL_WAIT_TIMEOUT_DUMP_MILSEC": ("0", "torch's watchdog would stall the group for "
                                                 "4x this after an error"),
    "TORCH_NCCL_BLOCKING_WAIT": ("0", "blocking waits publish no work result, so a failed "
                                      "collective could not be told from a finished one"),
    "TORCH_NCCL_PROPAGATE_ERROR": ("0", "it broadcasts every error through the coordinator's "
                                        "store"),
    "TORCH_NCCL_DESYNC_DEBUG": ("0", "it switches error handling back to tearing the process "
                                     "down"),
    "TORCH_NCCL_NONBLOCKING_TIMEOUT": (str(NONBLOCKING_TIMEOUT_S),
                                       "a communicator whose init hangs would hold its lock for "
                                       "longer than a rebuild may take"),
}


def _same(key: str, value: str) -> bool:
    wanted = REQUIRED[key][0]
    if value.strip().lower() in ("false", "no", "off") and wanted == "0":
        return True
    try:
        return int(value) == int(wanted)
    except ValueError:
        return False


def conflicts(environ: Mapping[str, str]) -> list[str]:
    """One line per TORCH_NCCL_* setting of the user's that would break recovery."""
    return [f"{key}={environ[key]}: with in-job recovery {why}. Fix: unset it (ReCoVer sets "
            f"{key}={wanted})" for key, (wanted, why) in REQUIRED.items()
            if key in environ and not _same(key, environ[key])]


def required() -> dict[str, str]:
    return {key: wanted for key, (wanted, _) in REQUIRED.items()}


def apply(environ: MutableMapping[str, str]) -> None:
    """Put the required settings into `environ` (after `conflicts` found none)."""
    environ.update(required())


def check_applied(environ: Mapping[str, str] = os.environ) -> None:
    """A NCCL group built without the environment would be torn down by torch on the first
    peer failure: refuse to build it (a programming error, not a user's)."""
    missing = [k for k, v in required().items() if not _same(k, environ.get(k, "unset"))]
    if missing:
        raise RuntimeError(f"NCCL group built before the recovery environment was set: {missing} "
                           "(the launcher and the entry point set it before any group exists)")


def cpp_timeout(op_timeout: float) -> float:
    """torch's own per-operation timeout: far above ReCoVer's (which aborts first), so torch's
    watchdog never acts on a work ReCoVer is handling."""
    return 10 * op_timeout + 60
