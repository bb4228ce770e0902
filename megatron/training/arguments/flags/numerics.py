"""Megatron-LM `pretrain_gpt.py` flags that tune the model's and the optimizer's numerics, and
the run's memory and log level: same names, dests and defaults. Each is carried out by
megatron-core itself (TransformerConfig, GPTModel, OptimizerConfig's parameter groups) or by the
training loop, as in Megatron-LM; and its profiling flags (`profiling.py`)."""

from __future__ import annotations

import argparse

from megatron.training.arguments.flags.moe import moe_layer_freq


def window_size(text: str) -> tuple[int, int]:
    """Megatron-LM's tuple of --window-size: "LEFT,RIGHT", brackets allowed."""
    try:
        values = tuple(int(v) for v in text.strip().strip("()").split(","))
    except ValueError:
        values = ()
    if len(values) != 2 or min(values) < -1:
        raise argparse.ArgumentTypeError(f"{text!r} is not LEFT,RIGHT (integers >= -1, e.g. 128,0)")
    return values[0], values[1]


def add_numerics_args(parser: argparse.ArgumentParser) -> None:
    g = parser.add_argument_group("model and optimizer numerics")
    g.add_argument("--norm-epsilon", type=float, default=1e-5, dest="layernorm_epsilon",
                   help="Epsilon of every LayerNorm / RMSNorm.")
    g.add_argument("--add-qkv-bias", action="store_true",
                   help="Give the query/key/value projection a bias even with "
                        "--disable-bias-linear (with biases on, it has one anyway).")
    g.add_argument("--no-persist-layer-norm", action="store_true",
                   help="Do not use the persistent fused LayerNorm kernel (transformer-engine on "
                        "a GPU; the local layers never use it).")
    g.add_argument("--no-bias-swiglu-fusion", action="store_false", dest="bias_swiglu_fusion",
                   help="With --swiglu: do not fuse bias + SwiGLU (GPU-only, off on CPU).")
    g.add_argument("--disable-bf16-reduced-precision-matmul", action="store_true",
                   help="Forbid cuBLAS reduced-precision reductions in bf16 matmuls "
                        "(torch.backends.cuda.matmul.allow_bf16_reduced_precision_reduction).")
    g.add_argument("--use-rotary-position-embeddings", action="store_true",
                   help="Megatron-LM's older spelling of --position-embedding-type rope.")
    g.add_argument("--rope-type", default=None, choices=["rope", "yarn"],
                   help="Rope variant. Attention other than multi-latent takes only rope (as in "
                        "Megatron-LM); multi-latent attention defaults to yarn.")
    g.add_argument("--window-size", type=window_size, default=None,
                   help='Sliding-window attention: "LEFT,RIGHT" keys before and after each query '
                        "(-1: unbounded; causal attention ignores RIGHT). Default: off.")
    g.add_argument("--window-attn-skip-freq", type=moe_layer_freq, default=None,
                   help="With --window-size: every N-th layer attends to everything, or a 0/1 "
                        "list expression per layer (1: windowed).")
    g.add_argument("--qk-l2-norm", action="store_true",
                   help="L2-normalise each head's queries and keys (megatron-core's L2Norm, "
                        "Llama 4); it takes the place of --qk-layernorm's norms.")
    g.add_argument("--attention-output-gate", action="store_true",
                   help="Gated attention: the query projection also gives a gate per head, and "
                        "the attention's output is multiplied by its sigmoid (megatron-core).")
    g.add_argument("--rotary-seq-len-interpolation-factor", type=int, default=None,
                   help="Rope: divide positions by this factor (linear interpolation).")
    g.add_argument("--use-rope-scaling", action="store_true",
                   help="Rope: Llama 3.x frequency scaling.")
    g.add_argument("--rope-scaling-factor", type=float, default=8.0,
                   help="Rope: the factor of --use-rope-scaling.")
    _add_activation_args(g)
    g.add_argument("--apply-wd-to-qk-layernorm", action="store_true",
                   help="Apply weight decay to the query/key layernorm weights (the other 1-D "
                        "parameters and biases still skip it).")
    g.add_argument("--decoupled-lr", type=float, default=None,
                   help="Peak learning rate of the input embedding and output layer.")
    g.add_argument("--decoupled-min-lr", type=float, default=None,
                   help="Learning-rate floor of the input embedding and output layer.")
    g.add_argument("--empty-unused-memory-level", type=int, default=0, choices=[0, 1, 2],
                   help="On a GPU, release cached memory each iteration: 1 after the "
                        "forward-backward passes, 2 also after the optimizer step.")
    g.add_argument("--logging-level", type=int, default=None,
                   help="The root logger's level (logging's numbers: 10 debug, 20 info, ...). "
                        "Default: the MEGATRON_LOGGING_LEVEL environment variable, else info.")
    _add_profiling_args(parser)


