"""Megatron-LM `pretrain_gpt.py` flags of hybrid models with gated delta net layers (linear
attention): megatron-core's GatedDeltaNet on the layers --linear-attention-freq names, with
Megatron-LM's names and defaults."""
from __future__ import annotations

import argparse

from megatron.training.arguments.flags.moe import moe_layer_freq

# megatron-core 0.16.1's name of the layer, and the name current Megatron-LM gives it
GATED_DELTA_NET = ("gated_delta_net", "gdn")


def add_linear_attention_args(parser: argparse.ArgumentParser) -> None:
    g = parser.add_argument_group("linear attention")
    g.add_argument("--experimental-attention-variant", default=None,
                   help="gated_delta_net (or gdn): megatron-core's GatedDeltaNet layers, on the "
                        "layers --linear-attention-freq names. Not yet gdn2 or dsa.")
    g.add_argument("--linear-attention-freq", type=moe_layer_freq, default=None,
                   help="N: every N-th layer keeps softmax attention, the others are gated delta "
                        "nets; or a list expression of 1 (linear) and 0 (softmax) per layer, e.g. "
                        "'([1]*3+[0]*1)*2'.")
    g.add_argument("--linear-conv-kernel-dim", type=int, default=4,
                   help="Width of the causal convolution over queries, keys and values.")
    g.add_argument("--linear-key-head-dim", type=int, default=128,
                   help="Per-head dimension of the gated delta net's queries and keys.")
    g.add_argument("--linear-value-head-dim", type=int, default=128,
                   help="Per-head dimension of its values.")
    g.add_argument("--linear-num-key-heads", type=int, default=16,
                   help="Its query and key heads.")
    g.add_argument("--linear-num-value-heads", type=int, default=32,
                   help="Its value heads (a multiple of the key heads).")
