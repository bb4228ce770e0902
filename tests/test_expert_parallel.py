"""Expert parallelism: EP consecutive replicas (a unit) split the experts, and the unit is
the recovery unit (design.md §3). EP 2 of DP 2, EP 2 of DP 4, EP 2 with TP 2 + SP and EP 2 with an
interleaved PP 2 follow one process (fp32, 1e-5), with megatron-core's allgather and alltoall
token dispatchers. In DP 6 at EP 2 a rank killed in the dispatcher's all-to-all and then one
killed in a backward each cost their unit, whose microbatches the other units compute in the
same iteration -- an odd share split over a unit's two replicas, so one pads with a filler -- and
the losses and gradient norms stay the failure-free ones. A torch_dist checkpoint saved at EP 2
resumes at EP 2 and at EP 1. A killed rank's unit grows back whole, each replica from a live one
holding its experts, and the weights are checked among the replicas holding the same experts.
With the distributed optimizer each expert's state is sharded over the replicas holding it: DP 4
at EP 2 follows one process and its checkpoint resumes at EP 1; at DP 8, EP 2, K 2 a killed unit's
ranges come from the other instance and go back to the unit when it grows back."""
from __future__ import annotations

import re

import pytest

from megatron.training.checkpointing import LATEST_FILE
from recover_patches.recovery.iteration import LiveReplicas, ReplicaLost
from recover_patches.topology import Topology
from recover_patches.workload.policy import PlanInputError, even_plan, unit_plan, unit_timings
from tests._launch_util import launch
from tests.test_moe import FLAGS, same_moe_losses

EP2 = ["--expert-model-parallel-size", "2"]
LONG = ["--train-iters", "8"]
CHECKED = ["--check-weight-hash-across-dp-replicas-interval", "1"]
ALLTOALL = ["--moe-token-dispatcher-type", "alltoall"]  # megatron-core's, on the host here


def close(mine: dict, ref: dict, what: str, tolerance: float = 1e-5) -> bool:
    return abs(mine[what] - ref[what]) <= tolerance * abs(ref[what])


def test_a_unit_is_planned_as_one_and_split_over_its_replicas():
    assert unit_plan(range(6), [0, 1, 2, 3], 2, even_plan) == {
        0: [0, 1], 1: [2], 2: [3, 4], 3: [5]}  # units get 3 each, a replica pads to 2
    assert unit_plan([8, 9], [0, 1, 4, 5], 2, even_plan) == {0: [8], 1: [], 4: [9], 5: []}
    assert unit_plan(range(4), [0, 1], 1, even_plan) == {0: [0, 1], 1: [2, 3]}
    with pytest.raises(PlanInputError, match="not whole units of 2"):
        unit_plan(range(4), [0, 2, 3], 2, even_plan)
    assert unit_timings({0: 1.0, 1: 3.0, 2: 2.0, 3: None}, 2) == {0: 3.0, 2: None}


def test_a_dead_rank_breaks_every_replica_of_its_unit():
    topo = Topology.from_world(8, tp=1, pp=2, ep=2)  # DP 4: units {0, 1} and {2, 3}
    assert topo.unit_ranks(1) == [0, 4, 1, 5] and topo.expert_dp_ranks(0, 1, 1) == [5, 7]
    live = LiveReplicas(replica=0, live_replicas=[0, 1, 2, 3], epoch=0,
                        replica_ranks=topo.replica_ranks, unit_ranks=topo.unit_ranks)
    assert live.broken(frozenset({5})) == {0, 1}
    with pytest.raises(ReplicaLost, match=r"lost rank\(s\) \[5\]"):
        live.adopt_epoch(1, frozenset({5}))  # rank 0's own replica is whole: its unit is not
    assert live.live_replicas == [2, 3]
    alone = LiveReplicas(replica=2, live_replicas=[0, 1, 2, 3], epoch=0,
                         replica_ranks=topo.replica_ranks)  # control: replicas alone
    assert alone.broken(frozenset({5})) == {1}


