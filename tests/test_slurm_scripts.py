"""The SLURM scripts, tested without SLURM: stub `scontrol`/`srun` on PATH and fake SLURM_* env.

What this proves: the scripts parse, every node derives the same master address, ports and token
from SLURM's variables, the sbatch script asks srun for one task per node that may fail alone, user
errors exit 2 with one line, and launch_node.sh really trains the tiny CPU config on this machine
(one node). What it cannot prove: behaviour on a real SLURM cluster.
"""
from __future__ import annotations

import json
import os
import re
import shlex
import socket
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
SLURM_DIR = REPO / "scripts" / "slurm"
LAUNCH_NODE = SLURM_DIR / "launch_node.sh"
SBATCH = SLURM_DIR / "pretrain_gpt.sbatch"
CONFIGS = sorted((REPO / "scripts" / "configs").glob("*.sh"))
CONFIG_ARRAYS = ("MODEL_ARGS", "PARALLEL_ARGS", "BATCH_ARGS", "OPT_ARGS", "DATA_ARGS", "CKPT_ARGS",
                 "LOG_ARGS", "PRECISION_ARGS")


def stub(directory: Path, name: str, body: str) -> None:
    path = directory / name
    path.write_text("#!/usr/bin/env bash\n" + body)
    path.chmod(0o755)


@pytest.fixture
def stubs(tmp_path) -> Path:
    """`scontrol show hostnames` answers node01, node02; `srun` records its options, then runs the
    command once per node with SLURM_NODEID set, as srun --ntasks-per-node=1 would."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    stub(bin_dir, "scontrol", 'printf "%s\\n" ${STUB_HOSTS:-node01 node02}\n')
    stub(bin_dir, "srun", 'printf "%s\\n" "$@" > "$STUB_SRUN_LOG"\n'
                          'printf "%s" "$RECOVER_JOB_TOKEN" > "$STUB_SRUN_LOG.token"\n'
                          'while [[ "${1:-}" == --* ]]; do shift; done\n'
                          'for ((id = 0; id < SLURM_NNODES; id++)); do\n'
                          '    SLURM_NODEID=$id "$@" || exit $?\n'
                          'done\n')
    return bin_dir


def clean_env(bin_dir: Path, **settings: str) -> dict[str, str]:
    """This process's env without anything SLURM/launcher related, plus the stubs and settings."""
    env = {k: v for k, v in os.environ.items()
           if not k.startswith(("SLURM_", "RECOVER_", "MASTER_", "CONFIG", "DRY_RUN"))}
    env.update(PATH=f"{bin_dir}{os.pathsep}{env.get('PATH', '')}", OMP_NUM_THREADS="1",
               PYTHONWARNINGS="ignore", PYTHON=sys.executable)
    env.update(settings)
    return env


def run_bash(script: Path, env: dict[str, str], *args: str, timeout: float = 60
             ) -> subprocess.CompletedProcess:
    return subprocess.run(["bash", str(script), *args], env=env, capture_output=True, text=True,
                          timeout=timeout, cwd=REPO)


def flag(cmd: list[str], name: str) -> str:
    return cmd[cmd.index(name) + 1]


def config_args(config: Path) -> list[str]:
    """The config's arrays in order, read by bash itself (independently of launch_node.sh)."""
    listing = " ".join(f'"${{{a}[@]}}"' for a in CONFIG_ARRAYS)
    out = subprocess.run(["bash", "-c", f'source "$1"; printf "%s\\n" {listing}', "_", str(config)],
                         env={"PATH": os.environ["PATH"], "CKPT_DIR": "/ckpt"},
                         capture_output=True, text=True, check=True)
    return out.stdout.splitlines()


@pytest.mark.parametrize("script", [SBATCH, LAUNCH_NODE, *CONFIGS], ids=lambda p: p.name)
def test_scripts_parse(script):
    result = subprocess.run(["bash", "-n", str(script)], capture_output=True, text=True)
    assert result.returncode == 0, result.stderr


