"""Growing back end to end (design.md §11): a replacement process for a killed rank, and the surviving
ranks of its replica waiting as spares, re-form the replica at an iteration boundary; a donor
replica hands over its live state. The trajectory stays the failure-free one, every replica's
weights stay bitwise equal (checked every iteration), and a join that loses its donor is retried.

A `slow` fault on a rank that never dies keeps the job running long enough for the replacement
process to start (it only costs time: the numbers do not change).
"""
from __future__ import annotations

import os
import re
import secrets
import signal
import socket
import subprocess
import sys

import pytest

from tests._launch_util import REPO, TINY_GPT, launch, read_metrics, run_launchers

ITERS, M = 14, 8
COMMON = [*TINY_GPT, "--train-iters", str(ITERS), "--recover-balance", "even"]
CHECKED = ["--check-weight-hash-across-dp-replicas-interval", "1"]

pytestmark = [pytest.mark.multiprocess, pytest.mark.timeout(600)]  # every test starts a job


def faults(*specs: str) -> list[str]:
    return [arg for spec in specs for arg in ("--inject-fault", spec)]


def run_job(path, *extra: str, replacements: int = 0):
    # one machine plays every node: no limit on the failures of one (`--failure-window 0`)
    return launch(4, [*COMMON, *extra], path / "metrics.jsonl", timeout=300,
                  launcher_args=["--max-replacements", str(replacements), "--failure-window", "0"])


def train_records(run):
    return [r for r in run.records if "lm_loss" in r]


def joins(run):
    return [r["join"] for r in run.records if "join" in r]


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    """Failure-free losses per layout."""
    runs = {}
    for name, layout in (("dp4", []), ("pp2", ["--pipeline-model-parallel-size", "2"])):
        run = run_job(tmp_path_factory.mktemp(name), *layout)
        assert run.returncode == 0, run.stderr[-3000:]
        runs[name] = train_records(run)
    return runs


def assert_failure_free_trajectory(run, reference):
    records = train_records(run)
    assert [r["iteration"] for r in records] == list(range(1, ITERS + 1)), run.stdout[-3000:]
    for mine, ref in zip(records, reference):
        i = mine["iteration"]
        assert mine["microbatches"] == M and mine["id_sum"] == sum(range((i - 1) * M, i * M)), mine
        assert abs(mine["lm_loss"] - ref["lm_loss"]) <= 1e-5 * abs(ref["lm_loss"]), (mine, ref)
    # the weight check ran after every iteration once checking started, joins included
    assert [r.get("weights_checked_after") for r in records[1:]] == list(range(1, ITERS))
    return records


def test_a_replacement_rejoins_and_the_trajectory_is_the_failure_free_one(tmp_path, reference):
    # saving and evaluating every iteration: the joiner takes part in the join iteration's too
    run = run_job(tmp_path, *CHECKED, "--save", str(tmp_path / "ckpt"), "--save-interval", "1",
                  "--eval-interval", "1",
                  *faults("kill:rank=2,iter=3,phase=forward",
                          "slow:rank=1,seconds=0.15,iter=4,phase=forward"), replacements=1)
    assert run.returncode == 0, run.stderr[-3000:]
    records = assert_failure_free_trajectory(run, reference["dp4"])
    assert "abandoned" not in run.stdout, run.stdout[-3000:]  # no checkpoint or join gave up
    assert (tmp_path / "ckpt" / "latest_checkpointed_iteration.txt").read_text().strip() == str(ITERS)
    assert len([r for r in run.records if "valid_lm_loss" in r]) == ITERS
    live = [len(r["live_replicas"]) for r in records]
    assert live[:2] == [4, 4] and live[2] == 3 and live[-1] == 4, live  # 4 -> 3 -> 4
    assert len(joins(run)) == 1, run.stdout[-3000:] + run.stderr[-3000:]
    [join] = joins(run)
    assert join["joined"] == [2] and join["donor"] == 0 and join["bytes_sent"] > 0
    assert "started replacement" in run.stderr and "all 4 rank(s) exited 0" in run.stderr


