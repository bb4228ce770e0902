"""Groups after a failure, members as threads of this process (`fake_world`):
a rebuilt backend connects inside the rebuild's bound; a group whose members all vouch for it
keeps its backend, one dirty member makes every member rebuild, and a group that lost a member
is shrunk where the backend can (the fake NCCL-like backend of `fake_async`)."""
from __future__ import annotations

import threading
import time
from datetime import timedelta

import pytest
import torch
import torch.distributed as dist

from recover_patches.collectives import backends
from recover_patches.collectives.errors import PeerFailure
from recover_patches.collectives.watchdog import Watchdog
from tests.collectives import fake_async
from tests.collectives.fake_world import FakeWorld, build_together, together

pytestmark = pytest.mark.timeout(60)


@pytest.fixture
def fabric():
    made = fake_async.Fabric()
    fake_async.install(made)
    yield made
    fake_async.uninstall()
    assert backends.join_discards(5.0)


def regroup_all(groups, epoch: int, members, key: str) -> list[str]:
    return together([lambda g=g: g.regroup(epoch, members, key) for g in groups])


def sum_over(groups) -> list[float]:
    """Every member all-reduces its rank + 1 through the group (proves the backend works)."""
    tensors = [torch.tensor([float(g.membership.rank + 1)]) for g in groups]
    together([lambda g=g, t=t: dist.all_reduce(t, group=g) for g, t in zip(groups, tensors)])
    return [t.item() for t in tensors]


def shut(groups) -> None:
    for g in groups:
        g.shutdown()


def test_a_clean_group_is_kept_and_one_dirty_member_makes_every_member_rebuild():
    world = FakeWorld()
    groups = build_together(world, "tp.replica0.stage0", [(0, 1), (0, 1)], backend="gloo")
    try:
        assert sum_over(groups) == [3.0, 3.0]
        assert regroup_all(groups, 0, (0, 1), "recover/1") == ["kept", "kept"]
        assert sum_over(groups) == [3.0, 3.0]  # the kept backend's sequence is intact
        groups[1].abandon("recovery started in execute")  # only member 1 left it mid-sequence
        assert regroup_all(groups, 0, (0, 1), "recover/2") == ["rebuilt", "rebuilt"]
        assert sum_over(groups) == [3.0, 3.0]
    finally:
        shut(groups)


def test_a_backend_is_kept_only_if_every_member_issued_as_many_operations_on_it():
    """NCCL matches operations by order, and a wait returns at once: a member that issued (and
    waited for) one operation the others never issued leaves no trace but its count. Kept,
    that backend would pair every later operation wrongly; the meeting compares the counts."""
    from recover_patches.collectives import emulated_nccl
    from recover_patches.collectives.emulated_nccl import host_reads

    world = FakeWorld()
    groups = build_together(world, "tp.replica0.stage0", [(0, 1)] * 2,
                            backend=emulated_nccl.install(host_thread=False), timeout=60.0)
    try:
        def one_more() -> None:
            host_reads.enter()
            dist.all_reduce(torch.ones(1), group=groups[0], async_op=True).wait()
        extra = threading.Thread(target=one_more, daemon=True)
        extra.start()
        extra.join(5.0)
        assert not groups[0].dirty  # waited for: nothing else tells
        assert regroup_all(groups, 0, (0, 1), "recover/1") == ["rebuilt", "rebuilt"]
        assert regroup_all(groups, 0, (0, 1), "recover/2") == ["kept", "kept"]  # control
    finally:
        shut(groups)


def test_an_operation_issued_and_not_waited_makes_the_group_dirty():
    world = FakeWorld()
    groups = build_together(world, "pp.replica0.tp0", [(0, 1), (0, 1)], backend="gloo")
    try:
        pending = groups[0].send([torch.ones(1)], 1)  # posted, its receiver never came
        assert groups[0].dirty and not groups[1].dirty
        assert regroup_all(groups, 0, (0, 1), "recover/1") == ["rebuilt", "rebuilt"]
        del pending
    finally:
        shut(groups)