def test_a_unit_grows_back_whole_or_not_at_all():
    topo = Topology.from_world(4, tp=1, pp=1, ep=2)
    survivor = LiveReplicas(replica=2, live_replicas=[0, 1, 2, 3], epoch=0, replicas=4,
                            replica_ranks=topo.replica_ranks, unit_ranks=topo.unit_ranks)
    survivor.adopt_epoch(1, frozenset({1}))
    assert survivor.joinable() == []  # replica 0's rank lives, its unit does not
    survivor.adopt_join([2, 3], 2, frozenset())  # rank 1 replaced
    assert survivor.joinable() == [0, 1]


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    """One process's losses at global batch 8 (the layouts) and 6 (the kills)."""
    runs = {}
    for name, flags in ((8, []), (6, ["--global-batch-size", "6"]), ("long", LONG)):
        run = launch(1, [*FLAGS, *flags], tmp_path_factory.mktemp(f"ep-ref{name}") / "m.jsonl")
        assert run.returncode == 0, run.stderr[-3000:]
        runs[name] = [r for r in run.records if "lm_loss" in r]
    return runs


@pytest.mark.multiprocess
@pytest.mark.timeout(300)
@pytest.mark.parametrize("world,layout", [
    (2, ALLTOALL),  # EP 2 = DP 2: one unit, no expert-data-parallel sum
    (4, ["--overlap-grad-reduce", "--ddp-bucket-size", "20000"]),  # two units
    (4, ["--tensor-model-parallel-size", "2", "--sequence-parallel"]),  # ETP 2
    (4, ["--pipeline-model-parallel-size", "2",  # the interleaved schedule, 2 chunks a rank
         "--num-layers-per-virtual-pipeline-stage", "1"])])
def test_expert_parallel_layouts_follow_one_process(reference, tmp_path, world, layout):
    run = launch(world, [*FLAGS, *EP2, *layout], tmp_path / "metrics.jsonl")
    assert run.returncode == 0, run.stderr[-3000:]
    records = [r for r in run.records if "lm_loss" in r]
    assert len(records) == len(reference[8])
    for mine, ref in zip(records, reference[8]):
        assert close(mine, ref, "lm_loss") and close(mine, ref, "grad_norm"), (mine, ref)
        assert same_moe_losses(mine, ref), (mine, ref)


@pytest.mark.multiprocess
@pytest.mark.timeout(300)
def test_killed_expert_parallel_ranks_cost_their_units_not_the_trajectory(reference, tmp_path):
    """DP 6, EP 2, global batch 6, the alltoall dispatcher: rank 3 (unit 1) dies in the
    dispatcher's exchange of iteration 2, rank 0 (unit 0) in a backward of iteration 3. Each time the lost unit's two
    microbatches go one to each remaining unit, whose second replica computes a filler."""
    faults = ["--inject-fault", "kill:rank=3,iter=2,phase=ep_alltoall",
              "--inject-fault", "kill:rank=0,iter=3,phase=backward"]
    run = launch(6, [*FLAGS, *EP2, *ALLTOALL, "--global-batch-size", "6",
                     "--recover-spares", "off", *faults], tmp_path / "metrics.jsonl", launcher_args=[], timeout=240)
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    assert "ep.unit1.tp0.stage0.alltoall failed" in run.stdout + run.stderr
    records = [r for r in run.records if "lm_loss" in r]
    assert [r["live_replicas"] for r in records] == [
        [0, 1, 2, 3, 4, 5], [0, 1, 4, 5], [4, 5], [4, 5]]
    for mine, ref in zip(records, reference[6], strict=True):
        assert mine["microbatches"] == 6 and close(mine, ref, "lm_loss"), (mine, ref)
        assert close(mine, ref, "grad_norm"), (mine, ref)  # a filler's aux loss would show here
        assert same_moe_losses(mine, ref), (mine, ref)  # and in the log: fillers not counted


