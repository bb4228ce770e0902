"""Rank script for the multi-process tests of ResilientProcessGroup (run by recover_patches.launch).

usage: rank_scenarios.py OUT_DIR kills|hang OP_TIMEOUT

kills (world 7): scenario k = 0..4 runs OPS[k] in a group (0, 1, victim k+2) built in epoch k; the
    victim SIGKILLs itself (fault injection through the group's before_op hook) while the two
    survivors are inside the operation. Survivors catch PeerFailure, rebuild the group as (0, 1) in
    the epoch that declared the victim dead, and all-reduce again.
hang (world 3): the same with allreduce, the victim SIGSTOPs itself instead (a hang).
Survivors write OUT_DIR/result.<rank>.json; every rank writes OUT_DIR/pid.<rank> first.
"""
import json
import os
import sys
import threading
import time

import torch
import torch.distributed as dist

from recover_patches.collectives import backends, nccl_env
from recover_patches.collectives.errors import PeerFailure
from recover_patches.collectives.membership import MembershipClient
from recover_patches.collectives.process_group import ResilientProcessGroup
from recover_patches.faults import FaultInjector

OPS = ["allreduce", "allgather", "broadcast", "send", "recv"]
out_dir, mode, op_timeout = sys.argv[1], sys.argv[2], float(sys.argv[3])
rank = int(os.environ["RANK"])
with open(os.path.join(out_dir, f"pid.{rank}"), "w") as f:
    f.write(str(os.getpid()))
nccl_env.check_applied()  # the launcher set torch's NCCL knobs before any group exists
membership = MembershipClient.from_env(timeout=op_timeout)  # heartbeats derive from it


def check_every_op(g: ResilientProcessGroup) -> None:
    """The interface megatron-core and our trainer use, through the wrapper, with real values."""
    me, n = g.rank(), g.size()
    x = torch.full((3,), float(g.members[me]))
    dist.all_reduce(x, group=g)
    assert x.tolist() == [float(sum(g.members))] * 3, x
    gathered = torch.empty(3 * n)
    dist.all_gather_into_tensor(gathered, torch.full((3,), float(me)), group=g)
    assert gathered.tolist() == [float(i) for i in range(n) for _ in range(3)], gathered
    part = torch.empty(2)  # gloo gives this op no future (not needed: the caller waits on it)
    dist.reduce_scatter_tensor(part, torch.arange(2.0 * n) + me, group=g)
    assert part.tolist() == [n * (2.0 * me + i) + n * (n - 1) / 2 for i in range(2)], part
    lst = [torch.empty(2) for _ in range(n)]
    dist.all_gather(lst, torch.full((2,), float(me)), group=g)
    assert [t[0].item() for t in lst] == list(range(n))
    b = torch.full((2,), float(me))
    dist.broadcast(b, src=g.members[-1], group=g)  # global src: needs the c10d registration
    assert b.tolist() == [float(n - 1)] * 2
    assert dist.get_world_size(g) == n
    assert dist.get_process_group_ranks(g) == list(g.members)
    dist.barrier(group=g)
    ring = torch.empty(1)
    reqs = [dist.isend(torch.tensor([float(me)]), group=g, group_dst=(me + 1) % n),
            dist.irecv(ring, group=g, group_src=(me - 1) % n)]
    for req in reqs:
        req.wait()
    assert ring.item() == float((me - 1) % n)


def run_op(op: str, g: ResilientProcessGroup, victim_group_rank: int) -> None:
    x = torch.ones(4)
    if op == "allreduce":
        dist.all_reduce(x, group=g)
    elif op == "allgather":
        dist.all_gather([torch.empty(4) for _ in range(g.size())], x, group=g)
    elif op == "broadcast":
        dist.broadcast(x, group=g, group_src=victim_group_rank)
    elif op == "send":
        dist.isend(x, group=g, group_dst=victim_group_rank).wait()
    elif op == "recv":
        dist.irecv(x, group=g, group_src=victim_group_rank).wait()


def victim_hook(k: int, kind: str):
    injector = FaultInjector.from_specs([f"{kind}:rank={rank},iter={k},phase=tp_allreduce"], rank)

    def before_op(_op: str) -> None:
        time.sleep(0.3)  # let the survivors get inside the operation
        with open(os.path.join(out_dir, f"fault_time.{k}"), "w") as f:
            f.write(repr(time.time()))
        injector.at("tp_allreduce", k)
    return before_op


def scenario(k: int, op: str, victim: int, kind: str) -> dict | None:
    if membership.epoch() < k:
        membership.wait_for_epoch_after(k - 1, 30)
    g = ResilientProcessGroup(f"s{k}", (0, 1, victim), membership=membership, timeout=op_timeout)
    if k == 0:
        check_every_op(g)
    if rank == victim:
        g.set_before_op(victim_hook(k, kind))
        run_op(op, g, 2)
        raise SystemExit(f"victim {rank} survived its own {kind}")
    record: dict = {"op": op, "victim": victim}
    try:
        run_op(op, g, 2)
        record["failure"] = None
    except PeerFailure as e:
        caught = time.time()
        with open(os.path.join(out_dir, f"fault_time.{k}")) as f:
            record["failure"] = {"suspects": sorted(e.suspects), "epoch": e.epoch,
                                 "confirmed": e.confirmed, "op": e.op,
                                 "latency": caught - float(f.read())}
    epoch = membership.wait_for_epoch_after(k, 30)
    g.rebuild(epoch, (0, 1))
    y = torch.tensor([float(rank + 1)])
    dist.all_reduce(y, group=g)
    record.update(rebuilt_epoch=g.epoch, rebuilt_members=list(g.members), rebuilt_sum=y.item())
    g.shutdown()
    return record


def main() -> None:
    if mode == "kills":
        plan = [(k, op, k + 2, "kill") for k, op in enumerate(OPS)]
    else:
        plan = [(0, "allreduce", 2, "hang")]
    records = [scenario(*step) for step in plan if rank in (0, 1, step[2])]
    if rank == 0:
        membership.declare_complete()
    membership.close()
    deadline = time.monotonic() + op_timeout + 2
    backends.join_discards(op_timeout + 2)
    while threading.active_count() > 1 and time.monotonic() < deadline:
        time.sleep(0.05)
    result = {"records": records, "threads": [t.name for t in threading.enumerate()]}
    with open(os.path.join(out_dir, f"result.{rank}.json"), "w") as f:
        json.dump(result, f)


main()
