"""--recover-exact-reduction: microbatch gradients summed as fixed-point integers, the loss on
a grid and the norm in fixed point, so a run's bits depend on neither the DP size, nor the
balance, nor any failure. In one process: the buffer's sums and the norm are the same bits for
any order and split (and differ without the representation), the exponents follow the largest
gradient and an overflow is a verdict, not a wrap. Multi-process: fp32 DP 2 and DP 4 (with and
without the distributed optimizer, kills in a reduction, a backward and a weight all-gather) and
bf16 PP 2 (a kill in a forward) each equal one process bitwise: losses, grad norms and every
iteration's weight fingerprint, the last one's included."""
from __future__ import annotations

import math

import pytest
import torch

from megatron.training.arguments import parse_args, validate_args
from megatron.training.errors import ArgumentError
from megatron.training.optimizer.sums import fixed_point_norm
from recover_patches.recovery.fixed_point import (LIMIT_BITS, TARGET_BITS, FixedPointScales,
                                                  loss_quantum)
from recover_patches.pipeline.loss import on_grid
from recover_patches.recovery.grad_buffer import GradBuffer, flat_layout
from recover_patches.recovery.reduce import Totals
from tests._launch_util import TINY_GPT, launch


def _buffer(params, exact: bool) -> GradBuffer:
    layout = flat_layout(params, bucket_numel=40)
    scales = FixedPointScales(len(params)) if exact else None
    if scales is not None:
        scales.calibrate(torch.full((len(params),), 3.0, dtype=torch.float64))
    return GradBuffer(params, replicas=2, dp_group=None, layout=layout, scales=scales)


def _accumulate(order: list[int], exact: bool) -> torch.Tensor:
    """Microbatch gradients of widely different sizes, in `order`, through autograd's hook;
    the local sums, in units of the gradient."""
    params = [torch.nn.Parameter(torch.zeros(30)), torch.nn.Parameter(torch.zeros(25))]
    buffer = _buffer(params, exact)
    for k in order:
        g = torch.Generator().manual_seed(k)
        # magnitudes 2^-35 .. 2^5: plain float64 sums of them would round (40 bits + 24)
        loss = sum((p * torch.randn(p.shape, generator=g) * 2.0 ** (10 * (k % 5) - 35)).sum()
                   for p in params)
        loss.backward()
    units = [1.0 if buffer.scales is None else buffer.scales.multiplier(i)
             for i in range(len(params))]
    return torch.cat([buffer.local[o:o + p.numel()] / unit
                      for p, unit in zip(params, units) for o in [buffer.layout.offsets[p]]])


def test_fixed_point_sums_are_the_same_bits_in_any_order_and_float_sums_are_not():
    orders = [list(range(12)), list(reversed(range(12))), [5, 0, 11, 3, 8, 1, 10, 2, 7, 4, 9, 6]]
    exact = [_accumulate(order, True) for order in orders]
    assert all(torch.equal(exact[0], other) for other in exact[1:])
    plain = [_accumulate(order, False) for order in orders]
    assert not all(torch.equal(plain[0], other) for other in plain[1:])  # the control
    assert torch.allclose(exact[0], plain[0].double(), rtol=1e-5, atol=1e-7)


def test_losses_on_the_grid_sum_alike_in_any_order_and_keep_their_gradient():
    torch.manual_seed(1)
    losses = torch.randn(64, dtype=torch.float32) * torch.logspace(-8, 4, 64)
    losses.requires_grad_(True)
    quantum = loss_quantum(32)
    gridded = [on_grid(x, quantum) for x in losses]
    assert all(float(v.detach()) == round(float(x.detach()) / quantum) * quantum
               for v, x in zip(gridded, losses))
    sums = {float(sum(gridded[i] for i in order).detach()) for order in
            (range(64), reversed(range(64)), [*range(0, 64, 2), *range(1, 64, 2)])}
    assert len(sums) == 1
    plain = {float(sum(losses[i].double() for i in order).detach()) for order in
             (range(64), reversed(range(64)), [*range(0, 64, 2), *range(1, 64, 2)])}
    assert len(plain) > 1  # the control: the same values off the grid
    sum(gridded).backward()
    assert torch.equal(losses.grad, torch.ones(64))