@pytest.mark.multiprocess
@pytest.mark.timeout(300)
def test_an_expert_parallel_checkpoint_resumes_at_ep_2_and_at_ep_1(reference, tmp_path):
    """DP 4 at EP 2 saves with four writers, each expert item by one holder of those experts;
    iteration 2 resumes in one process (EP 2 -> 1, the experts re-sharded by DCP) and at EP 2 of
    DP 2, both on the uninterrupted losses."""
    ckpt = tmp_path / "ckpt"
    saved = launch(4, [*FLAGS, *EP2, "--save", str(ckpt), "--save-interval", "2"],
                   tmp_path / "a.jsonl")
    assert saved.returncode == 0, saved.stderr[-3000:]
    assert len(list((ckpt / "iter_0000002").glob("*.distcp"))) == 4
    (ckpt / LATEST_FILE).write_text("2")
    ref = [r["lm_loss"] for r in reference[8]][2:]
    for world, layout in ((1, []), (2, EP2)):
        resumed = launch(world, [*FLAGS, *layout, "--load", str(ckpt)],
                         tmp_path / f"b{world}.jsonl")
        assert resumed.returncode == 0, resumed.stderr[-3000:]
        mine = resumed.losses()
        assert len(mine) == 2 and all(abs(a - b) <= 1e-5 * abs(b) for a, b in zip(mine, ref)), (
            world, mine, ref)


def unit_1_grown_back(run, during: list[int], replicas: int) -> list[dict]:
    """A run's iteration records, checked: unit 1 (replicas 2 and 3) was lost in iteration 3
    (`during`: the live replicas then) and re-formed; all `replicas` live at the end."""
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    records = [r for r in run.records if "lm_loss" in r]
    live = [r["live_replicas"] for r in records]
    assert live[2] == during and live[-1] == list(range(replicas)), live
    assert [r["join"]["joined"] for r in run.records if "join" in r] == [[2, 3]]
    return records


DISTOPT = ["--use-distributed-optimizer", "--overlap-grad-reduce", "--overlap-param-gather",
           "--ddp-bucket-size", "20000"]


@pytest.mark.multiprocess
@pytest.mark.timeout(300)
def test_the_distributed_optimizer_shards_experts_among_their_holders(reference, tmp_path):
    """DP 4 at EP 2 with the distributed optimizer (one instance): the dense state in four
    shards, each expert's in two (the replicas holding it), reduce-scattered and all-gathered
    over those, overlapped; the run follows one process. Its torch_dist checkpoint of iteration
    2 (the experts' optimizer state gathered from their shards) resumes in one process."""
    ckpt = tmp_path / "ckpt"
    run = launch(4, [*FLAGS, *EP2, *DISTOPT, "--save", str(ckpt), "--save-interval", "2"],
                 tmp_path / "a.jsonl")
    assert run.returncode == 0, run.stderr[-3000:]
    records = [r for r in run.records if "lm_loss" in r]
    assert len(records) == len(reference[8])
    for mine, ref in zip(records, reference[8]):
        assert mine.get("reduce_scattered"), mine
        assert close(mine, ref, "lm_loss") and close(mine, ref, "grad_norm"), (mine, ref)
    (ckpt / LATEST_FILE).write_text("2")
    resumed = launch(1, [*FLAGS, "--load", str(ckpt)], tmp_path / "b.jsonl")
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    ref = [r["lm_loss"] for r in reference[8]][2:]
    mine = resumed.losses()
    assert len(mine) == 2 and all(abs(a - b) <= 1e-5 * abs(b) for a, b in zip(mine, ref)), (
        mine, ref)


