"""Typed failures of layer 1. Layer 2 catches `PeerFailure`; the trainer maps `CoordinatorError`s
raised at start-up to a one-line message and exit status 2."""
from __future__ import annotations

import logging
import re
from collections.abc import Iterable

logger = logging.getLogger(__name__)


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


# a backend's source location ("[/…/gloo/transport/tcp/pair.cc:553] "), and the advice gloo
# appends to its transport errors ("This is typically caused by a remote worker crashing. …")
_SOURCE_LOCATION = re.compile(r"\[[^\]\s]*\.(?:cc|cpp|h|hpp):\d+\]\s*")
_ADVICE = re.compile(r"\.\s+This is typically caused by.*$", re.S)
CAUSE_CHARS = 160


def short_cause(error: BaseException | str) -> str:
    """What a backend's error says, in one short line for ReCoVer's log: gloo's "[…/pair.cc:553]
    Connection closed by peer [127.0.0.1]:54485. This is typically caused by … GLHF! 🏖️" reads
    "Connection closed by peer [127.0.0.1]:54485". The raw text goes to the debug log."""
    raw = str(error)
    text = _ADVICE.sub("", _SOURCE_LOCATION.sub("", raw)).strip()
    text = " ".join(text.split()) or raw.strip()
    if text != raw.strip():
        logger.debug(f"backend error, as raised: {raw}")
    return text if len(text) <= CAUSE_CHARS else text[:CAUSE_CHARS - 3] + "..."
