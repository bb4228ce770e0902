"""The Megatron-LM `pretrain_gpt.py` flags ReCoVer accepts: same names, dests and defaults.

Only declarations live here; every cross-flag rule is in the `arguments.validate` modules, so a
flag's meaning can be read in one place and its constraints in another.
"""

from __future__ import annotations

import argparse

from megatron.training.arguments.validate.pipeline import add_pipeline_split_args
from megatron.training.config.io import SUPPORTED_TYPES

# The split Megatron falls back to (with a warning) when --data-path is given without --split.
LEGACY_DEFAULT_SPLIT = "969, 30, 1"


def add_model_args(parser: argparse.ArgumentParser) -> None:
    g = parser.add_argument_group("model")
    g.add_argument("--num-layers", type=int, default=None, help="Number of transformer layers.")
    g.add_argument("--hidden-size", type=int, default=None, help="Transformer hidden size.")
    g.add_argument("--ffn-hidden-size", type=int, default=None,
                   help="MLP hidden size. Default 4*hidden (with --swiglu: 8/3*hidden rounded down to 64).")
    g.add_argument("--num-attention-heads", type=int, default=None, help="Number of attention heads.")
    g.add_argument("--kv-channels", type=int, default=None,
                   help="Per-head projection size. Default hidden-size // num-attention-heads.")
    g.add_argument("--seq-length", type=int, default=None, help="Tokens per sample.")
    g.add_argument("--max-position-embeddings", type=int, default=None,
                   help="Largest sequence length position embeddings support (>= --seq-length).")
    g.add_argument("--position-embedding-type", default="learned_absolute",
                   choices=["learned_absolute", "rope"], help="Position embedding kind.")
    g.add_argument("--make-vocab-size-divisible-by", type=int, default=128,
                   help="Pad the vocabulary to a multiple of this (times TP size).")
    g.add_argument("--untie-embeddings-and-output-weights", action="store_true",
                   help="Give the output layer its own weights instead of sharing the input embedding.")
    g.add_argument("--normalization", default="LayerNorm", choices=["LayerNorm", "RMSNorm"],
                   help="Normalization layer kind.")
    g.add_argument("--swiglu", action="store_true", help="Use a gated SwiGLU MLP instead of GeLU.")
    g.add_argument("--disable-bias-linear", action="store_false", dest="add_bias_linear",
                   help="Drop the biases of linear layers.")
    g.add_argument("--init-method-std", type=float, default=0.02,
                   help="Standard deviation of the normal weight initialisation.")
    g.add_argument("--hidden-dropout", type=float, default=0.1, help="Dropout after attention and MLP.")
    g.add_argument("--attention-dropout", type=float, default=0.1, help="Dropout on attention probs.")
    g.add_argument("--attention-backend", default="auto",
                   choices=["auto", "flash", "fused", "unfused", "local"],
                   help="Attention kernel. On CPU every allowed value runs torch SDPA attention; "
                        "flash and fused need a GPU. Kept as a string (megatron-core's AttnBackend[name]).")
    g.add_argument("--transformer-impl", default=None, choices=["local", "transformer_engine"],
                   help="Layer implementation. Default: transformer_engine on GPU when it is "
                        "importable, else local (always local on CPU).")
    g.add_argument("--group-query-attention", action="store_true",
                   help="Grouped-query attention: --num-query-groups key/value heads.")
    g.add_argument("--num-query-groups", type=int, default=1,
                   help="Key/value head groups with --group-query-attention.")
    g.add_argument("--rotary-percent", type=float, default=1.0,
                   help="Fraction of each head's channels rotated by rope.")
    g.add_argument("--rotary-base", type=int, default=10000, help="Base of the rope frequencies.")
    g.add_argument("--rotary-interleaved", action="store_true",
                   help="Rotate interleaved channel pairs instead of halves.")
    g.add_argument("--apply-layernorm-1p", action="store_true",
                   help="LayerNorm weight stored as (gamma - 1) (needs transformer_engine).")
    g.add_argument("--qk-layernorm", action="store_true", help="Normalise queries and keys per head.")
    g.add_argument("--use-mcore-models", action="store_true",
                   help="Accepted for compatibility: a no-op, megatron-core models are the only kind.")
    g.add_argument("--deterministic-mode", action="store_true",
                   help="Deterministic kernels only (torch.use_deterministic_algorithms).")
    g.add_argument("--calculate-per-token-loss", action="store_true",
                   help="Accepted: ReCoVer always divides by the global token count of the batch.")
    _add_kernel_and_recompute_args(g)