@pytest.mark.multiprocess
@pytest.mark.timeout(300)
def test_sharded_experts_survive_their_unit_and_come_back_to_it(reference, tmp_path):
    """DP 8 at EP 2 with the distributed optimizer in two instances of two units: each expert's
    state in two shards per instance. Rank 2 dies in a backward of iteration 3 and takes unit 1:
    its instance's survivors, replicas 0 and 1, take the dead ranges of the dense and of their
    experts' state from the other instance. A replacement starts, unit 1 re-forms and its
    replicas take their ranges back (the experts' from holders of the same experts); then the
    gradients are reduce-scattered again. The losses and norms stay the failure-free ones."""
    run = launch(8, [*FLAGS, *EP2, *LONG, *DISTOPT, "--num-distributed-optimizer-instances", "2",
                     "--inject-fault", "kill:rank=2,iter=3,phase=backward"],
                 tmp_path / "metrics.jsonl", timeout=240,
                 launcher_args=["--max-replacements", "1"])
    records = unit_1_grown_back(run, [0, 1, 4, 5, 6, 7], 8)
    log = run.stdout + run.stderr

    def received(holders: str, units: str) -> list[str]:
        return re.findall(r"rank (\d+): distributed optimizer: \d+ parameters' state held for "
                          rf"live holders \[{holders}\] \(experts: units \[{units}\]\), "
                          r"[\d.]+ MiB received", log)
    assert sorted(received("0, 1, 4, 5, 6, 7", "0, 2, 3")) == ["0", "1"], log[-3000:]
    assert {"2", "3"} <= set(received("0, 1, 2, 3, 4, 5, 6, 7", "0, 1, 2, 3")), log[-3000:]
    assert records[-1].get("reduce_scattered") and not records[2].get("reduce_scattered")
    for mine, ref in zip(records, reference["long"], strict=True):
        assert close(mine, ref, "lm_loss") and close(mine, ref, "grad_norm"), (mine, ref)


@pytest.mark.multiprocess
@pytest.mark.timeout(300)
def test_a_unit_grows_back_each_replica_from_a_holder_of_its_experts(reference, tmp_path):
    """DP 4 at EP 2: rank 2 dies in iteration 3, its unit's other rank waits as a spare, a
    replacement starts; after iteration 4 the unit re-forms, replica 2 taking replica 0's state
    and replica 3 replica 1's (the experts it holds), and the losses stay the failure-free ones.
    Evaluations every 2 iterations are voted on by unit."""
    run = launch(4, [*FLAGS, *EP2, *LONG, *CHECKED, "--eval-interval", "2",
                     "--inject-fault", "kill:rank=2,iter=3,phase=forward",
                     "--inject-fault", "slow:rank=1,seconds=0.15,iter=4,phase=forward"],
                 tmp_path / "metrics.jsonl", timeout=240,
                 launcher_args=["--max-replacements", "1"])
    records = unit_1_grown_back(run, [0, 1], 4)
    assert "rank 3: waiting as a spare" in run.stdout
    # evaluations, voted on by unit: before, during and after the unit's absence
    assert len([r for r in run.records if "valid_lm_loss" in r]) == 4, run.stdout[-3000:]
    for mine, ref in zip(records, reference["long"], strict=True):
        assert close(mine, ref, "lm_loss"), (mine, ref)  # one donor for both: 1e-3 off
    # the weights agreed after every iteration, among the replicas holding the same experts
    assert [r.get("weights_checked_after") for r in records[1:]] == list(range(1, 8))


@pytest.mark.multiprocess
@pytest.mark.timeout(300)
def test_a_corrupted_expert_rank_is_caught_by_its_expert_peer(tmp_path):
    """DP 4 at EP 2: a weight of rank 3 changes before iteration 3's reduction; replica 1, which
    holds the same experts, disagrees, and every rank stops."""
    run = launch(4, [*FLAGS, *EP2, *CHECKED, "--inject-fault",
                     "corrupt:rank=3,iter=3,phase=dp_reduce"], tmp_path / "m.jsonl",
                 launcher_args=[])
    assert run.returncode != 0
    assert run.stdout.count("stopping: after iteration 2 the data-parallel replicas hold "
                            "different weights") == 4, run.stdout[-3000:]
