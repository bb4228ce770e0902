"""A rank's connections to the coordinator do not grow with its groups: an asynchronous
backend's set-up (NCCL's unique-id exchange; here the emulated NCCL's, which exchanges an id the
same way) goes through the rank's one store client, whose blocking reads poll
(`backends.SharedClientView`)."""
from __future__ import annotations

import os
import threading
from datetime import timedelta

import pytest
import torch.distributed as dist

from recover_patches.collectives import backends, emulated_nccl
from recover_patches.collectives.emulated_nccl.communicator import EmulatedCommunicator

pytestmark = pytest.mark.timeout(60)


def connections_to(port: int) -> int:
    """This process's established TCP connections to `port`: its sockets' inodes, found in the
    kernel's tables by remote port."""
    inodes = set()
    for fd in os.listdir("/proc/self/fd"):
        try:
            target = os.readlink(f"/proc/self/fd/{fd}")
        except OSError:
            continue
        if target.startswith("socket:["):
            inodes.add(target[len("socket:["):-1])
    count = 0
    for table in ("/proc/self/net/tcp", "/proc/self/net/tcp6"):
        for row in open(table).read().splitlines()[1:]:
            fields = row.split()
            established = fields[3] == "01"
            if established and int(fields[2].rsplit(":", 1)[1], 16) == port and fields[9] in inodes:
                count += 1
    return count


@pytest.fixture
def server():
    return dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)


def client_of(server: dist.TCPStore, timeout: float = 10.0) -> dist.TCPStore:
    return dist.TCPStore("127.0.0.1", server.port, is_master=False,
                         timeout=timedelta(seconds=timeout))


def test_groups_set_up_on_the_ranks_client_open_no_connection_of_their_own(server):
    """Four one-member groups of the emulated NCCL kind (unique id, eager connect, warm-up
    all-reduce): the rank's connections stay as they were. Control: a client of its own per
    group, what each group held before, is one connection each, and the count sees it."""
    kind = emulated_nccl.install(host_thread=False)
    client = client_of(server)
    before = connections_to(server.port)  # the master's own client, and this rank's
    assert before == 2
    groups = [backends.build(kind, client, f"pg/{i}/backend/", 0, 1, 5.0, 5.0) for i in range(4)]
    assert connections_to(server.port) == before
    own = [client.clone() for _ in groups]
    assert connections_to(server.port) == before + len(own)
    for g in groups:
        g.abort()


def connect_crosswise(tag: str, store_of, timeout: float) -> list[str]:
    """Ranks A and B, each with one client, connect groups G1 (A its root) and G2 (B its root)
    concurrently, the non-roots first: each rank's wait for one group's id comes before its
    publishing of the other's. Returns what failed or did not finish."""
    failed: list[str] = []

    def connect(store, rank: int, group: str) -> None:
        try:
            EmulatedCommunicator(dist.PrefixStore(f"{tag}/{group}/", store), rank, 2)._connect()
        except Exception as e:  # noqa: BLE001 - reported by the test
            failed.append(f"{group} rank {rank}: {type(e).__name__}")

    a, b = store_of(), store_of()
    waits = [threading.Thread(target=connect, args=(a, 1, "G2"), daemon=True),
             threading.Thread(target=connect, args=(b, 1, "G1"), daemon=True)]
    roots = [threading.Thread(target=connect, args=(a, 0, "G1"), daemon=True),
             threading.Thread(target=connect, args=(b, 0, "G2"), daemon=True)]
    for t in waits:
        t.start()
    # the waits hold on first (a connect's set-up before its blocking read took over 0.3 s in
    # one CI run: the root then published first and the control's deadlock did not form)
    threading.Event().wait(1.0)
    for t in roots:
        t.start()
    for t in waits:
        t.join(timeout + 10)
    for t, name in zip(roots, ("G1 rank 0", "G2 rank 0")):
        t.join(5.0)  # (a root whose peer gave up waits for it in gloo's own set-up)
        if t.is_alive():
            failed.append(f"{name}: still connecting")
    return sorted(failed)


def test_groups_connecting_at_once_on_one_client_do_not_block_each_other(server):
    """Through the polling view both groups connect. Control: the shared client read directly,
    its `get` holding the client while it waits, blocks each rank's root until the wait times
    out -- the deadlock a shared client would bring without the view."""
    emulated_nccl.install(host_thread=False)
    assert connect_crosswise("view", lambda: backends.SharedClientView(client_of(server), 10.0),
                             10.0) == []
    failed = connect_crosswise("direct", lambda: client_of(server, timeout=3.0), 3.0)
    assert [f for f in failed if "rank 1" in f] == ["G1 rank 1: DistStoreError",
                                                     "G2 rank 1: DistStoreError"], failed
