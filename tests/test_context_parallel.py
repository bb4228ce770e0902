"""Context parallelism trains along the single-process trajectory: each replica's sequences
split over CP ranks (Megatron's chunks, ReCoVer's all-gather attention), the loss and token
counts summed over CP, the gradients reduced over DP x CP. Layouts (TP, PP, CP, DP) of four ranks,
fp32 within reduction-order noise and bf16 within its rounding (`test_parallel_equivalence`'s
tolerances); and the flags' checks, each refusal one line naming the flag."""
from __future__ import annotations

import re
from types import SimpleNamespace

import pytest

from megatron.training.arguments import parse_args, validate_args
from megatron.training.errors import ArgumentError
from tests._launch_util import TINY_GPT, launch
from tests.test_parallel_equivalence import PRECISIONS, TOLERANCE, assert_same_trajectory

ITERS = 4
CP_FLAGS: list[str] = []  # Megatron's default --cp-comm-type: p2p (the ring)
EVAL = ["--eval-interval", "2", "--eval-iters", "1"]  # the validation loss is summed over CP too


@pytest.fixture(scope="module")
def references(tmp_path_factory):
    return {}


# the distributed optimizer sharded over DP x CP as in Megatron, its buckets reduce-scattered
# during the backward (small buckets: several per step) and its weights gathered in the forward
DISTOPT = ["--use-distributed-optimizer", "--overlap-grad-reduce", "--overlap-param-gather",
           "--ddp-bucket-size", "4000"]
VARIANTS = {"rope": ["--position-embedding-type", "rope"], "distopt": DISTOPT,
            "sp": ["--sequence-parallel"], "allgather": ["--cp-comm-type", "allgather"],
            "a2a": ["--cp-comm-type", "a2a"],
            "vp": ["--num-layers-per-virtual-pipeline-stage", "1"]}  # the interleaved schedule
SAME_MODEL = ("distopt", "sp", "allgather", "a2a", "vp")  # one process without them: the reference


def train(tmp_path_factory, precision: str, tp: int = 1, pp: int = 1, cp: int = 1, dp: int = 1):
    """`precision`: fp32 or bf16, with VARIANTS suffixes: "-rope" (rotary position embeddings),
    "-distopt", "-sp" (sequence parallelism: the CP rank's chunks split again over TP), "-vp"
    (two model chunks per pipeline rank), or another --cp-comm-type than the default p2p ("-allgather", "-a2a")."""
    out = tmp_path_factory.mktemp(f"{precision}-tp{tp}pp{pp}cp{cp}dp{dp}")
    dtype, *variants = precision.split("-")
    flags = [*TINY_GPT, "--train-iters", str(ITERS), *PRECISIONS[dtype], *EVAL,
             *(flag for variant in variants for flag in VARIANTS[variant]),
             "--tensor-model-parallel-size", str(tp), "--pipeline-model-parallel-size", str(pp),
             *(["--context-parallel-size", str(cp), *CP_FLAGS] if cp > 1 else [])]
    # the interleaved schedule with recovery on: its p2p channels are groups of their own
    run = launch(tp * pp * cp * dp, flags, out / "metrics.jsonl",
                 launcher_args=[] if "vp" in variants else None)
    assert run.returncode == 0, run.stderr[-3000:]
    assert len(run.losses()) == ITERS, run.stdout[-2000:]
    return run


@pytest.mark.multiprocess
@pytest.mark.timeout(300)
@pytest.mark.parametrize("precision, tp, pp, cp, dp", [
    ("fp32", 1, 1, 2, 2), ("fp32", 2, 1, 2, 1), ("fp32", 1, 2, 2, 1),
    ("fp32-allgather", 1, 1, 4, 1), ("bf16", 1, 1, 2, 2), ("fp32-rope", 1, 1, 2, 2),
    ("fp32-distopt", 1, 1, 2, 2), ("fp32-sp-a2a", 2, 1, 2, 1), ("fp32-vp", 1, 2, 2, 1)])
def test_cp_layouts_follow_the_single_process_trajectory(references, tmp_path_factory,
                                                          precision, tp, pp, cp, dp):
    dtype, *variants = precision.split("-")
    model = dtype if all(v in SAME_MODEL for v in variants) else precision
    if model not in references:
        references[model] = train(tmp_path_factory, model)
    run = train(tmp_path_factory, precision, tp, pp, cp, dp)
    reference = references[model]
    assert_same_trajectory(trained(run), trained(reference), dtype, dp)
    if "distopt" in variants:  # reduce-scattered over the DP x CP shards
        assert all(r.get("reduce_scattered") for r in trained(run).records)
    valid = [[r["valid_lm_loss"] for r in one.records if "valid_lm_loss" in r]
             for one in (run, reference)]
    assert len(valid[0]) == ITERS // 2 and valid[0] == pytest.approx(valid[1], rel=TOLERANCE[dtype])


def trained(run) -> SimpleNamespace:
    """The run's training records only (its validation records apart)."""
    return SimpleNamespace(records=[r for r in run.records if "lm_loss" in r])


def refusal(*flags: str, world: int = 2) -> str:
    with pytest.raises(ArgumentError) as refused:
        validate_args(parse_args([*TINY_GPT, "--train-iters", "1", *flags]), world)
    return str(refused.value)


