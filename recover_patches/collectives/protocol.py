"""The coordinator's TCPStore layout and handshake, shared by the coordinator, ranks and launchers.

Public keys (anyone can reach them): ``recover/hello/*`` for the handshake. Everything else lives
under ``recover/job/<digest of the job token>/``, so a process holding another job's token can
neither read nor disturb this job's state even before it is refused.

Under the job prefix:
  config           JSON {world_size}
  epoch            the latest epoch number e (written after epoch/<e>)
  epoch/<e>        JSON {epoch, dead: [global ranks], reason, dead_incarnations: {rank: k} (k > 0
                   only), joining: [ranks a grow epoch made members again]}
  hb/<rank>        "<beat> <progress>": a counter the rank bumps every heartbeat interval, then
                   where it is (marks counted, epoch, phase, iteration, microbatch); written
                   only by ranks started without a ReCoVer launcher
  hbs/<shard>      node beats: a launcher appends one line for its live ranks once per
                   heartbeat interval to its node's shard (the format: `node_beats.py`); the
                   coordinator takes each shard's lines with one read and one compare-and-set, so
                   a sweep costs what was written since the last one, not a read per node
  notify/<rank>    queue: the coordinator pushes each new epoch number; the rank pushes "stop" to
                   its own queue to end its watcher
  notify/launcher/<node>  the same for the launcher of node <node> (`epoch_watch.py`): it fences
                   the ranks an epoch declares dead without polling, and passes the epoch on to
                   the ranks whose beats it forwards (the coordinator then pushes to those ranks
                   no more: a push per node, not per rank); "job stopped" when the coordinator
                   stopped the job
  reports/count    number of reports; reports/<n> is the n-th report (JSON, see `Report`)
  complete         JSON {epoch, dead} stamped by the coordinator when the job declares completion
  finished         set once every rank of the world has exited or been declared dead, and every
                   standby process sent home has exited: "standbys" if standby nodes took part
  stopped          why the job stopped before completion (no unit holds the training state):
                   every rank, standby process and launcher ends, with the restart status 3
  standby/<id>     queue: the coordinator pushes a standby process its slot (JSON {rank,
                   incarnation}), or "complete" / "stopped" when it will never be needed
  assigned/<id>    the same JSON, read by the standby's launcher (which fences by slot);
                   assigned/count counts assignments so a launcher reads keys only when it moved
  pg/<name>/...    process-group rendezvous keys (one fresh sub-prefix per build)
"""
from __future__ import annotations

import hashlib
import json
import socket
import time
import zlib
from datetime import timedelta
from pathlib import Path
from typing import Protocol, Sequence

import torch.distributed as dist

from recover_patches.collectives.bounded_call import BoundedCaller
from recover_patches.collectives.errors import (CoordinatorConfigError, CoordinatorUnreachable,
                                                JobTokenRefused, SlotTaken)

HELLO_COUNT = "recover/hello/count"
OK = "ok"
STOP = "stop"
CONFIG, EPOCH, REPORTS_COUNT, COMPLETE, FINISHED = "config", "epoch", "reports/count", "complete", "finished"
STOPPED = "stopped"
JOB_STOPPED = "job stopped"  # pushed to the launchers' queues when the coordinator stops the job
FINISHED_WITH_STANDBYS = "standbys"  # FINISHED's value when standby nodes took part
ASSIGNED_COUNT = "assigned/count"
SLOT_TAKEN = "slot taken:"  # how a refusal starts when a standby process was given the slot


def hello_key(n: int) -> str:
    return f"recover/hello/{n}"


def reply_key(n: int) -> str:
    return f"recover/hello/{n}/reply"


def dead_incarnations(record: dict) -> dict[int, int]:
    """Which incarnation of each dead rank an epoch record declared dead."""
    return {r: int(record.get("dead_incarnations", {}).get(str(r), 0)) for r in record["dead"]}


def epoch_key(epoch: int) -> str:
    return f"epoch/{epoch}"


def heartbeat_key(rank: int) -> str:
    return f"hb/{rank}"


NODE_BEAT_SHARDS = 64  # few keys for one multi_get; enough that a launcher's append seldom
#                       lands between the coordinator's read of a shard and its clearing


def node_beats_key(node: str) -> str:
    """The shard a node's beats are appended to (crc32: the same in every process)."""
    return f"hbs/{zlib.crc32(node.encode()) % NODE_BEAT_SHARDS}"


def node_beats_keys() -> list[str]:
    return [f"hbs/{shard}" for shard in range(NODE_BEAT_SHARDS)]


def notify_key(rank: int) -> str:
    return f"notify/{rank}"


def launcher_notify_key(node: str) -> str:
    return f"notify/launcher/{node}"


def report_key(n: int) -> str:
    return f"reports/{n}"


def standby_key(standby_id: str) -> str:
    return f"standby/{standby_id}"


def assigned_key(standby_id: str) -> str:
    return f"assigned/{standby_id}"


def token_digest(token: str) -> str:
    return hashlib.sha256(token.encode()).hexdigest()


def job_prefix(token: str) -> str:
    return f"recover/job/{token_digest(token)[:16]}/"


def job_key(token: str, key: str) -> str:
    """`key` of the job's store as the server holds it: dist.PrefixStore joins prefix and key
    with a "/" (tests/collectives/test_coordinator_counters.py checks torch still does)."""
    return f"{job_prefix(token)}/{key}"


