"""The emulated NCCL keeps NCCL's and ProcessGroupNCCL's rules where ReCoVer depends on them.

Ranks are threads of this process sharing a HashStore (each thread has its own compute stream
and host-read rules, as each process has under RECOVER_EMULATE_NCCL=1). Every test that shows a
block also shows what releases it, bounded by a join timeout.
"""
from __future__ import annotations

import threading
import time

import pytest
import torch
import torch.distributed as dist
from torch._C import _distributed_c10d as c10d

from recover_patches.collectives.emulated_nccl import host_reads, streams
from recover_patches.collectives.emulated_nccl.communicator import (COMM_ERROR, SUCCESS,
                                                                   EmulatedCommunicator)

BOUND = 20.0  # no test thread may outlive this


def sync_opts():
    opts = dist.AllreduceOptions()
    opts.asyncOp = False
    return opts


def run_ranks(*bodies, store=None, rules: bool = True, one_process: bool = False):
    """Run body(rank, communicator, results) on a thread per rank; the communicators connect
    first (collectively). Each rank stands for a process (a driver lock of its own) unless
    `one_process`. Returns (results, communicators)."""
    store = store or dist.HashStore()
    results: dict = {}
    comms: dict[int, EmulatedCommunicator] = {}
    errors: list[BaseException] = []

    def run(rank: int) -> None:
        try:
            if rules:
                host_reads.enter()
            if not one_process:
                streams.own_driver()
            comms[rank] = EmulatedCommunicator(dist.PrefixStore("c/", store), rank, len(bodies))
            comms[rank].eager_connect_single_device()
            bodies[rank](rank, comms[rank], results)
        except BaseException as e:  # noqa: BLE001 -- reported by the test
            errors.append(e)
    threads = [threading.Thread(target=run, args=(r,), daemon=True) for r in range(len(bodies))]
    for t in threads:
        t.start()
    return threads, results, comms, errors


def join(threads, errors, bound: float = BOUND) -> None:
    for t in threads:
        t.join(bound)
    assert not any(t.is_alive() for t in threads), "a rank thread is still blocked"
    assert not errors, errors


def test_a_synchronous_collective_returns_no_work_and_the_next_read_sees_its_result():
    def body(rank, comm, out):
        t = torch.full((3,), float(rank + 1))
        out[f"work{rank}"] = comm.allreduce([t], sync_opts())
        out[rank] = (t * 2).tolist()  # compute, then a host read: both after the collective
    threads, out, _, errors = run_ranks(body, body)
    join(threads, errors)
    assert out["work0"] is None and out["work1"] is None
    assert out[0] == out[1] == [6.0, 6.0, 6.0]


def test_a_missing_member_blocks_the_host_read_until_the_abort():
    """The H200's survivor: a host read behind a collective whose peer never posts waits for
    ever, until the communicator is aborted. Control: a thread without the host-read rules
    reads at once (as the fake backend of the CPU suite did)."""
    gate, posted = threading.Event(), threading.Event()

    def reader(rank, comm, out):
        t = torch.ones(2)
        comm.allreduce([t], sync_opts())
        posted.set()
        start = time.monotonic()
        t.tolist()
        out["blocked"] = time.monotonic() - start

    def absent(rank, comm, out):
        gate.wait(BOUND)
    for rules, expect_block in ((True, True), (False, False)):
        threads, out, comms, errors = run_ranks(reader, absent, rules=rules)
        assert posted.wait(BOUND)
        time.sleep(1.0)
        aborted_at = time.monotonic()
        comms[0].abort()
        join(threads[:1], errors)
        gate.set()
        join(threads, errors)
        gate.clear()
        posted.clear()
        if expect_block:
            assert out["blocked"] >= 0.9 and time.monotonic() - aborted_at < 2.0, out
        else:
            assert out["blocked"] < 0.1, out


