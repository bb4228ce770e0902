"""A cut link answers nothing and closes nothing. In this process: the coordinator's store is
reached through a proxy that can be cut (it then swallows every byte both ways, keeping the
connections open), so what a partition does to a launcher's link and to a rank is seen without
root or network namespaces (`test_netns_partition.py` has the real thing).

* A store operation over a cut link is given up within its bound (`bounded_call.py`), and the
  launcher's node beat then proves no contact: `answered_at` stops (a TCPStore `set` expects
  no answer, so it would have gone on "succeeding").
* A rank whose node's address file names a successor coordinator reconnects to it although its
  old connections, cut, never fail; a failure report it makes meanwhile is given up in bounded
  time instead of blocking the watchdog for a quarter of an hour.
"""
from __future__ import annotations

import os
import socket
import threading
import time

import pytest
import torch.distributed as dist

from recover_patches.collectives.bounded_call import BoundedCaller, OperationTimedOut
from recover_patches.collectives.coordinator import Coordinator, CoordinatorConfig, start_server
from recover_patches.collectives.launcher_link import OPERATION_WAIT, LauncherLink
from recover_patches.collectives.membership import MembershipClient
from recover_patches.collectives.node_beats import RankAges
from recover_patches.collectives.self_fence import SelfFence
from recover_patches.collectives.timeouts import REPORT_WAIT
from recover_patches.recovery.agreement import StoreAgreement

TOKEN = "cut-link-job"
pytestmark = pytest.mark.timeout(60)


class CutProxy:
    """TCP proxy to `port`; `cut()` makes it drop everything it reads, both ways, on every
    connection, or on one: `cut(n)`, the n-th accepted (from 0)."""

    def __init__(self, port: int):
        self.target, self.cut_off = port, threading.Event()
        self.cut_ones: set[int] = set()
        self.listener = socket.create_server(("127.0.0.1", 0))
        self.port = self.listener.getsockname()[1]
        self.sockets: list[socket.socket] = [self.listener]
        self.accepted = 0
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self) -> None:
        while True:
            try:
                inside, _ = self.listener.accept()
            except OSError:
                return
            outside = socket.create_connection(("127.0.0.1", self.target))
            self.sockets += [inside, outside]
            for a, b in ((inside, outside), (outside, inside)):
                threading.Thread(target=self._pump, args=(a, b, self.accepted),
                                 daemon=True).start()
            self.accepted += 1

    def _pump(self, source: socket.socket, sink: socket.socket, connection: int) -> None:
        try:
            while data := source.recv(65536):
                if not (self.cut_off.is_set() or connection in self.cut_ones):
                    sink.sendall(data)
        except OSError:
            pass

    def cut(self, connection: int | None = None) -> None:
        if connection is None:
            self.cut_off.set()
        else:
            self.cut_ones.add(connection)

    def close(self) -> None:
        """Close every connection (a shutdown wakes the threads blocked on them, and the
        clients' stuck operations then fail: their abandoned threads end)."""
        for s in self.sockets:
            try:
                s.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass
            s.close()


def serve(world_size: int, restarted: bool = False):
    server = start_server("127.0.0.1", 0)
    coord = Coordinator(server, CoordinatorConfig(world_size=world_size, token=TOKEN,
                                                  restarted=restarted))
    thread = threading.Thread(target=coord.serve, daemon=True)
    thread.start()
    return server.port, coord, thread


def stop(coord, thread) -> None:
    coord.stopping = True
    thread.join(5)


def test_a_bounded_call_gives_up_on_a_stuck_call_and_serves_the_next_on_a_new_worker():
    call, stuck = BoundedCaller(0.2), threading.Event()
    assert call(lambda: 7) == 7
    started = time.monotonic()
    with pytest.raises(OperationTimedOut):
        call(stuck.wait)  # a recv that never returns
    assert time.monotonic() - started < 1.0
    assert call(lambda: 8) == 8  # (the stuck worker still waits)
    with pytest.raises(ZeroDivisionError):
        call(lambda: 1 / 0)
    stuck.set()
    call.close()