def parse_address(text: str, source: str) -> tuple[str, int]:
    host, sep, port = text.rpartition(":")
    if not sep or not host or not port.isdigit():
        raise CoordinatorConfigError(f"{source}={text!r} is not host:port; set it to the coordinator's "
                                     "address, e.g. 127.0.0.1:29400")
    return host, int(port)


def read_address(address_file: Path, fallback: str) -> str:
    """The coordinator's address as the node's agent last wrote it (`fallback` without one)."""
    try:
        return address_file.read_text().strip() or fallback
    except FileNotFoundError:
        return fallback


def current_address(address_file: Path | None, host: str, port: int) -> tuple[str, int]:
    """Where to connect: the elected coordinator's address from the node's file, else
    (no file, or none written yet) `host:port`."""
    if address_file is None:
        return host, port
    return parse_address(read_address(address_file, f"{host}:{port}"), str(address_file))


CONNECT_SLACK = 2.0  # seconds a connection may take past its timeout before it is abandoned


def connect(host: str, port: int, timeout: float, source: str,
            quick: bool = False) -> dist.TCPStore:
    """A client connection to the coordinator's store, or a clear error naming `source`.
    `quick`: an address where nothing listens fails at once (torch's own connect retries it,
    with backoff, for seconds past `timeout`), for a rank that looks for a successor.
    Bounded: torch's client validates the connection with a blocking read, so a server that
    accepts and never answers (a coordinator coming up or going down under load) would hold
    the caller for good; it is abandoned `CONNECT_SLACK` past `timeout` instead."""
    bounded = BoundedCaller(timeout + CONNECT_SLACK, "recover-connect")
    try:
        if quick:
            socket.create_connection((host, port), timeout=timeout).close()
        return bounded(lambda: dist.TCPStore(host, port, is_master=False, wait_for_workers=False,
                                             timeout=timedelta(seconds=timeout)))
    except (RuntimeError, OSError) as e:  # (TimeoutError is an OSError; so is OperationTimedOut)
        raise CoordinatorUnreachable(
            f"no coordinator reachable at {host}:{port} within {timeout:g}s (from {source}); start it "
            "with `python -m recover_patches.collectives.coordinator` or let the launcher start it"
        ) from e
    finally:
        bounded.close()


def handshake(store: dist.Store, token: str, role: str, rank: int, timeout: float,
              incarnation: int = 0, standby: str | None = None,
              recover_timeout: float | None = None, rejoin: dict | None = None,
              node: str | None = None, startup: float | None = None,
              unit: Sequence[int] = ()) -> None:
    """Present the job token (and, for a process that started as a standby, its name; for a rank
    its --recover-timeout, `rejoin` = {epoch, record} when it registers again with a restarted
    coordinator, `node`: the launcher whose node beat carries its heartbeat, if any, and
    `startup`: the silence allowed while it starts, and `unit`: the slots whose death breaks its
    replica); raise JobTokenRefused with the coordinator's reason if refused."""
    hello = {"digest": token_digest(token), "role": role, "rank": rank, "incarnation": incarnation,
             "standby": standby, "timeout": recover_timeout, "rejoin": rejoin, "node": node,
             "startup": startup, "unit": list(unit)}
    bounded = BoundedCaller(timeout + CONNECT_SLACK, "recover-connect")
    try:  # bounded as the connection is: a coordinator gone silent mid-handshake never answers
        reply = bounded(lambda: _hello(store, hello, timeout))
    except RuntimeError as e:
        raise CoordinatorUnreachable(f"the coordinator did not answer the handshake of {role} "
                                     f"{rank} within {timeout:g}s") from e
    finally:
        bounded.close()
    if reply.startswith(SLOT_TAKEN):
        raise SlotTaken(f"coordinator refused {role} {rank}: {reply}")
    if reply != OK:
        raise JobTokenRefused(f"coordinator refused {role} {rank}: {reply}")


def _hello(store: dist.Store, hello: dict, timeout: float) -> str:
    n = store.add(HELLO_COUNT, 1)
    store.set(hello_key(n), json.dumps(hello))
    store.wait([reply_key(n)], timedelta(seconds=timeout))
    return store.get(reply_key(n)).decode()


class Report(dict):
    """One report to the coordinator. kinds: exit (by a launcher: rank, code, incarnation,
    replacing = whether it starts a replacement), standby (a standby process waiting for a slot:
    id), standby_exit (by a launcher: a standby process that never got a slot ended: id),
    suspect (by a rank whose operation timed out or broke: epoch, suspects, where), leave (a rank
    quitting cleanly), spare (a rank waiting to re-form its replica: incarnation, slots = the
    replica's ranks), joined (a rank a grow brought back received the state: incarnation),
    complete (the job finished its work)."""

    @classmethod
    def make(cls, kind: str, **fields) -> "Report":
        return cls(kind=kind, time=time.time(), **fields)


class ReportBox(Protocol):
    """Where reports go: the coordinator's store, counted or not."""

    def add(self, key: str, amount: int, /) -> int: ...

    def set(self, key: str, value: str, /) -> None: ...


def post_report(store: ReportBox, report: Report) -> int:
    n = store.add(REPORTS_COUNT, 1)
    store.set(report_key(n), json.dumps(report))
    return n


def read_latest(store) -> tuple[int, frozenset[int], dict]:
    """The latest membership epoch in the coordinator's store: (epoch, its dead, its record)."""
    epoch = int(store.get(EPOCH))
    record = json.loads(store.get(epoch_key(epoch)))
    return epoch, frozenset(record["dead"]), record
