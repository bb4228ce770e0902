"""What the iteration transaction drives (`iteration.py`): this rank's part of its replica,
phase by phase (`ReplicaStep`; implemented by `megatron/training/step/replica.py`), and the
coordinator store's part of a recovery (`Agreement`; `agreement.py`)."""
from __future__ import annotations

from typing import Any, Mapping, Protocol, Sequence

from recover_patches.collectives import Regrouped
from recover_patches.recovery.decision import Decision
from recover_patches.recovery.grad_buffer import ReducedGradients
from recover_patches.recovery.reduce import Totals


class Executed(Protocol):
    """What a replica's schedule computed on this rank (the pipeline engine's result)."""
    ids: list[int]
    tokens: int
    loss_sum: Any  # a float, or a device tensor read once by the reduction
    measures: Any  # None, or a device tensor summed over the ids (MoE's auxiliary losses)

class ReplicaStep(Protocol):
    """This rank's part of one replica, phase by phase, as the transaction drives it. Each
    method either does its work or raises PeerFailure; none changes the membership."""

    def plan(self, ids: Sequence[int], replicas: Sequence[int]) -> Mapping[int, list[int]]:
        """1: layer 3's placement of `ids` over `replicas` (the same on every rank)."""

    def refresh(self) -> None:
        """Before computing: PeerFailure if this replica's weights are incomplete (the same
        answer on all its ranks); a rebuild makes them whole again."""

    def execute(self, ids: list[int]) -> Executed:
        """2: the pipeline schedule over `ids`; gradients accumulate on top of what is there."""

    def reduce(self, local: Totals) -> ReducedGradients:
        """3: the out-of-place data-parallel reduction, the commit bookkeeping riding in it."""

    def check_reduced(self) -> None:
        """Raise a failure of an operation whose wait() returned before it ended (NCCL's waits
        do not block the host; layer 1's watchdog latches what went wrong)."""

    def validate(self, reduced: ReducedGradients, local: Totals,
                 assignment: Mapping[int, list[int]]) -> None:
        """3b: the reduced results are plausible (a rejected replica: PeerFailure naming it)."""

    def confirm(self, news: bool) -> bool:
        """4: the ack over the DP group, then the exchange over the replica's group, each waited
        for on the host (`settle.py`); returns whether any member passed news=True."""

    def step(self, reduced: ReducedGradients) -> dict:
        """5: clip, optimizer and LR step; returns what the iteration reports. Runs from the same
        `reduced` on a rank that rolls forward, so nothing before the optimizer changes it."""

    def abandon(self, phase: str) -> None:
        """Drop the backends peers may be blocked on (which: by the phase the failure came in)."""

    def rebuild(self, live_replicas: list[int], epoch: int, key: str) -> Regrouped:
        """Groups (and whatever follows them) for the agreed live replicas."""

    def mend(self, epoch: int, key: str) -> Regrouped:
        """Before rolling forward: the groups inside this replica are whole on all its members
        again (a failed ack or exchange may have aborted one); only this replica's ranks meet."""

    def weights_torn(self) -> bool:
        """An operation this rank issued before its reduction broke: the weights its round
        computed on may be what an aborted all-gather left half-written (the distributed
        optimizer's, issued by the last step; NCCL's wait let the forward run once the abort
        released the stream), so its round 0 is computed again. Ask before the rebuild."""

    def replica_any(self, flag: bool) -> bool:
        """True on every rank of this replica if any of them passes True."""

    def reset(self) -> None:
        """Zero the local gradients: round 0 is computed again."""

    def snapshot(self) -> Any:
        """The local gradients, to undo an aborted recovery round."""

    def restore(self, state: Any) -> None: ...


class Agreement(Protocol):  # the store's part (`agreement.py`)
    def latest_epoch(self) -> int: ...
    def note_commit(self, key: str, decision: Decision) -> None: ...
    def settle(self, key: str, members: list[int], status: str) -> Decision: ...
    def agree_on_epoch(self, key: str, since_epoch: int) -> tuple[int, frozenset[int]]: ...

    def barrier(self, key: str, members: list[int], epoch: int) -> None: ...
