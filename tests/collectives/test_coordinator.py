"""The coordinator's rules (pure), and the coordinator with real clients over a real TCPStore.

The in-process coordinator runs on a thread here only to keep the tests cheap; in a job it is
always its own process.
"""
from __future__ import annotations

import json
import threading
import time

import pytest

from recover_patches.collectives.coordinator import (Coordinator, CoordinatorConfig,
                                                     MembershipState, start_server)
from recover_patches.collectives.errors import (CoordinatorConfigError, JobTokenRefused,
                                                MembershipTimeout)
from recover_patches.collectives.launcher_link import LauncherLink
from recover_patches.collectives.membership import MembershipClient
from recover_patches.collectives.timeouts import Timeouts

TOKEN = "secret-of-this-job"
pytestmark = pytest.mark.timeout(30)


def test_state_exits_start_epochs_until_completion():
    s = MembershipState(world_size=4)
    assert s.next_epoch() is None
    s.on_exit(2, -9)
    s.on_exit(3, 1)
    assert s.next_epoch() == (1, "rank 2: process exited (signal 9); rank 3: process exited (code 1)")
    assert s.dead == {2, 3} and s.next_epoch() is None
    s.on_leave(1)        # a survivor of a broken replica leaving cleanly: no epoch
    s.on_exit(1, 0)
    assert s.next_epoch() is None and not s.finished()
    s.completed_at = s.epoch
    s.on_exit(0, 0)      # exiting after completion: no epoch either
    assert s.next_epoch() is None and s.finished()


def test_state_refuses_outsiders_and_the_dead():
    s = MembershipState(world_size=2)
    s.mark_dead(1, "no heartbeat")
    assert "outside" in s.refuse_reason(5)
    assert "declared dead" in s.refuse_reason(1)
    assert s.refuse_reason(0) is None


def test_state_a_replica_grows_back_once_all_its_ranks_wait():
    s = MembershipState(world_size=4)  # replica 1 = ranks 1 and 3 (PP 2)
    s.on_exit(3, -9)
    assert s.next_epoch() == (1, "rank 3: process exited (signal 9)")
    assert s.refuse_reason(3, incarnation=0) is not None   # the dead one cannot come back
    assert s.refuse_reason(3, incarnation=1) is None       # its replacement can
    s.on_register(3, 1)
    s.on_exit(3, -9, incarnation=0)  # a late report about the replaced process: ignored
    s.on_spare(1, 0, (1, 3))          # the survivor waits
    assert s.next_grow() is None      # rank 3's replacement has not said it waits yet
    s.on_spare(3, 1, (1, 3))
    assert s.next_grow() == (2, "grow: ranks [1, 3] re-form a replica")
    assert s.dead == set() and s.joining == (1, 3) and s.spares == {}
    assert s.record(2, "")["dead_incarnations"] == {}
    s.on_exit(3, 1, incarnation=1)    # the replacement dies after joining: a normal death
    assert s.next_epoch() == (3, "rank 3: process exited (code 1)")
    assert s.record(3, "")["dead_incarnations"] == {"3": 1} and s.joining == ()


def test_state_a_replacement_registered_before_the_exit_report_replaces_the_old_rank():
    s = MembershipState(world_size=2)
    s.on_register(1, 1)  # the launcher's exit report of incarnation 0 is still in the queue
    assert s.next_epoch() == (1, "rank 1: replaced by incarnation 1")
    s.on_exit(1, -9, incarnation=0)
    assert s.next_epoch() is None and not s.finished()  # incarnation 1 still runs
    s.on_exit(1, 0, incarnation=1)
    assert 1 in s.exited


def test_state_spares_are_told_when_no_member_is_left():
    s = MembershipState(world_size=2)
    s.on_spare(1, 0, (1,))
    assert s.stopped_reason() is None
    s.on_exit(0, 3)  # the last member stops (e.g. too few replicas): nobody can hand over state
    assert s.stopped_reason() is None  # the death is pending: published first
    s.next_epoch()
    assert "no live replica" in s.stopped_reason() and s.next_grow() is None