def test_the_reduction_converts_once_and_carries_the_verdict():
    params = [torch.nn.Parameter(torch.zeros(30))]
    buffer = _buffer(params, True)
    grad = torch.arange(-15, 15) / 16.0  # on the fixed-point grid: it comes back exactly
    (params[0] * grad).sum().backward()
    reduced = buffer.reduce(Totals.of_ids([0], 8, 2.5), 0, 0.0)
    assert torch.equal(buffer.reduced_grad(params[0]), grad)
    assert reduced.totals == Totals.of_ids([0], 8, 2.5)
    verdict = reduced.fixed_point
    assert verdict is not None and not verdict.overflow
    exponent = buffer.scales.exponents[0]
    assert verdict.exponents == [exponent + TARGET_BITS - math.frexp(15 / 16 * 2.0 ** exponent)[1]]


def test_exponents_aim_at_the_target_and_an_overflow_is_a_verdict():
    scales = FixedPointScales(3)
    scales.calibrate(torch.tensor([1.0, 0.0, 2.0 ** 20], dtype=torch.float64))
    assert scales.exponents == [TARGET_BITS - 4 - 1, 0, TARGET_BITS - 4 - 21]
    peaks = torch.tensor([2.0 ** 30, 0.0, 2.0 ** LIMIT_BITS], dtype=torch.float64)
    other = torch.tensor([2.0 ** 29.5, 0.0, 1.0], dtype=torch.float64)  # a second replica
    summed = (scales.encode(peaks) + 100 * scales.encode(other)).tolist()  # + 100 replicas
    assert len(summed) == 3 == scales.slots
    verdict = scales.verdict(summed)
    assert verdict.overflow and verdict.overflowed == [2]
    before = scales.exponents
    assert verdict.exponents == [before[0] + TARGET_BITS - 31, before[1],
                                 before[2] - (LIMIT_BITS + 1 - TARGET_BITS)]
    nan = scales.verdict(scales.encode(torch.tensor([1.0, 0.0, math.nan])).tolist())
    assert nan.overflow and nan.overflowed == [2]  # never a silent wrap
    assert loss_quantum(64) == 2.0 ** -(LIMIT_BITS - 14)


def test_the_fixed_point_norm_is_the_same_bits_for_any_split():
    torch.manual_seed(0)
    x = torch.randn(1000) * torch.logspace(-6, 2, 1000)
    splits = [[x], [x[:1], x[1:]], [x[:333], x[333:700], x[700:]], [x[i::7] for i in range(7)]]
    norms = [fixed_point_norm([(pieces, None, True)], None, x.device) for pieces in splits]
    assert len(set(norms)) == 1
    assert abs(norms[0] - float(x.double().norm())) <= 1e-9 * norms[0]
    float_norms = {float(sum(p.square().sum() for p in pieces)) for pieces in splits}
    assert len(float_norms) > 1  # the control: float sums depend on the split
    assert fixed_point_norm([([torch.tensor([1.0, math.inf])], None, True)], None,
                            x.device) == math.inf


def test_what_cannot_be_exact_is_refused_by_name():
    def refusal(*flags: str, world: int = 2) -> str:
        with pytest.raises(ArgumentError) as refused:
            validate_args(parse_args([*TINY_GPT, "--train-iters", "1",
                                      "--recover-exact-reduction", *flags]), world)
        return str(refused.value)
    assert refusal("--fp16").startswith("--recover-exact-reduction: --recover-exact-reduction "
                                        "with --fp16")
    assert "the experts' GEMMs sum the tokens of a unit's replicas' microbatches" in refusal(
        "--disable-bias-linear", "--num-experts", "4", "--expert-model-parallel-size", "2")
    assert "sums at most 65536 microbatches" in refusal("--global-batch-size", "131072")
    validate_args(parse_args([*TINY_GPT, "--train-iters", "1", "--recover-exact-reduction",
                              "--bf16", "--disable-bias-linear", "--num-experts", "4"]), 2)


# -- multi-process: one launch per layout, each compared with one process ------------------------
ITERS = 6
EXACT = [*TINY_GPT, "--train-iters", str(ITERS), "--recover-exact-reduction",
         "--check-weight-hash-across-dp-replicas-interval", "1"]
SHARDED = ["--use-distributed-optimizer", "--num-distributed-optimizer-instances", "2",
           "--overlap-grad-reduce", "--overlap-param-gather", "--ddp-bucket-size", "20000"]


