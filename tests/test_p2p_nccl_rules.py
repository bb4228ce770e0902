"""The pipeline's p2p designs under NCCL's rules (`tests/nccl_p2p_model.py`).

What the executors really call is recorded (`run_interleaved`, `run_1f1b` with a recording link
and stages that compute nothing), then turned into each rank's NCCL operations the way a design
posts them, and run under the model: every list length 0..3P+1, PP 1-4, V 1-3, with the group
size each length runs with. Negative control: the interleaved schedule over one communicator per
pair of ranks with tags (ReCoVer's design before the channels) deadlocks or swaps tensors under
the rules.
"""
from __future__ import annotations

import time
from collections.abc import Callable

import pytest
import torch

from recover_patches.pipeline.interleaved import Kind, best_group
from recover_patches.pipeline.p2p import StageLink
from recover_patches.pipeline.schedule import run_1f1b, run_interleaved
from tests.nccl_p2p_model import Op, Program, check


class Recorder:
    """A ChunkLink and the stages of one rank: logs what the executor does, computes nothing."""

    def __init__(self):
        self.log: list[tuple] = []

    # the link
    def post(self, kind, chunk, index):
        self.log.append(("post", kind, chunk, index))

    def recv(self, kind, chunk, index):
        self.log.append(("recv", kind, chunk, index))
        return torch.zeros(1)

    def send(self, kind, chunk, index, tensor):
        self.log.append(("send", kind, chunk, index))

    def flush(self):
        self.log.append(("flush",))

    def discard(self):
        pass

    # a stage
    def forward(self, g, x):
        self.log.append(("compute",))
        return torch.zeros(1)

    def backward(self, g, x, y, dy):
        self.log.append(("compute",))
        return torch.zeros(1)

    def tokens(self, g):
        return 1

    def measured(self, g):
        return None


def interleaved_logs(n: int, stages: int, chunks: int, group: int,
                     warmup_flush: bool = True) -> list[list[tuple]]:
    """`warmup_flush`: --overlap-p2p-communication-warmup-flush (receives posted ahead in every
    phase; without it, in the steady phase only)."""
    logs = []
    for rank in range(stages):
        recorder = Recorder()
        run_interleaved(list(range(n)), [recorder] * chunks, recorder, rank=rank, stages=stages,
                        group=group, overlap_warmup_flush=warmup_flush)
        logs.append(recorder.log)
    return logs


Comm = Callable[[int, int, Kind], object]  # (sending rank, receiving rank, kind) -> communicator


def chunk_programs(logs, stages: int, chunks: int, comm: Comm) -> list[Program]:
    """A ChunkLink's operations: a receive posted at `post` (or at `recv`) and waited by the next
    compute; a send posted and never waited before the final flush."""
    last = stages * chunks - 1
    programs = []
    for rank, log in enumerate(logs):
        program, posted, waits, sends = Program(), {}, [], []
        for event in log:
            if event[0] == "compute":
                program.compute(waits)
                waits = []
                continue
            if event[0] == "flush":
                program.compute(sends)
                continue
            kind, chunk, index = event[1:]
            v = chunk * stages + rank
            if event[0] in ("post", "recv"):
                source = v - 1 if kind is Kind.FORWARD else v + 1
                if not 0 <= source <= last:
                    continue
                if (kind, chunk, index) not in posted:
                    posted[(kind, chunk, index)] = program.post(Op(
                        False, comm(source % stages, rank, kind), source % stages,
                        (kind, source, index)))
                if event[0] == "recv":
                    waits.append(posted.pop((kind, chunk, index)))
            else:
                target = v + 1 if kind is Kind.FORWARD else v - 1
                if 0 <= target <= last:
                    sends.append(program.post(Op(True, comm(rank, target % stages, kind),
                                                 target % stages, (kind, v, index))))
        programs.append(program)
    return programs


def channels(src: int, dst: int, kind: Kind) -> object:
    return ("channel", src, dst, kind)  # ReCoVer's design: one communicator per ordered channel


def one_pair(src: int, dst: int, kind: Kind) -> object:
    return ("pair", min(src, dst), max(src, dst))  # one communicator per pair of ranks


def shapes() -> list[tuple[int, int, int, int]]:
    """(n, P, V, group) for every length 0..3P+1, PP 1-4, V 1-3 (V > 1 needs P >= 2), with the
    group each length runs with for the default group P and for P + 1."""
    found = set()
    for stages in (1, 2, 3, 4):
        for chunks in (1, 2, 3) if stages > 1 else (1,):
            for configured in (stages, stages + 1):
                for n in range(0, 3 * stages + 2):
                    found.add((n, stages, chunks, best_group(n, stages, chunks, configured)))
    return sorted(found)


