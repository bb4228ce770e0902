"""ShardedAdamW (--use-distributed-optimizer): each shard steps its slice of the flat parameter
space and the instance all-gathers the weights; the result, and the checkpointed state, are those
of the unsharded MainParamsAdamW, bitwise."""
from __future__ import annotations

import shutil

import pytest
import torch
import torch.distributed as dist

from megatron.training.optimizer.distributed import ShardedAdamW
from megatron.training.optimizer import MainParamsAdamW
from megatron.training.optimizer.shards import ShardDomain, bucket_ranges
from recover_patches.recovery.grad_buffer import GradBuffer, Scatter, flat_layout
from recover_patches.recovery.reduce import Totals
from tests.gloo_ranks import run_ranks

SHAPES = [(5, 3), (7,), (4, 4), (3,)]  # odd sizes: shard boundaries cut through parameters
HYPER = dict(lr=1e-2, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.1)


def make_params(dtype: torch.dtype) -> list[dict]:
    torch.manual_seed(0)
    params = [torch.nn.Parameter(torch.randn(*s).to(dtype)) for s in SHAPES]
    return [{"params": params[:2], "wd_mult": 1.0}, {"params": params[2:], "weight_decay": 0.0,
                                                     "wd_mult": 0.0}]


def sharded(groups, shard=0, shards=1, group=None) -> ShardedAdamW:
    """Two buckets of 19 and 22 parameters, padded to a multiple of the instance size: shard
    ranges cut through parameters in both."""
    flat = [p for g in groups for p in g["params"]]
    layout = flat_layout(flat, bucket_numel=10, pad_to=shards)
    assert len(layout.buckets) == 2
    return ShardedAdamW(groups, layout=layout, shard=shard, shards=shards,
                        instance_group=group, **HYPER)


def grads_for(step: int) -> list[torch.Tensor]:
    torch.manual_seed(100 + step)
    return [torch.randn(*s) for s in SHAPES]


def assert_same_state(a: dict, b: dict) -> None:
    assert a["optimizer"]["param_groups"] == b["optimizer"]["param_groups"]
    assert sorted(a["optimizer"]["state"]) == sorted(b["optimizer"]["state"])
    for i, s in a["optimizer"]["state"].items():
        for name in ("step", "exp_avg", "exp_avg_sq"):
            assert torch.equal(s[name], b["optimizer"]["state"][i][name]), (i, name)
    assert len(a["fp32_from_fp16_params"]) == len(b["fp32_from_fp16_params"])
    for x, y in zip(a["fp32_from_fp16_params"], b["fp32_from_fp16_params"]):
        assert torch.equal(x, y)


def step_both(plain: MainParamsAdamW, mine: ShardedAdamW, steps: range) -> bool:
    """The same gradients into both; True when their weights are then bitwise equal."""
    for step in steps:
        plain.step(grads_for(step))
        mine.step(grads_for(step))
    return all(torch.equal(p, q) for p, q in zip(plain.model_params, mine.model_params))


def resumed(plain: MainParamsAdamW, mine: ShardedAdamW) -> ShardedAdamW:
    """`mine` restarted from `plain`'s (unsharded) checkpoint: weights first, as the model loads."""
    with torch.no_grad():
        for p, q in zip(plain.model_params, mine.model_params):
            q.copy_(p)
    mine.load_state_dict(plain.state_dict())
    return mine


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_one_shard_steps_and_saves_as_the_unsharded_optimizer(dtype):
    plain, mine = MainParamsAdamW(make_params(dtype), **HYPER), sharded(make_params(dtype))
    assert_same_state(mine.state_dict(), plain.state_dict())  # before any step: no state
    assert step_both(plain, mine, range(3))
    assert_same_state(mine.state_dict(), plain.state_dict())


def test_loads_an_unsharded_state_and_goes_on_identically():
    plain = MainParamsAdamW(make_params(torch.bfloat16), **HYPER)
    plain.step(grads_for(0))
    assert step_both(plain, resumed(plain, sharded(make_params(torch.bfloat16))), range(1, 2))


