"""Checks for what the job reads and writes: data, tokenizer, checkpoints, logs; and ReCoVer's flags."""

from __future__ import annotations

import argparse
import importlib.util
import os

from megatron.training.errors import ArgumentError
from megatron.training.arguments.flags import LEGACY_DEFAULT_SPLIT
from megatron.training.config.data_sources import data_sources
from megatron.training.config.io import MODEL_FILE_TYPES, SENTENCEPIECE_TYPES
from megatron.training.config.rules import node_size_of, placed_topology
from megatron.training.replication import foreign_copy
from recover_patches.recovery.fixed_point import MAX_REPLICAS
from recover_patches.topology import Topology

# megatron-core's mock dataset always uses this even split; say so in args rather than hide it.
MOCK_DATA_SPLIT = "1,1,1"


def validate_data(args: argparse.Namespace) -> list[str]:
    """Returns warnings for the caller to print once every check has passed."""
    warnings: list[str] = []
    sources = data_sources(args)
    if sources.per_split is not None:
        if not sources.per_split[0]:
            raise ArgumentError(sources.split_flags[0], "no training split given",
                                "give the train split's PREFIX or W PREFIX entries")
        for flag, blend in zip(sources.split_flags, sources.per_split):
            _check_blend(list(blend or ()), flag)
    elif not args.mock_data and not sources.blend:
        raise ArgumentError("--data-path", "no training data given",
                            "pass --data-path PREFIX (or 'W1 PREFIX1 W2 PREFIX2 ...'), or --mock-data")
    if sources.blend:
        _check_blend(list(sources.blend), sources.blend_flag)
    if sources.per_split is not None:
        if args.split is not None:
            warnings.append("--split has no effect with a blend per split (as in Megatron-LM)")
    elif args.split is None:
        if args.mock_data:
            args.split = MOCK_DATA_SPLIT
        else:
            warnings.append("--split not given with --data-path; using the legacy "
                            f'default "{LEGACY_DEFAULT_SPLIT}"')
            args.split = LEGACY_DEFAULT_SPLIT
    if args.num_workers < 0:
        raise ArgumentError("--num-workers", "--num-workers must be >= 0", "pass --num-workers 2")
    if args.num_dataset_builder_threads < 1:
        raise ArgumentError("--num-dataset-builder-threads", "--num-dataset-builder-threads must "
                            "be >= 1", "pass --num-dataset-builder-threads 1")
    if not args.mid_level_dataset_surplus >= 0:
        raise ArgumentError("--mid-level-dataset-surplus", "--mid-level-dataset-surplus must be "
                            ">= 0", "pass --mid-level-dataset-surplus 0.005")
    if args.fim_data:
        _validate_fim(args)
    return warnings


# Tokenizers whose text round trip fill-in-the-middle needs (tokens to text, and back).
FIM_TOKENIZERS = ("GPT2BPETokenizer", "HuggingFaceTokenizer")


def _validate_fim(args: argparse.Namespace) -> None:
    if args.mock_data:
        raise ArgumentError("--fim-data", "fill-in-the-middle rewrites real text, and --mock-data "
                            "has none", "pass --data-path, or drop --fim-data")
    for flag, rate in (("--fim-rate", args.fim_rate), ("--fim-spm-rate", args.fim_spm_rate),
                       ("--fim-fragment-rate", args.fim_fragment_rate)):
        if rate is not None and not 0.0 <= rate <= 1.0:
            raise ArgumentError(flag, f"{flag} {rate} is not a probability",
                                f"pass {flag} between 0 and 1")
    if args.fim_split_sample is not None and args.fim_fragment_rate is None:
        raise ArgumentError("--fim-fragment-rate", "--fim-split-sample rewrites each fragment at "
                            "--fim-fragment-rate, which is not given",
                            "pass --fim-fragment-rate, e.g. 0.5")
    kind = args.tokenizer_type or "GPT2BPETokenizer"
    if kind not in FIM_TOKENIZERS:
        raise ArgumentError("--fim-data", f"fill-in-the-middle cuts a sample's text, which "
                            f"{kind} does not give back", f"use --tokenizer-type "
                            f"{' or '.join(FIM_TOKENIZERS)}")


def _is_number(text: str) -> bool:
    try:
        float(text)
    except ValueError:
        return False
    return True


