"""Mixture of experts, first part: megatron-core's MoE layer (router, allgather token
dispatcher, SequentialMLP experts) in ReCoVer's GPT, every replica holding every expert (expert
parallelism is refused by name for now). DP 2, TP 2 with SP, and PP 2 follow one process's
trajectory (fp32, 1e-5), with the load-balancing and z-losses on; a rank killed in its backward
pass keeps the failure-free losses; Megatron's checks and what is not built yet are one line
naming the flag."""
from __future__ import annotations

import pytest
import torch
from megatron.core.transformer.moe.moe_utils import MoEAuxLossAutoScaler

from megatron.training.arguments import parse_args, validate_args
from megatron.training.errors import ArgumentError
from megatron.training.checkpointing import LATEST_FILE
from megatron.training.step.parts import aux_loss_scaling
from tests._launch_util import TINY_GPT, launch

ITERS = 4
MOE = ["--disable-bias-linear", "--num-experts", "4", "--moe-router-topk", "2",
       "--moe-aux-loss-coeff", "0.01", "--moe-z-loss-coeff", "0.001",
       "--moe-layer-freq", "([1]*1+[0]*1)*2"]  # layers 1 and 3 MoE, 2 and 4 dense
FLAGS = [*TINY_GPT, "--train-iters", str(ITERS), *MOE, "--recover-balance", "even"]


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    run = launch(1, FLAGS, tmp_path_factory.mktemp("moe-ref") / "metrics.jsonl")
    assert run.returncode == 0, run.stderr[-3000:]
    return [r for r in run.records if "lm_loss" in r]


def close(mine: dict, ref: dict, what: str, tolerance: float) -> bool:
    return abs(mine[what] - ref[what]) <= tolerance * abs(ref[what])


def same_moe_losses(mine: dict, ref: dict, tolerance: float = 1e-5) -> bool:
    """The log line's auxiliary losses (Megatron's names, means over the M microbatches)."""
    return set(mine["moe_losses"]) == set(ref["moe_losses"]) == {"load_balancing_loss", "z_loss"} \
        and all(close(mine["moe_losses"], ref["moe_losses"], name, tolerance)
                for name in ref["moe_losses"])


@pytest.mark.multiprocess
@pytest.mark.timeout(300)
@pytest.mark.parametrize("layout", [["--tensor-model-parallel-size", "1"],  # DP 2
                                    ["--tensor-model-parallel-size", "2", "--sequence-parallel"],
                                    ["--pipeline-model-parallel-size", "2"],
                                    # megatron-core's module recompute: dense MLP, MoE layer
                                    ["--recompute-granularity", "selective", "--recompute-modules",
                                     "core_attn", "mlp", "moe"]])
def test_moe_layouts_follow_one_process(reference, tmp_path, layout):
    run = launch(2, [*FLAGS, *layout], tmp_path / "metrics.jsonl")
    assert run.returncode == 0, run.stderr[-3000:]
    records = [r for r in run.records if "lm_loss" in r]
    assert len(records) == ITERS
    for mine, ref in zip(records, reference):
        assert close(mine, ref, "lm_loss", 1e-5) and close(mine, ref, "grad_norm", 1e-4), (mine, ref)
        assert same_moe_losses(mine, ref), (mine, ref)  # TP parts summed, stages combined


@pytest.mark.multiprocess
@pytest.mark.timeout(300)
def test_group_limited_routing_and_probabilities_on_the_input_follow_one_process(tmp_path):
    """megatron-core's group-limited routing (4 experts in 2 groups, a token's from 1) and, at
    top-1, the routing probability applied to the experts' input: DP 2 = one process."""
    flags = [*FLAGS, "--moe-router-num-groups", "2", "--moe-router-group-topk", "1",
             "--moe-router-topk", "1", "--moe-router-pre-softmax", "--moe-apply-probs-on-input"]
    runs = [launch(n, flags, tmp_path / f"m{n}.jsonl") for n in (1, 2)]
    assert all(r.returncode == 0 for r in runs), runs[1].stderr[-3000:]
    one, two = ([r for r in run.records if "lm_loss" in r] for run in runs)
    assert len(one) == len(two) == ITERS
    for mine, ref in zip(two, one):
        assert close(mine, ref, "lm_loss", 1e-5) and close(mine, ref, "grad_norm", 1e-4), (mine, ref)