def _shard_rank(rank: int, dtype: torch.dtype) -> None:
    shards = dist.get_world_size()
    plain = MainParamsAdamW(make_params(dtype), **HYPER)
    mine = sharded(make_params(dtype), rank, shards, dist.group.WORLD)
    assert sum(f.numel() for f in mine.fragments) < sum(p.numel() for p in mine.model_params)
    assert step_both(plain, mine, range(3))
    assert_same_state(mine.state_dict(), plain.state_dict())
    # a checkpoint of any K loads into this K: restart from the unsharded state
    again = resumed(plain, sharded(make_params(dtype), rank, shards, dist.group.WORLD))
    assert step_both(plain, again, range(3, 4))


@pytest.mark.multiprocess
@pytest.mark.timeout(120)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_three_shards_over_gloo_match_the_unsharded_optimizer_bitwise(dtype):
    assert run_ranks(_shard_rank, 3, dtype) == []


def _reshard_rank(rank: int, dtype: torch.dtype) -> None:
    """DP = 4 in K = 2 instances {0, 1}, {2, 3}. Replica 1 is lost after 2 steps: replica 0
    takes the whole state (replica 3 sends the dead slice); after 2 more it rejoins empty-handed
    and gets its slice back. Every step's weights, and the final state, are the unsharded
    optimizer's, bitwise."""
    first, second = dist.new_group([0, 1]), dist.new_group([2, 3])
    survivors, alone = dist.new_group([0, 2, 3]), dist.new_group([0])
    plain = MainParamsAdamW(make_params(dtype), **HYPER)
    mine = sharded(make_params(dtype), rank % 2, 2, first if rank < 2 else second)
    assert step_both(plain, mine, range(2))
    if rank == 1:  # lost: what it held is out of date by the time it comes back
        mine.forget()
        plain.step(grads_for(2))
        plain.step(grads_for(3))
    else:
        mine.instance_group = alone if rank == 0 else second
        mine.reshard(ShardDomain((0, 2, 3), 2, survivors))
        if rank == 0:
            assert mine.ranges == mine.layout.buckets
        assert step_both(plain, mine, range(2, 4))
    mine.instance_group = first if rank < 2 else second
    mine.reshard(ShardDomain((0, 1, 2, 3), 2, dist.group.WORLD))
    assert step_both(plain, mine, range(4, 6))
    assert_same_state(mine.state_dict(), plain.state_dict())


