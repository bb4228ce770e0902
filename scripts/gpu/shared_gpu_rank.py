"""One rank of pretrain_gpt_recover.py on a GPU that several ranks share (the launcher's script).

    python -m recover_patches.launch --nproc-per-node 4 ... scripts/gpu/shared_gpu_rank.py \
        pretrain_gpt_recover.py <Megatron flags>

NCCL refuses two ranks of one communicator on one GPU unless each looks like its own host and
their traffic goes over sockets: each rank gets its own NCCL_HOSTID (its rank and incarnation),
NCCL over the loopback interface with peer-to-peer, shared-memory, InfiniBand and NVLink-SHARP
transports off, and every rank uses GPU 0 (LOCAL_RANK=0 in its own process only).

With RECOVER_COUNT_SYNCS=DIR, torch.cuda.set_sync_debug_mode("warn") is on and the rank writes
how many synchronizing CUDA calls it made to DIR/syncs.<rank>.<incarnation> when it exits.
"""
from __future__ import annotations

import atexit
import os
import runpy
import sys
import warnings

rank, incarnation = os.environ["RANK"], os.environ.get("RECOVER_INCARNATION", "0")
os.environ.update({
    "NCCL_HOSTID": f"recover-rank{rank}-inc{incarnation}",
    "NCCL_SOCKET_IFNAME": "lo", "NCCL_IB_DISABLE": "1", "NCCL_NVLS_ENABLE": "0",
    "NCCL_P2P_DISABLE": "1", "NCCL_SHM_DISABLE": "1", "NCCL_CUMEM_ENABLE": "0",
    "LOCAL_RANK": "0",
})
count_dir = os.environ.get("RECOVER_COUNT_SYNCS")
if count_dir:
    import torch
if count_dir and torch.cuda.is_available():  # (on CPU the harness runs as a dry run of itself)
    syncs = [0]
    shown = warnings.showwarning

    def count(message, category, filename, lineno, file=None, line=None):
        if "synchronizing" in str(message).lower():
            syncs[0] += 1
            return
        shown(message, category, filename, lineno, file, line)
    warnings.showwarning = count
    warnings.simplefilter("always")  # every synchronizing call, not only the first per place
    torch.cuda.set_sync_debug_mode("warn")

    @atexit.register
    def _write() -> None:
        with open(os.path.join(count_dir, f"syncs.{rank}.{incarnation}"), "w") as f:
            f.write(str(syncs[0]))

script, sys.argv = sys.argv[1], sys.argv[1:]
runpy.run_path(script, run_name="__main__")
