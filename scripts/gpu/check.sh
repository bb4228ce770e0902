#!/usr/bin/env bash
# The GPU checks, for a machine with one CUDA GPU (about 10 minutes): the gpu-marked tests, then
# the throughput benchmark against megatron-core's own schedule + DDP + optimizer.
#   bash scripts/gpu/check.sh            # results in ${OUT:-runs/gpu}/
# Packages: see scripts/gpu/env.sh (the machine's CUDA torch; wheels from .whl/ offline).
set -euo pipefail
source "$(dirname "$0")/env.sh"
out="${OUT:-runs/gpu}"
mkdir -p "$out"
record_device "$out"
status=0
python3 -m pytest -q -p no:cacheprovider -m gpu tests 2>&1 | tee "$out/tests.txt" || status=1
python3 scripts/bench/gpu_throughput.py --out "$out" 2>&1 | tee "$out/throughput.txt" || status=1
exit "$status"
