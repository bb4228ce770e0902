"""One GPU, one rank: the GPU path trains like the CPU path, in every precision, and layer 1's
NCCL groups work (and abort) at size 1. Skipped without CUDA (see conftest)."""
from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from tests._launch_util import TINY_GPT, launch

pytestmark = pytest.mark.gpu

ITERS = ["--train-iters", "6"]


def losses(tmp_path, name: str, *extra: str, cpu: bool = False) -> list[float]:
    env = {"CUDA_VISIBLE_DEVICES": ""} if cpu else None  # hides the GPU: the CPU path
    run = launch(1, [*TINY_GPT, *ITERS, *extra], tmp_path / f"{name}.jsonl", env=env,
                 launcher_args=[])
    assert run.returncode == 0, run.stdout[-2000:] + run.stderr[-3000:]
    assert len(run.losses()) == 6
    return run.losses()


def rel(a: float, b: float) -> float:
    return abs(a - b) / abs(b)


@pytest.mark.multiprocess
@pytest.mark.timeout(600)
def test_fp32_gpu_matches_cpu(tmp_path):
    gpu, cpu = losses(tmp_path, "gpu"), losses(tmp_path, "cpu", cpu=True)
    assert max(rel(g, c) for g, c in zip(gpu, cpu)) <= 1e-4, (gpu, cpu)


@pytest.mark.multiprocess
@pytest.mark.timeout(600)
@pytest.mark.parametrize("precision", [["--bf16"], ["--fp16", "--initial-loss-scale", "256"]])
def test_half_precision_trains_and_tracks_fp32(tmp_path, precision):
    fp32 = losses(tmp_path, "fp32")
    half = losses(tmp_path, "half", *precision)
    assert half[-1] < half[0]
    assert max(rel(h, f) for h, f in zip(half, fp32)) <= 2e-2, (half, fp32)


@pytest.fixture
def recovery_env(monkeypatch):
    """What the launcher gives every rank before any group exists."""
    from recover_patches.collectives import nccl_env
    for key, value in nccl_env.required().items():
        monkeypatch.setenv(key, value)


@pytest.mark.timeout(120)
def test_nccl_size_one_group_reduces_and_aborts(recovery_env):
    from recover_patches.collectives import backends

    group = backends.build("nccl", dist.HashStore(), "one/", 0, 1, build_timeout=60,
                           op_timeout=10)  # connected and warmed up inside the call
    t = torch.ones(4, device="cuda")
    group.allreduce([t]).wait()
    torch.cuda.synchronize()
    assert t.tolist() == [1.0] * 4
    backends.discard(group, [])  # ProcessGroupNCCL.abort() on a background thread
    assert backends.join_discards(timeout=60)


@pytest.mark.timeout(180)
def test_a_member_missing_at_connect_fails_the_build_within_its_bound(recovery_env):
    """NCCL: on a real communicator: member 1 never comes; the build gives up at its deadline
    and aborts the communicator, instead of hanging at the group's first operation."""
    import time

    from recover_patches.collectives import backends

    start = time.monotonic()
    with pytest.raises(RuntimeError):
        backends.build("nccl", dist.HashStore(), "two/", 0, 2, build_timeout=60, op_timeout=5)
    assert time.monotonic() - start < 5 + 1
    # the abort may wait for the stuck init's lock: TORCH_NCCL_NONBLOCKING_TIMEOUT (60 s) bounds it
    assert backends.join_discards(timeout=90)


@pytest.mark.timeout(120)
def test_a_resilient_nccl_group_leaves_the_host_free_and_times_only_what_could_start(
        recovery_env):
    """wait() only makes the stream wait; device time queued *before* a collective does not
    count against its deadline (the CUDA-event ready probe)."""
    import time

    from recover_patches.collectives import backends
    from recover_patches.collectives.process_group import ResilientProcessGroup
    from tests.collectives.fake_world import FakeWorld

    group = ResilientProcessGroup("gpu.one", (0,), membership=FakeWorld().member(0), timeout=10.0,
                                  backend="nccl", verdict_timeout=0.0)
    t = torch.ones(4, device="cuda")
    torch.cuda._sleep(int(2e9))  # about a second of device time queued before the collective
    start = time.perf_counter()
    group.allreduce([t]).wait()
    host = time.perf_counter() - start
    torch.cuda.synchronize()
    assert host < 0.2, f"wait() held the host {host:.3f}s: it must only make the stream wait"
    assert t.tolist() == [1.0] * 4
    group.timeout = 0.3  # far shorter than the compute queued before the next collective
    torch.cuda._sleep(int(4e9))
    group.allreduce([t]).wait()
    torch.cuda.synchronize()
    time.sleep(0.2)  # a sweep or more after the collective ended
    group.raise_latched()  # nothing latched: the collective itself took microseconds
    group.shutdown()
    assert backends.join_discards(timeout=60)


@pytest.mark.multiprocess
@pytest.mark.timeout(600)
def test_distributed_optimizer_with_overlap_trains_like_the_plain_one_on_gpu(tmp_path):
    """One rank: the sharded optimizer's buffers, bucket all-gathers and forward pre-hooks run
    on the device (NCCL groups of size 1) and take the same steps as the plain optimizer."""
    plain = losses(tmp_path, "plain", "--bf16")
    sharded = losses(tmp_path, "sharded", "--bf16", "--use-distributed-optimizer",
                     "--overlap-grad-reduce", "--overlap-param-gather")
    assert max(rel(s, p) for s, p in zip(sharded, plain)) <= 1e-5, (sharded, plain)


@pytest.mark.multiprocess
@pytest.mark.timeout(600)
def test_torch_dist_async_save_resumes_bitwise_on_gpu(tmp_path):
    """bf16 on the device: the async save's host copy is a device-to-host copy here."""
    ck = tmp_path / "ck"
    saved = losses(tmp_path, "saved", "--bf16", "--save", str(ck), "--save-interval", "3",
                   "--async-save")
    (ck / "latest_checkpointed_iteration.txt").write_text("3")
    run = launch(1, [*TINY_GPT, *ITERS, "--bf16", "--load", str(ck)], tmp_path / "resumed.jsonl",
                 launcher_args=[])
    assert run.returncode == 0, run.stderr[-3000:]
    assert run.losses() == saved[3:]