def test_a_group_that_lost_a_member_is_rebuilt_on_gloo():
    world = FakeWorld()
    groups = build_together(world, "dp.tp0.stage0", [(0, 1, 2)] * 3, backend="gloo")
    try:
        epoch = world.declare_dead({2})
        assert regroup_all(groups[:2], epoch, (0, 1), "recover/1") == ["rebuilt", "rebuilt"]
        assert sum_over(groups[:2]) == [3.0, 3.0]
    finally:
        shut(groups)


def outcomes_of(calls) -> list:
    """Each member's result, or the type of what it raised."""
    def caught(call):
        try:
            return call()
        except Exception as e:  # noqa: BLE001 -- the test compares them
            return type(e)
    return together([lambda c=c: caught(c) for c in calls])


def test_an_epoch_that_declares_no_member_dead_lets_every_member_finish_the_regroup():
    """A replica grows back (an epoch that kills no one) while the survivors regroup: each member
    finishes, whether it saw the epoch after the meeting or before it. Ending the regroup on the
    members that saw it first left the others connecting their next group alone (CI, 11/2026)."""
    world = FakeWorld()
    groups = build_together(world, "tp.replica0.stage0", [(0, 1), (0, 1)], backend="gloo")
    try:
        for g in groups:
            g.abandon("recovery started in execute")
        plans = together([lambda g=g: g.meet(0, (0, 1), "recover/1") for g in groups])
        world.readmit(set())  # epoch 1 arrives between the meeting and the connect
        assert outcomes_of([lambda g=g, p=p: g.apply(p) for g, p in zip(groups, plans)]) == \
            ["rebuilt", "rebuilt"]
        assert sum_over(groups) == [3.0, 3.0]
        for g in groups:  # and seen before the meeting
            g.abandon("recovery started in execute")
        assert regroup_all(groups, 0, (0, 1), "recover/2") == ["rebuilt", "rebuilt"]
        assert sum_over(groups) == [3.0, 3.0]
    finally:
        shut(groups)


def test_an_epoch_that_declares_a_member_dead_during_the_connect_ends_the_regroup():
    """The control: an epoch that kills a member between the meeting and the connect still ends
    the rebuild on every member (they retry with that epoch)."""
    world = FakeWorld()
    groups = build_together(world, "dp.tp0.stage0", [(0, 1, 2)] * 3, backend="gloo")
    try:
        plans = together([lambda g=g: g.meet(0, (0, 1, 2), "recover/1", force=True)
                          for g in groups])
        world.declare_dead({2})
        assert outcomes_of([lambda g=g, p=p: g.apply(p) for g, p in zip(groups, plans)]) == \
            [PeerFailure] * 3
    finally:
        shut(groups)


@pytest.mark.parametrize("shrinkable", [True, False])
def test_a_group_that_lost_a_member_is_shrunk_where_the_backend_can(fabric, shrinkable):
    fabric.shrinkable = shrinkable
    world = FakeWorld()
    groups = build_together(world, "dp.tp0.stage0", [(0, 1, 2)] * 3, backend=fake_async.NAME)
    try:
        made = len(fabric.made)
        epoch = world.declare_dead({2})
        outcome = "shrunk" if shrinkable else "rebuilt"
        assert regroup_all(groups[:2], epoch, (0, 1), "recover/1") == [outcome, outcome]
        if shrinkable:  # NCCL_SHRINK_ABORT on the parent, no communicator created from scratch
            assert len(fabric.made) == made
            assert sorted(excluded for _, excluded in fabric.shrunk) == [[2], [2]]
        else:
            assert len(fabric.made) == made + 2 and fabric.shrunk == []
    finally:
        shut(groups)


