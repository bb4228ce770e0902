"""The attention's fields of megatron-core's TransformerConfig, from Megatron-LM's flags."""
from __future__ import annotations

import argparse

from megatron.core.transformer.enums import AttnBackend


def attention_fields(args: argparse.Namespace) -> dict:
    """The attention's options (megatron-core's SelfAttention and its core attention)."""
    return dict(qk_layernorm=args.qk_layernorm, qk_l2_norm=args.qk_l2_norm,
                attention_output_gate=args.attention_output_gate,
                window_size=args.window_size, window_attn_skip_freq=args.window_attn_skip_freq,
                apply_query_key_layer_scaling=args.apply_query_key_layer_scaling,
                attention_softmax_in_fp32=args.attention_softmax_in_fp32,
                attention_backend=AttnBackend[args.attention_backend],
                **_linear_attention_fields(args))


def mla_fields(args: argparse.Namespace) -> dict:
    """MLATransformerConfig's own fields, from Megatron-LM's flags of the same names (its rope
    type stays megatron-core's default, yarn, unless --rope-type is given)."""
    fields = dict(q_lora_rank=args.q_lora_rank, kv_lora_rank=args.kv_lora_rank,
                  qk_head_dim=args.qk_head_dim, qk_pos_emb_head_dim=args.qk_pos_emb_head_dim,
                  v_head_dim=args.v_head_dim, rotary_scaling_factor=args.rotary_scaling_factor,
                  mscale=args.mscale, mscale_all_dim=args.mscale_all_dim,
                  rotary_base=args.rotary_base, rotary_percent=args.rotary_percent)
    return fields if args.rope_type is None else {**fields, "rope_type": args.rope_type}


def _linear_attention_fields(args: argparse.Namespace) -> dict:
    """Gated delta net layers: megatron-core 0.16.1 names the variant gated_delta_net, which
    current Megatron-LM also calls gdn."""
    if args.experimental_attention_variant is None:
        return {}
    return dict(experimental_attention_variant="gated_delta_net",
                linear_attention_freq=args.linear_attention_freq,
                linear_conv_kernel_dim=args.linear_conv_kernel_dim,
                linear_key_head_dim=args.linear_key_head_dim,
                linear_value_head_dim=args.linear_value_head_dim,
                linear_num_key_heads=args.linear_num_key_heads,
                linear_num_value_heads=args.linear_num_value_heads)