@pytest.fixture
def coordinator():
    server = start_server("127.0.0.1", 0)
    coord = Coordinator(server, CoordinatorConfig(world_size=3, token=TOKEN))
    thread = threading.Thread(target=coord.serve, daemon=True)
    thread.start()
    clients: list[MembershipClient] = []
    yield server.port, clients
    for c in clients:
        c.close()
    coord.stopping = True
    thread.join(5)
    assert not thread.is_alive()
    assert [t.name for t in threading.enumerate() if t.name.startswith("recover-")] == []


TIMEOUT = Timeouts(1.0)  # the ranks' --recover-timeout: heartbeat 0.1 s, stall 1.5 s


def client(port, clients, rank, token=TOKEN, timeout=TIMEOUT.operation):
    c = MembershipClient("127.0.0.1", port, token, rank, 3, connect_timeout=5, timeout=timeout)
    clients.append(c)
    return c


def test_wrong_token_is_refused_with_a_clear_message(coordinator):
    port, clients = coordinator
    with pytest.raises(JobTokenRefused) as e:
        client(port, clients, 0, token="another-job")
    assert "wrong job token" in str(e.value) and "RECOVER_JOB_TOKEN" in str(e.value)
    assert "rank 0" in str(e.value)


def launcher_sees(link: LauncherLink, dead: set[int], within: float = 2.0) -> bool:
    """The launcher's view of the dead ranks becomes `dead` (its epoch watch is asynchronous)."""
    deadline = time.monotonic() + within
    while link.dead_ranks() != dead and time.monotonic() < deadline:
        time.sleep(0.01)
    return link.dead_ranks() == dead


def test_an_idle_launcher_leaves_the_store_alone_and_learns_each_epoch_at_once(coordinator):
    """The launcher fences by the epoch's dead ranks without polling; the coordinator
    pushes each epoch to its queue. Idle, its reads of the dead ranks cost no store operation;
    a new epoch costs a few and reaches it within milliseconds."""
    port, clients = coordinator
    watcher = client(port, clients, 0)
    link = LauncherLink("127.0.0.1", port, TOKEN, node_rank=0)
    clients.append(link)
    assert launcher_sees(link, set())  # epoch 0, read once
    time.sleep(0.3)
    before = link.ops.count
    for _ in range(50):  # the supervisor's loop asks every 0.2 s: 10 s of it
        assert link.dead_ranks() == set()
        time.sleep(0.005)
    assert link.ops.count - before <= 1  # at most the watch's own pop, re-issued
    link.report_exit(1, -9)
    assert watcher.wait_for_epoch_after(0, 2) == 1
    assert launcher_sees(link, {1}, within=0.5)


def test_a_launcher_that_reconnected_after_a_late_answer_still_learns_each_epoch(coordinator):
    """Found under the emulated NCCL on two loaded cores: the coordinator answered a launcher
    late once, and the link reconnected with a new epoch watch while the old watch's pop still
    waited on the old connection, alive. That pop took the next epoch's push, so the launcher
    never fenced the rank the epoch declared dead (stopped: the job never ended). A watch that
    was replaced still passes on what it pops."""
    port, clients = coordinator
    watcher = client(port, clients, 0)
    link = LauncherLink("127.0.0.1", port, TOKEN, node_rank=0)
    clients.append(link)
    assert launcher_sees(link, set())
    time.sleep(0.3)  # the first watch's pop waits

    def late() -> None:
        raise RuntimeError("no answer within 2s (a cut link?)")
    link._guard(late, None)  # as the bounded caller reports a late answer
    time.sleep(0.6)  # the link retries after 0.5 s: its next operation reconnects
    assert link.completion() is None
    time.sleep(0.3)  # both watches' pops wait now, the first one's longest
    assert link.dead_ranks() == set()  # what the new watch's connect announced is read
    link.report_exit(1, -9)
    assert watcher.wait_for_epoch_after(0, 2) == 1
    assert launcher_sees(link, {1}, within=2.0)