def test_work_wait_never_blocks_the_host_and_its_result_is_an_integer_published_after_it():
    release = threading.Event()

    def early(rank, comm, out):
        t = torch.ones(1)
        work = comm.allreduce([t])
        start = time.monotonic()
        work.wait()
        out["wait"] = time.monotonic() - start
        out["before"] = (work.is_completed(), work.get_future_result().done())
        release.set()
        t.tolist()  # the host read waits for the peer
        out["after"] = (work.is_completed(), work.get_future_result().value())

    def late(rank, comm, out):
        release.wait(BOUND)
        time.sleep(0.3)
        comm.allreduce([torch.ones(1)])
    threads, out, _, errors = run_ranks(early, late)
    join(threads, errors)
    assert out["wait"] < 0.5 and out["before"] == (False, False)
    assert out["after"] == (True, SUCCESS) and type(out["after"][1]) is int


def test_p2p_matches_by_posting_order_with_no_tags_and_a_send_waits_for_its_receiver():
    posted = threading.Event()

    def sender(rank, comm, out):
        first = comm.send([torch.full((2,), 1.0)], 1, tag=7)
        comm.send([torch.full((2,), 2.0)], 1, tag=3)
        time.sleep(0.3)
        out["sent before the receiver posted"] = first.is_completed()
        posted.set()

    def receiver(rank, comm, out):
        posted.wait(BOUND)
        a, b = torch.zeros(2), torch.zeros(2)
        comm.recv([a], 0, tag=3).wait()  # tags differ from the sends': order decides
        comm.recv([b], 0, tag=7).wait()
        out["received"] = (a.tolist(), b.tolist())
    threads, out, _, errors = run_ranks(sender, receiver)
    join(threads, errors)
    assert out["sent before the receiver posted"] is False
    assert out["received"] == ([1.0, 1.0], [2.0, 2.0])


def test_a_stream_runs_in_order_and_an_event_completes_when_the_stream_reaches_it():
    go = threading.Event()

    def first(rank, comm, out):
        stuck = comm.allreduce([torch.ones(1)])
        ready = streams.current().event().query
        stuck.wait()
        behind = streams.current().event().query
        second = comm.allreduce([torch.ones(1)])
        time.sleep(0.3)
        out["while stuck"] = (stuck.is_completed(), second.is_completed(), ready(), behind())
        go.set()
        second.wait()
        torch.ones(1).tolist()
        out["after"] = (stuck.is_completed(), second.is_completed(), behind())

    def second_rank(rank, comm, out):
        go.wait(BOUND)
        comm.allreduce([torch.ones(1)]).wait()
        comm.allreduce([torch.ones(1)]).wait()
        torch.ones(1).tolist()
    threads, out, _, errors = run_ranks(first, second_rank)
    join(threads, errors)
    assert out["while stuck"] == (False, False, True, False)
    assert out["after"] == (True, True, True)


def test_abort_fails_every_pending_operation_with_comm_error():
    def lonely(rank, comm, out):
        work = comm.allreduce([torch.ones(1)])
        out["work"] = work
    threads, out, comms, errors = run_ranks(lonely, lambda *_: None)
    join(threads, errors)
    comms[0].abort()
    work = out["work"]
    deadline = time.monotonic() + 1.0
    while not work.get_future_result().done() and time.monotonic() < deadline:
        time.sleep(0.005)
    assert work.is_completed() and work.get_future_result().value() == COMM_ERROR
    assert comms[0].get_error().name == "COMM_ERROR"
    with pytest.raises(RuntimeError, match="aborted"):
        comms[0].allreduce([torch.ones(1)])


def test_single_queue_mode_holds_a_receive_behind_an_unmatched_send(monkeypatch):
    """CUDA_DEVICE_MAX_CONNECTIONS=1: one hardware queue for every stream. A send posted to a
    peer that has not posted its receive holds back a receive on another communicator; with a
    queue per stream (the control) the receive completes."""
    for single, expect_held in (("1", True), ("", False)):
        monkeypatch.setenv("CUDA_DEVICE_MAX_CONNECTIONS", single)
        store, release = dist.HashStore(), threading.Event()
        other = [EmulatedCommunicator(dist.PrefixStore("b/", store), r, 2) for r in range(2)]
        connect = [threading.Thread(target=c.eager_connect_single_device) for c in other]
        for t in connect:
            t.start()
        for t in connect:
            t.join(BOUND)

        def r0(rank, comm, out):
            comm.send([torch.ones(1)], 1)  # rank 1 posts its receive only later
            got = other[0].recv([torch.zeros(1)], 1)
            deadline = time.monotonic() + (1.0 if expect_held else 10.0)
            while not got.is_completed() and time.monotonic() < deadline:
                time.sleep(0.01)
            out["held"] = not got.is_completed()
            release.set()

        def r1(rank, comm, out):
            other[1].send([torch.ones(1)], 0)
            release.wait(BOUND)
            comm.recv([torch.zeros(1)], 0).wait()
        threads, out, _, errors = run_ranks(r0, r1, store=store)
        join(threads, errors)
        assert out["held"] is expect_held, single


