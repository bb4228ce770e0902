"""One heartbeat per node: ranks beat into their launcher's directory, the launcher
forwards the node's beats in one store write, and the coordinator's per-rank verdicts read them.

The coordinator and the clients run in this process (as in test_coordinator.py); a thread plays
the launcher's forwarding, so stopping it is the launcher's death.
"""
from __future__ import annotations

import os
import threading
import time

import pytest
import torch.distributed as dist

from recover_patches.collectives import protocol as P
from recover_patches.collectives.coordinator import Coordinator, CoordinatorConfig, start_server
from recover_patches.collectives.errors import MembershipTimeout
from recover_patches.collectives.launcher_link import LauncherLink
from recover_patches.collectives.membership import MembershipClient
from recover_patches.collectives.node_beats import NodeBeatRelay, NodeBeats, RankAges, \
    format_line, parse_lines, write_beat
from recover_patches.collectives.timeouts import Timeouts

TOKEN = "node-beats-job"
TIMEOUT = Timeouts(1.0)  # heartbeat 0.1 s, stall 1.5 s
pytestmark = pytest.mark.timeout(30)


class Clock:
    def __init__(self):
        self.now = 100.0

    def __call__(self):
        return self.now


def test_the_relay_forwards_live_processes_ages_once_per_interval(tmp_path):
    clock = Clock()
    relay = NodeBeatRelay("3", directory=str(tmp_path), clock=clock)
    assert relay.env() == {"RECOVER_NODE_BEATS": str(tmp_path), "RECOVER_NODE_NAME": "3"}
    write_beat(str(tmp_path), 5, 0.4, "7 e0 it2 forward")
    write_beat(str(tmp_path), 6, 0.25, "1 e0 it0 start")
    (tmp_path / "999999999-4").write_text("0.4 9 e0 it1 forward")  # an ended process's file
    assert relay.collect([os.getpid()]) == {5: RankAges(0.0, 0.0, "e0 it2 forward"),
                                            6: RankAges(0.0, 0.0, "e0 it0 start")}
    assert not (tmp_path / "999999999-4").exists()  # never read again, whoever gets its pid
    assert relay.interval == 0.25 and relay.due_in() == pytest.approx(0.25)
    clock.now += 0.2
    assert relay.collect([os.getpid()]) is None  # not due yet
    clock.now += 0.05
    write_beat(str(tmp_path), 5, 0.4, "8 e0 it2 forward")  # rank 5 beats on, marks nothing
    assert relay.collect([os.getpid()]) == {  # rank 6 has been quiet for 0.25 s
        5: RankAges(0.0, pytest.approx(0.25), "e0 it2 forward"),
        6: RankAges(pytest.approx(0.25), pytest.approx(0.25), "e0 it0 start")}
    clock.now += 0.25
    assert relay.collect([]) == {}  # due; no live process: nothing to forward for them
    relay.close()
    assert not tmp_path.exists()
    clock.now += 1.0
    assert relay.collect([os.getpid()]) == {}  # its directory gone: the launcher goes on


def test_a_node_line_says_its_quietest_rank_without_its_json():
    """The coordinator reads the node, the largest beat age and the ranks without parsing the
    JSON; the JSON carries each rank's ages and progress; a node's newest line wins."""
    ages = {2: RankAges(0.4, 1.5, "e1 it7 backward 3"), 1: RankAges(0.05, 0.05, "e1 it8 forward")}
    text = format_line("0", {1: RankAges(0.0, 0.0, "e1 it6 forward")}) + format_line("0", ages) \
        + format_line("standby-1", {})
    lines = parse_lines(text)
    assert sorted(lines) == ["0", "standby-1"]
    line = lines["0"]
    assert (line.stale, line.ranks, line.carried()) == (0.4, "1,2", frozenset({1, 2}))
    assert line.ages() == ages
    assert lines["standby-1"].carried() == frozenset() and lines["standby-1"].stale == 0.0


def test_node_beats_from_env_needs_both_variables():
    assert NodeBeats.from_env({"RECOVER_NODE_BEATS": "/d"}) is None
    assert NodeBeats.from_env({"RECOVER_NODE_BEATS": "/d", "RECOVER_NODE_NAME": "0"}) == \
        NodeBeats("/d", "0")


@pytest.fixture
def job(tmp_path):
    server = start_server("127.0.0.1", 0)
    coord = Coordinator(server, CoordinatorConfig(world_size=3, token=TOKEN))
    thread = threading.Thread(target=coord.serve, daemon=True)
    thread.start()
    relay = NodeBeatRelay("0", directory=str(tmp_path / "beats"))
    os.makedirs(relay.directory)
    link = LauncherLink("127.0.0.1", server.port, TOKEN, node_rank=0)
    launcher_alive = threading.Event()
    launcher_alive.set()

    def forward():  # the launcher's loop: its children are this process
        while launcher_alive.is_set():
            beats = relay.collect([os.getpid()])
            if beats is not None:
                link.forward_beats("0", beats)
            time.sleep(min(0.02, relay.due_in()))

    forwarding = threading.Thread(target=forward, daemon=True)
    forwarding.start()
    clients: list[MembershipClient] = []
    yield server, relay, launcher_alive, clients, coord
    launcher_alive.clear()
    forwarding.join(5)
    link.close()
    for c in clients:
        c.close()
    coord.stopping = True
    thread.join(5)