@pytest.mark.multiprocess
@pytest.mark.timeout(300)
def test_a_killed_moe_rank_keeps_the_failure_free_losses(reference, tmp_path):
    """DP 3: rank 1 dies in a backward pass of iteration 2; the survivors recompute its
    microbatches (their router and expert gradients included) in the same iteration."""
    run = launch(3, [*FLAGS, "--recover-spares", "off",
                     "--inject-fault", "kill:rank=1,iter=2,phase=backward"],
                 tmp_path / "metrics.jsonl", launcher_args=[], timeout=240)
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    records = [r for r in run.records if "lm_loss" in r]
    assert [r["live_replicas"] for r in records] == [[0, 1, 2]] + [[0, 2]] * (ITERS - 1)
    for mine, ref in zip(records, reference, strict=True):
        assert mine["microbatches"] == 8 and close(mine, ref, "lm_loss", 1e-5), (mine, ref)
        assert same_moe_losses(mine, ref), (mine, ref)  # redone microbatches counted once


@pytest.mark.multiprocess
@pytest.mark.timeout(300)
def test_experts_with_bias_at_ep_1_follow_ep_2(tmp_path):
    """Experts with biases (no --disable-bias-linear): megatron-core's expert MLP adds the bias
    in place into its second linear's output, which at EP 1 and TP 1 is the one-rank
    reduction's own output (`model/expert_linear.py`). One process (EP 1) follows two ranks at
    EP 2, where megatron-core takes no reduction, and the biases move the losses."""
    biased = [flag for flag in FLAGS if flag != "--disable-bias-linear"]
    runs = [launch(1, biased, tmp_path / "ep1.jsonl"),
            launch(2, [*biased, "--expert-model-parallel-size", "2"], tmp_path / "ep2.jsonl"),
            launch(1, FLAGS, tmp_path / "unbiased.jsonl")]
    assert all(r.returncode == 0 for r in runs), runs[0].stderr[-3000:]
    ep1, ep2, unbiased = ([r for r in run.records if "lm_loss" in r] for run in runs)
    assert len(ep1) == len(ep2) == ITERS
    assert abs(ep1[-1]["lm_loss"] - unbiased[-1]["lm_loss"]) > 1e-4  # the biases are there
    for mine, ref in zip(ep2, ep1):
        assert close(mine, ref, "lm_loss", 1e-5) and close(mine, ref, "grad_norm", 1e-4), (mine, ref)


@pytest.mark.multiprocess
@pytest.mark.timeout(300)
def test_the_routers_expert_bias_moves_as_in_one_process_through_tp_and_a_kill(tmp_path):
    """--moe-router-enable-expert-bias (sigmoid scores): each iteration's token counts per
    expert, summed over the committed microbatches, the TP ranks' sequence parts and the
    replicas, move every bias alike. DP 2 x TP 2 + SP, the MoE layers recomputed (their routers
    count in the backward then), replica 1 killed in a backward of iteration 2 (its
    microbatches redone by replica 0), follows one process; the bias moves the
    one-process losses (so the comparison is not of two runs that never updated it), and a
    checkpoint of iteration 2 resumes on them (the biases are model state)."""
    sigmoid = [*FLAGS, "--moe-router-score-function", "sigmoid", "--train-iters", "5"]
    bias = [*sigmoid, "--moe-router-enable-expert-bias", "--moe-router-bias-update-rate", "0.05"]
    ckpt = tmp_path / "ckpt"
    runs = [launch(1, sigmoid, tmp_path / "plain.jsonl"),
            launch(1, [*bias, "--save", str(ckpt), "--save-interval", "2"], tmp_path / "one.jsonl"),
            launch(4, [*bias, "--tensor-model-parallel-size", "2", "--sequence-parallel",
                       "--recompute-granularity", "selective", "--recompute-modules", "moe",
                       "--recover-spares", "off", "--inject-fault",
                       "kill:rank=2,iter=2,phase=backward"], tmp_path / "four.jsonl",
                   launcher_args=[], timeout=240)]
    assert all(r.returncode == 0 for r in runs), runs[2].stdout[-3000:] + runs[2].stderr[-3000:]
    plain, one, four = ([r for r in run.records if "lm_loss" in r] for run in runs)
    assert abs(plain[2]["lm_loss"] - one[2]["lm_loss"]) > 1e-4  # the bias changed the routing
    assert [r["live_replicas"] for r in four] == [[0, 1]] + [[0]] * 4
    for mine, ref in zip(four, one, strict=True):
        assert close(mine, ref, "lm_loss", 1e-5) and close(mine, ref, "grad_norm", 1e-4), (mine, ref)
    (ckpt / LATEST_FILE).write_text("2")  # the biases, moved twice, are in the checkpoint
    resumed = launch(1, [*bias, "--load", str(ckpt)], tmp_path / "resumed.jsonl")
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert all(abs(a - b["lm_loss"]) <= 1e-5 * b["lm_loss"]
               for a, b in zip(resumed.losses(), one[2:], strict=True)), resumed.losses()