def test_connect_is_collective_and_a_shrunk_communicator_works_without_the_excluded():
    arrived = []

    def member(rank, comm, out):
        arrived.append(rank)
        if rank == 2:
            return  # excluded from the shrink
        smaller = comm.shrink([2], 1, None)
        t = torch.full((1,), float(rank + 1))
        smaller.allreduce([t], sync_opts())
        out[rank] = (smaller.size(), t.tolist())
    threads, out, _, errors = run_ranks(member, member, member)
    join(threads, errors)
    assert sorted(arrived) == [0, 1, 2]
    assert out[0] == out[1] == (2, [3.0])


def test_a_shrunk_backend_is_proven_without_a_second_communicator():
    """torch 2.13's eager connect always makes a communicator; a shrunk backend already holds
    ncclCommShrink's, so layer 1 proves it with an all-reduce and connects nothing more.
    Control: an eager connect after the shrink makes a second communicator, its unique id under
    the parent's key: the member that reads first gets the parent's stale id, and the connect
    never completes (bounded here at 2 s)."""
    from recover_patches.collectives import backends, emulated_nccl
    kind = emulated_nccl.install(host_thread=False)

    def member(rank, comm, out):
        if rank == 2:
            return
        smaller = backends.shrink(kind, comm, [2], BOUND)
        out[rank] = smaller.extra_communicators
        if rank == 0:
            time.sleep(0.5)  # member 1 reads the id first: the parent's
        try:
            backends.connect_within(smaller, torch.device("cpu"), 2.0)
        except RuntimeError as e:
            out[f"control{rank}"] = str(e)
    threads, out, _, errors = run_ranks(member, member, member)
    join(threads, errors)
    assert out[0] == out[1] == 0
    assert "connect did not finish within 2s" in out["control1"], out


class _Gathered(torch.autograd.Function):
    """As megatron-core's all-gather Functions: a synchronous all-gather into split views of a
    buffer, the buffer returned from forward."""

    @staticmethod
    def forward(ctx, comm, x):
        out = torch.empty(4 * x.numel())[:2 * x.numel()]  # a view of the global buffer
        opts = c10d.AllgatherOptions()
        opts.asyncOp = False
        comm.allgather([list(torch.split(out, x.numel()))], [x], opts)
        return out

    @staticmethod
    def backward(ctx, grad):
        return None, grad[:1]


def test_the_device_writes_outside_autograd_and_every_collective_megatron_uses_completes():
    """The MoE all-gather dispatcher at EP 2 hung at its first step: the transport's in-place
    copy into split views of a buffer failed (views autograd guards, written on a thread with
    grad mode on), and writing the tensors themselves bumped the version counter of a custom
    Function's output after it returned, which autograd refuses; gloo's reduce_scatter_tensor
    has no future. Each failure left the stream stuck, as a dead member would. The device now
    writes the tensors' memory only: each completes, and backward runs through the output."""
    def body(rank, comm, out):
        x = torch.full((1,), float(rank + 1), requires_grad=True)
        gathered = _Gathered.apply(comm, x)
        (gathered * 3).sum().backward()  # reads the output the transport wrote
        scattered = torch.empty(1)
        opts = c10d.ReduceScatterOptions()
        opts.asyncOp = False
        comm._reduce_scatter_base(scattered, torch.tensor([1.0, 2.0]), opts)
        out[rank] = (gathered.tolist(), x.grad.tolist(), scattered.tolist())
    threads, out, _, errors = run_ranks(body, body)
    join(threads, errors)
    assert out[0] == ([1.0, 2.0], [3.0], [2.0]) and out[1] == ([1.0, 2.0], [3.0], [4.0])


