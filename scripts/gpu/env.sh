# Sourced by scripts/gpu/*.sh: the machine's python3 with its CUDA torch (not the pinned CPU .venv);
# a machine without network gets the other packages as wheels in .whl/, made where pip works:
#   pip download --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
#       --platform manylinux_2_28_x86_64 --platform manylinux2014_x86_64 \
#       --platform manylinux_2_5_x86_64 -d .whl \
#       megatron-core==0.16.1 pytest-timeout py-spy   # py-spy: a timed-out run's native stacks
cd "$(dirname "${BASH_SOURCE[0]}")/../.."
if compgen -G ".whl/*.whl" > /dev/null; then
    python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/recover-site .whl/*.whl
    export PYTHONPATH="/tmp/recover-site:${PYTHONPATH:-}" PATH="/tmp/recover-site/bin:$PATH"
fi
export PYTHONPATH="$PWD:${PYTHONPATH:-}" PYTHONUNBUFFERED=1

record_device() {  # $1 = results folder: the GPU, driver and package versions, and the load
    nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv | tee "$1/device.txt"
    python3 -c "import torch, megatron.core as m; print('torch', torch.__version__, 'cuda', \
torch.version.cuda, 'nccl', torch.cuda.nccl.version(), 'megatron-core', m.__version__)" \
        | tee -a "$1/device.txt"
    uptime | tee -a "$1/device.txt"
}