@pytest.mark.multiprocess
@pytest.mark.timeout(300)
def test_a_moe_checkpoint_of_two_writers_resumes_in_one_process(reference, tmp_path):
    """DP 2 saves (the two replicas share the writing, the experts' items too); one process
    loads iteration 2 and follows the uninterrupted losses."""
    ckpt = tmp_path / "ckpt"
    saved = launch(2, [*FLAGS, "--save", str(ckpt), "--save-interval", "2"], tmp_path / "a.jsonl")
    assert saved.returncode == 0, saved.stderr[-3000:]
    (ckpt / LATEST_FILE).write_text("2")
    resumed = launch(1, [*FLAGS, "--load", str(ckpt)], tmp_path / "b.jsonl")
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    mine, ref = resumed.losses(), [r["lm_loss"] for r in reference][2:]
    assert len(mine) == 2 and all(abs(a - b) <= 1e-5 * abs(b) for a, b in zip(mine, ref)), (
        mine, ref)


def test_the_auxiliary_losses_are_weighted_by_a_microbatchs_tokens():
    """MoE's auxiliary-loss gradient scale: the microbatch's nominal tokens times fp16's loss
    scale, set before each backward (the language-model loss is a sum over tokens here)."""
    config = validate_args(parse_args([*TINY_GPT, "--train-iters", "1", *MOE]), 1)
    from megatron.training.config import transformer_config
    set_scale = aux_loss_scaling(transformer_config(config), tokens=32)
    assert set_scale is not None
    set_scale(4.0)
    assert float(MoEAuxLossAutoScaler.main_loss_backward_scale) == 128.0
    dense = validate_args(parse_args([*TINY_GPT, "--train-iters", "1"]), 1)
    assert aux_loss_scaling(transformer_config(dense), tokens=32) is None
    MoEAuxLossAutoScaler.set_loss_scale(torch.tensor(1.0))


KERNELS = ("--moe-grouped-gemm", "--moe-permute-fusion", "--moe-router-fusion",
           "--moe-shared-expert-overlap")


def test_transformer_engines_moe_kernels_are_taken_and_change_no_result():
    """Real MoE jobs ask for transformer-engine's grouped GEMM and fusions: megatron-core's
    unfused modules compute the same, so they are taken (not refused), with a start-up line
    each, and the model megatron-core builds is the one built without them."""
    from megatron.training.config import transformer_config
    from megatron.training.config.rules import megatron_differences
    plain = validate_args(parse_args([*TINY_GPT, "--train-iters", "1", *MOE]), 2)
    fused = validate_args(parse_args([*TINY_GPT, "--train-iters", "1", *MOE, *KERNELS]), 2)
    assert all(getattr(fused, flag[2:].replace("-", "_")) for flag in KERNELS)
    said = " | ".join(megatron_differences(fused, "cpu"))
    assert all(f"{flag} changes no result" in said for flag in KERNELS), said
    assert not any(flag in " ".join(megatron_differences(plain, "cpu")) for flag in KERNELS)
    built = [{k: v for k, v in vars(transformer_config(a)).items()
              if not k.endswith("init_method")} for a in (plain, fused)]  # (fresh partials)
    assert built[0] == built[1] and not built[1]["moe_grouped_gemm"]
    shared = [*MOE, "--moe-shared-expert-intermediate-size", "64", "--moe-shared-expert-overlap"]
    assert "moe_shared_expert_overlap only works with alltoall token dispatcher" in refusal(
        *shared)  # megatron-core's own check still applies
    validate_args(parse_args([*TINY_GPT, "--train-iters", "1", *shared,
                              "--moe-token-dispatcher-type", "alltoall"]), 2)


def refusal(*flags: str, world: int = 2) -> str:
    with pytest.raises(ArgumentError) as refused:
        validate_args(parse_args([*TINY_GPT, "--train-iters", "1", *flags]), world)
    return str(refused.value)