def _check_blend(data_path: list[str], flag: str = "--data-path") -> None:
    """A blend is either prefixes only, or weight/prefix pairs: half-weighted lists are typos."""
    if len(data_path) < 2 or len(data_path) % 2 == 1:
        return
    weights = data_path[0::2]
    numeric = [_is_number(w) for w in weights]
    if any(numeric) and not all(numeric):
        raise ArgumentError(flag, f"blend {' '.join(data_path)!r} mixes weighted and "
                            "unweighted entries", "pass 'W1 PREFIX1 W2 PREFIX2 ...' or only prefixes")
    if all(numeric) and any(float(w) < 0 for w in weights):
        raise ArgumentError(flag, "blend weights must be >= 0", "fix the weights")


def validate_tokenizer(args: argparse.Namespace) -> None:
    if args.tokenizer_type == "NullTokenizer":
        if args.vocab_size is None or args.vocab_size < 1:
            raise ArgumentError("--vocab-size", "NullTokenizer needs a positive --vocab-size",
                                "pass --vocab-size N")
        return
    if args.tokenizer_type in SENTENCEPIECE_TYPES and args.special_tokens \
            and not args.tokenizer_sentencepiece_legacy:  # megatron-core raises
        raise ArgumentError("--tokenizer-special-tokens", "a SentencePiece model takes added "
                            "special tokens only with --tokenizer-sentencepiece-legacy "
                            "(otherwise they belong to the model when it is trained)",
                            "add --tokenizer-sentencepiece-legacy or drop the flag")
    if args.tokenizer_type in MODEL_FILE_TYPES:  # built: files checked
        if not args.tokenizer_model:
            raise ArgumentError("--tokenizer-model", f"{args.tokenizer_type} needs "
                                "--tokenizer-model", "pass --tokenizer-model PATH (a "
                                "tokenizer.json, or a directory holding one)")
        return
    for flag, path in (("--vocab-file", args.vocab_file), ("--merge-file", args.merge_file)):
        if path is None:
            raise ArgumentError(flag, f"{args.tokenizer_type} needs {flag}",
                                f"pass {flag} PATH, or use --tokenizer-type NullTokenizer --vocab-size N")
        if not os.path.isfile(path):
            raise ArgumentError(flag, f"{flag} file not found: {path}", f"pass an existing {flag}")


def validate_checkpointing(args: argparse.Namespace) -> None:
    if args.save is not None and (args.save_interval is None or args.save_interval < 1):
        raise ArgumentError("--save-interval", "--save needs a positive --save-interval",
                            "pass --save-interval N (iterations between saves)")
    retain = args.save_retain_interval
    if retain is not None and (retain < 1 or args.save_interval is None
                               or retain % args.save_interval):  # Megatron-LM asserts both
        raise ArgumentError("--save-retain-interval", f"--save-retain-interval {retain} is not a "
                            "positive multiple of --save-interval", "pass a multiple of "
                            "--save-interval")
    if args.verify_integrity and args.ckpt_format != "torch_dist":
        raise ArgumentError("--verify-integrity", "--verify-integrity needs --ckpt-format "
                            "torch_dist (as in Megatron-LM)", "drop --ckpt-format torch or "
                            "--verify-integrity")
    if args.override_opt_param_scheduler and args.use_checkpoint_opt_param_scheduler:
        raise ArgumentError("--override-opt_param-scheduler",
                            "--override-opt_param-scheduler keeps this run's LR schedule and "
                            "--use-checkpoint-opt_param-scheduler takes the checkpoint's",
                            "pass one of them")


def validate_non_persistent(args: argparse.Namespace, world_size: int) -> None:
    """Megatron's checks of the non-persistent flags, and ReCoVer's one: --replication's copies
    must be the same (tp, pp) in other replicas (`checkpoint_local`)."""
    kind, interval = args.non_persistent_ckpt_type, args.non_persistent_save_interval
    if kind == "in_memory":
        raise ArgumentError("--non-persistent-ckpt-type", "--non-persistent-ckpt-type in_memory "
                            "is not supported (Megatron-LM refuses it too)", "use local or global")
    if interval is not None and (interval < 1 or kind is None):
        raise ArgumentError("--non-persistent-save-interval", "--non-persistent-save-interval "
                            "needs a value >= 1 and a --non-persistent-ckpt-type",
                            "pass --non-persistent-ckpt-type local (with "
                            "--non-persistent-local-ckpt-dir) or global")
    if kind == "local" and not args.non_persistent_local_ckpt_dir:
        raise ArgumentError("--non-persistent-local-ckpt-dir", "--non-persistent-ckpt-type local "
                            "needs --non-persistent-local-ckpt-dir", "pass a directory on each "
                            "node's own disk")
    if args.replication:
        _validate_replication(args, world_size)


