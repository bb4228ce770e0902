#!/usr/bin/env bash
# One node's share of a ReCoVer job under SLURM: run once per node (srun --ntasks-per-node=1, see
# pretrain_gpt.sbatch). It starts `python -m recover_patches.launch`, which forks this node's ranks;
# on node 0 the launcher also starts the membership coordinator (design.md §6). A rank that dies does
# not take the others down: neither the launcher nor srun (--kill-on-bad-exit=0) kills the step.
#
# VERIFIED ON A REAL SLURM (tests/test_slurm_real.py), three SLURM nodes on one machine, each a
# network namespace with its own address, host name and slurmd: a kill survived, the last replica
# lost, scancel --signal=TERM, a standby node taking over a lost node (RDZV_ENDPOINT: etcd on each
# node, the coordinator elected). NOT VERIFIED on several machines; other command lines are
# checked with a stub `scontrol` (tests/test_slurm_scripts.py).
#
# Usage: bash scripts/slurm/launch_node.sh [extra pretrain_gpt_recover.py flags...]
#   (extra flags come after the config's, so they win: e.g. --train-iters 10)
# From SLURM:  SLURM_NNODES (nnodes), SLURM_NODEID (node rank), SLURM_JOB_NODELIST (the master
#              address is its first host, via `scontrol show hostnames`), SLURM_JOB_ID (ports).
# Settings (environment):
#   CONFIG            a name in scripts/configs/ (tiny_cpu, gpt2_345m, gpt3_175b, ...) or a path to
#                     such a file; it may need DATA_PATH, VOCAB_FILE, MERGE_FILE, CKPT_DIR, ...
#   NPROC_PER_NODE    ranks per node (default: SLURM_GPUS_ON_NODE, else 8)
#   SPARE_NODES       standby nodes (default 0): the last SPARE_NODES nodes of the allocation start
#                     only standby processes (launch --standby), which take over the ranks of a lost
#                     node and re-form its replicas; the world is (SLURM_NNODES - SPARE_NODES) x
#                     NPROC_PER_NODE ranks
#   MASTER_PORT       torch.distributed rendezvous port (default: 0 = any free port on one node,
#                     20000 + SLURM_JOB_ID % 20000 on several nodes: the same on every node)
#   COORDINATOR_PORT  coordinator port (default: 0 on one node, MASTER_PORT + 1 on several)
#   RECOVER_JOB_TOKEN the job's shared secret: required with several nodes (the sbatch script
#                     generates and exports it); one node generates its own
#   RDZV_ENDPOINT     etcd members' client addresses (h1:2379,h2:2379,h3:2379): every node's
#                     launcher can then run the coordinator, one elected through etcd, so losing
#                     node 0 is survived (--rdzv-backend etcd, job id recover-SLURM_JOB_ID,
#                     this node's address from `hostname`); standby nodes (SPARE_NODES) follow
#                     the elected coordinator without running for it
#   RECOVER_LAUNCH_ARGS extra launcher flags, split on spaces (e.g. "--rdzv-conf lease_ttl=3")
#   PYTHON            interpreter with this project installed (default: python3)
#   DRY_RUN=1         print the launcher command (shell-quoted) instead of running it
# To keep the coordinator off the training nodes, start it yourself (RECOVER_JOB_TOKEN exported):
#   recover-coordinator --port P --world-size N
# and export RECOVER_COORDINATOR=host:P: every launcher then joins it instead of starting one.
# User errors print one line naming the setting and the fix, and exit 2 before anything starts.
set -euo pipefail

REPO="$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)"
PROG="launch_node.sh"

fail() {  # $1 = the message (names the setting and the fix)
    echo "$PROG: error: $1" >&2
    exit 2
}

for var in SLURM_NNODES SLURM_NODEID SLURM_JOB_NODELIST; do
    [ -n "${!var:-}" ] || fail "$var is not set: run inside a SLURM allocation (sbatch \
scripts/slurm/pretrain_gpt.sbatch) or export SLURM_NNODES, SLURM_NODEID and SLURM_JOB_NODELIST"
done
ALLOCATED="$SLURM_NNODES"
NODE_RANK="$SLURM_NODEID"
[[ "$ALLOCATED" =~ ^[1-9][0-9]*$ && "$NODE_RANK" =~ ^[0-9]+$ && "$NODE_RANK" -lt "$ALLOCATED" ]] \
    || fail "SLURM_NNODES=$ALLOCATED / SLURM_NODEID=$NODE_RANK are not a node count and a node \
index below it"
SPARE_NODES="${SPARE_NODES:-0}"
[[ "$SPARE_NODES" =~ ^[0-9]+$ && "$SPARE_NODES" -lt "$ALLOCATED" ]] || fail "SPARE_NODES=$SPARE_NODES \
must be a whole number below the $ALLOCATED node(s) of the allocation: at least one node trains"
NNODES=$((ALLOCATED - SPARE_NODES))  # training nodes; the standby nodes come after them
rdzv=()
if [ -n "${RDZV_ENDPOINT:-}" ]; then
    rdzv=(--rdzv-backend etcd --rdzv-endpoint "$RDZV_ENDPOINT" --rdzv-id "recover-$SLURM_JOB_ID"
          --local-addr "$(hostname)")
fi
standby=()
if [ "$NODE_RANK" -ge "$NNODES" ]; then
    NODE_RANK=$((NODE_RANK - NNODES))  # this standby node's index: it names its processes
    standby=(--standby)
fi

