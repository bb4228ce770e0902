"""The coordinator's decisions: what it reads from the store each tick and what it publishes
(the package's docstring says what it decides and why)."""
from __future__ import annotations

import json
import logging
import time
from dataclasses import dataclass

import torch.distributed as dist

from recover_patches.collectives import protocol as P
from recover_patches.collectives.journal import COMPLETE, EPOCH, STANDBYS, Journal, \
    write_or_fence
from recover_patches.collectives.liveness import Liveness
from recover_patches.collectives.membership_state import MembershipState
from recover_patches.collectives.coordinator.posts import NumberedPosts
from recover_patches.collectives.node_beats import NodeBeatLine, parse_lines, standby_node
from recover_patches.collectives.timeouts import Timeouts

# by name, not __name__: also when run as __main__ (python -m)
logger = logging.getLogger("recover_patches.collectives.coordinator")

TICK = 0.02  # seconds between polls of the store: bounds detection latency, costs ~nothing
UNTIMED_GAP = 10.0  # s an empty post number holds up the next ones before a rank brought T
BACKLOG = 1 << 20  # bytes of a shard left unswept (after a long burst of handshakes) that is
#                    cleared by a set, not a compare-and-set
SWEEPS_PER_INTERVAL = 4  # heartbeat reads per heartbeat interval (every 100 ms at the default T)


@dataclass
class CoordinatorConfig:
    world_size: int
    token: str
    timeout: float | None = None  # the ranks' --recover-timeout; None: the first rank's
    restarted: bool = False  # a successor: rebuild the membership from the ranks that come back
    journal: Journal | None = None  # elected: decisions made durable first, fenced