def _records(run) -> list[dict]:
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    records = [r for r in run.records if "lm_loss" in r]
    (final,) = [r["final_weights_fingerprint"] for r in run.records
                if "final_weights_fingerprint" in r]
    assert len(records) == ITERS
    return [*records[:-1], {**records[-1], "final_weights_fingerprint": final}]


def _bitwise(mine: list[dict], ref: list[dict]) -> bool:
    """The same losses, grad norms and weights after every iteration (`_records` keeps the last
    weights' fingerprint in the last record)."""
    keys = ("lm_loss", "grad_norm", "weights_fingerprint", "final_weights_fingerprint")
    return all(a.get(k) == b.get(k) for a, b in zip(mine, ref) for k in keys)


@pytest.mark.multiprocess
@pytest.mark.timeout(300)
def test_fp32_runs_at_any_dp_size_and_through_kills_equal_one_process_bitwise(tmp_path):
    ref = _records(launch(1, EXACT, tmp_path / "ref.jsonl"))
    assert [r["weights_checked_after"] for r in ref[1:]] == list(range(1, ITERS))
    assert all("weights_fingerprint" in r for r in ref[1:])
    assert ref[-1]["final_weights_fingerprint"] != ref[-1]["weights_fingerprint"]  # a new step
    dp2 = _records(launch(2, EXACT, tmp_path / "dp2.jsonl"))  # the throughput balance
    sharded = _records(launch(4, [*EXACT, *SHARDED, "--recover-balance", "even",
                                  "--inject-fault", "kill:rank=2,iter=2,phase=dp_reduce",
                                  "--inject-fault", "kill:rank=1,iter=4,phase=param_gather"],
                              tmp_path / "dp4.jsonl", launcher_args=[]))
    assert [r["live_replicas"] for r in sharded] == [[0, 1, 2, 3]] + [[0, 1, 3]] * 3 + [
        [0, 3]] * 2
    plain = _records(launch(4, [*EXACT, "--recover-balance", "even", "--inject-fault",
                                "kill:rank=3,iter=3,phase=backward"], tmp_path / "plain.jsonl",
                            launcher_args=[]))
    assert plain[-1]["live_replicas"] == [0, 1, 2]
    for name, mine in (("dp2", dp2), ("dp4 sharded", sharded), ("dp4", plain)):
        assert _bitwise(mine, ref), (name, mine, ref)


@pytest.mark.multiprocess
@pytest.mark.timeout(300)
def test_bf16_pipeline_runs_through_a_kill_equal_one_replica_bitwise(tmp_path):
    flags = [*EXACT, "--bf16", "--pipeline-model-parallel-size", "2"]
    ref = _records(launch(2, flags, tmp_path / "ref.jsonl"))
    killed = _records(launch(4, [*flags, "--recover-balance", "even", "--inject-fault",
                                 "kill:rank=1,iter=3,phase=forward"], tmp_path / "k.jsonl",
                             launcher_args=[]))
    assert killed[-1]["live_replicas"] == [0]
    assert _bitwise(killed, ref), (killed, ref)


@pytest.mark.multiprocess
@pytest.mark.timeout(300)
def test_a_replica_that_grows_back_takes_the_exponents_and_the_run_stays_bitwise(tmp_path):
    """DP 4 with the distributed optimizer in two instances: rank 2 dies in a backward of
    iteration 2, a replacement joins (its shards re-sharded to it, the exponents from its
    donor) and the run stays bitwise the one-process run without the distributed optimizer."""
    longer = ["--train-iters", "10"]
    ref_run = launch(1, [*EXACT, *longer], tmp_path / "ref.jsonl")
    ref = [r for r in ref_run.records if "lm_loss" in r]
    run = launch(4, [*EXACT, *longer, "--use-distributed-optimizer",
                     "--num-distributed-optimizer-instances", "2",
                     "--inject-fault", "kill:rank=2,iter=2,phase=backward",
                     "--inject-fault", "slow:rank=1,seconds=0.3,iter=4,phase=forward"],
                 tmp_path / "grow.jsonl", launcher_args=["--max-replacements", "1"])
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    records = [r for r in run.records if "lm_loss" in r]
    assert [r["join"]["joined"] for r in run.records if "join" in r] == [[2]]
    assert [r["final_weights_fingerprint"] for r in run.records if "final_weights_fingerprint" in r
            ] == [r["final_weights_fingerprint"] for r in ref_run.records
                  if "final_weights_fingerprint" in r]
    assert records[-1]["live_replicas"] == [0, 1, 2, 3] and len(records) == len(ref) == 10
    assert _bitwise(records, ref), (records, ref)


