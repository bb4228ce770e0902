"""Megatron-LM `pretrain_gpt.py` flags of multi-latent attention (DeepSeek's MLA): megatron-core's
MLASelfAttention in the GPT layers (its local spec), with Megatron-LM's names and defaults."""
from __future__ import annotations

import argparse


def add_mla_args(parser: argparse.ArgumentParser) -> None:
    g = parser.add_argument_group("mla")
    g.add_argument("--multi-latent-attention", action="store_true",
                   help="Attention through low-rank latents of the keys and values (and queries, "
                        "with --q-lora-rank): megatron-core's MLASelfAttention. Not yet with "
                        "context parallelism or transformer-engine layers.")
    g.add_argument("--q-lora-rank", type=int, default=None,
                   help="Rank of the queries' latent (None: queries projected directly).")
    g.add_argument("--kv-lora-rank", type=int, default=32, help="Rank of the keys' and values' latent.")
    g.add_argument("--qk-head-dim", type=int, default=128,
                   help="Per-head dimension of queries and keys without position embedding.")
    g.add_argument("--qk-pos-emb-head-dim", type=int, default=64,
                   help="Per-head dimension of queries and keys that carries the rope.")
    g.add_argument("--v-head-dim", type=int, default=128, help="Per-head dimension of the values.")
    g.add_argument("--rotary-scaling-factor", type=float, default=1.0,
                   help="Rope scaling factor of MLA's yarn rope.")
    g.add_argument("--mscale", type=float, default=1.0, help="MLA's yarn mscale.")
    g.add_argument("--mscale-all-dim", type=float, default=0.0, help="MLA's yarn mscale_all_dim.")