def test_ranks_beat_through_their_launcher_and_fall_silent_with_it(monkeypatch, job):
    fenced: list[int] = []
    monkeypatch.setattr(os, "_exit", fenced.append)  # the clients live in this process
    server, relay, launcher_alive, clients, coord = job
    port = server.port
    on_node = [MembershipClient("127.0.0.1", port, TOKEN, r, 3, connect_timeout=5,
                                timeout=TIMEOUT.operation,
                                node_beats=NodeBeats(relay.directory, "0")) for r in (1, 2)]
    watcher = MembershipClient("127.0.0.1", port, TOKEN, 0, 3, connect_timeout=5,
                               timeout=TIMEOUT.operation)  # no launcher: beats on the store
    clients += [watcher, *on_node]
    time.sleep(0.2)  # registered, watchers waiting: what follows is beating only
    ops_before = [c.store_ops for c in clients]
    with pytest.raises(MembershipTimeout):  # the forwarded beats keep ranks 1 and 2 alive
        watcher.wait_for_epoch_after(0, TIMEOUT.stall + 1.0)
    ops = [c.store_ops - before for c, before in zip(clients, ops_before)]
    assert ops[0] > 10 and ops[1:] == [0, 0]  # a beat on the store is one operation; theirs none
    job_store = dist.PrefixStore(P.job_prefix(TOKEN), P.connect("127.0.0.1", port, 5, "the test"))
    assert job_store.check([P.heartbeat_key(0)])  # the watcher's own key
    assert not job_store.check([P.heartbeat_key(1)]) and not job_store.check([P.heartbeat_key(2)])
    assert coord.relayed_ranks() == {1, 2}  # one line per interval carries the node's ranks
    launcher_alive.clear()  # the launcher dies: its ranks, alive, fall silent
    t0 = time.monotonic()
    assert watcher.wait_for_epoch_after(0, 4) == 1
    waited = time.monotonic() - t0
    assert watcher.dead_ranks() == {1, 2}
    assert TIMEOUT.stall - 2 * TIMEOUT.heartbeat_interval < waited \
        < TIMEOUT.stall + TIMEOUT.heartbeat_interval + 1.0  # the per-rank verdict's timing


@pytest.mark.parametrize("relaying", [True, False], ids=["relaying", "control-no-relay"])
def test_each_epoch_reaches_a_nodes_ranks_through_its_launcher(monkeypatch, tmp_path, relaying):
    """The coordinator pushes a new epoch once per node, to the launcher, which passes it on to
    the ranks whose beats it forwards; rank 0, beating on its own key, still gets its own push.
    Control: a launcher that does not pass epochs on leaves its ranks without the news (so it is
    the relay that delivers them)."""
    fenced: list[int] = []
    monkeypatch.setattr(os, "_exit", fenced.append)  # rank 2 is declared dead in this process
    server = start_server("127.0.0.1", 0)
    coord = Coordinator(server, CoordinatorConfig(world_size=3, token=TOKEN))
    thread = threading.Thread(target=coord.serve, daemon=True)
    thread.start()
    relay = NodeBeatRelay("0", directory=str(tmp_path / "beats"))
    os.makedirs(relay.directory)
    link = LauncherLink("127.0.0.1", server.port, TOKEN, node_rank=0,
                        relay=relay if relaying else None)
    clients = [MembershipClient("127.0.0.1", server.port, TOKEN, r, 3, connect_timeout=5,
                                timeout=TIMEOUT.operation,
                                node_beats=None if r == 0 else NodeBeats(relay.directory, "0"))
               for r in range(3)]
    try:
        deadline = time.monotonic() + 5
        while coord.relayed_ranks() != {1, 2} and time.monotonic() < deadline:
            beats = relay.collect([os.getpid()])  # the launcher's loop
            if beats is not None:
                link.forward_beats("0", beats)
            time.sleep(0.02)
        assert coord.relayed_ranks() == {1, 2}
        before = coord.pushes
        link.report_exit(2, -9)
        assert clients[0].wait_for_epoch_after(0, 2) == 1
        assert coord.pushes - before == 2  # the launcher's queue and rank 0's: not one per rank
        if relaying:
            assert clients[1].wait_for_epoch_after(0, 2) == 1
        else:
            with pytest.raises(MembershipTimeout):
                clients[1].wait_for_epoch_after(0, 1)
    finally:
        link.close()
        for c in clients:
            c.close()
        coord.stopping = True
        thread.join(5)