def _add_kernel_and_recompute_args(g) -> None:
    """The model group's fused-kernel and activation-recompute flags."""
    for name, what in (("rope-fusion", "the fused rope kernel"),
                       ("masked-softmax-fusion", "the fused masked softmax"),
                       ("bias-gelu-fusion", "the fused bias + gelu"),
                       ("bias-dropout-fusion", "the fused bias + dropout + add"),
                       ("gradient-accumulation-fusion", "the fused weight-gradient accumulation")):
        g.add_argument(f"--no-{name}", action="store_false", dest=name.replace("-", "_"),
                       help=f"Do not use {what}. Fused kernels are GPU-only: always off on CPU "
                            "(rope fusion also needs transformer-engine).")
    g.add_argument("--recompute-activations", action="store_true",
                   help="Recompute the attention core in backward (--recompute-granularity selective).")
    g.add_argument("--recompute-granularity", default=None, choices=["full", "selective"],
                   help="full: recompute whole transformer layers (needs --recompute-method); "
                        "selective: only the attention core. Dropout masks are drawn again exactly.")
    g.add_argument("--recompute-method", default=None, choices=["uniform", "block"],
                   help="uniform: recompute groups of --recompute-num-layers layers; block: the first "
                        "--recompute-num-layers layers of each pipeline stage.")
    g.add_argument("--recompute-num-layers", type=int, default=1,
                   help="Layers per recompute group (uniform) or recomputed per stage (block).")
    g.add_argument("--recompute-modules", nargs="+", default=None,
                   help="With selective granularity, the submodules recomputed (megatron-core's "
                        "names: core_attn, the default; mlp, moe, shared_experts). moe_act and "
                        "layernorm are kept in memory instead (see the start-up line).")


def add_parallel_args(parser: argparse.ArgumentParser) -> None:
    g = parser.add_argument_group("parallelism")
    g.add_argument("--tensor-model-parallel-size", type=int, default=1, help="Tensor parallel size.")
    g.add_argument("--pipeline-model-parallel-size", type=int, default=1, help="Pipeline stages.")
    add_pipeline_split_args(g)
    g.add_argument("--sequence-parallel", action="store_true",
                   help="Sequence parallelism over the TP group (norms and dropout on sequence shards).")
    g.add_argument("--context-parallel-size", type=int, default=1,
                   help="Context parallel size: each replica's sequences split over this many ranks "
                        "(megatron/training/model/context_parallel/__init__.py).")
    g.add_argument("--cp-comm-type", nargs="+", type=str, default=["p2p"],
                   help="How attention exchanges K/V over the CP group: p2p (a ring), a2a "
                        "(heads for sequence), allgather; a2a+p2p is refused, and so is a "
                        "different value per layer (megatron/training/model/context_parallel/comm.py).")
    g.add_argument("--hierarchical-context-parallel-sizes", nargs="+", type=int, default=None,
                   help="CP sizes of the a2a and p2p levels of --cp-comm-type a2a+p2p.")
    g.add_argument("--distributed-backend", default="nccl", choices=["nccl", "gloo"],
                   help="Collective backend. On CPU, nccl means gloo (the CPU backend), silently.")
    g.add_argument("--overlap-grad-reduce", action="store_true",
                   help="Start each gradient bucket's DP reduction as soon as the last microbatch's "
                        "backward has made it final.")
    g.add_argument("--use-distributed-optimizer", action="store_true",
                   help="Shard fp32 main params and Adam moments over the replicas of an instance "
                        "(megatron/training/optimizer/distributed/__init__.py).")
    g.add_argument("--num-distributed-optimizer-instances", type=int, default=1,
                   help="With --use-distributed-optimizer: DP replicas form this many instances, "
                        "each holding a whole copy of the optimizer state. K >= 2 survives lost "
                        "replicas in-step (their slices come from another instance); K = 1 "
                        "stops for a restart with --load.")
    g.add_argument("--overlap-param-gather", action="store_true",
                   help="With --use-distributed-optimizer and --overlap-grad-reduce: the step only "
                        "starts the weights' all-gathers; each module's next forward waits for "
                        "its parameters' bucket.")
    g.add_argument("--overlap-param-gather-with-optimizer-step", action="store_true",
                   help="Accepted, changes nothing: the weights' all-gathers already overlap the "
                        "next forward (--overlap-param-gather).")
    g.add_argument("--ddp-average-in-collective", action="store_true",
                   help="Accepted, changes nothing: gradients are summed over replicas and divided "
                        "by the global batch's token count, the same average.")
    g.add_argument("--ddp-bucket-size", type=int, default=None,
                   help="Parameters per gradient bucket. Default: one bucket, or with "
                        "--overlap-grad-reduce max(40M, 1M * data-parallel size).")
    g.add_argument("--distributed-timeout-minutes", type=int, default=10,
                   help="Timeout for building process groups, in minutes.")
    g.add_argument("--local-rank", type=int, default=None,
                   help="Local rank; accepted for compatibility, the LOCAL_RANK env var wins.")
    g.add_argument("--use-cpu-initialization", action="store_true", default=None,
                   help="Initialise weights on the CPU.")
    g.add_argument("--use-tp-pp-dp-mapping", action="store_true",
                   help="Order ranks tp, then pp, then dp (rank = tp + TP*pp + TP*PP*dp): a "
                        "replica's ranks are contiguous. Default Megatron's tp, dp, pp.")