def _scatter_rank(rank: int) -> None:
    """DP = 4 in instances {0, 1}, {2, 3}: each bucket is reduce-scattered in the instance and
    summed across it; every rank's ranges hold the sum of all four ranks' gradients, and the tail
    the exact totals."""
    instances = [dist.new_group([0, 1]), dist.new_group([2, 3])]
    places = [dist.new_group([0, 2]), dist.new_group([1, 3])]
    params = [torch.nn.Parameter(torch.zeros(*s)) for s in SHAPES]
    layout = flat_layout(params, bucket_numel=10, pad_to=2)
    buffer = GradBuffer(params, replicas=4, dp_group=dist.group.WORLD, layout=layout)
    buffer.scatter = Scatter(instances[rank // 2], places[rank % 2], rank % 2, 2)
    grads = [torch.Generator().manual_seed(r) for r in range(4)]
    every = [torch.randn(layout.numel, generator=g) for g in grads]
    buffer.local[:layout.numel].copy_(every[rank])
    reduced = buffer.reduce(Totals.of_ids([rank], 10 + rank, 1.5), rank, 0.0)
    assert reduced.scattered and reduced.totals == Totals.of_ids([0, 1, 2, 3], 46, 6.0)
    expected = sum(every)
    for lo, hi in bucket_ranges(layout.buckets, rank % 2, 2):
        assert torch.allclose(buffer.reduced[lo:hi], expected[lo:hi], atol=1e-6), (lo, hi)


@pytest.mark.multiprocess
@pytest.mark.timeout(120)
def test_buckets_are_reduce_scattered_into_the_ranges_and_summed_across_instances():
    assert run_ranks(_scatter_rank, 4) == []


@pytest.mark.multiprocess
@pytest.mark.timeout(120)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_resharding_after_a_loss_and_a_rejoin_keeps_the_unsharded_trajectory(dtype):
    assert run_ranks(_reshard_rank, 4, dtype) == []


@pytest.mark.multiprocess
@pytest.mark.timeout(300)
def test_a_sharded_checkpoint_resumes_without_sharding_on_the_trajectory(tmp_path):
    """Saved by (1,1,4) with K = 2 (the state gathered from the shards), resumed unsharded: the
    Adam moments came back, so iterations 4..6 follow the uninterrupted single-process run."""
    from tests._launch_util import TINY_GPT, launch

    common = [*TINY_GPT, "--train-iters", "6"]
    reference = launch(1, common, tmp_path / "ref.jsonl")
    ckpt = str(tmp_path / "ckpt")
    first = launch(4, [*common, "--use-distributed-optimizer", "--num-distributed-optimizer-instances",
                       "2", "--save", ckpt, "--save-interval", "3", "--exit-interval", "3"],
                   tmp_path / "first.jsonl")
    resumed = launch(4, [*common, "--load", ckpt, "--save", ckpt, "--save-interval", "100"],
                     tmp_path / "resumed.jsonl")
    assert first.returncode == resumed.returncode == reference.returncode == 0, resumed.stderr[-2000:]
    assert [r["iteration"] for r in resumed.records] == [4, 5, 6]
    for mine, theirs in zip(first.records + resumed.records, reference.records):
        assert abs(mine["lm_loss"] - theirs["lm_loss"]) <= 1e-5 * theirs["lm_loss"], (mine, theirs)


@pytest.mark.multiprocess
@pytest.mark.timeout(300)
@pytest.mark.parametrize("overlap", [False, True], ids=["gather-in-step", "overlap-param-gather"])
def test_lost_replicas_are_survived_on_the_trajectory_with_two_instances(tmp_path, overlap):
    """DP = 4, K = 2: replica 2 dies in backward (its instance's survivor takes the whole state
    from the other instance), later replica 1 dies in the weight all-gather after stepping its
    slice: replica 0's weights stay incomplete, and iteration 6 recovers before computing (the
    step's all-gather failed) or mid-forward (--overlap-param-gather: the wait failed), then
    computes its quota again. Every iteration commits M ids on the failure-free losses, and the
    replicas' weights compared after every iteration are bitwise identical. The checkpoint saved
    after the first loss (instances of 1 and 2 replicas) resumes on the trajectory with all 4."""
    from tests._launch_util import TINY_GPT, launch

    common = [*TINY_GPT, "--train-iters", "8"]
    reference = launch(1, common, tmp_path / "ref.jsonl")
    saved = [] if overlap else ["--save", str(tmp_path / "ckpt"), "--save-interval", "4"]
    overlapped = ["--overlap-grad-reduce", "--overlap-param-gather", "--ddp-bucket-size", "20000"]
    # even: every replica keeps microbatches (to wait in, and for the kill in a backward to fire)
    run = launch(4, [*common, "--use-distributed-optimizer", "--num-distributed-optimizer-instances",
                     "2", "--check-weight-hash-across-dp-replicas-interval", "1", "--recover-balance", "even",
                     *(overlapped if overlap else []), *saved,
                     "--inject-fault", "kill:rank=2,iter=3,phase=backward",
                     "--inject-fault", "kill:rank=1,iter=5,phase=param_gather"],
                 tmp_path / "run.jsonl", launcher_args=[])  # recovery on: the coordinator
    assert reference.returncode == run.returncode == 0, run.stderr[-3000:]
    records = [r for r in run.records if "lm_loss" in r]
    assert [r["iteration"] for r in records] == list(range(1, 9))
    assert all(r["microbatches"] == 8 for r in records)
    assert [r["live_replicas"] for r in records] == [[0, 1, 2, 3]] * 2 + [[0, 1, 3]] * 3 + [[0, 3]] * 3
    recoveries = [(p["phase"], p["redo"]) for r in records for p in r["recoveries"]]
    assert recoveries == [("reduce", False), ("execute" if overlap else "refresh", True)]
    assert [r.get("weights_checked_after") for r in records] == [None, *range(1, 8)]
    # reduce-scattered while all four replicas live, all-reduced after the first loss
    assert [r.get("reduce_scattered", False) for r in records] == [True] * 2 + [False] * 6
    expected = reference.records
    if saved:  # saved by 3 replicas (instances of 1 and 2), resumed by 4 on the trajectory
        four = tmp_path / "at4"  # iteration 4's checkpoint alone (the run also saved its last)
        shutil.copytree(tmp_path / "ckpt" / "iter_0000004", four / "iter_0000004")
        (four / "latest_checkpointed_iteration.txt").write_text("4")
        resumed = launch(4, [*common, "--use-distributed-optimizer",
                             "--num-distributed-optimizer-instances", "2", "--load", str(four)],
                         tmp_path / "resumed.jsonl")
        assert resumed.returncode == 0, resumed.stderr[-3000:]
        records += [r for r in resumed.records if "lm_loss" in r]
        assert [r["iteration"] for r in records[8:]] == [5, 6, 7, 8]
        expected = expected + expected[4:]
    for mine, theirs in zip(records, expected, strict=True):
        assert abs(mine["lm_loss"] - theirs["lm_loss"]) <= 1e-5 * theirs["lm_loss"], (mine, theirs)


@pytest.mark.multiprocess
@pytest.mark.timeout(300)
def test_with_one_instance_a_lost_replica_stops_the_job_for_a_restart(tmp_path):
    """K = 1 keeps a single copy of the optimizer state: a kill stops every survivor with status 3,
    naming --load and K >= 2, and no iteration commits after the failure."""
    from tests._launch_util import TINY_GPT, launch

    run = launch(4, [*TINY_GPT, "--train-iters", "6", "--use-distributed-optimizer",
                     "--save", str(tmp_path / "ckpt"), "--save-interval", "2",
                     "--inject-fault", "kill:rank=1,iter=4,phase=backward",
                     # even: the throughput plan may give a replica slowed by the save at iteration 2
                     # no microbatch at iteration 4, and then the kill in its backward never fires
                     "--recover-balance", "even"],
                 tmp_path / "metrics.jsonl", launcher_args=[])  # recovery on: the coordinator
    # every survivor stops with status 3; no replica is left, so the coordinator stops the job and
    # the launcher exits 3 (restart from the checkpoint), the kill notwithstanding
    assert run.returncode == 3, run.stderr[-2000:]
    assert "the job stopped (no live replica is left" in run.stderr
    assert all(f"rank {r} (pid" in run.stderr for r in (0, 2, 3))
    assert run.stderr.count("failed: exit code 3") == 3, run.stderr[-2000:]
    assert [r["iteration"] for r in run.records if "lm_loss" in r] == [1, 2, 3]
    assert "K >= 2" in run.stdout and f"--load {tmp_path / 'ckpt'}" in run.stdout


def test_norm_and_zero_count_from_the_ranges_match_the_whole_gradients():
    """One shard holds every range: its norm and zero count are the unsharded ones (a tied copy
    and TP-replicated parameters on TP rank 1 are left out alike)."""
    from megatron.training.optimizer import count_zeros, global_grad_norm
    groups = make_params(torch.float32)
    flat = [p for g in groups for p in g["params"]]
    flat[1].tied_embedding_is_duplicate = True
    flat[2].tensor_model_parallel = True
    mine = sharded(groups)
    grads = grads_for(0)
    grads[0].view(-1)[:3] = 0.0
    grads[2].view(-1)[4] = 0.0
    for tp_rank in (0, 1):
        assert mine.grad_norm(grads, None, tp_rank) == pytest.approx(
            global_grad_norm(flat, grads, None, tp_rank), rel=1e-12)
        assert mine.count_zeros(grads, None, tp_rank) == count_zeros(flat, grads, None, tp_rank)
    assert mine.count_zeros(grads, None, 0) == 4 and mine.count_zeros(grads, None, 1) == 1
