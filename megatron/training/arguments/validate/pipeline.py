"""How the layers split over pipeline stages and model chunks: Megatron-LM's flags and rules.

--num-layers-per-virtual-pipeline-stage N or --num-virtual-stages-per-pipeline-rank V give each
pipeline rank V model chunks (`config_rules.model_chunks_of`: None for one, as Megatron's
virtual_pipeline_model_parallel_size) and the interleaved schedule. --decoder-first/last-pipeline-num-layers make the end
stages uneven; --account-for-embedding/loss-in-pipeline-split count the embedding / loss as a
layer. megatron-core builds each chunk from these (`get_num_layers_to_build`); here every rule it
would assert on is one line naming the flag.
"""

from __future__ import annotations

import argparse
import os

from megatron.training.errors import ArgumentError
from megatron.training.arguments.recover import COORDINATOR_ENV
from megatron.training.config.rules import layers_to_split, model_chunks_of
from recover_patches.collectives import emulated_nccl

SINGLE_QUEUE_ENV = "CUDA_DEVICE_MAX_CONNECTIONS"
_VP_FLAGS = "--num-layers-per-virtual-pipeline-stage / --num-virtual-stages-per-pipeline-rank"


def add_pipeline_split_args(g: argparse._ArgumentGroup) -> None:
    g.add_argument("--num-layers-per-virtual-pipeline-stage", type=int, default=None,
                   help="Layers per model chunk: each pipeline rank holds (layers per stage / N) "
                        "chunks and runs the interleaved 1F1B schedule.")
    g.add_argument("--num-virtual-stages-per-pipeline-rank", type=int, default=None,
                   help="Model chunks per pipeline rank (the interleaved schedule).")
    g.add_argument("--microbatch-group-size-per-virtual-pipeline-stage", type=int, default=None,
                   dest="microbatch_group_size_per_vp_stage",
                   help="Contiguous microbatches per model chunk in the interleaved schedule "
                        "(default: the pipeline size).")
    g.add_argument("--no-overlap-p2p-communication", action="store_false", dest="overlap_p2p_comm",
                   help="Megatron: blocking p2p in the interleaved schedule. ReCoVer's interleaved "
                        "schedule always posts its sends asynchronously, so with model chunks this "
                        "is refused; without them it changes nothing, as in Megatron.")
    g.add_argument("--overlap-p2p-communication-warmup-flush", action="store_true",
                   dest="overlap_p2p_comm_warmup_flush",
                   help="Overlap p2p with compute in the interleaved schedule's warm-up and "
                        "flush too, not only in its steady phase (the next receive is posted "
                        "before the compute; sends never block).")
    g.add_argument("--decoder-first-pipeline-num-layers", type=int, default=None,
                   help="Layers on the first pipeline stage (the rest split evenly).")
    g.add_argument("--decoder-last-pipeline-num-layers", type=int, default=None,
                   help="Layers on the last pipeline stage (the rest split evenly).")
    g.add_argument("--account-for-embedding-in-pipeline-split", action="store_true",
                   help="Count the embedding as a layer of the first stage when splitting.")
    g.add_argument("--account-for-loss-in-pipeline-split", action="store_true",
                   help="Count the loss as a layer of the last stage when splitting.")