def _validate_replication(args: argparse.Namespace, world_size: int) -> None:
    jump, factor = args.replication_jump, args.replication_factor
    if args.non_persistent_ckpt_type != "local":
        raise ArgumentError("--replication", "--replication copies local checkpoints",
                            "pass --non-persistent-ckpt-type local, or drop --replication")
    if jump is None or jump < 1 or factor < 1 or world_size % (jump * factor):
        raise ArgumentError("--replication-jump", f"--replication needs --replication-jump J >= 1 "
                            f"and --replication-factor F >= 1 with J x F dividing the {world_size} "
                            f"ranks (got J={jump}, F={factor})", "pass matching values")
    order = placed_topology(args, world_size, node_size_of(os.environ, world_size)).dp_last
    topology = Topology.from_world(world_size, args.tensor_model_parallel_size,
                                   args.pipeline_model_parallel_size, order)
    pair = foreign_copy(topology, jump, factor)
    if pair is not None:
        step = topology.rank(0, 1, 0) if topology.dp > 1 else None
        raise ArgumentError("--replication-jump", f"--replication-jump {jump} puts rank "
                            f"{pair[0]}'s copy on rank {pair[1]}, another (tp, pp) position; "
                            "ReCoVer's copies are the other replicas' own files of the same "
                            "position", (f"pass a multiple of {step} that stays within the "
                                         "replicas" if step else "DP is 1: no replica holds a "
                                         "copy") + ", or drop --replication")


def validate_logging(args: argparse.Namespace) -> None:
    check = args.check_weight_hash_across_dp_replicas_interval
    if check is not None and check < 1:
        raise ArgumentError("--check-weight-hash-across-dp-replicas-interval",
                            f"--check-weight-hash-across-dp-replicas-interval must be >= 1, got "
                            f"{check}", "pass a positive interval or drop the flag")
    for flag, value, least in (("--log-interval", args.log_interval, 1),
                               ("--eval-interval", args.eval_interval, 1),
                               ("--eval-iters", args.eval_iters, 0)):
        if value < least:
            raise ArgumentError(flag, f"{flag} must be >= {least}, got {value}", f"pass {flag} {least}")
    if args.profile and not 0 <= args.profile_step_start < args.profile_step_end:
        raise ArgumentError("--profile-step-end", f"--profile-step-end {args.profile_step_end} "
                            f"must be after --profile-step-start {args.profile_step_start} (>= 0)",
                            "pass --profile-step-start S --profile-step-end E with 0 <= S < E")
    if args.straggler_minmax_count < 1:
        raise ArgumentError("--straggler-minmax-count", f"--straggler-minmax-count must be >= 1, "
                            f"got {args.straggler_minmax_count}", "pass --straggler-minmax-count 1")
    if args.error_injection_rate < 0 or (args.error_injection_rate and
                                         args.rerun_mode != "validate_results"):
        raise ArgumentError("--error-injection-rate", f"--error-injection-rate "
                            f"{args.error_injection_rate} needs a rate >= 0 and --rerun-mode "
                            "validate_results", "drop --error-injection-rate or --rerun-mode")
    for flag, value in (("--exit-interval", args.exit_interval),
                        ("--exit-duration-in-mins", args.exit_duration_in_mins)):
        if value is not None and value <= 0:
            raise ArgumentError(flag, f"{flag} must be > 0, got {value}", f"pass a positive {flag}")
    if args.manual_gc_interval < 0:
        raise ArgumentError("--manual-gc-interval", "--manual-gc-interval must be >= 0",
                            "pass --manual-gc-interval 0 (collect only at start) or more")
    for flag, value, least in (("--tensorboard-log-interval", args.tensorboard_log_interval, 1),
                               ("--tensorboard-queue-size", args.tensorboard_queue_size, 1)):
        if value < least:
            raise ArgumentError(flag, f"{flag} must be >= {least}, got {value}", f"pass {flag} {least}")
    if args.wandb_project and importlib.util.find_spec("wandb") is None:
        raise ArgumentError("--wandb-project", "the wandb package is not installed",
                            "pip install 'recover[wandb]' (or wandb) or drop the flag")
    if args.tensorboard_dir is not None and importlib.util.find_spec("tensorboard") is None:
        raise ArgumentError("--tensorboard-dir", "the tensorboard package is not installed",
                            "pip install tensorboard or drop the flag")
    if args.tensorboard_dir is None:
        for flag in ("--log-timers-to-tensorboard", "--log-memory-to-tensorboard",
                     "--log-validation-ppl-to-tensorboard"):
            if getattr(args, flag[2:].replace("-", "_")):
                raise ArgumentError(flag, f"{flag} writes to TensorBoard, but no --tensorboard-dir "
                                          "was given", "pass --tensorboard-dir DIR or drop the flag")


