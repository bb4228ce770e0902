"""Mixture of experts: the flags as megatron-core's TransformerConfig fields."""
from __future__ import annotations

import argparse


def one_or_list(values):
    """Megatron's nargs="+" MoE flags: a single value is passed as itself."""
    if isinstance(values, list) and len(values) == 1:
        return values[0]
    return values


def moe_fields(args: argparse.Namespace) -> dict:
    """TransformerConfig's MoE fields (megatron-core ignores them without experts)."""
    if args.num_experts is None:
        return {}
    return dict(
        num_moe_experts=args.num_experts,
        moe_layer_freq=args.moe_layer_freq,
        moe_ffn_hidden_size=args.moe_ffn_hidden_size or args.ffn_hidden_size,
        moe_shared_expert_intermediate_size=args.moe_shared_expert_intermediate_size,
        moe_shared_expert_gate=args.moe_shared_expert_gate,
        moe_router_topk=args.moe_router_topk,
        moe_router_score_function=args.moe_router_score_function,
        moe_router_pre_softmax=args.moe_router_pre_softmax,
        moe_router_topk_scaling_factor=args.moe_router_topk_scaling_factor,
        moe_router_num_groups=args.moe_router_num_groups,
        moe_router_group_topk=args.moe_router_group_topk,
        moe_apply_probs_on_input=args.moe_apply_probs_on_input,
        moe_router_dtype=args.moe_router_dtype,
        moe_router_load_balancing_type=one_or_list(args.moe_router_load_balancing_type),
        moe_aux_loss_coeff=one_or_list(args.moe_aux_loss_coeff),
        moe_z_loss_coeff=args.moe_z_loss_coeff,
        moe_per_layer_logging=args.moe_per_layer_logging,
        moe_router_enable_expert_bias=args.moe_router_enable_expert_bias,
        moe_router_bias_update_rate=args.moe_router_bias_update_rate,
        moe_token_dispatcher_type=args.moe_token_dispatcher_type,
        moe_expert_capacity_factor=args.moe_expert_capacity_factor,
        moe_pad_expert_input_to_capacity=args.moe_pad_expert_input_to_capacity,
        moe_token_drop_policy=args.moe_token_drop_policy,
        expert_model_parallel_size=args.expert_model_parallel_size,
        expert_tensor_parallel_size=(args.expert_tensor_parallel_size
                                     or args.tensor_model_parallel_size),
        moe_grouped_gemm=False,  # --moe-grouped-gemm computes the same with SequentialMLP
    )
