#!/usr/bin/env bash
# The GPU checks, for a machine with one CUDA GPU (about 10 minutes): the gpu-marked tests, then
# the throughput benchmark against megatron-core's own schedule + DDP + optimizer.
#   bash scripts/gpu/check.sh            # results in runs/gpu/
# It installs torch with CUDA into .venv-gpu (not the CPU .venv the tests use).
set -euo pipefail
cd "$(dirname "$0")/../.."
venv="${RECOVER_GPU_VENV:-.venv-gpu}"
if [ ! -x "$venv/bin/python" ]; then
    python3 -m venv "$venv"
    "$venv/bin/pip" install --quiet --upgrade pip
    "$venv/bin/pip" install --quiet torch==2.13.0   # the CUDA build on a Linux GPU machine
    "$venv/bin/pip" install --quiet -e ".[test]"
fi
# shellcheck disable=SC1091
source "$venv/bin/activate"
mkdir -p runs/gpu
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv | tee runs/gpu/device.txt
python -c "import torch; print('torch', torch.__version__, 'cuda', torch.version.cuda, \
'nccl', torch.cuda.nccl.version())" | tee -a runs/gpu/device.txt
python -m pytest -q -p no:cacheprovider -m gpu tests 2>&1 | tee runs/gpu/tests.txt
python scripts/bench/gpu_throughput.py --out runs/gpu 2>&1 | tee runs/gpu/throughput.txt