def test_sbatch_directives_keep_the_job_alive_after_a_task_dies():
    directives = []
    for line in SBATCH.read_text().splitlines()[1:]:
        if line.strip() and not line.startswith("#"):
            break  # sbatch reads #SBATCH lines only before the first command
        if line.startswith("#SBATCH"):
            directives.append(line.split()[1])
    assert "--no-kill" in directives
    assert "--ntasks-per-node=1" in directives
    assert not any(d.startswith("--gpus") for d in directives)  # GPUS_PER_NODE: the environment's
    for script in (SBATCH, LAUNCH_NODE):  # what tests/test_slurm_real.py verifies, and what not
        assert "VERIFIED ON A REAL SLURM" in script.read_text()
        assert "NOT VERIFIED on several machines" in script.read_text()


def test_gpus_per_node_comes_from_the_environment(stubs, tmp_path):
    srun_log = tmp_path / "srun.args"
    base = dict(SLURM_NNODES="1", SLURM_JOB_NODELIST="node01", SLURM_JOB_ID="7",
                SLURM_SUBMIT_DIR=str(REPO), CONFIG="tiny_cpu", CKPT_DIR="/ckpt", DRY_RUN="1",
                STUB_SRUN_LOG=str(srun_log))
    unallocated = run_bash(SBATCH, clean_env(stubs, **base, GPUS_PER_NODE="8"))
    assert unallocated.returncode == 2
    assert unallocated.stderr.count("\n") == 1 and "SBATCH_GPUS_PER_NODE=8" in unallocated.stderr
    allocated = run_bash(SBATCH, clean_env(stubs, **base, GPUS_PER_NODE="8", SLURM_GPUS_ON_NODE="8"))
    assert allocated.returncode == 0, allocated.stderr
    assert "--gpus-per-node=8" in srun_log.read_text().splitlines()
    cpu = run_bash(SBATCH, clean_env(stubs, **base))  # the default: no GPU request at all
    assert cpu.returncode == 0, cpu.stderr
    assert not any(a.startswith("--gpus") for a in srun_log.read_text().splitlines())


def test_sbatch_starts_one_launcher_per_node_with_shared_settings(stubs, tmp_path):
    srun_log = tmp_path / "srun.args"
    env = clean_env(stubs, SLURM_NNODES="2", SLURM_JOB_NODELIST="node[01-02]", SLURM_JOB_ID="4242",
                    SLURM_SUBMIT_DIR=str(REPO), SLURM_CPUS_PER_TASK="4", CONFIG="tiny_cpu",
                    CKPT_DIR="/ckpt", DRY_RUN="1", STUB_SRUN_LOG=str(srun_log))
    result = run_bash(SBATCH, env, "--train-iters", "7")
    assert result.returncode == 0, result.stderr
    srun_args = srun_log.read_text().splitlines()
    assert {"--ntasks-per-node=1", "--kill-on-bad-exit=0", "--ntasks=2"} <= set(srun_args)
    token = Path(f"{srun_log}.token").read_text()
    assert re.fullmatch(r"[0-9a-f]{32}", token), token  # generated once, exported to every node

    commands = [shlex.split(line) for line in result.stdout.splitlines() if line.strip()]
    assert len(commands) == 2
    assert [flag(c, "--node-rank") for c in commands] == ["0", "1"]
    for cmd in commands:
        assert cmd[:3] == [sys.executable, "-m", "recover_patches.launch"]
        assert flag(cmd, "--nnodes") == "2" and flag(cmd, "--master-addr") == "node01"
        assert flag(cmd, "--master-port") == str(20000 + 4242)
        assert flag(cmd, "--coordinator-port") == str(20000 + 4242 + 1)
        assert token not in " ".join(cmd)  # the secret travels in the env, not on a command line
        script = cmd.index(str(REPO / "pretrain_gpt_recover.py"))
        expected = config_args(REPO / "scripts" / "configs" / "tiny_cpu.sh")
        assert cmd[script + 1:] == expected + ["--train-iters", "7"]