def add_batch_args(parser: argparse.ArgumentParser) -> None:
    g = parser.add_argument_group("batch and length of training")
    g.add_argument("--micro-batch-size", type=int, required=True, help="Samples per microbatch.")
    g.add_argument("--global-batch-size", type=int, default=None,
                   help="Samples per iteration. Default micro-batch-size * data-parallel size.")
    g.add_argument("--rampup-batch-size", nargs=3, type=int, default=None,
                   metavar=("START", "INCR", "SAMPLES"),
                   help="Grow the global batch from START by INCR over SAMPLES samples. Unlike "
                        "Megatron-LM, also allowed with --train-iters.")
    g.add_argument("--step-batch-size-schedule", default=None,
                   help='Global batch by consumed tokens, "THRESHOLD:BATCH ..." (K/M/B/T '
                        'suffixes; e.g. "0:768 250B:1536"), instead of --global-batch-size.')
    g.add_argument("--train-iters", type=int, default=None, help="Iterations to train for.")
    g.add_argument("--train-samples", type=int, default=None,
                   help="Samples to train for (sets train-iters; excludes --train-iters).")


def add_optimizer_args(parser: argparse.ArgumentParser) -> None:
    g = parser.add_argument_group("optimizer and learning rate")
    g.add_argument("--optimizer", default="adam", choices=["adam", "sgd"],
                   help="Optimizer. Only adam is supported by ReCoVer.")
    g.add_argument("--lr", type=float, default=None, help="Peak learning rate.")
    g.add_argument("--min-lr", type=float, default=0.0, help="Floor of the learning rate decay.")
    g.add_argument("--lr-decay-style", default="linear",
                   choices=["constant", "linear", "cosine", "inverse-square-root", "WSD"],
                   help="Learning rate decay shape (WSD: warm-up, stable, then the last "
                        "--lr-wsd-decay-iters/-samples anneal in --lr-wsd-decay-style).")
    g.add_argument("--lr-wsd-decay-style", default="exponential",
                   choices=["exponential", "linear", "cosine", "minus_sqrt"],
                   help="WSD: the annealing phase's shape.")
    g.add_argument("--lr-wsd-decay-iters", type=int, default=None,
                   help="WSD: iterations of the annealing phase.")
    g.add_argument("--lr-wsd-decay-samples", type=int, default=None,
                   help="WSD: samples of the annealing phase (sample-based runs).")
    g.add_argument("--lr-decay-iters", type=int, default=None,
                   help="Iterations to decay over. Default --train-iters.")
    g.add_argument("--lr-decay-samples", type=int, default=None,
                   help="Samples to decay over (sample-based runs). Default --train-samples.")
    g.add_argument("--lr-warmup-fraction", type=float, default=None,
                   help="Warmup length as a fraction of the decay length.")
    g.add_argument("--lr-warmup-iters", type=int, default=0, help="Warmup length in iterations.")
    g.add_argument("--lr-warmup-samples", type=int, default=0, help="Warmup length in samples.")
    g.add_argument("--lr-warmup-init", type=float, default=0.0, help="Learning rate warmup starts at.")
    g.add_argument("--weight-decay", type=float, default=0.01, help="Weight decay coefficient.")
    g.add_argument("--start-weight-decay", type=float, default=None,
                   help="Initial weight decay (non-constant --weight-decay-incr-style).")
    g.add_argument("--end-weight-decay", type=float, default=None,
                   help="Final weight decay (non-constant --weight-decay-incr-style).")
    g.add_argument("--weight-decay-incr-style", default="constant",
                   choices=["constant", "linear", "cosine"], help="Weight decay schedule.")
    g.add_argument("--adam-beta1", type=float, default=0.9, help="Adam beta1.")
    g.add_argument("--adam-beta2", type=float, default=0.999, help="Adam beta2.")
    g.add_argument("--adam-eps", type=float, default=1e-8, help="Adam epsilon.")
    g.add_argument("--clip-grad", type=float, default=1.0, help="Global gradient-norm clip (0: off).")
    g.add_argument("--seed", type=int, default=1234, help="Random seed.")


