"""Layer 1: fault-tolerant collectives, the membership coordinator, failure detection (DESIGN §5).

Public names are loaded lazily so that importing `errors` (e.g. from the launcher) stays cheap.
"""
from importlib import import_module

_EXPORTS = {
    "PeerFailure": "errors", "CoordinatorError": "errors", "CoordinatorConfigError": "errors",
    "CoordinatorUnreachable": "errors", "JobTokenRefused": "errors", "MembershipTimeout": "errors",
    "MembershipClient": "membership", "ResilientProcessGroup": "process_group",
    "Regrouped": "rendezvous",
}
__all__ = sorted(_EXPORTS)


def __getattr__(name: str):
    if name not in _EXPORTS:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    return getattr(import_module(f"{__name__}.{_EXPORTS[name]}"), name)
