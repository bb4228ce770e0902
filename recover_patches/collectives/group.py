"""What the layers above use of a resilient group: a torch ProcessGroup whose operations end in
PeerFailure and whose backend is replaced in place, rendezvous first (`process_group.py` holds the
one implementation, `ResilientProcessGroup`, and its rules)."""
from __future__ import annotations

from typing import Callable, Protocol, Sequence

from recover_patches.collectives.rendezvous import Regroup


class ResilientGroup(Protocol):
    label: str  # e.g. "dp.tp0.stage1": names the group in failures and rendezvous keys
    members: tuple[int, ...]  # global ranks, in group-rank order
    backend_kind: str  # "gloo", "nccl", ...
    host_waits: bool  # wait() blocks the host (gloo); else a stream wait the watchdog bounds

    def meet(self, epoch: int, members: Sequence[int], key: str = "", force: bool = False,
             fate: Sequence[int] = ()) -> Regroup:
        """Meet the other members at (epoch, key) and decide with them: keep, shrink, rebuild.
        An epoch after `epoch` that declares a member, or a rank of `fate`, dead ends it."""
        ...

    def apply(self, plan: Regroup) -> str:
        """Carry out what the meeting decided: 'kept', 'shrunk' or 'rebuilt'."""
        ...

    def abandon(self, reason: str) -> None:
        """Stop using the backend (recovery starts): peers blocked on it fail fast."""
        ...

    def broke(self, op: str) -> bool:
        """A break of the current backend cut an `op` operation short (NCCL, where its wait
        had returned: what ran after it may have read what the abort left)."""
        ...

    def stream_event(self) -> Callable[[], bool] | None:
        """A query of an event recorded now on the current stream; None where wait() blocks."""
        ...

    def settle(self) -> None:
        """Start-up is over: operations and rebuilds are bounded by T from now on."""
        ...

    def raise_latched(self) -> None:
        """Raise a failure the watchdog latched for an operation whose wait() had returned."""
        ...

    def set_before_op(self, hook: Callable[[str], None]) -> None:
        """Fault injection: `hook(op)` before each operation."""
        ...

    def shutdown(self) -> None:
        """Stop using the group for good."""
        ...
