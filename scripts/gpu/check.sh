#!/usr/bin/env bash
# The GPU checks, for a machine with one CUDA GPU (about 10 minutes): the gpu-marked tests, then
# the throughput benchmark against megatron-core's own schedule + DDP + optimizer.
#   bash scripts/gpu/check.sh            # results in ${OUT:-runs/gpu}/
# Uses the machine's python3 with its CUDA build of torch (it is not the pinned CPU .venv). A
# machine without network gets the other packages as wheels in .whl/, made where pip works:
#   pip download --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
#       --platform manylinux_2_28_x86_64 --platform manylinux2014_x86_64 -d .whl \
#       megatron-core==0.16.1 pytest-timeout
set -euo pipefail
cd "$(dirname "$0")/../.."
out="${OUT:-runs/gpu}"
mkdir -p "$out"
if compgen -G ".whl/*.whl" > /dev/null; then
    python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/recover-site .whl/*.whl
    export PYTHONPATH="/tmp/recover-site:${PYTHONPATH:-}"
fi
export PYTHONPATH="$PWD:${PYTHONPATH:-}" PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv | tee "$out/device.txt"
python3 -c "import torch, megatron.core as m; print('torch', torch.__version__, 'cuda', \
torch.version.cuda, 'nccl', torch.cuda.nccl.version(), 'megatron-core', m.__version__)" \
    | tee -a "$out/device.txt"
status=0
python3 -m pytest -q -p no:cacheprovider -m gpu tests 2>&1 | tee "$out/tests.txt" || status=1
python3 scripts/bench/gpu_throughput.py --out "$out" 2>&1 | tee "$out/throughput.txt" || status=1
exit "$status"