def add_data_args(parser: argparse.ArgumentParser) -> None:
    g = parser.add_argument_group("data and tokenizer")
    g.add_argument("--data-path", nargs="*", default=None,
                   help='Dataset prefix, or a blend "W1 PREFIX1 W2 PREFIX2 ...".')
    g.add_argument("--data-args-path", default=None,
                   help="A file holding --data-path's list (for long blends).")
    for split in ("train", "valid", "test"):
        g.add_argument(f"--{split}-data-path", nargs="*", default=None,
                       help=f"The {split} split's own blend (as --data-path; no --split).")
    g.add_argument("--per-split-data-args-path", default=None,
                   help='A JSON file {"train": [...], "valid": [...], "test": [...]} of blends.')
    g.add_argument("--split", default=None,
                   help=f'Train/valid/test weights, e.g. "949,50,1". Default "{LEGACY_DEFAULT_SPLIT}" '
                        "(with a warning when --data-path is given).")
    g.add_argument("--mock-data", action="store_true", help="Train on synthetic data (no --data-path).")
    g.add_argument("--tokenizer-type", default="GPT2BPETokenizer", choices=SUPPORTED_TYPES,
                   help="Tokenizer kind (the SentencePiece ones read --tokenizer-model).")
    add_tiktoken_args(g)
    g.add_argument("--tokenizer-model", default=None,
                   help="HuggingFaceTokenizer: a local directory holding tokenizer.json (offline).")
    g.add_argument("--vocab-file", default=None, help="GPT-2 BPE vocab.json.")
    g.add_argument("--merge-file", default=None, help="GPT-2 BPE merges.txt.")
    g.add_argument("--vocab-size", type=int, default=None,
                   help="Vocabulary size: NullTokenizer's; TikTokenizer's, special tokens included.")
    g.add_argument("--data-cache-path", default=None, help="Where dataset index caches are written.")
    g.add_argument("--num-workers", type=int, default=2,
                   help="Data loader worker processes (Megatron-LM). ReCoVer has no loader pool "
                   "(microbatches are read by id): a value other than 2 is noted at start-up.")
    g.add_argument("--reset-position-ids", action="store_true",
                   help="Restart position ids after each end-of-document token.")
    g.add_argument("--reset-attention-mask", action="store_true",
                   help="Do not attend across end-of-document tokens.")
    g.add_argument("--no-create-attention-mask-in-dataloader", action="store_false",
                   dest="create_attention_mask_in_dataloader",
                   help="The dataset builds no attention mask (attention is plain causal).")
    g.add_argument("--eod-mask-loss", action="store_true", help="No loss on end-of-document tokens.")
    g.add_argument("--no-mmap-bin-files", action="store_false", dest="mmap_bin_files",
                   help="Read the .bin files with plain file reads instead of memory-mapping them "
                        "(megatron-core's IndexedDataset option).")
    g.add_argument("--num-dataset-builder-threads", type=int, default=1,
                   help="Threads that build a blend's datasets (each prefix's index arrays).")
    g.add_argument("--mid-level-dataset-surplus", type=float, default=0.005,
                   help="Extra share of samples each dataset of a blend builds beyond its weight's.")