def test_a_call_waiting_when_another_thread_closes_its_caller_still_gives_up_cleanly():
    """A reconnection closes the old store's caller on the watcher thread while the main thread
    waits in a call on it (seen in the chaos harness as an AttributeError that ended a rank)."""
    call, stuck = BoundedCaller(0.3), threading.Event()
    outcome: list[BaseException] = []

    def waits() -> None:
        try:
            call(stuck.wait)
        except BaseException as e:  # noqa: BLE001 (the test reads which one)
            outcome.append(e)
    waiter = threading.Thread(target=waits)
    waiter.start()
    time.sleep(0.1)
    call.close()
    waiter.join(2)
    stuck.set()
    assert [type(e) for e in outcome] == [OperationTimedOut], outcome


def test_a_fence_fires_once_when_the_silence_passes_its_limit():
    silence, fenced = [0.0], []
    fence = SelfFence(lambda: silence[0], 1.0, fenced.append)
    time.sleep(0.3)
    assert fenced == []
    silence[0] = 1.5
    time.sleep(0.3)
    silence[0] = 3.0
    time.sleep(0.3)
    fence.close()
    assert len(fenced) == 1 and "--recover-timeout 1" in fenced[0], fenced


def test_over_a_cut_link_the_launcher_gives_up_in_bounds_and_hears_nothing():
    port, coord, thread = serve(1)
    proxy = CutProxy(port)
    link = LauncherLink("127.0.0.1", proxy.port, TOKEN, node_rank=0)
    try:
        link.forward_beats("0", {0: RankAges(0.0, 0.0, "e0 it0 start")})
        heard = link.answered_at
        time.sleep(0.05)
        link.forward_beats("0", {0: RankAges(0.0, 0.1, "e0 it0 start")})
        assert link.answered_at > heard  # answered while the link holds
        proxy.cut()
        heard = link.answered_at
        for beat in range(3, 6):
            started = time.monotonic()
            link.forward_beats("0", {0: RankAges(0.0, beat / 10, "e0 it0 start")})
            assert time.monotonic() - started < OPERATION_WAIT + 1.5
        assert link.answered_at == heard  # no answer came: this node hears nothing
        started = time.monotonic()
        link.close()
        assert time.monotonic() - started < OPERATION_WAIT + 6
    finally:
        proxy.close()
        stop(coord, thread)


def test_a_rank_follows_the_address_file_to_a_successor_over_a_cut_link(tmp_path, monkeypatch):
    monkeypatch.setattr(os, "_exit", lambda code: None)  # (a fenced client lives in this process)
    old_port, old, old_thread = serve(1)
    proxy = CutProxy(old_port)
    address_file = tmp_path / "coordinator"
    address_file.write_text(f"127.0.0.1:{proxy.port}")
    rank = MembershipClient("127.0.0.1", proxy.port, TOKEN, 0, 1, timeout=1.0,
                            connect_timeout=5, address_file=address_file)
    new_port, new, new_thread = serve(1, restarted=True)
    try:
        proxy.cut()
        started = time.monotonic()
        rank.report_failure([], "a test: the coordinator is cut off")
        assert time.monotonic() - started < REPORT_WAIT + 1.0
        started = time.monotonic()
        with pytest.raises(dist.DistNetworkError, match="did not answer"):
            rank.store.check(["recover/anything"])  # the main thread's: fails as a lost link
        assert time.monotonic() - started < rank.timeouts.operation + 1.0
        staging = tmp_path / "coordinator.tmp"
        staging.write_text(f"127.0.0.1:{new_port}")
        os.replace(staging, address_file)  # as the leader agent publishes a successor
        deadline = time.monotonic() + 10
        while rank.generation == 0 and time.monotonic() < deadline:
            time.sleep(0.05)
        assert rank.generation == 1, "the rank stayed on the cut coordinator"
        assert rank.dead_ranks() == frozenset()  # the successor took it back, alive
        assert not rank.store.check(["recover/anything"])  # the successor's store answers
    finally:
        rank.close()
        proxy.close()
        stop(old, old_thread)
        stop(new, new_thread)
    settled = time.monotonic() + 5
    while time.monotonic() < settled and any(t.name.startswith("recover-")
                                              for t in threading.enumerate()):
        time.sleep(0.05)  # the stale watcher and workers end with the proxy's connections




