"""Checks and derived values for batch sizes, training length and the LR / weight-decay schedules.

ReCoVer's batch arithmetic differs from Megatron-LM in one place: an iteration is M = global/micro
microbatches for the whole job, not per data-parallel rank, because the microbatches are dealt out
to whichever replicas are alive (a replica may get any number of them, even none).
"""

from __future__ import annotations

import argparse

from megatron.training.errors import ArgumentError


def validate_batch(args: argparse.Namespace, dp: int) -> None:
    micro = args.micro_batch_size
    if micro < 1:
        raise ArgumentError("--micro-batch-size", f"--micro-batch-size must be >= 1, got {micro}",
                            "pass a positive --micro-batch-size")
    if args.step_batch_size_schedule is not None:
        _validate_step_schedule(args)
    if args.global_batch_size is None:
        args.global_batch_size = micro * dp
    if args.global_batch_size < 1:
        raise ArgumentError("--global-batch-size", "--global-batch-size must be >= 1",
                            "pass a positive --global-batch-size")
    if args.global_batch_size % micro != 0:
        raise ArgumentError(
            "--global-batch-size", f"--global-batch-size {args.global_batch_size} is not divisible by "
            f"--micro-batch-size {micro}", "make the global batch a multiple of the micro batch")
    if args.rampup_batch_size is not None:
        _validate_rampup(args)


def _validate_step_schedule(args: argparse.Namespace) -> None:
    """--step-batch-size-schedule: Megatron-LM's format and checks; each batch a multiple of the
    micro batch (an iteration is M whole microbatches, dealt to whichever replicas live). The
    global batch is then the last step's."""
    from megatron.training.config.batch import parse_step_schedule
    flag = "--step-batch-size-schedule"
    for other, given in (("--global-batch-size", args.global_batch_size is not None),
                         ("--rampup-batch-size", args.rampup_batch_size is not None)):
        if given:
            raise ArgumentError(flag, f"{flag} and {other} are exclusive (the schedule sets the "
                                "global batch)", f"drop {other}")
    try:
        steps = parse_step_schedule(args.step_batch_size_schedule, args.seq_length)
    except ValueError as e:
        raise ArgumentError(flag, f"{flag} \"{args.step_batch_size_schedule}\": {e}",
                            'write it as "THRESHOLD:BATCH ...", e.g. "0:256 10B:512" (tokens, '
                            "K/M/B/T suffixes), the first at 0") from None
    odd = [size for _, size in steps if size % args.micro_batch_size]
    if odd:
        raise ArgumentError(flag, f"{flag}: batch size {odd[0]} is not a multiple of "
                            f"--micro-batch-size {args.micro_batch_size}",
                            "make every batch size a multiple of the micro batch")
    args.global_batch_size = steps[-1][1]


def _validate_rampup(args: argparse.Namespace) -> None:
    start, incr, samples = args.rampup_batch_size
    micro, final = args.micro_batch_size, args.global_batch_size
    flag = "--rampup-batch-size"
    if start < 1 or incr < 1 or samples < 0:
        raise ArgumentError(flag, f"{flag} needs START >= 1, INCR >= 1, SAMPLES >= 0, got "
                            f"{start} {incr} {samples}", f"pass {flag} START INCR SAMPLES")
    if start % micro != 0 or incr % micro != 0:
        raise ArgumentError(flag, f"START {start} and INCR {incr} must be multiples of "
                            f"--micro-batch-size {micro}", "pick multiples of the micro batch")
    if start > final or (final - start) % incr != 0:
        raise ArgumentError(flag, f"ramping from {start} by {incr} does not reach "
                            f"--global-batch-size {final} exactly",
                            "pick START <= global batch with (global - START) a multiple of INCR")


def global_batch_size_at(args: argparse.Namespace, consumed_samples: int) -> int:
    """Global batch size of the iteration starting after `consumed_samples` samples (rampup
    aware): `BatchSchedule`'s rule, for the checks that run before the typed configuration."""
    from megatron.training.config import BatchSchedule  # megatron-core: not for every parse
    return BatchSchedule.from_args(args).global_batch_size_at(consumed_samples)


def _iterations_in_samples(args: argparse.Namespace, train_samples: int) -> int:
    """Iterations whose whole global batch fits in `train_samples`, following the rampup; with
    a step schedule, Megatron-LM's count: iterations until `train_samples` are reached."""
    if args.step_batch_size_schedule is not None:
        consumed = iterations = 0
        while consumed < train_samples:
            consumed += global_batch_size_at(args, consumed)
            iterations += 1
        return iterations
    if args.rampup_batch_size is None:
        return train_samples // args.global_batch_size
    ramp_samples = args.rampup_batch_size[2]
    consumed = iterations = 0
    while consumed <= ramp_samples:
        batch = global_batch_size_at(args, consumed)
        if consumed + batch > train_samples:
            return iterations
        consumed += batch
        iterations += 1
    return iterations + (train_samples - consumed) // args.global_batch_size