def test_a_group_busy_when_a_member_is_declared_dead_is_aborted_not_set_aside(fabric):
    """Found on an H200: a communicator set aside for shrinking is not aborted, so an all-reduce
    stuck on it (a member dead) held the compute stream and the survivor's next host read never
    returned. Only an idle one is set aside; the busy one is aborted at once."""
    fabric.shrinkable = True
    world = FakeWorld()
    groups = build_together(world, "dp.tp0.stage0", [(0, 1, 2)] * 3, backend=fake_async.NAME)
    try:
        backend_of = {b.group_rank: b for b in fabric.made}
        fabric.complete = False  # member 2 never joins: member 0's all-reduce stays in flight
        dist.all_reduce(torch.ones(1), group=groups[0], async_op=True).wait()
        epoch = world.declare_dead({2})
        assert backend_of[0].aborted.wait(5.0), "the busy communicator was set aside"
        assert not backend_of[1].aborted.is_set()  # idle: kept aside for a shrink
        fabric.complete = True  # the members decide together: one cannot shrink, so none does
        assert regroup_all(groups[:2], epoch, (0, 1), "recover/1") == ["rebuilt", "rebuilt"]
        assert fabric.shrunk == [] and backend_of[1].aborted.wait(5.0)
    finally:
        shut(groups)


def test_a_member_that_dies_before_first_use_fails_the_rebuild_within_its_bound(fabric):
    """NCCL: the communicator is created eagerly inside the rebuild: a member gone before first
    use is a PeerFailure at the rebuild's deadline, not a hang at the group's first operation."""
    fabric.hang_connect = True
    world, bound = FakeWorld(), 0.5  # --recover-timeout
    start = time.monotonic()
    with pytest.raises(PeerFailure, match="connect did not finish within 0.5s"):
        build_together(world, "tp.replica1.stage0", [(0, 1), (0, 1)],
                       backend=fake_async.NAME, timeout=bound, build_timeout=30.0)
    assert time.monotonic() - start < bound + 1.0
    assert [b.aborted.wait(1.0) for b in fabric.made] == [True, True]  # its threads let go


def test_the_unique_id_exchange_waits_no_longer_than_the_rebuild(fabric):
    """NCCL: torch fetches the NCCL unique id with the store client's own timeout (30 s for
    our coordinator's): the backend is made on a client bounded by the operation timeout."""
    store = dist.TCPStore("127.0.0.1", 0, 1, True, timeout=timedelta(seconds=10),
                          wait_for_workers=False)
    fabric.fetch_id = True  # member 1 waits for member 0's id, which never comes
    start = time.monotonic()
    with pytest.raises(Exception, match="(?i)timeout|timed out"):
        backends.build(fake_async.NAME, store, "pg/tp/e1/", 1, 2, build_timeout=30.0,
                       op_timeout=0.5)
    assert time.monotonic() - start < 1.5
    store.set("still", "usable")  # the shared client keeps its own timeout
    assert store.get("still") == b"usable"


def test_a_regroup_connects_its_rebuilt_communicators_concurrently(fabric):
    """NCCL takes seconds per communicator; the groups a recovery rebuilds connect at
    once, not one after another (the fake counts how many eager connects overlap)."""
    from megatron.training.initialize import build_groups
    from recover_patches.collectives.process_group import ResilientProcessGroup
    from recover_patches.topology import Topology

    world, topology = FakeWorld(), Topology(tp=2, pp=1, dp=2)

    def groups_of(rank: int):
        def make(name, ranks):
            return ResilientProcessGroup(name, ranks, membership=world.member(rank), timeout=5.0,
                                         backend=fake_async.NAME, build_timeout=5.0,
                                         verdict_timeout=0.0)
        return build_groups(topology, rank, make, resilient=True)
    everyone = together([lambda r=r: groups_of(r) for r in range(4)])
    try:
        fabric.connect_seconds, fabric.most_connecting = 0.05, 0
        for groups in everyone:  # every rank left mid-execute: every group is rebuilt
            groups.abandon("execute")
        reports = together([lambda g=g: g.regroup([0, 1], 0, "recover/1") for g in everyone])
        assert len(reports[0].rebuilt) == len(everyone[0].all_groups()) == 5
        assert fabric.most_connecting > 4, fabric.most_connecting  # > one per rank at a time
    finally:
        for groups in everyone:
            for g in groups.all_groups():
                g.shutdown()