def _add_activation_args(g) -> None:
    """The MLP's activation and the loss's kernel."""
    g.add_argument("--squared-relu", action="store_true",
                   help="MLP activation: megatron-core's squared ReLU (not with --swiglu).")
    g.add_argument("--quick-geglu", action="store_true",
                   help="Gated MLP with megatron-core's quick GELU (not with --swiglu).")
    g.add_argument("--glu-linear-offset", type=float, default=0.0,
                   help="Gated MLPs: added to the linear half before the product.")
    g.add_argument("--activation-func-clamp-value", type=float, default=None,
                   help="Gated MLPs: clamp the activation's input to this magnitude.")
    g.add_argument("--openai-gelu", action="store_true",
                   help="Accepted: current Megatron-LM reads it nowhere (it changes nothing).")
    g.add_argument("--onnx-safe", default=None,
                   help="Accepted: current Megatron-LM reads it nowhere (it changes nothing).")
    g.add_argument("--cross-entropy-loss-fusion", action="store_true",
                   help="The loss through megatron-core's fused vocab-parallel cross entropy "
                        "(torch.compile'd: the first iteration compiles it). As in Megatron-LM "
                        "its gradient to the logits is bf16, whatever the training dtype.")
    g.add_argument("--use-flash-attn", action="store_true",
                   help="Accepted: current Megatron-LM reads it nowhere for megatron-core models "
                        "(the kernel is --attention-backend); it changes nothing here either.")
    g.add_argument("--defer-embedding-wgrad-compute", action="store_true",
                   help="Accepted, changes nothing: a scheduling of transformer-engine's fused "
                        "weight-gradient GEMMs; the embedding's gradient is the same.")
    g.add_argument("--wgrad-deferral-limit", type=int, default=0,
                   help="Accepted, changes nothing: how many microbatches' embedding "
                        "weight-gradient GEMMs --defer-embedding-wgrad-compute defers (0: all).")
    g.add_argument("--cross-entropy-fusion-impl", default="native", choices=["native"],
                   help="The fused cross entropy's kernel: megatron-core's native one "
                        "(transformer-engine's `te` is not supported yet).")


def _add_profiling_args(parser: argparse.ArgumentParser) -> None:
    g = parser.add_argument_group("profiling")
    g.add_argument("--profile", action="store_true",
                   help="Profile the iterations between --profile-step-start and "
                        "--profile-step-end (megatron/training/profiling.py says which).")
    g.add_argument("--profile-step-start", type=int, default=10,
                   help="Profiling starts after this many iterations.")
    g.add_argument("--profile-step-end", type=int, default=12,
                   help="Profiling ends after this many iterations.")
    g.add_argument("--use-pytorch-profiler", action="store_true",
                   help="torch.profiler: a chrome trace per rank in <--tensorboard-dir>/../"
                        "torch_profile (else the CUDA profiler range, for nsys; GPU only).")
    g.add_argument("--pytorch-profiler-collect-shapes", action="store_true",
                   help="Record tensor shapes in the trace.")
    g.add_argument("--pytorch-profiler-collect-callstack", action="store_true",
                   help="Record Python call stacks in the trace.")
    g.add_argument("--profile-ranks", nargs="+", type=int, default=[],
                   help="Global ranks to profile (default: all).")
    g = parser.add_argument_group("straggler")
    g.add_argument("--log-straggler", action="store_true",
                   help="At every log line, the slowest and fastest replicas by seconds per "
                        "microbatch (ReCoVer's measured timings; megatron/training/straggler.py).")
    g.add_argument("--straggler-minmax-count", type=int, default=1,
                   help="How many slowest and fastest replicas the report names.")
    g.add_argument("--disable-straggler-on-startup", action="store_true",
                   help="No report (Megatron-LM waits for a toggle on its control port).")
    g.add_argument("--straggler-ctrlr-port", type=int, default=65535,
                   help="Megatron-LM's toggle server port. No effect: there is no such server.")