def validate_training_length(args: argparse.Namespace) -> None:
    if args.train_iters is not None and args.train_samples is not None:
        raise ArgumentError("--train-samples", "--train-iters and --train-samples are exclusive",
                            "pass only one of them")
    if args.train_iters is None and args.train_samples is None:
        raise ArgumentError("--train-iters", "the training length is missing",
                            "pass --train-iters N or --train-samples N")
    if args.train_iters is not None:
        _check_not_mixed(args, sample_based=False)
        if args.train_iters < 1:
            raise ArgumentError("--train-iters", f"--train-iters must be >= 1, got {args.train_iters}",
                                "pass a positive --train-iters")
        if args.lr_decay_iters is None:
            args.lr_decay_iters = args.train_iters
        return
    _check_not_mixed(args, sample_based=True)
    args.train_iters = _iterations_in_samples(args, args.train_samples)
    if args.train_iters < 1:
        raise ArgumentError("--train-samples", f"--train-samples {args.train_samples} is less than "
                            f"one global batch ({args.global_batch_size})", "train on more samples")
    if args.lr_decay_samples is None:
        args.lr_decay_samples = args.train_samples


def _check_not_mixed(args: argparse.Namespace, sample_based: bool) -> None:
    """Megatron-LM's rule: iteration-based and sample-based schedule flags must not be mixed."""
    if sample_based:
        mode, wrong = "--train-samples", (("--lr-decay-iters", args.lr_decay_iters is not None),
                                          ("--lr-warmup-iters", args.lr_warmup_iters != 0))
        counterpart = {"--lr-decay-iters": "--lr-decay-samples", "--lr-warmup-iters": "--lr-warmup-samples"}
    else:
        mode, wrong = "--train-iters", (("--lr-decay-samples", args.lr_decay_samples is not None),
                                        ("--lr-warmup-samples", args.lr_warmup_samples != 0))
        counterpart = {"--lr-decay-samples": "--lr-decay-iters", "--lr-warmup-samples": "--lr-warmup-iters"}
    for flag, present in wrong:
        if present:
            raise ArgumentError(flag, f"{flag} cannot be mixed with {mode}",
                                f"use {counterpart[flag]} instead")
    warmup_flag = "--lr-warmup-samples" if sample_based else "--lr-warmup-iters"
    warmup = args.lr_warmup_samples if sample_based else args.lr_warmup_iters
    if args.lr_warmup_fraction is not None and warmup != 0:
        raise ArgumentError("--lr-warmup-fraction", f"--lr-warmup-fraction and {warmup_flag} are "
                            "exclusive", "pass only one of them")


def validate_lr_and_weight_decay(args: argparse.Namespace) -> None:
    if args.lr is None:
        raise ArgumentError("--lr", "--lr is required", "pass --lr, e.g. --lr 1.5e-4")
    if args.min_lr > args.lr:
        raise ArgumentError("--min-lr", f"--min-lr {args.min_lr} is above --lr {args.lr}",
                            "pass --min-lr <= --lr")
    if args.lr_warmup_fraction is not None and not 0.0 <= args.lr_warmup_fraction <= 1.0:
        raise ArgumentError("--lr-warmup-fraction", "--lr-warmup-fraction must be in [0, 1]",
                            "pass a fraction such as .01")
    # megatron-core's scheduler asserts warmup < decay; say it as a user error instead
    if args.train_iters and args.lr_warmup_iters and args.lr_decay_iters \
            and args.lr_warmup_iters >= args.lr_decay_iters:
        raise ArgumentError("--lr-warmup-iters", f"--lr-warmup-iters {args.lr_warmup_iters} must "
                            f"be below the decay length ({args.lr_decay_iters} iterations: "
                            "--lr-decay-iters, default --train-iters)",
                            "pass a smaller --lr-warmup-iters or a longer --lr-decay-iters")
    if args.train_samples and args.lr_warmup_samples and args.lr_decay_samples \
            and args.lr_warmup_samples >= args.lr_decay_samples:
        raise ArgumentError("--lr-warmup-samples", f"--lr-warmup-samples {args.lr_warmup_samples}"
                            f" must be below --lr-decay-samples {args.lr_decay_samples}",
                            "pass a smaller --lr-warmup-samples")
    _validate_wsd(args)
    if args.weight_decay_incr_style == "constant":
        for flag, value in (("--start-weight-decay", args.start_weight_decay),
                            ("--end-weight-decay", args.end_weight_decay)):
            if value is not None:
                raise ArgumentError(flag, f"{flag} needs a non-constant --weight-decay-incr-style",
                                    f"drop {flag} or pass --weight-decay-incr-style linear|cosine")
        args.start_weight_decay = args.end_weight_decay = args.weight_decay
        return
    for flag, value in (("--start-weight-decay", args.start_weight_decay),
                        ("--end-weight-decay", args.end_weight_decay)):
        if value is None:
            raise ArgumentError(flag, f"--weight-decay-incr-style {args.weight_decay_incr_style} "
                                f"needs {flag}", f"pass {flag}")


def _validate_wsd(args: argparse.Namespace) -> None:
    """megatron-core's scheduler asserts an annealing length for WSD: say it as a user error."""
    flag = "--lr-wsd-decay-samples" if args.train_samples else "--lr-wsd-decay-iters"
    length = args.lr_wsd_decay_samples if args.train_samples else args.lr_wsd_decay_iters
    if args.lr_decay_style == "WSD" and (length is None or length < 1):
        raise ArgumentError(flag, f"--lr-decay-style WSD needs {flag} (the annealing phase)",
                            f"pass {flag} N, N >= 1")
