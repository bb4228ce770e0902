"""One heartbeat per node: ranks beat into a node-local directory, their launcher forwards them.

At 100,000 GPUs a store write per rank per heartbeat interval is 250,000 writes a second into
the coordinator's one store (design.md §14). Instead the launcher that started a node's
ranks gives them a directory (RECOVER_NODE_BEATS, on tmpfs where there is one); each rank's
heartbeat thread replaces its own file there (`<pid>-<rank>`: "<interval> <beat> <progress>")
instead of writing to the store, and the launcher writes every live child's latest line as one
key per node (`hbn/<node>`, JSON {rank: "<beat> <progress>"}) once per heartbeat interval. The
coordinator's verdicts stay per rank (`liveness.py` reads the same "<beat> <progress>"); a rank's
beat reaches it at most one interval later than a direct write would, which the verdict's bound
absorbs (`timeouts.py`). A launcher that dies takes its node's beats with it: its ranks fall
silent, as with a lost node.

Only the launcher's live children are forwarded, found by pid: the file of a process that ended
(killed, fenced, replaced) is never read again, so a slot's replacement -- on this node or, from a
standby, on another -- is the only voice of its rank. Ranks started without such a launcher
(torchrun, one SLURM task per GPU) have no RECOVER_NODE_BEATS and beat on the store as before.
"""
from __future__ import annotations

import contextlib
import os
import shutil
import tempfile
import time
from collections.abc import Iterable
from typing import NamedTuple

ENV_VAR, NODE_ENV_VAR = "RECOVER_NODE_BEATS", "RECOVER_NODE_NAME"
LOCAL_BEATS_PER_INTERVAL = 8  # a rank's file is replaced this often per forward: a progress mark
#                               then waits at most 1/8 of an interval for the next forward
FIRST_INTERVAL = 0.1  # seconds between forwards until a rank's file says its interval


class NodeBeats(NamedTuple):
    """Where a rank started by a ReCoVer launcher beats: the directory, and the node's name (the
    key its launcher forwards under, told to the coordinator in the rank's handshake)."""
    directory: str
    node: str

    @classmethod
    def from_env(cls, environ=os.environ) -> "NodeBeats | None":
        if not environ.get(ENV_VAR) or not environ.get(NODE_ENV_VAR):
            return None
        return cls(environ[ENV_VAR], environ[NODE_ENV_VAR])


def write_beat(directory: str, rank: int, interval: float, beat: str) -> None:
    """A rank's heartbeat ("<beat> <progress>") in `<pid>-<rank>`, replacing its last one
    atomically (a reader never sees half a line): a file write on tmpfs, no store operation."""
    path = os.path.join(directory, f"{os.getpid()}-{rank}")
    with open(path + ".tmp", "w") as f:
        f.write(f"{interval!r} {beat}")
    os.replace(path + ".tmp", path)


def _beat_files(directory: str, live_pids: set[int]) -> list[tuple[int, str]]:
    """(rank, path) of the beat files of live processes; the files of ended ones are removed
    (a later process given the same pid must not speak for their ranks)."""
    try:
        names = os.listdir(directory)
    except OSError:  # the directory was removed under us: nothing to forward, the launcher lives on
        return []
    found = []
    for name in names:
        pid, _, rank = name.partition("-")
        if not (rank.isdigit() and pid.isdigit()):
            continue  # a file being written
        path = os.path.join(directory, name)
        if int(pid) in live_pids:
            found.append((int(rank), path))
        else:
            with contextlib.suppress(OSError):
                os.remove(path)
    return found


def _read_beat(path: str) -> tuple[float, str] | None:
    try:
        with open(path) as f:
            interval, beat = f.read().split(" ", 1)
        return float(interval), beat
    except (OSError, ValueError):  # replaced or removed meanwhile
        return None


class NodeBeatRelay:
    """The launcher's side: a directory for its children, and what to forward when it is due."""

    def __init__(self, node: str, directory: str | None = None, clock=time.monotonic):
        shm = "/dev/shm" if os.path.isdir("/dev/shm") and os.access("/dev/shm", os.W_OK) else None
        self.node = node  # "<node rank>", or "standby-<node rank>" for a standby node
        self.directory = directory or tempfile.mkdtemp(prefix="recover-beats-", dir=shm)
        self.interval = FIRST_INTERVAL
        self.ranks: frozenset[int] = frozenset()  # those of the last forward (epochs go to them)
        self._clock = clock
        self._next = clock()

    def env(self) -> dict[str, str]:
        return {ENV_VAR: self.directory, NODE_ENV_VAR: self.node}

    def due_in(self) -> float:
        """Seconds until the next forward is due (0 when it is)."""
        return max(0.0, self._next - self._clock())

    def collect(self, live_pids: Iterable[int]) -> dict[int, str] | None:
        """{rank: "<beat> <progress>"} of the live children when a forward is due, else None.
        The interval follows the ranks' own (their --recover-timeout's heartbeat interval)."""
        now = self._clock()
        if now < self._next:
            return None
        beats, intervals = {}, []
        for rank, path in _beat_files(self.directory, set(live_pids)):
            found = _read_beat(path)
            if found is not None:
                interval, beats[rank] = found
                intervals.append(interval)
        if intervals:
            self.interval = min(intervals)
        self._next = now + self.interval
        self.ranks = frozenset(beats)  # (one reference swap: read by the epoch watch's thread)
        return beats

    def close(self) -> None:
        shutil.rmtree(self.directory, ignore_errors=True)