# The master address: the first host of the allocation, the same answer on every node.
hosts=()
mapfile -t hosts < <(scontrol show hostnames "$SLURM_JOB_NODELIST" 2>/dev/null || true)
[ "${#hosts[@]}" -gt 0 ] && [ -n "${hosts[0]}" ] || fail "\`scontrol show hostnames \
$SLURM_JOB_NODELIST\` printed no host: check SLURM_JOB_NODELIST and that scontrol is on PATH"
MASTER_ADDR="${hosts[0]}"

# Ports: fixed (derived from the job id) when nodes must agree on them, free ones on a single node.
if [ "$ALLOCATED" -gt 1 ]; then
    MASTER_PORT="${MASTER_PORT:-$((20000 + ${SLURM_JOB_ID:-0} % 20000))}"
    COORDINATOR_PORT="${COORDINATOR_PORT:-$((MASTER_PORT + 1))}"
    [ -n "${RECOVER_JOB_TOKEN:-}" ] || fail "RECOVER_JOB_TOKEN is not set: with $ALLOCATED nodes every \
launcher needs the same token; submit through scripts/slurm/pretrain_gpt.sbatch (it generates one) \
or export RECOVER_JOB_TOKEN=\$(od -An -N16 -tx1 /dev/urandom | tr -d ' \\n')"
else
    MASTER_PORT="${MASTER_PORT:-0}"
    COORDINATOR_PORT="${COORDINATOR_PORT:-0}"
fi
NPROC_PER_NODE="${NPROC_PER_NODE:-${SLURM_GPUS_ON_NODE:-8}}"

# The config: a bash file defining MODEL_ARGS, PARALLEL_ARGS, ... arrays (scripts/configs/*.sh).
CONFIG="${CONFIG:-}"
[ -n "$CONFIG" ] || fail "CONFIG is not set: export CONFIG=<name in scripts/configs/, e.g. \
tiny_cpu or gpt3_175b> or CONFIG=/path/to/config.sh"
config_file="$CONFIG"
[ -f "$config_file" ] || config_file="$REPO/scripts/configs/${CONFIG%.sh}.sh"
if [ ! -f "$config_file" ]; then
    known="$(cd "$REPO/scripts/configs" && ls -- *.sh | sed 's/\.sh$//' | tr '\n' ' ')"
    fail "CONFIG=$CONFIG is neither a file nor a config in scripts/configs/: pick one of: ${known% }"
fi
# Source in a subshell first: a variable the config needs but nobody set is named, not expanded to ''.
if ! problem="$( (set -u; source "$config_file") 2>&1 >/dev/null)"; then
    missing="$(sed -n 's/.*: \([A-Za-z_][A-Za-z0-9_]*\): unbound variable.*/\1/p' <<<"$problem")"
    [ -n "$missing" ] && fail "CONFIG=$CONFIG needs $missing: export $missing=... before submitting"
    fail "CONFIG=$CONFIG could not be sourced: $problem"
fi
MODEL_ARGS=() PARALLEL_ARGS=() BATCH_ARGS=() OPT_ARGS=() DATA_ARGS=() CKPT_ARGS=() LOG_ARGS=()
PRECISION_ARGS=()
# shellcheck disable=SC1090
source "$config_file"

read -r -a launch_extra <<<"${RECOVER_LAUNCH_ARGS:-}"
cmd=(
    "${PYTHON:-python3}" -m recover_patches.launch
    --nproc-per-node "$NPROC_PER_NODE" --nnodes "$NNODES" --node-rank "$NODE_RANK"
    --master-addr "$MASTER_ADDR" --master-port "$MASTER_PORT"
    --coordinator-port "$COORDINATOR_PORT" "${standby[@]}" "${rdzv[@]}"
    "${launch_extra[@]}"
    "$REPO/pretrain_gpt_recover.py"
    "${MODEL_ARGS[@]}" "${PARALLEL_ARGS[@]}" "${BATCH_ARGS[@]}" "${OPT_ARGS[@]}"
    "${DATA_ARGS[@]}" "${CKPT_ARGS[@]}" "${LOG_ARGS[@]}" "${PRECISION_ARGS[@]}"
    "$@"
)
export OMP_NUM_THREADS="${OMP_NUM_THREADS:-1}"
# CUDA_DEVICE_MAX_CONNECTIONS is left as the user set it (Megatron-LM's scripts set 1): with 1,
# every stream shares one hardware queue, which 1F1B's p2p survives and the interleaved
# schedule's does not (refused with VP > 1; docs/NCCL.md §8)
export RECOVER_JOB_TOKEN="${RECOVER_JOB_TOKEN:-}"
[ -n "$RECOVER_JOB_TOKEN" ] || unset RECOVER_JOB_TOKEN  # one node: the launcher makes its own

role="node $NODE_RANK/$NNODES"
[ "${#standby[@]}" -eq 0 ] || role="standby node $NODE_RANK/$SPARE_NODES"
echo "[recover.slurm] $role on $(hostname): master $MASTER_ADDR:$MASTER_PORT," \
     "coordinator port $COORDINATOR_PORT, $NPROC_PER_NODE process(es), config $config_file" >&2
if [ "${DRY_RUN:-0}" = 1 ]; then
    printf '%q ' "${cmd[@]}"
    echo
    exit 0
fi
# exec: srun's signals (SIGTERM at the time limit, scancel) reach the launcher, which forwards
# them to the ranks (--exit-signal-handler then saves a checkpoint).
exec "${cmd[@]}"