def test_start_up_gives_the_store_its_longer_bound_until_the_rank_settles(monkeypatch):
    """Every rank building every group at once can keep the coordinator's store from answering
    within T on a healthy job (seen: an EP 2 job at T = 3 s lost two ranks at start-up). Until
    its first commit a rank waits start-up's bound for an answer, then T. Measured over a cut
    link, where no answer ever comes."""
    monkeypatch.setattr(os, "_exit", lambda code: None)  # (a fenced client lives in this process)
    port, coord, thread = serve(1)
    proxy = CutProxy(port)
    rank = MembershipClient("127.0.0.1", proxy.port, TOKEN, 0, 1, timeout=1.0,
                            connect_timeout=5, startup=3.0)
    try:
        proxy.cut()
        waited = []
        for settle in (False, True):
            if settle:
                rank.settle()
            started = time.monotonic()
            with pytest.raises(dist.DistNetworkError, match="did not answer"):
                rank.store.check(["recover/anything"])
            waited.append(time.monotonic() - started)
        assert 3.0 <= waited[0] < 4.5, waited  # start-up's bound, not T
        assert waited[1] < 1.0 + 0.5, waited  # then T
    finally:
        rank.close()
        proxy.close()
        stop(coord, thread)


def test_a_rank_whose_own_connection_goes_unanswered_registers_again_at_once(monkeypatch):
    """The main thread's connection gets no answer within T while the watcher's holds (a
    restarted coordinator serving every rank's registration at once: the soak's seeds 116 and
    117). The watcher never fails, so waiting for it to reconnect waited out RECONNECT_WITHIN
    (60 s) in the middle of a recovery barrier. The rank registers again itself and the barrier
    passes within T and a few seconds, on the same coordinator, with the rank alive. A reconnect
    listener that fails (its store did not answer either) makes it register once more, instead
    of ending the watcher."""
    monkeypatch.setattr(os, "_exit", lambda code: None)  # (a fenced client lives in this process)
    port, coord, thread = serve(1)
    proxy = CutProxy(port)
    rank = MembershipClient("127.0.0.1", proxy.port, TOKEN, 0, 1, timeout=1.0,
                            connect_timeout=5)
    assert proxy.accepted == 3  # the main thread's connection, the watcher's, the heartbeat's
    agreement = StoreAgreement(rank, timeout=1.0)
    failed_once: list[int] = []

    def republish_fails_once(store) -> None:
        if not failed_once:
            failed_once.append(rank.generation)
            raise dist.DistNetworkError("the coordinator's store did not answer")
    rank.add_reconnect_listener(republish_fails_once)
    try:
        proxy.cut(0)  # the main thread's connection only
        passed: list[float] = []
        started = time.monotonic()
        barrier = threading.Thread(target=lambda: (agreement.barrier("1/0", [0], epoch=0),
                                                   passed.append(time.monotonic() - started)),
                                   daemon=True)
        barrier.start()
        barrier.join(15)
        assert passed, "the barrier waited for a reconnection nobody made"
        assert passed[0] < rank.timeouts.operation + 5, passed
        assert rank.generation == 1 and failed_once == [0]
        assert rank.dead_ranks() == frozenset() and rank._watcher.is_alive()
        coord_epoch = rank.epoch()
        assert coord_epoch == 0  # registering again on a live coordinator declared no one dead
    finally:
        rank.close()
        proxy.close()
        stop(coord, thread)
