"""Layer 1: fault-tolerant collectives, the membership coordinator, failure detection (design.md §6).

Public names are loaded lazily so that importing `errors` (e.g. from the launcher) stays cheap.
"""
from importlib import import_module
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # the type checker sees the real names; at run time they load lazily
    from recover_patches.collectives.errors import (CoordinatorConfigError, CoordinatorError,
                                                    CoordinatorUnreachable, JobTokenRefused,
                                                    MembershipTimeout, PeerFailure)
    from recover_patches.collectives.group import ResilientGroup
    from recover_patches.collectives.membership import MembershipClient
    from recover_patches.collectives.probe import NO_PROBE, Probe
    from recover_patches.collectives.process_group import ResilientProcessGroup
    from recover_patches.collectives.rendezvous import Regrouped

_EXPORTS = {
    "PeerFailure": "errors", "CoordinatorError": "errors", "CoordinatorConfigError": "errors",
    "CoordinatorUnreachable": "errors", "JobTokenRefused": "errors", "MembershipTimeout": "errors",
    "MembershipClient": "membership", "ResilientProcessGroup": "process_group",
    "Regrouped": "rendezvous", "ResilientGroup": "group", "Probe": "probe", "NO_PROBE": "probe",
}
__all__ = sorted(_EXPORTS)


def __getattr__(name: str):
    if name not in _EXPORTS:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    return getattr(import_module(f"{__name__}.{_EXPORTS[name]}"), name)