@pytest.mark.parametrize("warmup_flush", [True, False])
def test_the_interleaved_schedule_over_channels_meets_nccls_rules(warmup_flush):
    cases = shapes()
    problems = {case: check(chunk_programs(interleaved_logs(*case, warmup_flush), case[1],
                                           case[2], channels)) for case in cases}
    assert {case: p for case, p in problems.items() if p} == {}
    assert len(cases) > 150  # every shape above, none deadlocked, none swapped
    print(f"\n{len(cases)} interleaved cases under NCCL's rules over channels: "
          f"0 deadlocked, 0 swapped")


def per_direction(src: int, dst: int, kind: Kind) -> object:
    return ("direction", src, dst)  # one per ordered pair: activations and gradients share it


def without_posts(logs):
    """The executor before the p2p channels: no receive posted ahead."""
    return [[event for event in log if event[0] != "post"] for log in logs]


def outcomes(comm: Comm, logs=lambda logs: logs) -> dict[str, int]:
    counts = {"cases": 0, "swapped": 0, "deadlock": 0}
    for case in shapes():
        if case[2] == 1:
            continue
        found = check(chunk_programs(logs(interleaved_logs(*case)), case[1], case[2], comm))
        counts["cases"] += 1
        for problem in ("swapped", "deadlock"):
            counts[problem] += any(p.startswith(problem) for p in found)
    return counts


def test_negative_control_the_design_before_breaks_under_nccls_rules():
    """Tags kept gloo right. Under NCCL, one communicator per pair of ranks (the design before
    NCCL p2p) deadlocks: a posted send holds back the receives behind it on the pair's stream; and
    one per direction would still swap tensors: an activation and a gradient between the same
    two ranks (P = 2) are matched in posting order, tags ignored."""
    before = outcomes(one_pair, without_posts)
    directions = outcomes(per_direction)
    assert before["deadlock"] > 0 and directions["swapped"] > 0, (before, directions)
    assert outcomes(channels, without_posts) == {"cases": before["cases"], "swapped": 0,
                                                 "deadlock": 0}
    print(f"\nwith model chunks, of {before['cases']} cases: one communicator per pair "
          f"deadlocks in {before['deadlock']}; one per direction swaps tensors in "
          f"{directions['swapped']}; one per channel: none")


class StageRecorder(StageLink):
    """The 1F1B link's exchanges, recorded: (send to, receive from) stage per call."""

    def __init__(self, stage: int, stages: int, log: list):
        super().__init__(None, stage, stages, (1,))
        self.log = log

    def _exchange(self, send, send_to, recv_from):
        self.log.append(("exchange", send_to if send is not None else None, recv_from))
        return None if recv_from is None else torch.zeros(1)


def stage_link_program(log, stage: int, receive_first: bool | None = None) -> Program:
    """StageLink's operations (one communicator for the pipeline): even stages post their send
    before their receive, odd ones after (`receive_first` overrides it: a negative control);
    compute waits for both."""
    program, counts, waits = Program(), {"sent": [0, 0], "read": [0, 0]}, []
    for event in log:
        if event[0] == "compute":
            program.compute(waits)
            waits = []
            continue
        _, send_to, recv_from = event
        ops = []
        if send_to is not None:
            backward = int(send_to < stage)
            ops.append(Op(True, "pp", send_to, (backward, stage, counts["sent"][backward])))
            counts["sent"][backward] += 1
        if recv_from is not None:
            backward = int(recv_from > stage)
            first = bool(stage % 2) if receive_first is None else receive_first
            ops.insert(0 if first else len(ops), Op(False, "pp", recv_from,
                                                        (backward, recv_from,
                                                         counts["read"][backward])))
            counts["read"][backward] += 1
        waits += [program.post(op) for op in ops]
    return program


def one_f_one_b(n: int, stages: int, receive_first: bool | None = None) -> list[str]:
    programs = []
    for stage in range(stages):
        recorder = Recorder()
        run_1f1b(list(range(n)), recorder, StageRecorder(stage, stages, recorder.log))
        programs.append(stage_link_program(recorder.log, stage, receive_first))
    return check(programs)


def test_1f1b_meets_nccls_rules():
    """1F1B keeps one communicator for the pipeline: Megatron's unbatched order (even stages
    send first) holds under the rules; every stage receiving first deadlocks (the control)."""
    cases = [(n, p) for p in (1, 2, 3, 4) for n in range(0, 3 * p + 2)]
    assert {case: one_f_one_b(*case) for case in cases} == {case: [] for case in cases}
    assert any(one_f_one_b(n, 3, receive_first=True) for n in range(2, 6))