def test_cp_flags_are_checked_and_what_is_not_built_is_refused_by_name():
    assert "a2a+p2p (hierarchical) is not implemented" in refusal(
        "--context-parallel-size", "2", "--cp-comm-type", "a2a+p2p",
        "--hierarchical-context-parallel-sizes", "2", "1")
    assert "4 attention heads and 4 query groups per TP rank do not divide by" in refusal(
        "--context-parallel-size", "8", "--cp-comm-type", "a2a", world=8)
    assert "indexes the list by the 1-based layer number" in refusal(
        "--context-parallel-size", "2", "--cp-comm-type", "p2p", "p2p", "a2a", "p2p")
    assert "not one of" in refusal("--cp-comm-type", "ring")
    assert "--hierarchical-context-parallel-sizes" in refusal(
        "--context-parallel-size", "2", "--cp-comm-type", "a2a+p2p")
    assert "--seq-length 32 does not split into 2 x --context-parallel-size 3" in refusal(
        "--context-parallel-size", "3", *CP_FLAGS, world=3)
    assert "--context-parallel-size 2 = 4" in refusal(  # a replica is TP x PP x CP ranks
        "--context-parallel-size", "2", "--tensor-model-parallel-size", "2", *CP_FLAGS, world=6)
    for flag in (["--reset-attention-mask"], ["--ckpt-format", "torch", "--save", "/tmp/x"]):
        assert refusal("--context-parallel-size", "2", *CP_FLAGS, *flag).startswith(flag[0])
    args = validate_args(parse_args([*TINY_GPT, "--train-iters", "1", "--context-parallel-size", "2",
                                     *CP_FLAGS]), 4)
    assert args.context_parallel_size == 2 and args.cp_comm_type == ["p2p"]  # the default, the ring


@pytest.mark.multiprocess
@pytest.mark.timeout(420)
def test_a_lost_cp_rank_loses_its_replica_and_the_trajectory_is_kept(references, tmp_path_factory):
    """DP 3 x CP 2, recovery on: rank 1 (replica 0's second CP rank) dies in the attention's K/V
    exchange of iteration 2, rank 4 (replica 2's first) in a backward of iteration 4. Each takes
    its replica; the survivors recompute the lost microbatches in the same iteration, and every
    iteration commits its M microbatches with the failure-free losses. The distributed optimizer
    runs with three instances (one a replica: its two CP ranks hold half the state each), so the
    survivors re-shard the state of the holders that died from their own copies."""
    if "fp32" not in references:
        references["fp32"] = train(tmp_path_factory, "fp32")
    out = tmp_path_factory.mktemp("cp-kills")
    flags = [*TINY_GPT, "--train-iters", str(ITERS), "--context-parallel-size", "2", *CP_FLAGS,
             "--recover-balance", "even", "--recover-spares", "off",
             "--use-distributed-optimizer", "--num-distributed-optimizer-instances", "3",
             "--inject-fault", "kill:rank=1,iter=2,phase=cp_exchange",
             "--inject-fault", "kill:rank=4,iter=4,phase=backward"]
    run = launch(6, flags, out / "metrics.jsonl", launcher_args=[], timeout=300)
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    records = [r for r in run.records if "lm_loss" in r]
    assert [r["iteration"] for r in records] == list(range(1, ITERS + 1)), run.stdout[-3000:]
    for mine, ref in zip(records, trained(references["fp32"]).records):
        i = mine["iteration"]
        assert mine["microbatches"] == 8 and mine["id_sum"] == sum(range((i - 1) * 8, i * 8))
        assert abs(mine["lm_loss"] - ref["lm_loss"]) <= 1e-5 * abs(ref["lm_loss"]), (mine, ref)
    assert [r["live_replicas"] for r in records] == [[0, 1, 2], [1, 2], [1, 2], [1]]
    assert [bool(r["recoveries"]) for r in records] == [False, True, False, True]
    said = run.stdout + run.stderr
    assert "rank 1: injecting kill at iter 2 phase cp_exchange" in said
    # its CP peer saw it in the ring's exchange
    assert re.search(r"cp\.replica0\.tp0\.stage0\.(send|recv) failed", said), said[-3000:]


@pytest.mark.multiprocess
@pytest.mark.timeout(420)
def test_grow_back_re_forms_a_cp_replica(tmp_path_factory):
    """DP 2 x CP 2, one replacement allowed: rank 1 dies in iteration 3; its replica's other CP
    rank waits as a spare, the launcher's replacement joins it, each takes the state from the rank
    of its own CP index in replica 1, and replica 0 trains again: the losses are the failure-free
    ones and the replicas' weights agree after every iteration (the hash check)."""
    iters = 12
    common = [*TINY_GPT, "--train-iters", str(iters), "--context-parallel-size", "2", *CP_FLAGS,
              "--recover-balance", "even", "--check-weight-hash-across-dp-replicas-interval", "1"]
    reference = launch(1, [*TINY_GPT, "--train-iters", str(iters)],
                       tmp_path_factory.mktemp("cp-ref") / "metrics.jsonl")
    run = launch(4, [*common, "--inject-fault", "kill:rank=1,iter=3,phase=forward",
                     "--inject-fault", "slow:rank=2,seconds=0.15,iter=4,phase=forward"],
                 tmp_path_factory.mktemp("cp-grow") / "metrics.jsonl", timeout=300,
                 launcher_args=["--max-replacements", "1"])
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    records = [r for r in run.records if "lm_loss" in r]
    for mine, ref in zip(records, reference.records, strict=True):
        assert mine["microbatches"] == 8
        assert abs(mine["lm_loss"] - ref["lm_loss"]) <= 1e-5 * abs(ref["lm_loss"]), (mine, ref)
    live = [r["live_replicas"] for r in records]
    assert [0, 1] in live[3:] and [1] in live and live[-1] == [0, 1], live
    assert [r["join"]["joined"] for r in run.records if "join" in r] == [[0]]
    assert [r.get("weights_checked_after") for r in records[1:]] == list(range(1, iters))