def test_a_replacement_takes_its_optimizer_shard_back_from_the_instances(tmp_path, reference):
    # --use-distributed-optimizer, K = 2: replica 2's survivor-less instance mate (replica 3)
    # takes the whole state; at the join the replacement gets its slice back by re-sharding
    run = run_job(tmp_path, *CHECKED, "--use-distributed-optimizer",
                  "--num-distributed-optimizer-instances", "2",
                  "--save", str(tmp_path / "ckpt"), "--save-interval", "1",
                  *faults("kill:rank=2,iter=3,phase=forward",
                          "slow:rank=1,seconds=0.15,iter=4,phase=forward"), replacements=1)
    assert run.returncode == 0, run.stderr[-3000:]
    records = assert_failure_free_trajectory(run, reference["dp4"])
    assert "abandoned" not in run.stdout, run.stdout[-3000:]
    assert (tmp_path / "ckpt" / "latest_checkpointed_iteration.txt").read_text().strip() == str(ITERS)
    live = [len(r["live_replicas"]) for r in records]
    assert live[2] == 3 and live[-1] == 4, live
    assert [j["joined"] for j in joins(run)] == [[2]]


def test_a_pipeline_replica_is_re_formed_from_its_waiting_survivor(tmp_path, reference):
    # (1,2,2): replica 1 is rank 1 (stage 0) and rank 3 (stage 1); rank 3 dies in backward
    run = run_job(tmp_path, "--pipeline-model-parallel-size", "2", *CHECKED,
                  *faults("kill:rank=3,iter=3,phase=backward",
                          "slow:rank=0,seconds=0.15,iter=4,phase=forward"), replacements=1)
    assert run.returncode == 0, run.stderr[-3000:]
    records = assert_failure_free_trajectory(run, reference["pp2"])
    assert [len(r["live_replicas"]) for r in records][2] == 1 and records[-1]["live_replicas"] == [0, 1]
    assert "rank 1: waiting as a spare" in run.stdout  # the survivor, not a new process
    assert run.stderr.count("started replacement") == 1 and "rank 3 (killed" in run.stderr
    # the joiners received (ranks 1 and 3), the donor replica's ranks sent: searched in the whole
    # output, as lines of different ranks may arrive cut into each other
    moved = dict(re.findall(r"\[recover\] rank (\d): after iteration \d+, epoch \d+: replicas "
                            r"\[1\] joined \(state from replica 0, [\d.]+ MiB (received|sent)",
                            run.stdout))
    assert moved == {"0": "sent", "1": "received", "2": "sent", "3": "received"}, moved


def test_a_join_that_loses_its_donor_is_retried_and_the_donor_comes_back(tmp_path, reference):
    # slower than the others: two replacements start one after the other before the job ends
    run = run_job(tmp_path, *CHECKED, *faults("kill:rank=2,iter=3,phase=forward",
                                              "kill:rank=0,iter=any,phase=join",
                                              "slow:rank=1,seconds=0.3,iter=4,phase=forward"),
                  replacements=2)
    assert run.returncode == 0, run.stderr[-3000:]
    records = assert_failure_free_trajectory(run, reference["dp4"])
    assert len(joins(run)) == 2, run.stdout[-3000:] + run.stderr[-3000:]
    first, second = joins(run)
    assert first["joined"] == [2] and first["dropped"] == [0] and first["donor"] == 1
    assert first["attempts"] == 2  # the attempt with donor 0 was abandoned
    assert second["joined"] == [0] and second["live"] == [0, 1, 2, 3]
    assert records[-1]["live_replicas"] == [0, 1, 2, 3]