def test_launcher_exit_report_starts_an_epoch_at_once(coordinator):
    port, clients = coordinator
    watcher = client(port, clients, 0)
    link = LauncherLink("127.0.0.1", port, TOKEN, node_rank=0)
    clients.append(link)
    link.report_exit(2, -9)  # rank 2 never registered: no heartbeat could declare it dead
    assert watcher.wait_for_epoch_after(0, 2) == 1
    assert watcher.dead_ranks() == {2} and launcher_sees(link, {2})
    with pytest.raises(JobTokenRefused, match="declared dead"):  # a dead rank cannot come back
        client(port, clients, 2)
    assert watcher.declare_complete() == (1, frozenset({2}))
    assert link.completion() == (1, frozenset({2}))


def test_silent_heartbeat_declares_a_rank_dead(coordinator):
    port, clients = coordinator
    watcher, silent = client(port, clients, 0), client(port, clients, 1)
    seen = []
    watcher.add_listener(lambda epoch, dead: seen.append((epoch, dead)))
    with pytest.raises(MembershipTimeout):  # heartbeats flowing: nothing happens
        watcher.wait_for_epoch_after(0, 1.0)
    silent.close(leave=False)  # its heartbeat stops, like a SIGSTOPped or lost rank
    t0 = time.monotonic()
    assert watcher.wait_for_epoch_after(0, 3) == 1
    assert time.monotonic() - t0 > TIMEOUT.stall - 2 * TIMEOUT.heartbeat_interval  # not before
    assert watcher.dead_ranks() == {1} and seen == [(1, frozenset({1}))]


def test_a_closed_client_leaves_without_starting_an_epoch(coordinator):
    port, clients = coordinator
    watcher, leaving = client(port, clients, 0), client(port, clients, 1)
    leaving.close()
    with pytest.raises(MembershipTimeout):  # longer than the stall timeout
        watcher.wait_for_epoch_after(0, TIMEOUT.stall + 0.5)


def test_a_rank_with_another_recover_timeout_is_refused(coordinator):
    port, clients = coordinator
    client(port, clients, 0)  # the first rank brings the job's --recover-timeout
    with pytest.raises(JobTokenRefused, match="--recover-timeout 2 differs from the job's 1"):
        client(port, clients, 1, timeout=2.0)


def test_a_live_rank_that_stops_making_progress_is_declared_dead_when_others_wait(coordinator,
                                                                                 monkeypatch):
    import os
    fenced: list[int] = []
    monkeypatch.setattr(os, "_exit", fenced.append)  # the stuck client lives in this process
    port, clients = coordinator
    waiter, stuck, bystander = (client(port, clients, r) for r in range(3))
    for _ in range(int(TIMEOUT.stall / 0.1) + 5):  # negative control: nobody waits for anyone,
        waiter.mark("forward")                     # so a rank that does not move is left alone
        bystander.mark("forward")
        time.sleep(0.1)
    assert waiter.epoch() == 0, "a rank was declared dead although nobody waited for it"
    waiter.report_failure([1], "dp.allreduce: timed out")  # the waiter waits for rank 1
    t0 = time.monotonic()
    while time.monotonic() - t0 < 1.0:  # rank 2 keeps moving; rank 1 beats but never marks
        bystander.mark("forward")
        time.sleep(0.05)
    assert waiter.wait_for_epoch_after(0, 3) == 1
    assert waiter.dead_ranks() == {1}  # the stuck one, although its heartbeat thread beats on
    deadline = time.monotonic() + 2
    while not fenced and time.monotonic() < deadline:
        time.sleep(0.01)
    assert fenced == [1]  # its own watcher fences it (its launcher would SIGKILL it too)