def add_logging_args(parser: argparse.ArgumentParser) -> None:
    g = parser.add_argument_group("logging and evaluation")
    g.add_argument("--log-interval", type=int, default=100, help="Iterations between log lines.")
    g.add_argument("--eval-interval", type=int, default=1000, help="Iterations between evaluations.")
    g.add_argument("--eval-iters", type=int, default=100, help="Iterations per evaluation.")
    g.add_argument("--tensorboard-dir", default=None,
                   help="Write TensorBoard scalars here from the logging rank (needs the "
                        "tensorboard package: pip install tensorboard).")
    g.add_argument("--tensorboard-log-interval", type=int, default=1,
                   help="Iterations between TensorBoard scalars (the JSONL gets every iteration).")
    g.add_argument("--tensorboard-queue-size", type=int, default=1000,
                   help="Events TensorBoard's writer queues before it writes (its max_queue).")
    g.add_argument("--log-params-norm", action="store_true",
                   help="Compute the fp32 main params' L2 norm every iteration: `params norm` in the "
                        "log line, `params-norm` in TensorBoard (one small collective per iteration "
                        "over the replica's model-parallel ranks). With --use-distributed-optimizer "
                        "the norm of the model's weights (the main ones are sharded).")
    g.add_argument("--log-num-zeros-in-grad", action="store_true",
                   help="Count the zeros of the reduced gradient every iteration: `num zeros` in the "
                        "log line, `num-zeros` in TensorBoard.")
    g.add_argument("--log-throughput", action="store_true",
                   help="TFLOP/s per GPU with Megatron-LM's FLOP formula (dense GPT) over the live "
                        "ranks: in the log line and as TensorBoard's `throughput`.")
    g.add_argument("--log-timers-to-tensorboard", action="store_true",
                   help="Write the iteration's phase times (forward-backward, grads-all-reduce, "
                        "recover-commit, optimizer) as `<name>-time` scalars. Needs --tensorboard-dir.")
    g.add_argument("--timing-log-level", type=int, default=0, choices=[0, 1, 2],
                   help="Megatron's timer detail. ReCoVer times the four phases of its iteration "
                        "only, so levels 1 and 2 log the same timers as 0.")
    g.add_argument("--log-memory-to-tensorboard", action="store_true",
                   help="Memory of the logging rank: on CUDA Megatron's mem-reserved-bytes, "
                        "mem-allocated-bytes, mem-max-allocated-bytes, mem-allocated-count; on CPU "
                        "mem-max-rss-bytes and (Linux) mem-rss-bytes. Needs --tensorboard-dir.")
    g.add_argument("--log-validation-ppl-to-tensorboard", action="store_true",
                   help="Also write `lm loss validation ppl` (exp of the loss). Needs "
                        "--tensorboard-dir.")
    _add_wandb_and_gc_args(g)
    _add_rerun_args(g)
    g.add_argument("--metrics-file", default=None,
                   help="ReCoVer: append one JSON record per iteration to this JSONL file.")
    g.add_argument("--check-weight-hash-across-dp-replicas-interval", type=int, default=None,
                   help="Every N iterations, check that every data-parallel replica holds bitwise "
                        "the same weights (a fingerprint rides in the next gradient reduction); "
                        "stop loudly if not.")


def _add_wandb_and_gc_args(g) -> None:
    """The logging group's Weights & Biases and manual garbage-collection flags."""
    g.add_argument("--wandb-project", default="",
                   help="Weights & Biases project: on when given, the same scalars as TensorBoard "
                        "from the logging rank (needs the `wandb` extra; offline with "
                        "WANDB_MODE=offline).")
    g.add_argument("--wandb-exp-name", default="", help="W&B run name.")
    g.add_argument("--wandb-save-dir", default="", help="Directory of W&B's local files.")
    g.add_argument("--wandb-entity", default="", help="W&B entity (user or team).")
    g.add_argument("--manual-gc", action="store_true",
                   help="Disable Python's automatic garbage collection; collect every "
                        "--manual-gc-interval iterations (and around evaluations) instead.")
    g.add_argument("--manual-gc-interval", type=int, default=0,
                   help="Iterations between collections with --manual-gc (0: only at start).")
    g.add_argument("--no-manual-gc-eval", action="store_false", dest="manual_gc_eval",
                   help="With --manual-gc: no collection before and after each evaluation.")


