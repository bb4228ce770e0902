"""Mixture of experts: Megatron-LM's MoE flags that ReCoVer honours, with Megatron's names,
meanings and defaults (megatron-core's MoE layer: router, token dispatcher, SequentialMLP
experts). The other `--moe-*` flags stay refused by name (`arguments.refused.reasons`)."""
from __future__ import annotations

import argparse
import ast


def moe_layer_freq(text: str) -> int | list[int]:
    """Megatron's --moe-layer-freq: N (every N-th layer is MoE) or a list expression of 0/1 per
    layer such as "([1]*3+[0]*1)*3". Megatron evaluates it with eval(); here only list literals,
    integers, + and * are read, so a flag cannot run code."""
    try:
        return int(text)
    except ValueError:
        pass
    try:
        value = _list_expression(ast.parse(text.strip(), mode="eval").body)
    except (SyntaxError, ValueError) as err:
        raise argparse.ArgumentTypeError(f"{text!r} is not an integer or a list expression like "
                                         f"'([1]*3+[0]*1)*3' ({err})") from None
    if not isinstance(value, list) or any(v not in (0, 1) for v in value):
        raise argparse.ArgumentTypeError(f"{text!r} must give a list of 0 and 1, one per layer")
    return value


def _list_expression(node: ast.AST):
    if isinstance(node, ast.Constant) and isinstance(node.value, int):
        return node.value
    if isinstance(node, ast.List):
        return [_list_expression(e) for e in node.elts]
    if isinstance(node, ast.BinOp) and isinstance(node.op, (ast.Add, ast.Mult)):
        left, right = _list_expression(node.left), _list_expression(node.right)
        return left + right if isinstance(node.op, ast.Add) else left * right
    raise ValueError(f"{ast.dump(node)[:40]} is not allowed")


def add_moe_args(parser: argparse.ArgumentParser) -> None:
    g = parser.add_argument_group("mixture of experts")
    g.add_argument("--num-experts", type=int, default=None,
                   help="Experts per MoE layer (None: a dense model).")
    g.add_argument("--moe-layer-freq", type=moe_layer_freq, default=1,
                   help="Every N-th layer is MoE, or a 0/1 list expression per layer.")
    g.add_argument("--moe-ffn-hidden-size", type=int, default=None,
                   help="An expert's FFN hidden size (default: --ffn-hidden-size).")
    g.add_argument("--moe-shared-expert-intermediate-size", type=int, default=None,
                   help="Hidden size of the shared experts (all of them together).")
    g.add_argument("--moe-shared-expert-gate", action="store_true",
                   help="Scale the shared experts' output by a sigmoid gate of the token "
                        "(megatron-core's SharedExpertMLP gate).")
    g.add_argument("--moe-router-topk", type=int, default=2, help="Experts per token.")
    g.add_argument("--moe-router-score-function", default="softmax",
                   choices=["softmax", "sigmoid"], help="The router's score function.")
    g.add_argument("--moe-router-pre-softmax", action="store_true",
                   help="Softmax before the top-k (the scores of all experts).")
    g.add_argument("--moe-router-topk-scaling-factor", type=float, default=None,
                   help="Scales the routing probabilities of the top-k experts.")
    g.add_argument("--moe-router-dtype", default=None, choices=["fp32", "fp64"],
                   help="The router's compute dtype (default: the model's).")
    g.add_argument("--moe-router-load-balancing-type", nargs="+", default="aux_loss",
                   choices=["aux_loss", "seq_aux_loss", "global_aux_loss", "sinkhorn", "none"],
                   help="Load balancing: aux_loss (per microbatch), seq_aux_loss (per "
                        "sequence), sinkhorn, none; global_aux_loss is refused.")
    g.add_argument("--moe-aux-loss-coeff", type=float, nargs="+", default=0.0,
                   help="The load-balancing loss's coefficient (one per balancing type).")
    g.add_argument("--moe-z-loss-coeff", type=float, default=None,
                   help="The router z-loss's coefficient.")
    g.add_argument("--moe-token-dispatcher-type", default="allgather",
                   choices=["allgather", "alltoall", "flex"],
                   help="How tokens reach their experts; flex is refused (alltoall with TP > 1 "
                        "needs a GPU).")
    g.add_argument("--moe-router-num-groups", type=int, default=None,
                   help="Group-limited routing: the experts in this many equal groups.")
    g.add_argument("--moe-router-group-topk", type=int, default=None,
                   help="Group-limited routing: a token's experts come from this many groups.")
    g.add_argument("--moe-apply-probs-on-input", action="store_true",
                   help="Multiply the routing probabilities into the experts' input instead of "
                        "their output (top-1 routing only, megatron-core's check).")
    g.add_argument("--moe-router-enable-expert-bias", action="store_true",
                   help="Aux-loss-free balancing: a per-expert bias on the routing scores, moved "
                        "each iteration towards the layer's mean count (sigmoid scores only).")
    g.add_argument("--moe-router-bias-update-rate", type=float, default=1e-3,
                   help="How far an expert's bias moves per iteration.")
    g.add_argument("--moe-expert-capacity-factor", type=float, default=None,
                   help="Expert capacity (tokens beyond it are dropped); None: no dropping.")
    g.add_argument("--moe-pad-expert-input-to-capacity", action="store_true",
                   help="Pad each expert's input to its capacity.")
    g.add_argument("--moe-token-drop-policy", default="probs", choices=["probs", "position"],
                   help="Which tokens an over-full expert drops.")
    _add_kernel_choices(g)
    g.add_argument("--expert-model-parallel-size", type=int, default=1,
                   help="Expert parallelism: the experts split over this many consecutive "
                        "data-parallel replicas (a unit, which fails and recovers as one).")
    g.add_argument("--expert-tensor-parallel-size", type=int, default=None,
                   help="Tensor parallelism inside an expert (default and only value for now: "
                        "--tensor-model-parallel-size).")


def _add_kernel_choices(g) -> None:
    """transformer-engine's kernels and overlaps, and per-layer logging: megatron-core's
    unfused modules compute the same (`config_rules._moe_kernels`)."""
    g.add_argument("--moe-grouped-gemm", action="store_true",
                   help="Megatron: one grouped GEMM for a layer's local experts. Here the same "
                        "products, one GEMM per expert (SequentialMLP).")
    g.add_argument("--moe-permute-fusion", action="store_true",
                   help="Megatron: transformer-engine's fused token permutation. Here "
                        "megatron-core's unfused one, which moves the same tokens.")
    g.add_argument("--moe-router-fusion", action="store_true",
                   help="Megatron: transformer-engine's fused top-k and aux loss. Here "
                        "megatron-core's unfused router, the same routing.")
    g.add_argument("--moe-shared-expert-overlap", action="store_true",
                   help="Megatron: the shared experts overlap the dispatch on a CUDA stream. "
                        "Here they run in turn (megatron-core's check of the dispatcher holds).")
    g.add_argument("--moe-per-layer-logging", action="store_true",
                   help="Each layer's auxiliary losses to TensorBoard as moe/<name>_layer_<i>.")
