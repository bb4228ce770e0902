"""--num-experts and its flags: Megatron-LM's checks, and what ReCoVer does not combine
with mixture of experts yet, each refused in one line naming the flag."""
from __future__ import annotations

import argparse

from megatron.core.transformer import TransformerConfig

from megatron.training.errors import ArgumentError
from megatron.training.config.moe import moe_fields


def validate_moe(args: argparse.Namespace, device: str) -> None:
    experts, flag = args.num_experts, "--num-experts"
    if experts is None:
        if args.expert_model_parallel_size != 1:
            raise ArgumentError("--expert-model-parallel-size", "--expert-model-parallel-size "
                                "needs --num-experts", "add --num-experts or drop the flag")
        return
    if experts < 1:
        raise ArgumentError(flag, f"{flag} must be >= 1, got {experts}", f"pass a positive {flag}")
    if not 1 <= args.moe_router_topk <= experts:
        raise ArgumentError("--moe-router-topk", f"--moe-router-topk {args.moe_router_topk} must "
                            f"be between 1 and {flag} {experts}", "pass a smaller top-k")
    if args.moe_apply_probs_on_input and args.moe_router_topk != 1:  # megatron-core's, at run
        raise ArgumentError("--moe-apply-probs-on-input", "--moe-apply-probs-on-input works only "
                            f"with --moe-router-topk 1, got {args.moe_router_topk}",
                            "pass --moe-router-topk 1 or drop the flag")
    freq = args.moe_layer_freq
    if isinstance(freq, list) and len(freq) != args.num_layers:
        raise ArgumentError("--moe-layer-freq", f"--moe-layer-freq gives {len(freq)} layers, the "
                            f"model has --num-layers {args.num_layers}", "give one 0/1 per layer")
    if args.moe_shared_expert_intermediate_size and args.add_bias_linear:  # megatron-core raises
        raise ArgumentError("--moe-shared-expert-intermediate-size", "megatron-core's shared "
                            "experts have no biases, and linear layers have them by default",
                            "add --disable-bias-linear")
    _refuse_not_built(args, device)
    _megatron_core_checks(args)


def _refuse_not_built(args: argparse.Namespace, device: str) -> None:
    ep, etp, tp = (args.expert_model_parallel_size, args.expert_tensor_parallel_size,
                   args.tensor_model_parallel_size)
    if ep < 1 or args.num_experts % ep:
        raise ArgumentError("--expert-model-parallel-size", f"--expert-model-parallel-size {ep} "
                            f"must divide --num-experts {args.num_experts}",
                            "pass a divisor of the expert count")
    if ep > 1:
        _refuse_with_expert_parallelism(args)
    if etp not in (None, tp):
        raise ArgumentError("--expert-tensor-parallel-size", f"--expert-tensor-parallel-size "
                            f"{etp} other than --tensor-model-parallel-size {tp} is not "
                            "supported by ReCoVer yet", "drop the flag")
    kinds = args.moe_router_load_balancing_type
    if "global_aux_loss" in (kinds if isinstance(kinds, list) else [kinds]):
        raise ArgumentError("--moe-router-load-balancing-type", "--moe-router-load-balancing-type "
                            "global_aux_loss sums expert loads over the data-parallel replicas, "
                            "so one replica's microbatches would change with the others': "
                            "not with ReCoVer's recovery", "pass aux_loss or seq_aux_loss")
    dispatcher = args.moe_token_dispatcher_type
    if dispatcher == "flex":
        raise ArgumentError("--moe-token-dispatcher-type", "--moe-token-dispatcher-type flex "
                            "needs DeepEP", "pass --moe-token-dispatcher-type alltoall")
    if dispatcher == "alltoall" and tp > 1 and device == "cpu":
        raise ArgumentError("--moe-token-dispatcher-type", "--moe-token-dispatcher-type "
                            "alltoall with --tensor-model-parallel-size > 1 gathers uneven token "
                            "counts over TP, which gloo's all-gather cannot (a GPU's NCCL can)",
                            "pass --moe-token-dispatcher-type allgather on a CPU")
    if args.context_parallel_size > 1:
        raise ArgumentError("--num-experts", "--num-experts with --context-parallel-size "
                            f"{args.context_parallel_size} is not supported by ReCoVer yet",
                            "use --context-parallel-size 1")
    if args.tensor_model_parallel_size > 1 and not args.sequence_parallel:  # megatron-core's
        raise ArgumentError("--num-experts", "--num-experts with --tensor-model-parallel-size "
                            f"{args.tensor_model_parallel_size} needs --sequence-parallel "
                            "(megatron-core's MoE layer refuses to train without it)",
                            "add --sequence-parallel")
    if args.moe_pad_expert_input_to_capacity and args.moe_expert_capacity_factor is None:
        raise ArgumentError("--moe-pad-expert-input-to-capacity", "--moe-pad-expert-input-to-"
                            "capacity needs --moe-expert-capacity-factor",
                            "add --moe-expert-capacity-factor or drop the flag")