def test_the_model_sees_a_swap_between_two_ranks():
    """P = 2, V = 2, four microbatches: over one communicator per direction, rank 1 sends rank 0
    both chunk-0 gradients and wrap-around activations, and they are matched in posting order."""
    found = check(chunk_programs(interleaved_logs(4, 2, 2, 4), 2, 2, per_direction))
    assert any(p.startswith("swapped") for p in found), found
    assert check(chunk_programs(interleaved_logs(4, 2, 2, 4), 2, 2, channels)) == []


def test_a_dead_neighbour_is_a_peer_failure_of_the_channel():
    """Under `fake_async`'s NCCL-like backend: a receive on the forward channel from a rank that
    died never completes; the watchdog aborts that channel's communicator and the commit raises a
    PeerFailure naming the neighbour and the channel."""
    from recover_patches.collectives import backends
    from recover_patches.collectives.errors import PeerFailure
    from recover_patches.collectives.watchdog import Watchdog
    from recover_patches.pipeline.p2p import Channel, ChunkP2P
    from tests.collectives import fake_async
    from tests.collectives.fake_world import FakeWorld, build_together

    fabric = fake_async.Fabric()
    fake_async.install(fabric)
    try:
        name = "p2p.replica0.tp0.F0to1"
        _, stage1 = build_together(FakeWorld(), name, [(0, 1), (0, 1)], backend=fake_async.NAME,
                                   timeout=0.2, watchdog=Watchdog(poll=0.001))
        fabric.complete = False  # rank 0 died: what rank 1 receives from it never arrives
        channels = {(Kind.FORWARD, False): Channel(stage1, 0)}
        link = ChunkP2P(channels, rank=1, stages=2, chunks=2, shape=(2,))
        link.recv(Kind.FORWARD, 0, 0)  # returns at once: a stream wait
        with pytest.raises(PeerFailure) as failure:
            for _ in range(200):  # up to 2 s; the deadline is 0.2 s
                stage1.raise_latched()  # what the commit calls
                time.sleep(0.01)
        assert failure.value.suspects == {0} and name in failure.value.op
        # the failure is latched first (no commit may vote on the stuck receive), then the
        # communicator is aborted on a discard thread
        assert next(b for b in fabric.made if b.group_rank == 1).aborted.wait(5.0)
    finally:
        fake_async.uninstall()
        assert backends.join_discards(5.0)


def test_receives_are_posted_ahead_in_warm_up_and_flush_only_with_the_flag():
    """--overlap-p2p-communication-warmup-flush with Megatron's meaning: without it, the next
    receive is posted ahead only from the first backward to the last forward."""
    def posted(warmup_flush: bool) -> list[int]:
        log = interleaved_logs(8, 4, 2, 4, warmup_flush)[0]
        actions = [i for i, e in enumerate(log) if e[0] == "recv"]
        return [sum(1 for e in log[:at] if e[0] == "post") for at in actions]
    steady_only, everywhere = posted(False), posted(True)
    assert steady_only[1] == 0 and everywhere[1] == 1  # the warm-up's second receive
    assert steady_only[-1] < everywhere[-1]  # fewer posted ahead overall


def test_under_one_hardware_queue_1f1b_holds_and_the_interleaved_schedule_does_not():
    """CUDA_DEVICE_MAX_CONNECTIONS=1 (`single_queue`): a rank's operations start in posting
    order whatever their communicator. 1F1B (one communicator, paired in Megatron's order)
    holds for every length; the interleaved schedule's unwaited sends hold back the receives
    behind them, with or without receives posted ahead: so VP > 1 is refused on NCCL with that
    setting (arguments_validate_pipeline). Control: the same programs without the rule."""
    cases = [(n, p) for p in (1, 2, 3, 4) for n in range(0, 3 * p + 2)]
    for n, stages in cases:
        programs = []
        for stage in range(stages):
            recorder = Recorder()
            run_1f1b(list(range(n)), recorder, StageRecorder(stage, stages, recorder.log))
            programs.append(stage_link_program(recorder.log, stage))
        assert check(programs, single_queue=True) == [], (n, stages)
    stuck = {posts: sum(bool(check(chunk_programs(posts(interleaved_logs(*case)), case[1],
                                                  case[2], channels), single_queue=True))
                        for case in shapes() if case[1] > 1)
             for posts in (lambda logs: logs, without_posts)}
    assert all(count > 0 for count in stuck.values()), stuck
    assert not any(check(chunk_programs(interleaved_logs(*case), case[1], case[2], channels))
                   for case in shapes())