def test_spare_nodes_start_standby_launchers_for_the_training_nodes_world(stubs, tmp_path):
    env = clean_env(stubs, SLURM_NNODES="3", SLURM_JOB_NODELIST="node[01-03]", SLURM_JOB_ID="5",
                    SLURM_SUBMIT_DIR=str(REPO), CONFIG="tiny_cpu", CKPT_DIR="/ckpt", DRY_RUN="1",
                    SPARE_NODES="1", STUB_HOSTS="node01 node02 node03",
                    STUB_SRUN_LOG=str(tmp_path / "srun.args"))
    result = run_bash(SBATCH, env)
    assert result.returncode == 0, result.stderr
    commands = [shlex.split(line) for line in result.stdout.splitlines() if line.strip()]
    assert [("--standby" in c, flag(c, "--node-rank"), flag(c, "--nnodes")) for c in commands] == [
        (False, "0", "2"), (False, "1", "2"), (True, "0", "2")]
    assert {flag(c, "--coordinator-port") for c in commands} == {str(20000 + 5 + 1)}
    assert "standby node 0/1" in result.stderr


def test_an_etcd_endpoint_makes_every_node_a_candidate_coordinator(stubs, tmp_path):
    env = clean_env(stubs, **NODE_ENV, RDZV_ENDPOINT="e1:2379,e2:2379,e3:2379")
    result = run_bash(LAUNCH_NODE, env)
    assert result.returncode == 0, result.stderr
    cmd = shlex.split(result.stdout)
    assert flag(cmd, "--rdzv-backend") == "etcd" and flag(cmd, "--rdzv-id") == "recover-7"
    assert flag(cmd, "--rdzv-endpoint") == "e1:2379,e2:2379,e3:2379"
    assert flag(cmd, "--local-addr") == socket.gethostname()
    # standby nodes follow the elected coordinator: the same etcd flags, and --standby
    spare = run_bash(SBATCH, clean_env(stubs, SLURM_NNODES="3", SLURM_JOB_NODELIST="node[01-03]",
                                       SLURM_JOB_ID="5", SLURM_SUBMIT_DIR=str(REPO), DRY_RUN="1",
                                       CONFIG="tiny_cpu", CKPT_DIR="/ckpt", SPARE_NODES="1",
                                       RDZV_ENDPOINT="e1", STUB_HOSTS="node01 node02 node03",
                                       STUB_SRUN_LOG=str(tmp_path / "srun.args")))
    assert spare.returncode == 0, spare.stderr
    commands = [shlex.split(line) for line in spare.stdout.splitlines() if line.strip()]
    assert [("--standby" in c, flag(c, "--rdzv-backend")) for c in commands] == [
        (False, "etcd"), (False, "etcd"), (True, "etcd")]


def test_sbatch_refuses_a_missing_config_before_srun(stubs, tmp_path):
    srun_log = tmp_path / "srun.args"
    env = clean_env(stubs, SLURM_NNODES="2", SLURM_SUBMIT_DIR=str(REPO), STUB_SRUN_LOG=str(srun_log))
    result = run_bash(SBATCH, env)
    assert result.returncode == 2
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and "CONFIG" in lines[0], result.stderr
    assert not srun_log.exists()


NODE_ENV = {"SLURM_NNODES": "2", "SLURM_NODEID": "0", "SLURM_JOB_NODELIST": "node[01-02]",
            "SLURM_JOB_ID": "7", "RECOVER_JOB_TOKEN": "t0ken", "CONFIG": "tiny_cpu",
            "CKPT_DIR": "/ckpt", "DRY_RUN": "1"}