def test_torch_can_list_a_resilient_groups_configuration():
    """torch's profiler lists every registered group's configuration when it starts and stops
    (`_get_all_pg_configs`): a resilient group carries its backend's, and leaves none behind."""
    world = FakeWorld()
    groups = build_together(world, "dp.tp0.stage0", [(0, 1), (0, 1)], backend="gloo")
    try:
        for g in groups:  # what _get_pg_config reads of each registered group
            assert "gloo" in dist.get_backend_config(g)
            assert dist.get_process_group_ranks(g) == [0, 1]
    finally:
        shut(groups)
    registry = dist.distributed_c10d._world.pg_backend_config
    assert not any(g in registry for g in groups)


def _read_behind_a_stuck_all_reduce_then_an_epoch(issue) -> tuple[bool, float | None]:
    """A survivor issues an all-reduce member 1 never joins (`issue(tensor, group)`), then
    reads the result on the host, and an epoch declares member 1 dead. Returns whether the
    epoch's watcher ended the backend, and how long the read took (None: still blocked after
    5 s). A watchdog of its own, swept by no thread: the epoch watcher holds the last
    references to what the survivor issued."""
    from recover_patches.collectives import emulated_nccl
    from recover_patches.collectives.emulated_nccl import host_reads

    world, watchdog = FakeWorld(), Watchdog(background=False)
    groups = build_together(world, "dp.tp0.stage1", [(0, 1)] * 2, watchdog=watchdog,
                            backend=emulated_nccl.install(host_thread=False), timeout=60.0)
    communicator = groups[0]._inner  # to release a stuck survivor when the test fails
    issued, out = threading.Event(), {}

    def survivor() -> None:
        host_reads.enter()
        reduced = torch.ones(1)
        issue(reduced, groups[0])
        issued.set()
        start = time.monotonic()
        reduced.tolist()  # a host read: it waits until the stuck all-reduce ends
        out["read took"] = time.monotonic() - start
    reader = threading.Thread(target=survivor, daemon=True)
    reader.start()
    try:
        assert issued.wait(5.0)
        time.sleep(0.3)  # inside the read's synchronize
        verdict = threading.Thread(target=world.declare_dead, args=({1},), daemon=True)
        verdict.start()
        verdict.join(5.0)
        reader.join(5.0)
        return not verdict.is_alive(), out.get("read took")
    finally:
        if reader.is_alive():
            communicator.abort()
        shut(groups)


def test_a_survivor_waiting_in_a_host_read_is_released_when_an_epoch_ends_its_collective():
    """Found on an H200 (a (1,2,2) job, a rank stopped in the DP reduction; emulated here with
    the driver's lock): the training thread waited in a host read for an all-reduce stuck on
    the stopped member. The epoch watcher, ending that backend, first let go of the watchdog's
    event of the all-reduce, and cudaEventDestroy waited for the lock the read held: the abort
    that would have ended the read never came, and the rank hung with its training done."""
    watcher_done, read_took = _read_behind_a_stuck_all_reduce_then_an_epoch(
        lambda t, group: dist.all_reduce(t, group=group))
    assert watcher_done, "the epoch watcher is stuck ending the backend"
    assert read_took is not None and read_took < 5.0


