"""One heartbeat per node: ranks beat into a node-local directory, their launcher forwards them.

At 100,000 GPUs a store write per rank per heartbeat interval is 250,000 writes a second into
the coordinator's one store (design.md §14). Instead the launcher that started a node's
ranks gives them a directory (RECOVER_NODE_BEATS, on tmpfs where there is one); each rank's
heartbeat thread replaces its own file there (`<pid>-<rank>`: "<interval> <beat> <progress>")
instead of writing to the store, and the launcher appends one line per node per heartbeat interval
to its node's shard of the store (`protocol.py`, `hbs/<shard>`). The line says, by the launcher's
clock, how long ago each live child's beat and progress last moved, and its progress:

    <node> TAB <largest beat age, ms> TAB <ranks, "1,2"> TAB JSON {rank: "<beat age ms> <progress age ms> <progress>"}

so the coordinator learns from the first three fields alone, without parsing the JSON, that the
node is alive and that none of its ranks has been quiet long enough to matter: at 12,500 nodes it
takes 31,000 lines a second, and parses a node's JSON only when its quietest rank nears a verdict
or a waiter asks for the progress of a rank (`liveness.py`). A rank's beat reaches the coordinator
at most one interval later than a direct write would, which the verdict's bound absorbs
(`timeouts.py`). A launcher that dies takes its node's beats with it: its ranks fall silent, as
with a lost node.

Only the launcher's live children are forwarded, found by pid: the file of a process that ended
(killed, fenced, replaced) is never read again, so a slot's replacement -- on this node or, from a
standby, on another -- is the only voice of its rank. Ranks started without such a launcher
(torchrun, one SLURM task per GPU) have no RECOVER_NODE_BEATS and beat on the store as before.
"""
from __future__ import annotations

import contextlib
import json
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


class RankAges(NamedTuple):
    """What a node's line says of one rank: seconds since its beat and its progress last moved
    (by the launcher's clock), and the progress itself."""
    beat: float
    progress: float
    where: str


class NodeBeatLine(NamedTuple):
    """One node's line, split but not parsed further (`format_line` says what each field is)."""
    node: str
    stale: float  # seconds: the largest beat age among its ranks
    ranks: str  # "1,2": the ranks it carries, compared as a string
    detail: str  # JSON {rank: "<beat age ms> <progress age ms> <progress>"}

    def carried(self) -> frozenset[int]:
        return frozenset(int(r) for r in self.ranks.split(",") if r)

    def ages(self) -> dict[int, RankAges]:
        ages = {}
        for rank, text in json.loads(self.detail).items():
            beat, progress, where = text.split(" ", 2)
            ages[int(rank)] = RankAges(int(beat) / 1000, int(progress) / 1000, where)
        return ages


def format_line(node: str, ages: dict[int, RankAges]) -> str:
    stale = max((a.beat for a in ages.values()), default=0.0)
    detail = {r: f"{round(a.beat * 1000)} {round(a.progress * 1000)} {a.where}"
              for r, a in sorted(ages.items())}
    return (f"{node}\t{round(stale * 1000)}\t{','.join(str(r) for r in sorted(ages))}\t"
            f"{json.dumps(detail)}\n")


def parse_lines(text: str) -> dict[str, NodeBeatLine]:
    """node -> its newest line in `text` (an older line of the node says nothing more)."""
    newest = {}
    for line in text.splitlines():
        node, _, rest = line.partition("\t")
        newest[node] = rest
    lines = {}
    for node, rest in newest.items():
        fields = rest.split("\t", 2)
        if len(fields) == 3:
            lines[node] = NodeBeatLine(node, int(fields[0]) / 1000, fields[1], fields[2])
    return lines


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


def node_name(node_rank: int, standby: bool) -> str:
    """The name a launcher's lines carry: its node rank, or `standby-N` for a standby node."""
    return f"standby-{node_rank}" if standby else str(node_rank)


def standby_node(standby: str) -> str:
    """The node whose lines speak for standby process `N.k` (its launcher's): `standby-N`."""
    return node_name(int(standby.split(".", 1)[0]), standby=True)


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


class _Moved(NamedTuple):
    beat: str
    beat_at: float
    where: str
    where_at: float


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
        self._moved: dict[int, _Moved] = {}  # rank -> its beat and progress, and when each moved

    def env(self) -> dict[str, str]:
        return {ENV_VAR: self.directory, NODE_ENV_VAR: self.node}

    def due_in(self) -> float:
        """Seconds until the next forward is due (0 when it is)."""
        return max(0.0, self._next - self._clock())

    def collect(self, live_pids: Iterable[int]) -> dict[int, RankAges] | None:
        """The live children's ages when a forward is due, else None. The interval follows the
        ranks' own (their --recover-timeout's heartbeat interval)."""
        now = self._clock()
        if now < self._next:
            return None
        moved, intervals = {}, []
        for rank, path in _beat_files(self.directory, set(live_pids)):
            found = _read_beat(path)
            if found is None:
                continue
            interval, line = found
            intervals.append(interval)
            beat, _, where = line.partition(" ")
            last = self._moved.get(rank)
            beat_at = last.beat_at if last and last.beat == beat else now
            where_at = last.where_at if last and last.where == where else now
            moved[rank] = _Moved(beat, beat_at, where, where_at)
        self._moved = moved  # (an ended child's history goes with it)
        if intervals:
            self.interval = min(intervals)
        self._next = now + self.interval
        self.ranks = frozenset(moved)  # (one reference swap: read by the epoch watch's thread)
        return {r: RankAges(now - m.beat_at, now - m.where_at, m.where) for r, m in moved.items()}

    def close(self) -> None:
        shutil.rmtree(self.directory, ignore_errors=True)