@pytest.mark.parametrize("change, named", [
    ({"SLURM_NODEID": None}, "SLURM_NODEID"),
    ({"SLURM_NODEID": "2"}, "SLURM_NODEID"),
    ({"RECOVER_JOB_TOKEN": None}, "RECOVER_JOB_TOKEN"),
    ({"CONFIG": "no_such_config"}, "CONFIG=no_such_config"),
    ({"CONFIG": "gpt3_175b"}, "DATA_PATH"),  # the config needs it and nobody set it
    ({"STUB_HOSTS": " "}, "SLURM_JOB_NODELIST"),
    ({"SPARE_NODES": "2"}, "SPARE_NODES=2"),  # no node would train
])
def test_launch_node_user_errors_exit_2_naming_the_setting(stubs, change, named):
    settings = {**NODE_ENV, **change}
    env = clean_env(stubs, **{k: v for k, v in settings.items() if v is not None})
    result = run_bash(LAUNCH_NODE, env)
    assert result.returncode == 2, result.stdout + result.stderr
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("launch_node.sh: error:") and named in lines[0]
    assert result.stdout == ""


def session_alive(pgid: int) -> bool:
    try:
        os.killpg(pgid, 0)
        return True
    except ProcessLookupError:
        return False


@pytest.mark.multiprocess
@pytest.mark.timeout(300)
def test_launch_node_trains_the_tiny_config_on_one_fake_node(stubs, tmp_path):
    metrics = tmp_path / "metrics.jsonl"
    env = clean_env(stubs, SLURM_NNODES="1", SLURM_NODEID="0", SLURM_JOB_NODELIST="localhost",
                    STUB_HOSTS="localhost", CONFIG="tiny_cpu", CKPT_DIR=str(tmp_path / "ckpt"),
                    NPROC_PER_NODE="2")
    # 3 iterations; warmup shortened so it stays below the decay length
    cmd = ["bash", str(LAUNCH_NODE), "--train-iters", "3", "--lr-warmup-iters", "1",
           "--metrics-file", str(metrics)]
    proc = subprocess.Popen(cmd, env=env, cwd=tmp_path, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, start_new_session=True)
    try:
        out, err = proc.communicate(timeout=240)
        deadline = time.monotonic() + 10  # the launcher stops its coordinator before exiting
        while session_alive(proc.pid) and time.monotonic() < deadline:
            time.sleep(0.1)
        leftovers = session_alive(proc.pid)
    finally:
        if session_alive(proc.pid):
            os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
    assert proc.returncode == 0, out[-2000:] + err[-3000:]
    assert not leftovers, "processes of the job outlived the launcher"
    assert "coordinator pid" in err  # node 0's launcher started the coordinator
    records = [json.loads(line) for line in metrics.read_text().splitlines()]
    train = [r for r in records if "lm_loss" in r]
    assert [r["iteration"] for r in train] == [1, 2, 3]
    m = 16 // 2  # tiny_cpu: global batch 16, micro batch 2
    for r in train:
        assert r["microbatches"] == m and r["live_replicas"] == [0, 1]
        assert r["id_sum"] == sum(range((r["iteration"] - 1) * m, r["iteration"] * m))
    assert (tmp_path / "ckpt" / "iter_0000003").is_dir()  # tiny_cpu's CKPT_ARGS were passed


def test_the_coordinator_command_runs_the_layer1_coordinator(tmp_path):
    """`python -m recover_patches.collectives.coordinator` (what `recover-coordinator` runs)
    reaches the real command line: its own user error."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("RECOVER_")}
    env["OMP_NUM_THREADS"] = "1"
    result = subprocess.run([sys.executable, "-m", "recover_patches.collectives.coordinator",
                             "--port", "0", "--world-size", "1"], env=env, cwd=tmp_path, capture_output=True,
                            text=True, timeout=120)
    assert result.returncode == 2 and "no job token" in result.stderr, result.stderr