def test_a_survivor_reading_behind_an_asynchronous_collective_is_released_by_the_epoch():
    """Found on an H200 (a (2,2,2) job, the DP partner of a killed rank): the training thread
    read the reduction's tail behind an asynchronous all-reduce stuck on the dead member. The
    epoch watcher, ending that backend, let go of the group's reference to the work, and the
    watchdog of another finished one: destroying a WorkNCCL destroys its future's CUDA events,
    and both threads waited for the driver's lock the read held. No abort came; the rank was
    declared stuck and the job lost it. A work is let go of on the thread that issued it."""
    def issue(t, group) -> None:  # the stream waits, the host goes on, and no handle is kept:
        dist.all_reduce(t, group=group, async_op=True).wait()  # the group and watchdog hold it
    watcher_done, read_took = _read_behind_a_stuck_all_reduce_then_an_epoch(issue)
    assert watcher_done, "the epoch watcher is stuck ending the backend"
    assert read_took is not None and read_took < 5.0


def test_a_meeting_ends_at_once_when_an_epoch_kills_a_rank_of_its_fate():
    """A replica's members mend its groups before rolling forward; a member whose replica broke
    leaves instead, so one still meeting would wait the build bound (60 s in a (2,2,2) job under
    the emulated NCCL) for it. An epoch that kills a rank of the meeting's `fate` ends it."""
    world = FakeWorld()
    groups = build_together(world, "pp.replica1.tp1", [(0, 1), (0, 1)], backend="gloo",
                            build_timeout=5.0)
    try:
        world.declare_dead({2})  # another rank of the replica: member 1 will not come
        start = time.monotonic()
        with pytest.raises(PeerFailure, match="declared a member dead"):
            groups[0].meet(0, (0, 1), "mend/3/after0", fate=(0, 1, 2))
        assert time.monotonic() - start < 1.0
        with pytest.raises(PeerFailure, match="did not arrive"):  # control: no fate, the bound
            groups[0].meet(0, (0, 1), "mend/3/after0.b")
    finally:
        shut(groups)


def test_a_break_names_the_operations_it_cut_short_until_the_rebuild():
    """The distributed optimizer's weight all-gather, issued by the step and waited for on the
    stream, cut short when an epoch ends the backend: the group says so (`broke`), so the
    replica computes its round again instead of keeping gradients of half-gathered weights.
    Control: an all-gather that completed before the break is not named."""
    from recover_patches.collectives import emulated_nccl

    world, watchdog = FakeWorld(), Watchdog(poll=0.001)
    groups = build_together(world, "instance0", [(0, 1, 2)] * 3, timeout=60.0,
                            backend=emulated_nccl.install(host_thread=False), watchdog=watchdog)

    def swept_down_to(pending: int) -> bool:
        deadline = time.monotonic() + 5.0
        while watchdog.pending() > pending and time.monotonic() < deadline:
            time.sleep(0.005)
        return watchdog.pending() == pending
    try:
        def gather(g):
            whole = torch.empty(3)
            dist.all_gather_into_tensor(whole, torch.ones(1), group=g, async_op=True).wait()
        together([lambda g=g: gather(g) for g in groups])  # completes on every member
        assert swept_down_to(0)
        gather(groups[0])  # members 1 and 2 never post theirs: in flight
        time.sleep(0.1)
        assert watchdog.pending() == 1
        assert not groups[0].broke("allgather") and not groups[1].broke("allgather")
        epoch = world.declare_dead({2})
        assert groups[0].broke("allgather") and not groups[0].broke("allreduce")
        assert not groups[1].broke("allgather")  # nothing of member 1's was in flight
        together([lambda g=g: g.regroup(epoch, (0, 1), "recover/1") for g in groups[:2]])
        assert not groups[0].broke("allgather")  # a new backend: nothing cut short yet
    finally:
        shut(groups)


def test_together_runs_each_member_on_a_thread_of_its_own():
    """A member's thread is its compute stream under the emulated NCCL: two members sharing one
    queue each other's collectives on it and wait for each other. Calls that return at once
    are the case a thread pool served on fewer threads than members."""
    for _ in range(20):
        threads = together([threading.current_thread] * 3)  # held: no id is reused
        assert len({id(thread) for thread in threads}) == 3