@pytest.fixture(scope="module")
def pipeline_reference(tmp_path_factory) -> list[dict]:
    run = launch(2, [*EXACT, "--pipeline-model-parallel-size", "2"],
                 tmp_path_factory.mktemp("exact-pp") / "ref.jsonl")
    return _records(run)


@pytest.mark.multiprocess
@pytest.mark.timeout(300)
@pytest.mark.parametrize("phase", ["forward", "backward", "p2p", "dp_reduce", "reduced", "ack",
                                   "exchange", "confirmed", "optimizer", "param_gather"])
def test_a_kill_in_any_phase_leaves_no_trace_in_the_bits(pipeline_reference, tmp_path, phase):
    """PP 2 x DP 2 with the distributed optimizer (an instance per replica): rank 3 (replica 1's
    last stage) dies in `phase` of iteration 3; the survivor's run is bitwise the failure-free
    DP 1 run. (In `ack`: rank 2's ack, with rank 3, fails while rank 0's, with rank 1,
    completes; rank 2 must still join replica 0's exchange, or rank 0 waits there until the
    settle gives up on it and the survivors are fenced: `step/commit_vote.py`.)"""
    run = launch(4, [*EXACT, "--pipeline-model-parallel-size", "2", "--use-distributed-optimizer",
                     "--num-distributed-optimizer-instances", "2", "--recover-balance", "even",
                     "--inject-fault", f"kill:rank=3,iter=3,phase={phase}"],
                 tmp_path / "k.jsonl", launcher_args=[])
    records = _records(run)
    assert records[-1]["live_replicas"] == [0]
    assert _bitwise(records, pipeline_reference), (records, pipeline_reference)


@pytest.mark.multiprocess
@pytest.mark.timeout(300)
def test_a_mixture_of_experts_at_ep_1_is_bitwise_too(tmp_path):
    """MoE (4 experts, top 2, aux and z losses) at EP 1: DP 4 with a kill in a backward equals
    one process (with EP > 1 the flag is refused: the experts mix microbatches)."""
    from tests.test_moe import FLAGS as MOE_FLAGS
    flags = [*MOE_FLAGS, "--train-iters", str(ITERS), "--recover-exact-reduction",
             "--check-weight-hash-across-dp-replicas-interval", "1"]
    ref = _records(launch(1, flags, tmp_path / "ref.jsonl"))
    killed = _records(launch(4, [*flags, "--inject-fault", "kill:rank=3,iter=3,phase=backward"],
                             tmp_path / "k.jsonl", launcher_args=[]))
    assert killed[-1]["live_replicas"] == [0, 1, 2]
    assert _bitwise(killed, ref), (killed, ref)


@pytest.mark.multiprocess
@pytest.mark.timeout(300)
def test_a_resume_at_another_dp_size_continues_bitwise(tmp_path):
    """DP 2 saves after iteration 3 (torch_dist: the exponents ride with each position's RNG
    state); DP 4 resumes and its iterations 4-6 are bitwise the uninterrupted one-process run."""
    ref = _records(launch(1, EXACT, tmp_path / "ref.jsonl"))
    ckpt = tmp_path / "ckpt"
    saved = launch(2, [*EXACT, "--save", str(ckpt), "--save-interval", "3", "--exit-interval", "3"],
                   tmp_path / "a.jsonl")
    assert saved.returncode == 0, saved.stderr[-3000:]
    resumed = launch(4, [*EXACT, "--load", str(ckpt)], tmp_path / "b.jsonl")
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    records = [r for r in resumed.records if "lm_loss" in r]
    assert [r["iteration"] for r in records] == [4, 5, 6]
    final = [r["final_weights_fingerprint"] for r in resumed.records
             if "final_weights_fingerprint" in r]
    assert _bitwise([*records[:-1], {**records[-1], "final_weights_fingerprint": final[0]}],
                    ref[3:]), (records, ref[3:])