class Coordinator:
    def __init__(self, server: dist.TCPStore, config: CoordinatorConfig):
        self.raw = server
        self.store = dist.PrefixStore(P.job_prefix(config.token), server)
        self.config = config
        self.state = MembershipState(config.world_size)
        # registrations and reports, each read once in order (an empty number held up
        # every one after it: `posts.py`); the gap becomes T once the first rank brings it
        self.hellos, self.reports = NumberedPosts(UNTIMED_GAP), NumberedPosts(UNTIMED_GAP)
        self.timeouts: Timeouts | None = None
        self.liveness = Liveness(stall=float("inf"), expiry=float("inf"))
        if config.timeout is not None:
            self._adopt_timeouts(config.timeout)
        self.digest = P.token_digest(config.token)
        self.registered: set[int] = set()  # ranks to notify of new epochs
        self.launchers: set[str] = set()  # the nodes whose launchers are notified of new epochs
        self.pushes = 0  # epoch notifications pushed so far (ranks' and launchers' queues)
        self.beats_via: dict[int, str] = {}  # rank -> the node whose launcher forwards its beat
        self._next_sweep = 0.0  # of the heartbeats
        self.unresolved_logged = False
        self.rejoin_window: float | None = None  # restarted: when the ranks had to be back by
        self.stopping = False
        self.stopped = False
        self.store.set(P.CONFIG, json.dumps({"world_size": config.world_size}))
        # both counters exist from now on, so that each tick reads them in one multi_get (two
        # round trips per 20 ms tick were most of an idle coordinator's CPU)
        self.raw.add(P.HELLO_COUNT, 0)
        self.store.add(P.REPORTS_COUNT, 0)
        self._counter_keys = [P.HELLO_COUNT, P.job_key(config.token, P.REPORTS_COUNT)]
        for key in P.node_beats_keys():  # (kept if a launcher appended first): one multi_get
            self.store.compare_set(key, "", "")  # reads them all without waiting for any
        self._publish(0, "job start" if not config.restarted else "coordinator restarted")
        last = config.journal.read(EPOCH) if config.restarted and config.journal else None
        if last is not None:  # a successor on another node: the journal's last epoch first
            self._adopt_record(int(last["epoch"]), last["record"], "the journal")
            grants = config.journal.read(STANDBYS) if config.journal else None
            self.state.restore_grants(grants["grants"] if grants else [])

    def _adopt_timeouts(self, timeout: float) -> None:
        self.timeouts = t = Timeouts(timeout)
        self.state.standby_grace, self.state.register_timeout = t.standby_grace, t.register_timeout
        # a waiter gives up after verdict_wait: until then (and a stall more) it is not a suspect
        self.liveness.stall, self.liveness.expiry = t.stall, t.verdict_wait + t.stall
        self.hellos.gap = self.reports.gap = t.operation

    def _publish(self, epoch: int, reason: str) -> None:
        record = self.state.record(epoch, reason)
        if epoch:  # durable before any rank or launcher hears of it
            write_or_fence(self.config.journal, EPOCH, {"epoch": epoch, "record": record})
        self.store.set(P.epoch_key(epoch), json.dumps(record))
        self.store.set(P.EPOCH, str(epoch))  # after epoch/<e>: readers of EPOCH find its record
        direct = sorted(self.registered - self.relayed_ranks())
        for rank in direct:
            self.store.queue_push(P.notify_key(rank), str(epoch))
        for node in sorted(self.launchers):
            self.store.queue_push(P.launcher_notify_key(node), str(epoch))
        self.pushes += len(direct) + len(self.launchers)
        if epoch:
            logger.info(f"epoch {epoch}: dead ranks {sorted(self.state.dead)} ({reason})")
            self.liveness.new_epoch(epoch)
            self.unresolved_logged = False
            for r in self.state.joining:
                self.liveness.watch(r, via=self.beats_via.get(r))

    def tick(self) -> None:
        hellos, reports = (int(v) for v in self.raw.multi_get(self._counter_keys))
        self._handshakes(hellos)
        self._reports(reports)
        self._check_heartbeats()
        self._missing_after_restart()
        for published in (self.state.next_epoch(), self.state.next_grow()):
            if published is not None:
                self._publish(*published)
        self._standbys()
        if self.state.finished() and not self.raw.check([P.FINISHED]):
            self.store.set(P.FINISHED, P.FINISHED_WITH_STANDBYS if self.state.had_standbys
                           else "1")
        if not self.stopped and (reason := self.state.stopped_reason()) is not None:
            self.stopped = True
            self.store.set(P.STOPPED, reason)
            logger.warning(f"job stopped: {reason}")
            for node in sorted(self.launchers):  # they end what is left of their nodes
                self.store.queue_push(P.launcher_notify_key(node), P.JOB_STOPPED)

    def _standbys(self) -> None:
        """Hand orphaned slots to standby processes; send them home when none ever will be."""
        given = self.state.assign_standbys(self._silent_standbys())
        if given:  # durable before any standby hears of it: a successor never gives a slot twice
            write_or_fence(self.config.journal, STANDBYS, {"grants": self.state.grant_record()})
        for standby, slot, incarnation in given:
            self._send_slot(standby, slot, incarnation)
        for standby in self.state.release_standbys():
            ended = P.COMPLETE if self.state.completed_at is not None else P.STOPPED
            self.store.queue_push(P.standby_key(standby), ended)

    def _silent_standbys(self) -> frozenset[str]:
        """Standby processes whose node's line stopped for longer than T + GRACE: lost with
        their launcher (a node fault), they must not be given a slot (`liveness.py`)."""
        waiting = [*self.state.standbys, *(r.standby for r in self.state.reserved.values())]
        if not waiting or self.timeouts is None:
            return frozenset()
        now, nodes = self.liveness.clock(), self.liveness.nodes
        return frozenset(s for s in waiting if (node := nodes.get(standby_node(s))) is not None
                         and now - node.at > self.timeouts.stall)

    def _send_slot(self, standby: str, slot: int, incarnation: int) -> None:
        assignment = json.dumps({"rank": slot, "incarnation": incarnation})
        self.store.set(P.assigned_key(standby), assignment)  # (its launcher reads which slot)
        self.store.add(P.ASSIGNED_COUNT, 1)
        self.store.queue_push(P.standby_key(standby), assignment)
        logger.info(f"standby {standby} takes rank {slot} (incarnation {incarnation})")

    def _handshakes(self, count: int) -> None:
        for n in self.hellos.ready(count, lambda n: self.raw.check([P.hello_key(n)])):
            hello = json.loads(self.raw.get(P.hello_key(n)))
            reason = None
            if hello["digest"] != self.digest:
                reason = ("wrong job token (RECOVER_JOB_TOKEN / --job-token must be the one the "
                          "coordinator was started with)")
            elif hello["role"] == "rank":
                reason = self._timeout_refusal(hello.get("timeout")) or self.state.refuse_reason(
                    hello["rank"], hello.get("incarnation", 0), hello.get("standby"))
            if reason is None and hello["role"] == "rank":
                if self.timeouts is None:
                    self._adopt_timeouts(hello["timeout"])
                if hello.get("rejoin") and self.config.restarted:
                    self._restore(hello["rank"], hello.get("incarnation", 0), hello["rejoin"])
                else:
                    self.state.on_register(hello["rank"], hello.get("incarnation", 0))
                self.state.note_unit(hello["rank"], hello.get("unit") or ())
                self._beats_from(hello["rank"], hello.get("node"))
                self.liveness.watch(hello["rank"], float(hello.get("startup") or 0.0),
                                    self.beats_via.get(hello["rank"]))
                self.registered.add(hello["rank"])
            if reason is None and hello["role"] == "launcher":
                self.launchers.add(hello.get("node") or str(hello["rank"]))
            if reason is not None:
                logger.info(f"refused {hello['role']} {hello['rank']}: {reason}")
            self.raw.set(P.reply_key(n), reason or P.OK)

    def _restore(self, rank: int, incarnation: int, rejoin: dict) -> None:
        """A rank registers again with this restarted coordinator: adopt the newest epoch record
        any rank brings (published before the rank's reply, which it reads next)."""
        if self.rejoin_window is None:
            assert self.timeouts is not None
            self.rejoin_window = time.monotonic() + self.timeouts.stall
        self._adopt_record(int(rejoin["epoch"]), rejoin["record"], f"rank {rank}")
        self.state.incarnation[rank] = incarnation
        self.state.issued[rank] = max(self.state.issued.get(rank, 0), incarnation)
        if (held := self.state.reserved.get(rank)) and held.incarnation == incarnation:
            del self.state.reserved[rank]  # the standby that was given the slot is back

    def _adopt_record(self, epoch: int, record: dict, source: str) -> None:
        if epoch > self.state.epoch:
            self.state.epoch, self.state.dead = epoch, set(record["dead"])
            self.state.dead_incarnation = P.dead_incarnations(record)
            self.state.dead_at.update({r: time.monotonic() for r in self.state.dead})
            self.state.joining = tuple(record.get("joining", ()))
            self.store.set(P.epoch_key(epoch), json.dumps(record))
            self.store.set(P.EPOCH, str(epoch))
            self.liveness.new_epoch(epoch)
            logger.info(f"restored epoch {epoch} (dead ranks {sorted(self.state.dead)}) from "
                        f"{source}")

    def _missing_after_restart(self) -> None:
        """Once the rejoin window closed: ranks that never came back are gone."""
        if self.rejoin_window is None or time.monotonic() < self.rejoin_window:
            return
        self.rejoin_window = None
        for r in range(self.config.world_size):
            if r not in self.registered and r not in self.state.dead:
                self.state.mark_dead(r, "did not come back after the coordinator restarted")

    def _timeout_refusal(self, timeout: float | None) -> str | None:
        if timeout is None:
            return "no --recover-timeout in the handshake (a client of another ReCoVer version?)"
        if self.timeouts is not None and timeout != self.timeouts.operation:
            return (f"--recover-timeout {timeout:g} differs from the job's "
                    f"{self.timeouts.operation:g}: give every rank the same value")
        return None

    def _reports(self, count: int) -> None:
        for n in self.reports.ready(count, lambda n: self.store.check([P.report_key(n)])):
            report = json.loads(self.store.get(P.report_key(n)))
            self.store.delete_key(P.report_key(n))  # read once: the store stays flat
            kind = report["kind"]
            if kind == "exit":
                if report.get("incarnation", 0) == self.state.incarnation.get(report["rank"], 0):
                    self.liveness.forget(report["rank"])
                self.state.on_exit(report["rank"], report["code"], report.get("incarnation", 0),
                                   report.get("replacing", False))
            elif kind == "leave":
                self.state.on_leave(report["rank"])
                self.liveness.forget(report["rank"])
            elif kind == "spare":
                self.state.on_spare(report["rank"], report["incarnation"], tuple(report["slots"]))
            elif kind == "joined":
                self.state.on_joined(report["rank"], report["incarnation"])
            elif kind == "standby":  # (with a slot already: its answer went with a predecessor)
                if (held := self.state.on_standby(report["id"])) is not None:
                    self._send_slot(report["id"], *held)
            elif kind == "standby_exit":
                self.state.on_standby_exit(report["id"])
            elif kind == "complete":
                self._complete(report["rank"])
            elif kind == "suspect":
                logger.info(f"rank {report['rank']} suspects {report['suspects']} in "
                            f"{report['where'][:160]}")
                self.liveness.waiting(report["rank"], report["suspects"], report.get("epoch", 0),
                                      report["where"])

    def _complete(self, by_rank: int) -> None:
        if self.state.completed_at is None:
            done = {"epoch": self.state.epoch, "dead": sorted(self.state.dead), "by": by_rank}
            write_or_fence(self.config.journal, COMPLETE, done)
            self.state.completed_at = self.state.epoch
            self.store.set(P.COMPLETE, json.dumps(done))
            logger.info(f"job declared complete by rank {by_rank} at epoch {self.state.epoch}")

    def _beats_from(self, rank: int, node: str | None) -> None:
        """Where this incarnation of `rank` beats: its launcher's node beat, or its own key. A
        node beat that still lists the rank (a dead launcher's last one) is not read for it."""
        if node is None:
            self.beats_via.pop(rank, None)
            # the key exists from now on (empty until the first beat), so that a sweep reads
            # all of them in one multi_get instead of checking each
            self.store.compare_set(P.heartbeat_key(rank), "", "")
        else:
            self.beats_via[rank] = node

    def _read_present(self, keys: list[str]) -> list[str | None]:
        values = self.store.multi_get(keys) if self.store.check(keys) else \
            [self.store.get(k) if self.store.check([k]) else None for k in keys]
        return [None if v is None else v.decode() for v in values]

    def _take_node_beats(self) -> dict[str, NodeBeatLine]:
        """node -> its newest line appended since the last sweep: one multi_get of the
        shards, then each non-empty shard cleared by a compare-and-set against what was read
        (a line appended meanwhile fails it; the answer holds it, and the next try clears it)."""
        keys = P.node_beats_keys()
        taken: list[str] = []
        for key, read in zip(keys, self.store.multi_get(keys)):
            value = read.decode()
            if len(value) > BACKLOG:  # too big to send back (the store takes at most 8 MiB)
                self.store.set(key, "")  # lines appended since the read are lost: a beat
                taken.append(value)      # each at most, of nodes that beat on
                continue
            while value:
                left = self.store.compare_set(key, value, "").decode()
                if not left:  # cleared: what was read is ours
                    taken.append(value)
                    break
                value = left  # lines appended after the read: the whole shard, tried again
        return parse_lines("".join(taken))

    def _observe_beats(self) -> None:
        """Every beat since the last sweep: the node lines appended (each kept unparsed,
        `liveness.py`) and the keys of the ranks beating on their own (one multi_get)."""
        for line in self._take_node_beats().values():
            self.liveness.observe_node(line)
        if own := self.liveness.own_key():
            for r, value in zip(own, self._read_present([P.heartbeat_key(r) for r in own])):
                self.liveness.observe(r, value)

    def relayed_ranks(self) -> set[int]:
        """The ranks whose launcher passes each epoch on to them (`epoch_watch.py`): its node's
        last beat carried them, so it relays to them too, and they beat through that node. The
        others (no ReCoVer launcher, or not in a beat yet) get the coordinator's own push."""
        nodes = self.liveness.nodes
        return {r for node in self.launchers if node in nodes for r in nodes[node].carried
                if self.beats_via.get(r) == node}

    def _check_heartbeats(self) -> None:
        """Read every watched rank's heartbeat (SWEEPS_PER_INTERVAL times per heartbeat interval,
        not every tick: at 100,000 ranks a sweep is most of the coordinator's work), then declare
        the silent and the stuck dead; say once what was seen when waiters wait and no one can
        be named."""
        now = time.monotonic()
        if not self.liveness.seen or self.timeouts is None or now < self._next_sweep:
            return  # (watched: members, spares and registered replacements)
        self._next_sweep = now + self.timeouts.heartbeat_interval / SWEEPS_PER_INTERVAL
        self._observe_beats()
        self.liveness.probe_settled()
        if self.stopped:  # nobody's start-up matters now: every process must end
            self.liveness.settle()
        members = {r for r in self.liveness.seen if self.state.is_member(r)} \
            if self.liveness.waiters else set()
        for r, why in self.liveness.silent() + self.liveness.stuck(members):
            if r in self.liveness.seen:
                self.state.mark_dead(r, why)
                self.liveness.forget(r)
        if not self.unresolved_logged and (seen := self.liveness.unresolved(members)):
            logger.warning(f"no verdict yet: {seen}")
            self.unresolved_logged = True

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
