"""Typed failures of layer 1. Layer 2 catches `PeerFailure`; the trainer maps `CoordinatorError`s
raised at start-up to a one-line message and exit status 2."""
from __future__ import annotations

from collections.abc import Iterable


class PeerFailure(RuntimeError):
    """A collective or p2p operation could not complete because a peer failed (or a newer
    membership epoch made the group stale).

    epoch:     the membership epoch the failed operation belonged to; recovery waits for a newer one.
    suspects:  GLOBAL ranks blamed: the ranks the coordinator declared dead since `epoch` (restricted
               to the group's members when any of them are), or, if no verdict arrived in time, the
               peers the operation was waiting on (then `confirmed` is False).
    op:        "<group name>.<operation>", e.g. "dp.allreduce".
    """

    def __init__(self, epoch: int, suspects: Iterable[int], op: str, detail: str = "",
                 confirmed: bool = True):
        self.epoch = epoch
        self.suspects = frozenset(suspects)
        self.op = op
        self.detail = detail
        self.confirmed = confirmed
        blame = sorted(self.suspects) if self.suspects else "unknown"
        kind = "" if confirmed else " (unconfirmed)"
        super().__init__(f"{op} failed in epoch {epoch}; suspects{kind}: {blame}"
                         + (f"; {detail}" if detail else ""))

    def __reduce__(self):  # keep the fields when pickled (e.g. across a multiprocessing pipe)
        return (type(self), (self.epoch, self.suspects, self.op, self.detail, self.confirmed))


class CoordinatorError(RuntimeError):
    """Base class: something is wrong between this process and the membership coordinator."""


class CoordinatorConfigError(CoordinatorError):
    """Missing or malformed coordinator settings (address, token, rank env)."""


class CoordinatorUnreachable(CoordinatorError):
    """No coordinator answered at the configured address in time."""


class JobTokenRefused(CoordinatorError):
    """The coordinator refused this process: wrong job token, bad rank, or a rank already dead."""


class SlotTaken(JobTokenRefused):
    """A local replacement came too late: the coordinator gave its slot to a standby process.
    Not an error of the job: the process leaves with status 0."""


class MembershipTimeout(CoordinatorError):
    """No newer membership epoch was announced within the wait."""