def add_precision_args(parser: argparse.ArgumentParser) -> None:
    g = parser.add_argument_group("precision")
    g.add_argument("--fp16", action="store_true",
                   help="fp16 params and activations, fp32 main params and grads, dynamic loss scaling.")
    g.add_argument("--bf16", action="store_true",
                   help="bf16 params and activations, fp32 main params and grads.")
    g.add_argument("--loss-scale", type=float, default=None,
                   help="Static fp16 loss scale (a power of 2); default dynamic.")
    g.add_argument("--initial-loss-scale", type=float, default=2.0**32,
                   help="Starting dynamic loss scale.")
    g.add_argument("--min-loss-scale", type=float, default=1.0, help="Floor of the dynamic loss scale.")
    g.add_argument("--loss-scale-window", type=float, default=1000,
                   help="Iterations without overflow before the dynamic loss scale doubles.")
    g.add_argument("--hysteresis", type=int, default=2,
                   help="Overflowing iterations tolerated before the dynamic loss scale halves.")
    g.add_argument("--accumulate-allreduce-grads-in-fp32", action="store_true",
                   help="Accumulate and reduce gradients in fp32. ReCoVer always does (its main-grad "
                        "buffer carries the commit bookkeeping); unlike Megatron-LM, --fp16 without "
                        "this flag also reduces in fp32.")
    g.add_argument("--attention-softmax-in-fp32", action="store_true",
                   help="Compute the attention softmax in fp32.")
    g.add_argument("--apply-query-key-layer-scaling", action="store_true",
                   help="Scale Q*K^T by 1/layer-number (fp16 stability).")


def _add_rerun_args(g) -> None:
    """Megatron's rerun state machine, done by another replica (megatron/training/rerun/__init__.py)."""
    g.add_argument("--rerun-mode", default="validate_results",
                   choices=["disabled", "validate_results", "report_stats"],
                   help="validate_results: a non-finite loss is re-computed on another replica; "
                        "a replica whose result does not repeat is fenced and training goes on, "
                        "one that repeats stops the job (status 3). report_stats: each iteration "
                        "one replica's microbatches are re-run by another, and the loss sums' "
                        "relative difference is logged as Megatron's determinism stats.")
    g.add_argument("--error-injection-rate", type=int, default=0,
                   help="Every N-th iteration, replica (iteration / N) mod DP makes its loss NaN "
                        "(Megatron draws it at random at this rate; here it is deterministic).")
    g.add_argument("--error-injection-type", default="transient_error",
                   choices=["correct_result", "transient_error", "persistent_error"],
                   help="correct_result: the NaN follows the microbatches (the re-run repeats "
                        "it); the errors stay on the replica that made them.")
    g.add_argument("--check-for-spiky-loss", action="store_true",
                   help="validate_results also re-runs a replica whose loss per token is 10 x the "
                        "largest of its first 100 (Megatron's rule): the same again goes on, "
                        "another result fences the replica. Injected errors become spikes.")
    g.add_argument("--check-for-large-grads", action="store_true",
                   help="validate_results also re-runs a replica whose gradient norm (on one of "
                        "its ranks, per microbatch) is 10 x the largest of its first 100: the "
                        "same norms again go on, others fence it. Injected errors amplify the "
                        "gradients.")
    g.add_argument("--result-rejected-tracker-filename", default=None,
                   help="Append one line per rejected result (iteration, replicas, ranks, "
                        "microbatches) to this file.")


def add_tiktoken_args(g) -> None:
    """TikTokenizer's and SentencePiece's flags (the training and preprocessing parsers share
    them)."""
    g.add_argument("--tiktoken-pattern", default=None, choices=["v1", "v2"],
                   help="TikTokenizer: the pre-tokenization regex (default v2).")
    g.add_argument("--tiktoken-num-special-tokens", type=int, default=1000,
                   help="TikTokenizer: ids 0..N-1 are special tokens; the vocabulary follows.")
    g.add_argument("--tokenizer-special-tokens", nargs="+", dest="special_tokens", default=None,
                   help="TikTokenizer: the named special tokens (must include <unk> <s> </s> "
                        "<mask> <pad> <cls> <sep>); SentencePiece with "
                        "--tokenizer-sentencepiece-legacy: tokens added to its model.")
    g.add_argument("--tokenizer-sentencepiece-legacy", action="store_true",
                   help="SentencePiece: megatron-core's legacy wrapper (special tokens added "
                        "after training).")
    g.add_argument("--no-tokenizer-sentencepiece-ignore-extra-whitespaces",
                   "--disable-tokenizer-sentencepiece-ignore-extra-whitespaces",
                   action="store_false", dest="tokenizer_sentencepiece_ignore_extra_whitespaces",
                   help="SentencePiece: keep runs of spaces that the model would drop.")

