"""A whole node lost (design.md §3): TP 2 x PP 2 x DP 2 over two launchers of 4 ranks, as a new
user would start it, node 1 killed with its launcher in iteration 3 (only heartbeats tell).

ReCoVer's placement puts each replica on a node of its own, so replica 0 finishes every
iteration on the failure-free losses (exact reduction: bitwise, against one replica). The
control is Megatron's order (`--recover-placement megatron`): each node holds one stage of both
replicas, the loss leaves no complete replica, and every process ends with status 3 within
T + 5 s of the kill (a rank whose last forwarded beat still said `starting` once kept the owner
waiting for start-up's 10 minutes)."""
from __future__ import annotations

import secrets

import pytest

from tests._launch_util import REPO, TINY_GPT, launch, read_metrics, run_launchers
from tests.test_grow_back import free_port

ITERS, T = 8, 3.0
LAYOUT = ["--tensor-model-parallel-size", "2", "--pipeline-model-parallel-size", "2",
          "--recover-exact-reduction", "--train-iters", str(ITERS)]
TRAJECTORY = ("iteration", "lm_loss", "grad_norm", "microbatches", "tokens", "id_sum", "lr",
              "skipped_iterations", "consumed_samples")

pytestmark = [pytest.mark.multiprocess, pytest.mark.timeout(300)]


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    """One replica, failure-free: with exact reduction DP 2 must match it bit for bit."""
    run = launch(4, [*TINY_GPT, *LAYOUT], tmp_path_factory.mktemp("ref") / "m.jsonl")
    assert run.returncode == 0, run.stderr[-3000:]
    return [{k: r[k] for k in TRAJECTORY} for r in run.records if "lm_loss" in r]


def two_nodes(tmp_path, *extra: str):
    metrics = tmp_path / "metrics.jsonl"
    common = ["--nproc-per-node", "4", "--nnodes", "2", "--master-port", str(free_port()),
              "--coordinator-port", str(free_port()), "--job-token", secrets.token_hex(8)]
    script = [str(REPO / "pretrain_gpt_recover.py"), *TINY_GPT, *LAYOUT, "--recover-timeout",
              str(T), "--metrics-file", str(metrics), "--inject-fault",
              "node:rank=5,iter=3,phase=forward", *extra]
    run = run_launchers({f"node{n}": [*common, "--node-rank", str(n), *script] for n in (0, 1)},
                        limit=180)
    return run, [r for r in read_metrics(metrics) if "lm_loss" in r]


def test_a_lost_node_is_survived_on_the_failure_free_losses(tmp_path, reference):
    run, records = two_nodes(tmp_path)
    everything = run.everything()
    assert run.returncodes == {"node0": 0, "node1": -9}, (run.returncodes, everything[-4000:])
    assert "failure domains: 2 nodes of 4 ranks, losing one takes at worst 1 of 2 replicas: " \
           "the job survives any one node loss" in everything
    assert "replicas on disjoint nodes, rank order tp-cp-ep-pp-dp" in everything
    assert [{k: r[k] for k in TRAJECTORY} for r in records] == reference
    assert records[0]["live_replicas"] == [0, 1] and records[-1]["live_replicas"] == [0]
    assert "dead ranks [4, 5, 6, 7]" in everything  # node 1 is replica 1, whole


def test_with_megatrons_order_the_same_loss_ends_the_job_promptly(tmp_path):
    run, records = two_nodes(tmp_path, "--recover-placement", "megatron")
    everything = run.everything()
    assert run.returncodes == {"node0": 3, "node1": -9}, (run.returncodes, everything[-4000:])
    assert "losing one takes at worst 2 of 2 replicas: one node loss ends the job" in everything
    killed = run.outputs["node1"].first(r"injecting node at iter 3")
    assert killed is not None, everything[-4000:]
    assert run.ended["node0"] - killed <= T + 5.0, (run.ended, killed)
    assert not any(run.left.values()), run.left
    assert len(records) == 2  # iterations 1 and 2 committed; 3 never did
