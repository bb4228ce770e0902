"""The membership coordinator: a small process outside the training ranks (DESIGN §5).

It owns the TCPStore server and decides membership epochs. A rank is declared dead on evidence
only: its launcher saw it exit (reported within milliseconds), or its heartbeat went silent for
`heartbeat_timeout` (hangs, lost nodes). Each batch of new deaths starts a new epoch; ranks watch
the epoch key and abort every pending operation of the old epoch.

What does NOT start an epoch, and why:
  * a rank's own failure report (`suspect`): a timeout or a closed socket does not say who is at
    fault; the report is logged, and the verdict is left to exits and heartbeats;
  * a clean `leave` (surviving ranks of a broken replica) and any exit after the job declared
    completion: those ranks are recorded as gone without aborting everyone's work.

It also brings slots back (DESIGN §15, rules in `membership_state.py`): a grow epoch once a broken
replica's slots all have waiting processes, and dead slots no local replacement is coming for
handed to standby processes (`launch --standby`).

Run by hand (e.g. SLURM, on the first node):
    RECOVER_JOB_TOKEN=... python -m recover_patches.collectives.coordinator --port 29400 --world-size N
"""
from __future__ import annotations

import argparse
import json
import os
import signal
import sys
import time
from dataclasses import dataclass
from datetime import timedelta

import torch.distributed as dist

from recover_patches.collectives import protocol as P
from recover_patches.collectives.membership_state import MembershipState

TICK = 0.02  # seconds between polls of the store: bounds detection latency, costs ~nothing


def log(message: str) -> None:
    print(f"[recover.coordinator] {message}", file=sys.stderr, flush=True)


@dataclass
class CoordinatorConfig:
    world_size: int
    token: str
    heartbeat_interval: float = 1.0
    heartbeat_timeout: float = 10.0

    @property
    def standby_grace(self) -> float:
        """How long a dead slot's launcher may take to report a local replacement before the slot
        goes to a standby: it fences and reports within a fraction of a second when it is alive."""
        return max(1.0, 2 * self.heartbeat_interval)

    @property
    def register_timeout(self) -> float:
        """How long a standby given a slot may take to register before the slot goes to another."""
        return self.heartbeat_timeout + 10.0