def validate_pipeline_split(args: argparse.Namespace) -> None:
    pp = args.pipeline_model_parallel_size
    per_layer, chunks = (args.num_layers_per_virtual_pipeline_stage,
                         args.num_virtual_stages_per_pipeline_rank)
    first, last = args.decoder_first_pipeline_num_layers, args.decoder_last_pipeline_num_layers
    uneven = first is not None or last is not None
    if per_layer is not None and chunks is not None:
        raise ArgumentError("--num-layers-per-virtual-pipeline-stage", "--num-layers-per-virtual-"
                            "pipeline-stage and --num-virtual-stages-per-pipeline-rank cannot both "
                            "be set", "keep one of them")
    for flag, value in (("--num-layers-per-virtual-pipeline-stage", per_layer),
                        ("--num-virtual-stages-per-pipeline-rank", chunks),
                        ("--decoder-first-pipeline-num-layers", first),
                        ("--decoder-last-pipeline-num-layers", last)):
        if value is not None and value < 1:
            raise ArgumentError(flag, f"{flag} must be >= 1, got {value}", f"pass {flag} 1 or more")
    accounted = layers_to_split(args)
    if uneven:
        _validate_uneven(args, pp, first, last, chunks or 1)
    elif accounted % pp:
        raise ArgumentError("--num-layers", f"--num-layers {args.num_layers}"
                            + (" (with the embedding/loss counted)" if accounted != args.num_layers
                               else "") + f" is not divisible by --pipeline-model-parallel-size "
                            f"{pp}", "use a layer count that is a multiple of the PP size")
    if per_layer is not None:
        if uneven:
            raise ArgumentError("--num-layers-per-virtual-pipeline-stage", "uneven pipeline stages "
                                "(--decoder-first/last-pipeline-num-layers) need "
                                "--num-virtual-stages-per-pipeline-rank",
                                "pass --num-virtual-stages-per-pipeline-rank instead")
        if (accounted // pp) % per_layer:
            raise ArgumentError("--num-layers-per-virtual-pipeline-stage", f"--num-layers-per-"
                                f"virtual-pipeline-stage {per_layer} does not divide the "
                                f"{accounted // pp} layers of a pipeline stage",
                                "pass a divisor of the layers per stage")
    vp = model_chunks_of(args)
    if args.overlap_p2p_comm_warmup_flush and (vp is None or not args.overlap_p2p_comm):
        raise ArgumentError("--overlap-p2p-communication-warmup-flush", "--overlap-p2p-"
                            "communication-warmup-flush overlaps the interleaved schedule's p2p "
                            "(Megatron's rule: with model chunks and p2p overlap)",
                            f"add {_VP_FLAGS} and drop --no-overlap-p2p-communication, or drop it")
    if vp is not None:
        _validate_interleaved(args, pp, vp, accounted, uneven)
    else:  # Megatron's rule: only the interleaved schedule overlaps p2p (the entry point says so)
        if args.microbatch_group_size_per_vp_stage is not None:
            raise ArgumentError("--microbatch-group-size-per-virtual-pipeline-stage",
                                "--microbatch-group-size-per-virtual-pipeline-stage groups "
                                "microbatches of the interleaved schedule, and there is none",
                                f"add {_VP_FLAGS} or drop the flag")


def _validate_uneven(args, pp: int, first: int | None, last: int | None, vp: int) -> None:
    flag = "--decoder-first-pipeline-num-layers" if first is not None \
        else "--decoder-last-pipeline-num-layers"
    if pp == 1:
        raise ArgumentError(flag, f"{flag} splits pipeline stages, and there is one",
                            "add --pipeline-model-parallel-size 2 or more, or drop the flag")
    if args.account_for_embedding_in_pipeline_split or args.account_for_loss_in_pipeline_split:
        raise ArgumentError(flag, f"{flag} cannot go with --account-for-embedding/loss-in-"
                            "pipeline-split (megatron-core's rule)", "keep one way of splitting")
    middle_layers = args.num_layers - (first or 0) - (last or 0)
    middle_stages = pp - (first is not None) - (last is not None)
    if middle_layers < 0 or bool(middle_layers) != bool(middle_stages) or \
            (middle_stages and middle_layers % middle_stages):
        raise ArgumentError(flag, f"--num-layers {args.num_layers} minus the first/last stage's "
                            f"layers leaves {middle_layers} for {middle_stages} middle stage(s), "
                            "not an even split", "choose first/last counts that leave a multiple "
                            "of the middle stages")
    for name, layers in (("--decoder-first-pipeline-num-layers", first),
                         ("--decoder-last-pipeline-num-layers", last),
                         ("--num-layers", middle_layers // middle_stages if middle_stages else None)):
        if layers is not None and layers % vp:
            raise ArgumentError(name, f"{layers} layers of a pipeline stage do not split into "
                                f"{vp} model chunks", "use layer counts divisible by "
                                "--num-virtual-stages-per-pipeline-rank")


def _validate_interleaved(args, pp: int, vp: int, accounted: int, uneven: bool) -> None:
    if pp == 1:
        raise ArgumentError(_VP_FLAGS.split(" / ")[0], "the interleaved schedule needs "
                            "--pipeline-model-parallel-size 2 or more", "add PP or drop the flag")
    if not uneven and (accounted // pp) % vp:
        raise ArgumentError("--num-virtual-stages-per-pipeline-rank", f"{accounted // pp} layers "
                            f"of a pipeline stage do not split into {vp} model chunks",
                            "pass a divisor of the layers per stage")
    if not args.overlap_p2p_comm:
        raise ArgumentError("--no-overlap-p2p-communication", "--no-overlap-p2p-communication is "
                            "not supported: ReCoVer's interleaved schedule posts every send "
                            "asynchronously (blocking sends could deadlock its order for short "
                            "id lists)", "drop the flag")
    group = args.microbatch_group_size_per_vp_stage
    if group is None:
        args.microbatch_group_size_per_vp_stage = pp  # Megatron's default
    elif group < pp:
        raise ArgumentError("--microbatch-group-size-per-virtual-pipeline-stage",
                            f"--microbatch-group-size-per-virtual-pipeline-stage {group} is below "
                            f"the pipeline size {pp}", f"pass {pp} or more (or drop the flag)")


def validate_pipeline_backend(args: argparse.Namespace, device: str) -> None:
    """After the device flags: on NCCL the interleaved schedule needs its p2p channels as groups
    of their own (p2p.ChunkP2P: NCCL ignores tags and runs a group's operations on one stream).
    ReCoVer's groups can be that; torch's own groups, used without the coordinator, are named by
    their ranks, so two groups of the same two ranks cannot exist."""
    if model_chunks_of(args) is not None and device == "cuda" and \
            not (args.coordinator_addr or os.environ.get(COORDINATOR_ENV)):
        raise ArgumentError(_VP_FLAGS.split(" / ")[0], "the interleaved schedule on a GPU needs "
                            "ReCoVer's launcher (its p2p channels are groups of their own, which "
                            "torch's groups cannot name apart)", "start it with `python -m "
                            "recover_patches.launch` (the coordinator on), or drop the flag (1F1B)")
    if model_chunks_of(args) is not None and os.environ.get(SINGLE_QUEUE_ENV, "").strip() == "1" \
            and (device == "cuda" or emulated_nccl.requested()):
        raise ArgumentError(_VP_FLAGS.split(" / ")[0], f"{SINGLE_QUEUE_ENV}=1 puts every stream "
                            "on one hardware queue, where the interleaved schedule's unwaited "
                            "sends hold back the receives behind them (docs/NCCL.md §8: 1F1B "
                            "holds, the interleaved schedule does not)",
                            f"unset {SINGLE_QUEUE_ENV} (or set it above 1) for this run, or drop "
                            "the flag (1F1B)")