def test_moe_flags_are_checked_and_what_is_not_built_is_refused_by_name():
    moe = ["--disable-bias-linear", "--num-experts", "4"]
    ep = [*moe, "--expert-model-parallel-size", "2"]
    assert "must divide --num-experts 4" in refusal(*moe, "--expert-model-parallel-size", "3",
                                                   world=3)
    assert "must divide the data-parallel size 3" in refusal(*ep, world=3)
    sharded = ["--use-distributed-optimizer", "--num-distributed-optimizer-instances", "2"]
    assert refusal(*ep, *sharded, world=6).startswith(
        "--num-distributed-optimizer-instances: --num-distributed-optimizer-instances 2 with "
        "--expert-model-parallel-size 2: each instance's 3 replicas must hold whole units of 2")
    validate_args(parse_args([*TINY_GPT, "--train-iters", "1", *ep, *sharded]), 4)  # taken
    assert refusal(*ep, "--rerun-mode", "report_stats").startswith("--rerun-mode")
    assert refusal(*ep, "--save", "/tmp/x", "--save-interval", "1",
                   "--no-ckpt-fully-parallel-save").startswith("--no-ckpt-fully-parallel-save")
    assert refusal(*ep, "--load", "/tmp/x", "--ckpt-format", "torch").startswith("--ckpt-format")
    validate_args(parse_args([*TINY_GPT, "--train-iters", "1", *ep]), 4)  # EP 2 of DP 4: taken
    assert refusal(*moe, "--expert-tensor-parallel-size", "2").startswith(
        "--expert-tensor-parallel-size: --expert-tensor-parallel-size 2 other than")
    assert "global_aux_loss sums expert loads over the data-parallel replicas" in refusal(
        *moe, "--moe-router-load-balancing-type", "global_aux_loss")
    assert "gathers uneven token counts over TP" in refusal(
        *moe, "--moe-token-dispatcher-type", "alltoall", "--tensor-model-parallel-size", "2",
        "--sequence-parallel")
    assert "needs --sequence-parallel" in refusal(*moe, "--tensor-model-parallel-size", "2")
    assert "--moe-layer-freq gives 3 layers" in refusal(*moe, "--moe-layer-freq", "[1,0,1]")
    assert "--moe-router-topk 5 must be between 1 and --num-experts 4" in refusal(
        *moe, "--moe-router-topk", "5")
    assert "not an integer or a list expression" in refusal(*moe, "--moe-layer-freq",
                                                            "__import__('os')")
    assert "Bias in Moe" in refusal("--num-experts", "4", "--tensor-model-parallel-size", "2",
                                    "--sequence-parallel")  # megatron-core's own check, one line
    assert "works only with --moe-router-topk 1, got 2" in refusal(*moe,
                                                                  "--moe-apply-probs-on-input")
    assert "shared experts have no biases" in refusal(  # megatron-core raises at build
        "--num-experts", "4", "--moe-shared-expert-intermediate-size", "32")
    assert refusal("--expert-model-parallel-size", "2").startswith("--expert-model-parallel-size")
    args = validate_args(parse_args([*TINY_GPT, "--train-iters", "1", *MOE]), 2)
    assert (args.num_experts, args.moe_layer_freq) == (4, [1, 0, 1, 0])


def test_the_router_meter_takes_one_microbatchs_counts_and_the_bias_moves_by_their_sum():
    """In process, a stand-in for megatron-core's router: each forward's counts alone (the
    meter zeroes them before it), carried split at 256 (exact in the float32 tail), summed over
    TP rows, and each layer's bias moves by the rate towards the layer's mean count, as
    megatron-core's get_updated_expert_bias moves it."""
    from megatron.training.model.moe_metrics import RouterMeter, RouterReport

    class Router(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.layer_number = 2
            self.register_buffer("expert_bias", torch.zeros(3))
            self.register_buffer("local_tokens_per_expert", torch.zeros(3, dtype=torch.bfloat16))

    model = torch.nn.Sequential(Router())
    report = RouterReport(("z_loss",), num_layers=2, moe_layers=1, per_layer=False, experts=3,
                          bias_rate=0.5)
    meter, router = RouterMeter(report, model, torch.device("cpu")), model[0]
    taken = []
    for counts in ([700.0, 10.0, 3.0], [1.0, 2.0, 300.0]):
        meter.start()
        router.local_tokens_per_expert += torch.tensor(counts)  # what a forward's routing adds
        taken.append(meter.take())
    assert router.local_tokens_per_expert.dtype == torch.float32  # exact past 256
    total = taken[0] + taken[1]  # the replica's sum; a second TP rank adds the same again
    assert len(total) == report.slots == 2 + 2 * 2 * 3
    hi, lo = total[2:].reshape(2, 2, 3)
    assert (hi[1] * 256 + lo[1]).tolist() == [701.0, 12.0, 303.0] and not hi[0].any()
    shared = [max(a, b) for a, b in zip(report.rows(total, 2, 0), report.rows(total, 2, 1))]
    report.conclude(shared, 2, 8, model)  # the replica's MAX over its two TP ranks' rows
    counts = torch.tensor([1402.0, 24.0, 606.0])  # both TP rows
    assert router.expert_bias.tolist() == (torch.sign(counts.mean() - counts) * 0.5).tolist()