def test_a_join_that_loses_its_joiner_is_retried_with_the_next_replacement(tmp_path, reference):
    """The other side of a join: rank 2's first replacement is killed about to receive the state
    (phase join, incarnation 1). The live ranks' vote aborts that join, and the second
    replacement joins; the trajectory is the failure-free one."""
    run = run_job(tmp_path, *CHECKED, *faults("kill:rank=2,iter=3,phase=forward",
                                              "kill:rank=2,iter=any,phase=join,incarnation=1",
                                              "slow:rank=1,seconds=0.3,iter=4,phase=forward"),
                  replacements=2)
    assert run.returncode == 0, run.stderr[-3000:]
    records = assert_failure_free_trajectory(run, reference["dp4"])
    assert re.search(r"rank 2: injecting kill at iter \d+ phase join", run.stdout)
    first, second = joins(run)
    assert (first["joined"], first["abandoned"]) == ([], [2]), first  # its joiner died
    assert second["joined"] == [2] and second["live"] == [0, 1, 2, 3], second


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def test_a_standby_node_takes_over_a_lost_nodes_ranks(tmp_path, reference):
    # Two training nodes of two ranks and one standby node of two processes, all on this machine.
    # Node 1 (ranks 2 and 3, two whole replicas) dies with its launcher at iteration 3: only
    # heartbeats tell; the standby processes take its slots and re-form both replicas.
    metrics = tmp_path / "metrics.jsonl"
    token, master, coordinator = secrets.token_hex(8), free_port(), free_port()
    common = ["--nproc-per-node", "2", "--nnodes", "2", "--master-port", str(master),
              "--coordinator-port", str(coordinator), "--job-token", token]
    script = [str(REPO / "pretrain_gpt_recover.py"), *COMMON, *CHECKED, "--metrics-file", str(metrics),
              "--recover-timeout", "3",  # the lost node is silent: declared dead after 3.5 s
              *faults("node:rank=3,iter=3,phase=forward",
                      "slow:rank=1,seconds=0.25,iter=4,phase=forward")]
    env = {k: v for k, v in os.environ.items() if not k.startswith("NVTE_")}
    env.update(OMP_NUM_THREADS="1", PYTHONWARNINGS="ignore")
    procs = {}
    try:
        for name, where in (("node0", ["--node-rank", "0"]), ("node1", ["--node-rank", "1"]),
                            ("standby", ["--node-rank", "0", "--standby"])):
            procs[name] = subprocess.Popen(
                [sys.executable, "-m", "recover_patches.launch", *common, *where, *script],
                cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                start_new_session=True)
        out = {name: proc.communicate(timeout=300) for name, proc in procs.items()}
    finally:
        for proc in procs.values():
            try:
                os.killpg(proc.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            proc.wait()
    stdout = "".join(o for o, _ in out.values())
    stderr = "".join(e for _, e in out.values())
    assert procs["node0"].returncode == 0 and procs["standby"].returncode == 0, stderr[-4000:]
    assert procs["node1"].returncode == -signal.SIGKILL  # the lost node
    run = type("Run", (), {"records": read_metrics(metrics), "stdout": stdout})()
    records = assert_failure_free_trajectory(run, reference["dp4"])
    live = [len(r["live_replicas"]) for r in records]
    assert live[:2] == [4, 4] and 2 in live and live[-1] == 4, live
    assert sorted(rank for join in joins(run) for rank in join["joined"]) == [2, 3]
    for rank in (2, 3):
        assert f"takes rank {rank}" in stderr, stderr[-4000:]  # the coordinator's assignment
    # Only liveness can tell (the node's launcher died too, no exit is reported): a silent
    # heartbeat, or a progress mark that stopped while a survivor waited for it, whichever the
    # coordinator's sweep sees first.
    by_liveness = re.findall(r"rank ([23]): no (?:heartbeat|progress)", stderr)
    assert sorted(set(by_liveness)) == ["2", "3"], stderr[-4000:]
    assert not re.search(r"rank [23]: process exited", stderr), stderr[-4000:]
    assert "all 2 standby process(es) exited 0" in out["standby"][1]


def test_a_lost_job_ends_everywhere_with_the_restart_status(tmp_path):
    """PP 2 x DP 2. Rank 3 dies; its replacement and rank 1 re-form replica 1, and rank 0 dies
    as it is about to give them the state: no replica holds the state any more. Every process
    -- the ranks left, both replacements, the standby node's processes and every launcher -- is
    gone within T + 5 s of that death, and each launcher exits 3 (restart from a checkpoint)."""
    token, master, coordinator = secrets.token_hex(8), free_port(), free_port()
    common = ["--master-port", str(master), "--coordinator-port", str(coordinator),
              "--job-token", token, "--nnodes", "1", "--node-rank", "0"]
    script = lost_job_script(tmp_path / "metrics.jsonl")
    run = run_launchers({"node": [*common, "--nproc-per-node", "4", "--max-replacements", "2",
                                  *script],
                         "standby": [*common, "--nproc-per-node", "4", "--standby", *script]},
                        limit=240)
    assert_the_lost_job_ended(run)
    node = run.text("node")
    assert "grow: ranks [1, 3] re-form a replica" in node, node[-4000:]
    assert "the job stopped (no replica holds the training state): exiting" in run.text("standby")


LOST_JOB_T = 3.0  # --recover-timeout of the lost job


def lost_job_script(metrics) -> list[str]:
    """The training script and its flags: PP 2 x DP 2; rank 3 dies at iteration 3, rank 0 as it
    is about to give a joining replica the state (a slow rank 2 keeps the job going meanwhile)."""
    return [str(REPO / "pretrain_gpt_recover.py"), *COMMON, "--metrics-file", str(metrics),
            "--pipeline-model-parallel-size", "2", "--recover-timeout", str(LOST_JOB_T),
            *faults("kill:rank=3,iter=3,phase=forward", "kill:rank=0,iter=any,phase=join",
                    "slow:rank=2,seconds=0.3,iter=4,phase=forward")]


def assert_the_lost_job_ended(run) -> None:
    everything = run.everything()
    killed_at = next((out.first(r"injecting kill at iter \d+ phase join")
                      for out in run.outputs.values()
                      if out.first(r"injecting kill at iter \d+ phase join") is not None), None)
    assert killed_at is not None, everything[-4000:]
    assert set(run.returncodes.values()) == {3}, (run.returncodes, everything[-4000:])
    assert not any(run.left.values()), run.left  # no rank, replacement nor coordinator
    assert max(run.ended.values()) - killed_at <= LOST_JOB_T + 5.0, (run.ended, killed_at)
    assert "job stopped: no complete replica holds the training state" in everything
    # the ones left say why they end: rank 2 (its replica broke) and rank 1 (its join failed)
    for rank in (1, 2):
        assert re.search(rf"rank {rank}: .*stopping: ", everything), everything[-4000:]


def test_a_joiner_that_becomes_the_logging_rank_writes_the_record_its_predecessor_died_before(
        tmp_path, reference):
    """Found by scripts/chaos.py (seed 1). Rank 1 dies at iteration 2 and its replacement waits
    as a spare; rank 2 stalls 6 s in iteration 4's forward (below T), so the grow epoch is
    known by iteration 4's commit and the join follows it. The logging rank 0 dies right after
    that commit, before writing its record; the joiner, now the lowest live rank, writes the
    records from then on, and iteration 4's must be among them: it was a spare then, so it has
    it only from its donor."""
    run = run_job(tmp_path, *CHECKED, *faults("kill:rank=1,iter=2,phase=forward",
                                              "stall:rank=2,iter=4,phase=forward,seconds=6",
                                              "kill:rank=0,iter=4,phase=confirmed"),
                  replacements=2)
    assert run.returncode == 0, run.stderr[-3000:]
    kinds = [("join" if "join" in r else "iteration", r["iteration"]) for r in run.records]
    assert ("join", 4) in kinds, kinds  # the join this test is about happened where planned
    [join] = [r["join"] for r in run.records if "join" in r and r["iteration"] == 4]
    assert join["joined"] == [1], join
    assert_failure_free_trajectory(run, reference["dp4"])
    assert kinds.index(("iteration", 4)) < kinds.index(("join", 4)), kinds


def test_a_join_made_when_the_last_evaluation_fails_does_not_redo_the_save(tmp_path, reference):
    """Found by scripts/chaos.py (seed 11). Rank 1 dies right after the last commit: the last
    save is interrupted, and the survivors re-form their groups and save again. Its
    replacement registers while rank 3 stalls in the evaluation, then rank 3 dies there: the
    evaluation fails and the live ranks take the replacement in at that boundary. The joiner
    must not make that iteration's save and evaluation again (the others made them before the
    join): it used to, alone, and stopped the job with status 3 after the job had completed."""
    from megatron.training.checkpointing import read_latest
    ck = tmp_path / "ck"
    run = run_job(tmp_path, "--save", str(ck), "--save-interval", str(ITERS), "--eval-interval",
                  str(ITERS), *faults(f"kill:rank=1,iter={ITERS},phase=confirmed",
                                      f"stall:rank=3,iter={ITERS},phase=eval,seconds=6",
                                      f"kill:rank=3,iter={ITERS},phase=eval"), replacements=2)
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    assert read_latest(ck) == ITERS
    late = [j for j in joins(run) if j["after"] == "eval"]
    assert late and late[0]["joined"] == [1], joins(run)  # the join this test is about
    assert f"checkpoint of iteration {ITERS} abandoned" in run.stdout  # the first attempt
    assert run.stdout.count(f"saved checkpoint {ck / f'iter_{ITERS:07d}'}") == 1
    # the joiner (rank 1's replacement: the first rank 1 died before the save) saved nothing
    assert f"rank 1: warning: checkpoint of iteration {ITERS} abandoned" not in run.stdout
