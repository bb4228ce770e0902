"""Nodes as failure domains (`recover_patches/placement.py`, design.md §3): what one node (or
switch) loss costs a layout under each rank order, the order ReCoVer's placement picks, the
start-up line, and the run configuration that carries the choice to every builder. Pure
arithmetic and flag parsing: no process is started (tests/test_node_loss.py starts them)."""
from __future__ import annotations

import pytest

from recover_patches.placement import Nodes, domain_loss, placed, startup_line, switch_of
from recover_patches.topology import Topology


def worst(topology: Topology, nodes: Nodes) -> int:
    return domain_loss(topology, nodes.node_ranks(), "node").worst_units


@pytest.mark.parametrize("tp,pp,dp,per_node,megatron,recover", [
    (4, 2, 2, 8, 2, 1),  # a node of 8 holds stage 0 of both replicas in Megatron's order
    (2, 4, 8, 8, 4, 1),  # 8 nodes: Megatron's order loses 4 of the 8 replicas with one
    (2, 2, 2, 4, 2, 1),  # two launchers of 4: the new user
    (2, 3, 4, 8, 4, 2),  # replicas of 6 on nodes of 8: every node straddles two at best
    (1, 1, 8, 4, 4, 4),  # PP 1: both orders are the same; 4 replicas per node either way
])
def test_one_node_loss_costs_what_each_order_lays_out(tp, pp, dp, per_node, megatron, recover):
    asked = Topology.from_world(tp * pp * dp, tp, pp)
    nodes = Nodes(per_node, asked.world_size)
    assert worst(asked, nodes) == megatron
    chosen = placed(asked, nodes, "recover")
    assert worst(chosen, nodes) == recover
    assert chosen.dp_last == (recover < megatron)  # changed only where it buys survival
    assert placed(asked, nodes, "megatron") == asked
    for r in range(asked.world_size):  # TP stays inside a node: its group is consecutive ranks
        assert len({nodes.node_of(x) for x in chosen.tp_ranks(chosen.replica_of(r),
                                                             chosen.coord(r).pp)}) == 1


def test_the_placement_keeps_the_math_a_rank_computes_only_the_rank_numbers_change():
    """Every (tp, replica, pp) position still exists once: the same groups, on other ranks."""
    asked = Topology.from_world(8, 2, 2)
    chosen = placed(asked, Nodes(4, 8), "recover")
    assert chosen != asked
    positions = {tuple(chosen.coord(r)) for r in range(8)}
    assert positions == {tuple(asked.coord(r)) for r in range(8)}
    assert chosen.replica_ranks(0) == [0, 1, 2, 3] and asked.replica_ranks(0) == [0, 1, 4, 5]


def test_units_are_placed_whole_and_counted_as_units():
    """EP 2: two replicas share their experts and fail as one; a node of 4 at PP 2 holds one
    unit under ReCoVer's order, parts of two under Megatron's."""
    asked = Topology.from_world(16, 1, 2, ep=2)
    nodes = Nodes(4, 16)
    chosen = placed(asked, nodes, "recover")
    loss = domain_loss(chosen, nodes.node_ranks(), "node")
    assert (loss.worst_units, loss.units) == (1, 4) and loss.taken() == "1 of 4 units (2 of 8 replicas)"
    assert worst(asked, nodes) == 2


def test_the_start_up_line_names_the_domains_the_verdict_and_the_placement():
    asked = Topology.from_world(8, 2, 2)
    line = startup_line(asked, Nodes(4, 8), "recover")
    assert line.startswith("failure domains: 2 nodes of 4 ranks, losing one takes at worst 1 of 2 "
                           "replicas: the job survives any one node loss")
    assert "replicas on disjoint nodes, rank order tp-cp-ep-pp-dp" in line
    assert "would lose 2 of 2 replicas" in line
    megatron = startup_line(asked, Nodes(4, 8), "megatron")
    assert "2 of 2 replicas: one node loss ends the job" in megatron
    assert "Megatron's order tp-cp-ep-dp-pp (--recover-placement megatron)" in megatron
    one_node = startup_line(asked, Nodes(8, 8), "recover")  # nothing to place: Megatron's order
    assert "1 node of 8 ranks" in one_node and "rank order tp-cp-ep-dp-pp" in one_node
    copy = startup_line(asked, Nodes(4, 8), "recover", one_optimizer_copy=True)
    assert "any replica loss ends the job" in copy
    fewer = startup_line(asked, Nodes(4, 8), "recover", min_replicas=2)
    assert "one node loss ends the job" in fewer


def test_switches_are_a_second_level_from_slurm_topology_addresses():
    assert switch_of("s0.s3.node7") == "s0.s3" and switch_of("node7") is None
    assert switch_of(None) is None
    asked = Topology.from_world(16, 1, 2)  # DP 8, replicas of 2
    nodes = Nodes(4, 16, ("s0", "s0", "s1", "s1"))
    line = startup_line(asked, nodes, "recover")
    assert "2 switches, losing one takes at worst 4 of 8 replicas: the job survives any one " \
           "switch loss" in line
    with pytest.raises(ValueError):
        Nodes(4, 16, ("s0",))


def test_the_run_configuration_carries_the_placement_to_every_builder():
    """The rank order is chosen once, from the flags and the launcher's LOCAL_WORLD_SIZE: the
    groups (`ParallelConfig.topology`) and the checkpoint's layout agree. Controls: one node,
    --recover-placement megatron and --use-tp-pp-dp-mapping."""
    from megatron.training.arguments import parse_and_validate
    from megatron.training.config import RunLayout
    from megatron.training.config.io import CheckpointConfig
    from megatron.training.config.run import ParallelConfig
    from tests._launch_util import TINY_GPT

    def chosen(*extra: str, per_node: str = "4") -> tuple[bool, bool]:
        args = parse_and_validate([*TINY_GPT, "--train-iters", "2", "--tensor-model-parallel-size",
                                   "2", "--pipeline-model-parallel-size", "2", *extra], world_size=8)
        layout = RunLayout.from_args(args, 8, "cpu", environ={"RANK": "0",
                                                              "LOCAL_WORLD_SIZE": per_node})
        parallel = ParallelConfig.from_args(args, layout.node_size)
        return (parallel.topology(8).dp_last,
                CheckpointConfig.from_args(args, 256, layout).tp_pp_dp_mapping)

    assert chosen() == (True, True)
    assert chosen(per_node="8") == (False, False)
    assert chosen(per_node="3") == (False, False)  # not a divisor: taken as one node
    assert chosen("--recover-placement", "megatron") == (False, False)
    assert chosen("--use-tp-pp-dp-mapping", "--recover-placement", "megatron") == (True, True)