def _refuse_with_expert_parallelism(args: argparse.Namespace) -> None:
    """What is not built for EP > 1 yet, each by its flag."""
    why = {"--ckpt-format": ((args.save or args.load) and args.ckpt_format == "torch",
                             "per-position files of each expert rank"),
           "--no-ckpt-fully-parallel-save": (
               args.save and not args.ckpt_fully_parallel_save, "one replica writing its "
               "unit's experts"),
           "--non-persistent-ckpt-type": (args.non_persistent_ckpt_type == "local",
                                          "local checkpoints of each expert rank"),
           "--rerun-mode": (args.rerun_mode == "report_stats", "re-running one replica's "
                            "microbatches (its unit runs together)")}
    for flag, (given, what) in why.items():
        if given:
            raise ArgumentError(flag, f"{flag} with --expert-model-parallel-size "
                                f"{args.expert_model_parallel_size}: {what} is not built yet",
                                "drop the flag or pass --expert-model-parallel-size 1")


def validate_expert_layout(args: argparse.Namespace, dp: int) -> None:
    """Megatron's check: the expert-parallel group is carved out of the data-parallel ranks."""
    ep = args.expert_model_parallel_size
    if args.num_experts is not None and dp % ep:
        raise ArgumentError("--expert-model-parallel-size", f"--expert-model-parallel-size {ep} "
                            f"must divide the data-parallel size {dp}",
                            "launch a multiple of EP replicas or change the flag")
    k = args.num_distributed_optimizer_instances
    if args.num_experts is not None and args.use_distributed_optimizer and (dp // k) % ep:
        # a unit within one instance: its replicas' experts are sharded over that instance's
        # units (Megatron: the expert-data-parallel size must divide by K)
        raise ArgumentError("--num-distributed-optimizer-instances", "--num-distributed-optimizer"
                            f"-instances {k} with --expert-model-parallel-size {ep}: each "
                            f"instance's {dp // k} replicas must hold whole units of {ep}",
                            f"pass an instance count K with {dp} / K a multiple of {ep}")


def _megatron_core_checks(args: argparse.Namespace) -> None:
    """megatron-core's own checks of the MoE fields, as one line instead of a traceback."""
    try:
        TransformerConfig(num_layers=args.num_layers, hidden_size=args.hidden_size,
                          num_attention_heads=args.num_attention_heads,
                          ffn_hidden_size=args.ffn_hidden_size,
                          tensor_model_parallel_size=args.tensor_model_parallel_size,
                          sequence_parallel=args.sequence_parallel,
                          add_bias_linear=args.add_bias_linear, **moe_fields(args),
                          moe_shared_expert_overlap=args.moe_shared_expert_overlap)
    except (AssertionError, ValueError) as err:
        raise ArgumentError("--num-experts", f"megatron-core refuses this mixture of experts: "
                            f"{str(err).splitlines()[0][:200]}", "change the MoE flags it "
                            "names (megatron-core's field names are the flags' with _)") from None