def validate_recover(args: argparse.Namespace, dp: int) -> None:
    if not args.recover_timeout >= 1:  # the heartbeat must move several times within it
        raise ArgumentError("--recover-timeout", f"--recover-timeout {args.recover_timeout:g} is "
                            "below 1 second", "pass --recover-timeout 1 or more (default 10)")
    if args.distributed_timeout_minutes < 1:  # start-up's bound: connects, the first iteration
        raise ArgumentError("--distributed-timeout-minutes", "--distributed-timeout-minutes "
                            f"{args.distributed_timeout_minutes} bounds start-up and must be 1 "
                            "or more", "pass --distributed-timeout-minutes 1 or more (default 10)")
    if not 1 <= args.recover_min_replicas <= dp:
        raise ArgumentError("--recover-min-replicas", f"--recover-min-replicas "
                            f"{args.recover_min_replicas} must be between 1 and the {dp} "
                            "data-parallel replicas of this job", f"pass a value in 1..{dp}")
    if args.coordinator_addr is not None:
        _check_host_port(args.coordinator_addr)
    if args.recover_exact_reduction:
        _check_exact_reduction(args, dp)
    if args.enable_ft_package and not args.save:
        raise ArgumentError("--enable-ft-package", "--enable-ft-package keeps its timeout in "
                            "--save (as Megatron-LM's ft_state.json)", "pass --save DIR")
    if args.ft_num_warmup_iters < 0:
        raise ArgumentError("--ft-num-warmup-iters", "--ft-num-warmup-iters must be >= 0",
                            "pass --ft-num-warmup-iters 5 (the default)")


def _check_exact_reduction(args: argparse.Namespace, dp: int) -> None:
    flag = "--recover-exact-reduction"
    if dp > MAX_REPLICAS:
        raise ArgumentError(flag, f"{flag} agrees its exponents among at most {MAX_REPLICAS} "
                            f"replicas; this job has {dp}", "drop the flag")
    if args.fp16:
        raise ArgumentError(flag, f"{flag} with --fp16: fixed-point gradients take the place of "
                            "fp16's loss scale (their exponent is theirs)", "use --bf16")
    if args.num_experts is not None and args.expert_model_parallel_size > 1:
        raise ArgumentError(flag, f"{flag} with --expert-model-parallel-size "
                            f"{args.expert_model_parallel_size}: the experts' GEMMs sum the "
                            "tokens of a unit's replicas' microbatches together, so which "
                            "microbatches meet there follows the partition",
                            "pass --expert-model-parallel-size 1 or drop the flag")
    microbatches = args.global_batch_size // args.micro_batch_size
    if microbatches > 1 << 16:
        raise ArgumentError(flag, f"{flag} sums at most 65536 microbatches exactly; this batch "
                            f"has {microbatches}", "raise --micro-batch-size or lower "
                            "--global-batch-size")


def _check_host_port(addr: str) -> None:
    host, sep, port = addr.rpartition(":")
    if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise ArgumentError("--coordinator-addr", f"{addr!r} is not HOST:PORT",
                            "pass --coordinator-addr HOST:PORT (or set RECOVER_COORDINATOR)")