class Coordinator:
    def __init__(self, server: dist.TCPStore, config: CoordinatorConfig):
        self.raw = server
        self.store = dist.PrefixStore(P.job_prefix(config.token), server)
        self.config = config
        self.state = MembershipState(config.world_size, standby_grace=config.standby_grace,
                                     register_timeout=config.register_timeout)
        self.digest = P.token_digest(config.token)
        self.next_hello = 1
        self.next_report = 1
        self.heartbeats: dict[int, tuple[int, float]] = {}  # rank -> (last counter, when it moved)
        self.registered: set[int] = set()  # ranks to notify of new epochs
        self.stopping = False
        self.stopped = False
        self.store.set(P.CONFIG, json.dumps({"world_size": config.world_size,
                                             "heartbeat_interval": config.heartbeat_interval,
                                             "heartbeat_timeout": config.heartbeat_timeout}))
        self._publish(0, "job start")

    def _publish(self, epoch: int, reason: str) -> None:
        self.store.set(P.epoch_key(epoch), json.dumps(self.state.record(epoch, reason)))
        self.store.set(P.EPOCH, str(epoch))  # after epoch/<e>: readers of EPOCH find its record
        for rank in sorted(self.registered):
            self.store.queue_push(P.notify_key(rank), str(epoch))
        if epoch:
            log(f"epoch {epoch}: dead ranks {sorted(self.state.dead)} ({reason})")
            self.heartbeats.update({r: (-1, time.monotonic()) for r in self.state.joining})

    def tick(self) -> None:
        self._handshakes()
        self._reports()
        self._check_heartbeats()
        for published in (self.state.next_epoch(), self.state.next_grow()):
            if published is not None:
                self._publish(*published)
        self._standbys()
        if self.state.finished() and not self.raw.check([P.FINISHED]):
            self.store.set(P.FINISHED, "1")
        if not self.stopped and (reason := self.state.stopped_reason()) is not None:
            self.stopped = True
            self.store.set(P.STOPPED, reason)
            log(f"job stopped: {reason}")

    def _standbys(self) -> None:
        """Hand orphaned slots to standby processes; send them home when none ever will be."""
        for standby, slot, incarnation in self.state.assign_standbys():
            assignment = json.dumps({"rank": slot, "incarnation": incarnation})
            self.store.set(P.assigned_key(standby), assignment)
            self.store.add(P.ASSIGNED_COUNT, 1)
            self.store.queue_push(P.standby_key(standby), assignment)
            log(f"standby {standby} takes rank {slot} (incarnation {incarnation})")
        for standby in self.state.release_standbys():
            ended = P.COMPLETE if self.state.completed_at is not None else P.STOPPED
            self.store.queue_push(P.standby_key(standby), ended)

    def _handshakes(self) -> None:
        count = self.raw.add(P.HELLO_COUNT, 0)
        while self.next_hello <= count and self.raw.check([P.hello_key(self.next_hello)]):
            n = self.next_hello
            hello = json.loads(self.raw.get(P.hello_key(n)))
            reason = None
            if hello["digest"] != self.digest:
                reason = ("wrong job token (RECOVER_JOB_TOKEN / --job-token must be the one the "
                          "coordinator was started with)")
            elif hello["role"] == "rank":
                reason = self.state.refuse_reason(hello["rank"], hello.get("incarnation", 0),
                                                  hello.get("standby"))
            if reason is None and hello["role"] == "rank":
                self.state.on_register(hello["rank"], hello.get("incarnation", 0))
                self.heartbeats[hello["rank"]] = (-1, time.monotonic())
                self.registered.add(hello["rank"])
            if reason is not None:
                log(f"refused {hello['role']} {hello['rank']}: {reason}")
            self.raw.set(P.reply_key(n), reason or P.OK)
            self.next_hello += 1

    def _reports(self) -> None:
        count = self.store.add(P.REPORTS_COUNT, 0)
        while self.next_report <= count and self.store.check([P.report_key(self.next_report)]):
            report = json.loads(self.store.get(P.report_key(self.next_report)))
            self.next_report += 1
            kind = report["kind"]
            if kind == "exit":
                if report.get("incarnation", 0) == self.state.incarnation.get(report["rank"], 0):
                    self.heartbeats.pop(report["rank"], None)
                self.state.on_exit(report["rank"], report["code"], report.get("incarnation", 0),
                                   report.get("replacing", False))
            elif kind == "leave":
                self.state.on_leave(report["rank"])
                self.heartbeats.pop(report["rank"], None)
            elif kind == "spare":
                self.state.on_spare(report["rank"], report["incarnation"], tuple(report["slots"]))
            elif kind == "standby":
                self.state.on_standby(report["id"])
            elif kind == "standby_exit":
                self.state.on_standby_exit(report["id"])
            elif kind == "complete":
                self._complete(report["rank"])
            elif kind == "suspect":
                log(f"rank {report['rank']} suspects {report['suspects']} in {report['where'][:160]}")

    def _complete(self, by_rank: int) -> None:
        if self.state.completed_at is None:
            self.state.completed_at = self.state.epoch
            self.store.set(P.COMPLETE, json.dumps({"epoch": self.state.epoch,
                                                   "dead": sorted(self.state.dead), "by": by_rank}))
            log(f"job declared complete by rank {by_rank} at epoch {self.state.epoch}")

    def _check_heartbeats(self) -> None:
        ranks = list(self.heartbeats)  # members, spares and registered replacements
        if not ranks:
            return
        values = self.store.multi_get([P.heartbeat_key(r) for r in ranks]) \
            if self.store.check([P.heartbeat_key(r) for r in ranks]) else None
        now = time.monotonic()
        for i, r in enumerate(ranks):
            value = int(values[i]) if values is not None else self._one_heartbeat(r)
            last, since = self.heartbeats[r]
            if value != last:
                self.heartbeats[r] = (value, now)
            elif now - since > self.config.heartbeat_timeout:
                self.state.mark_dead(r, f"no heartbeat for {now - since:.1f}s")
                del self.heartbeats[r]

    def _one_heartbeat(self, rank: int) -> int:
        key = P.heartbeat_key(rank)
        return int(self.store.get(key)) if self.store.check([key]) else -1

    def serve(self, linger: float | None = None) -> None:
        """Tick until stopped; with `linger`, also stop that long after every rank is done (time
        for the launchers to read the completion record)."""
        done_at = None
        while not self.stopping:
            self.tick()
            if linger is not None and self.state.finished():
                done_at = done_at or time.monotonic()
                if time.monotonic() - done_at > linger:
                    return
            time.sleep(TICK)


def start_server(host: str, port: int) -> dist.TCPStore:
    return dist.TCPStore(host, port, is_master=True, wait_for_workers=False,
                         timeout=timedelta(seconds=30))


def run(server: dist.TCPStore, config: CoordinatorConfig, linger: float | None,
        stop_on_sigint: bool = True) -> None:
    """Serve until SIGTERM (and SIGINT unless a launcher owns us: its Ctrl-C must not take the
    coordinator away from ranks that are still shutting down) or `linger` s after all is done."""
    coordinator = Coordinator(server, config)

    def stop(_signum, _frame):
        coordinator.stopping = True

    signal.signal(signal.SIGTERM, stop)
    signal.signal(signal.SIGINT, stop if stop_on_sigint else signal.SIG_IGN)
    coordinator.serve(linger)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m recover_patches.collectives.coordinator")
    p.add_argument("--host", default="0.0.0.0")
    p.add_argument("--port", type=int, required=True)
    p.add_argument("--world-size", type=int, required=True)
    p.add_argument("--job-token", default=os.environ.get("RECOVER_JOB_TOKEN"))
    p.add_argument("--heartbeat-interval", type=float, default=1.0)
    p.add_argument("--heartbeat-timeout", type=float, default=10.0)
    p.add_argument("--stay", action="store_true", help="keep serving after every rank is done")
    args = p.parse_args(argv)
    if not args.job_token:
        print("error: no job token: pass --job-token or set RECOVER_JOB_TOKEN", file=sys.stderr)
        return 2
    if args.world_size < 1 or not 0 < args.heartbeat_interval < args.heartbeat_timeout:
        print("error: need --world-size >= 1 and 0 < --heartbeat-interval < --heartbeat-timeout",
              file=sys.stderr)
        return 2
    server = start_server(args.host, args.port)
    log(f"serving on port {server.port} for {args.world_size} rank(s)")
    run(server, CoordinatorConfig(args.world_size, args.job_token, args.heartbeat_interval,
                                  args.heartbeat_timeout), linger=None if args.stay else 10.0)
    return 0


if __name__ == "__main__":
    sys.exit(main())