def test_a_waiter_for_a_rank_that_keeps_moving_gets_no_verdict(coordinator, caplog):
    port, clients = coordinator
    waiter, slow, _ = (client(port, clients, r) for r in range(3))
    waiter.report_failure([1], "dp.allreduce: timed out")
    t0 = time.monotonic()
    while time.monotonic() - t0 < TIMEOUT.stall + 1.0:  # slower than the timeout, still moving
        slow.mark("forward")
        time.sleep(0.05)
    assert waiter.epoch() == 0  # not stuck: the job stops instead of killing a working rank
    assert any(r.name == "recover_patches.collectives.coordinator" and r.levelname == "WARNING"
               and "still make progress (slower than --recover-timeout" in r.getMessage()
               for r in caplog.records)


def test_from_env_names_what_is_missing(monkeypatch):
    for var in ("RECOVER_COORDINATOR", "RECOVER_JOB_TOKEN"):
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setenv("RANK", "0")
    monkeypatch.setenv("WORLD_SIZE", "1")
    with pytest.raises(CoordinatorConfigError, match="RECOVER_COORDINATOR, RECOVER_JOB_TOKEN"):
        MembershipClient.from_env()
    monkeypatch.setenv("RECOVER_COORDINATOR", "nohostport")
    monkeypatch.setenv("RECOVER_JOB_TOKEN", TOKEN)
    with pytest.raises(CoordinatorConfigError, match="host:port"):
        MembershipClient.from_env()


def test_a_standby_gets_a_slot_over_the_store_and_a_late_replacement_finds_it_taken(
        coordinator, monkeypatch):
    from concurrent.futures import ThreadPoolExecutor

    from recover_patches.collectives.errors import SlotTaken
    from recover_patches.collectives.standby import JobEnded, SlotAssignment, wait_for_slot
    port, clients = coordinator
    monkeypatch.setenv("RECOVER_COORDINATOR", f"127.0.0.1:{port}")
    monkeypatch.setenv("RECOVER_JOB_TOKEN", TOKEN)
    watcher = client(port, clients, 0)
    link = LauncherLink("127.0.0.1", port, TOKEN, node_rank=0)
    clients.append(link)
    with ThreadPoolExecutor(2) as pool:
        first = pool.submit(wait_for_slot, "9.0")
        time.sleep(0.3)  # the first to wait is the first to get a slot
        second = pool.submit(wait_for_slot, "9.1")
        time.sleep(0.3)  # both wait: nothing is dead
        assert not first.done() and not second.done()
        link.report_exit(2, -9, replacing=False)  # its launcher starts no replacement
        assert first.result(timeout=5) == SlotAssignment(2, 1)
        assert link.assignments(["9.0", "9.1"]) == {"9.0": (2, 1)}  # what the launcher fences by
        with pytest.raises(SlotTaken):  # the node's own replacement, had it come, is turned away
            MembershipClient("127.0.0.1", port, TOKEN, 2, 3, connect_timeout=5, incarnation=1,
                             timeout=TIMEOUT.operation)
        clients.append(MembershipClient("127.0.0.1", port, TOKEN, 2, 3, connect_timeout=5,
                                        incarnation=1, standby="9.0",
                                        timeout=TIMEOUT.operation))  # the standby itself
        watcher.declare_complete()
        assert second.result(timeout=5) is JobEnded.COMPLETE  # never needed: sent home