def test_destroying_an_event_waits_while_another_thread_waits_in_a_host_read():
    """The driver's lock as an H200 showed it: cudaEventDestroy on one thread waited for
    cudaStreamSynchronize on another. Control: with no read waiting it returns at once."""
    destroyed: list[float] = []

    def destroy_one() -> None:
        start = time.monotonic()
        event = streams.current().event()  # this thread's stream: nothing queued
        del event
        destroyed.append(time.monotonic() - start)

    def reader(rank, comm, out):
        t = torch.ones(1)
        comm.allreduce([t], sync_opts())  # member 1 posts only after the destroy was tried
        out["reading"] = True
        t.tolist()
        out["read"] = time.monotonic()

    def late(rank, comm, out):
        while not out.get("reading"):
            time.sleep(0.01)
        time.sleep(0.2)  # the reader is inside its synchronize now
        other = threading.Thread(target=destroy_one, daemon=True)
        other.start()
        other.join(0.5)
        out["destroy blocked"] = other.is_alive()
        comm.allreduce([torch.ones(1)], sync_opts())  # the read can end: so can the destroy
        other.join(BOUND)
        out["destroyed"] = time.monotonic()
    threads, out, _, errors = run_ranks(reader, late, one_process=True)
    join(threads, errors)
    assert out["destroy blocked"] and out["destroyed"] >= out["read"] - 0.05
    destroy_one()  # control: no thread waits in a read
    assert destroyed[-1] < 0.1 and streams.driver().synchronizing_threads() == 0


def test_the_emulations_own_threads_destroy_events_without_waiting_for_the_driver():
    """The stream workers and gloo's callback threads stand for the device and NCCL, not the
    host: the garbage collector, run on gloo's thread, freed a work's event there and waited
    for a host read, and that communicator's later operations never completed on that member.
    Control: a thread of the host's (the epoch watcher's kind) still waits."""
    waited: dict[str, float] = {}

    def destroy_on(name: str) -> None:
        event = streams.Event([])  # made on the reading thread's side: a work's, say
        def drop() -> None:
            nonlocal event
            start = time.monotonic()
            del event
            waited[name] = time.monotonic() - start
        thread = threading.Thread(target=drop, name=name, daemon=True)
        thread.start()
        thread.join(0.5)

    def reader(rank, comm, out):
        t = torch.ones(1)
        comm.allreduce([t], sync_opts())  # member 1 posts only after the destroys were tried
        out["reading"] = True
        t.tolist()

    def late(rank, comm, out):
        while not out.get("reading"):
            time.sleep(0.01)
        time.sleep(0.2)  # the reader is inside its synchronize
        destroy_on(f"{streams.WORKER_PREFIX}r0-None")
        destroy_on("recover-membership")
        out["host thread waited"] = "recover-membership" not in waited
        comm.allreduce([torch.ones(1)], sync_opts())
    threads, out, _, errors = run_ranks(reader, late, one_process=True)
    join(threads, errors)
    assert waited[f"{streams.WORKER_PREFIX}r0-None"] < 0.1
    assert out["host thread waited"]


def test_a_closed_streams_worker_ends_its_operation_before_the_process_exits(tmp_path):
    """A daemon thread still running when Python finalizes is ended wherever it next takes the
    GIL -- inside a gloo work's destructor it aborted the process (status 134) after a run that
    passed. So the exit waits, bounded, for the workers of closed streams. Control: the same
    operation on a stream never closed is cut off by the exit."""
    import subprocess
    import sys
    script = """
import sys, threading, time
from recover_patches.collectives.emulated_nccl import streams
started = threading.Event()
def slow(op):
    started.set()
    time.sleep(0.5)
    open(sys.argv[1], "w").write("ended")
    op.finish()
stream = streams.Stream("exit-test")
stream.enqueue(streams.DeviceOp("slow", slow, []))
started.wait(5)
if sys.argv[2] == "close":
    stream.close()
"""
    ended = {}
    for mode in ("close", "keep"):
        mark = tmp_path / mode
        done = subprocess.run([sys.executable, "-c", script, str(mark), mode], timeout=60,
                              capture_output=True, text=True)
        assert done.returncode == 0, done.stderr
        ended[mode] = mark.exists()
    assert ended == {"close": True, "keep": False}
