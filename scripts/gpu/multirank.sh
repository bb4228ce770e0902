#!/usr/bin/env bash
# Multi-rank NCCL on one GPU: 4 and 8 ranks share it, each with its own NCCL_HOSTID,
# NCCL over sockets on loopback (scripts/gpu/shared_gpu_rank.py). About 10 minutes; add
# --survive-minutes 10 for the long survival run (another ~12 minutes).
#   bash scripts/gpu/multirank.sh [--quick] [--survive-minutes M]   # results in ${OUT:-runs/gpu}/multirank
# Packages: see scripts/gpu/env.sh (the machine's CUDA torch; wheels from .whl/ offline).
set -euo pipefail
source "$(dirname "$0")/env.sh"
out="${OUT:-runs/gpu}/multirank"
mkdir -p "$out"
python3 scripts/gpu/multirank.py --out "$out" "$@" 2>&1 | tee "$out/multirank.txt"