def test_a_standby_follows_the_address_file_past_a_coordinator_that_never_answers(
        coordinator, monkeypatch, tmp_path):
    """A standby process may come up while the coordinator it was told of is going or gone:
    its launcher's address file names the successor once etcd elected one. A server that
    accepts and never answers held torch's client in its validation for good (a blocking recv)
    and the standby with it, so the successor never heard of it: each attempt is bounded, and
    between attempts the file is read again."""
    import socket

    from recover_patches.collectives.standby import SlotAssignment, wait_for_slot
    port, clients = coordinator
    silent = socket.create_server(("127.0.0.1", 0))  # the kernel completes connections; no answer
    address_file = tmp_path / "coordinator"
    address_file.write_text(f"127.0.0.1:{silent.getsockname()[1]}")
    monkeypatch.setenv("RECOVER_COORDINATOR", address_file.read_text())
    monkeypatch.setenv("RECOVER_COORDINATOR_FILE", str(address_file))
    monkeypatch.setenv("RECOVER_JOB_TOKEN", TOKEN)
    client(port, clients, 0)
    link = LauncherLink("127.0.0.1", port, TOKEN, node_rank=0)
    clients.append(link)
    outcome: list = []
    standby = threading.Thread(target=lambda: outcome.append(wait_for_slot("9.0", 5.0)),
                               daemon=True)  # (a hung one must not hold the test's exit)
    standby.start()
    time.sleep(3.0)  # more than one attempt on the silent server
    address_file.write_text(f"127.0.0.1:{port}")  # the successor, as the launcher's agent writes
    link.report_exit(2, -9, replacing=False)  # an orphaned slot for the standby
    standby.join(10)
    silent.close()  # ends the abandoned attempt's read
    assert outcome == [SlotAssignment(2, 1)]
    deadline = time.monotonic() + 5
    while any(t.name == "recover-connect" for t in threading.enumerate()) \
            and time.monotonic() < deadline:
        time.sleep(0.1)


def test_a_post_whose_poster_died_between_its_two_writes_holds_up_nothing(coordinator):
    """A report (and a registration) is two writes: take a number, then write the post under it.
    A poster killed or cut off between them left a number with no post, and the coordinator,
    reading posts in order, waited for it forever: no report after it was read (the chaos soak,
    seed 205: a cut node's rank, then every rank's `complete`, unheard for 30 s). A number still
    empty after T is passed over (and read later if its post ever comes)."""
    from recover_patches.collectives import protocol as P
    port, clients = coordinator
    watcher = client(port, clients, 0)
    watcher.store.add(P.REPORTS_COUNT, 1)  # a report's number, its post never written
    raw = P.connect("127.0.0.1", port, 5.0, "test")
    raw.add(P.HELLO_COUNT, 1)  # the same for a registration
    link = LauncherLink("127.0.0.1", port, TOKEN, node_rank=0)
    clients.append(link)
    link.report_exit(2, -9)
    started = time.monotonic()
    assert watcher.wait_for_epoch_after(0, 5) == 1 and watcher.dead_ranks() == {2}
    assert time.monotonic() - started < TIMEOUT.operation + 2
    client(port, clients, 1)  # a registration after the empty one is answered
    # the post passed over (number 1) comes after all: it is read then
    assert link.completion() is None
    watcher.store.set(P.report_key(1), json.dumps(P.Report.make("complete", rank=0)))
    deadline = time.monotonic() + 5
    while link.completion() is None and time.monotonic() < deadline:
        time.sleep(0.05)
    assert link.completion() == (1, frozenset({2}))


def test_numbered_posts_wait_a_gap_for_an_empty_number_then_read_on_and_look_back():
    from recover_patches.collectives.coordinator.posts import KEPT_FOR, NumberedPosts
    now, posted = [0.0], {1, 3}
    posts = NumberedPosts(gap=1.0, clock=lambda: now[0])
    assert posts.ready(3, posted.__contains__) == [1]  # 2 is empty: 3 waits behind it
    now[0] = 0.5
    assert posts.ready(3, posted.__contains__) == []
    now[0] = 1.6
    assert posts.ready(3, posted.__contains__) == [3]  # 2 passed over after the gap
    posted.add(2)
    assert posts.ready(3, posted.__contains__) == [2]  # and read when it comes after all
    assert posts.ready(4, posted.__contains__) == []  # 4 not posted yet
    now[0] = 2.7
    assert posts.ready(4, posted.__contains__) == []  # passed over, kept aside
    now[0] = 2.7 + KEPT_FOR + 0.1
    posts.ready(4, posted.__contains__)
    posted.add(4)
    assert posts.ready(4, posted.__contains__) == []  # forgotten by then
