"""The outcome of a commit, the same on every member: decided by the collectives of a
failure-free round, through the store otherwise (`settle.py`, `agreement.py`)."""
from __future__ import annotations

import enum


class Decision(enum.Enum):
    ABORT = "abort"
    COMMIT = "commit"
    COMMIT_AND_SYNC = "commit+sync"  # committed, and a member saw a newer membership epoch: all
    #                                  members meet at the iteration boundary (grow / rebuild)

    @property
    def committed(self) -> bool:
        return self is not Decision.ABORT
