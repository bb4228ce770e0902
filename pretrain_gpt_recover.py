"""ReCoVer's drop-in for Megatron-LM's `pretrain_gpt.py`: same flags, plus `--recover-*`.

    python -m recover_patches.launch --nproc-per-node 4 pretrain_gpt_recover.py <Megatron flags>
"""
from __future__ import annotations

import sys
import warnings

warnings.filterwarnings("ignore", message=".*(Apex|Transformer Engine).*")


def main(argv: list[str] | None = None) -> int:
    import torch

    from megatron.training.arguments import parse_and_validate
    from megatron.training.initialize import env_rank_world

    rank, world = env_rank_world()
    args = parse_and_validate(argv, world_size=world, device="cuda" if torch.cuda.is_available() else "cpu")

    from megatron.training.datasets import DataError, build_datasets, validate_data
    from megatron.training.tokenizer import TokenizerError, build_tokenizer, padded_vocab_size
    from recover_patches.faults import FaultInjector, FaultSpecError
    from megatron.training.checkpointing import CheckpointError, Checkpointer
    try:  # user errors first, before any process group exists or anything is written
        tokenizer = build_tokenizer(args)
        validate_data(args)
        faults = FaultInjector.from_specs(args.inject_fault, rank)
        checkpointer = Checkpointer(args, rank, world)  # validates --load before anything runs
    except (DataError, TokenizerError, CheckpointError) as err:
        print(f"pretrain_gpt_recover.py: error: {err.flag}: {err.message}. Fix: {err.fix}",
              file=sys.stderr)
        return 2
    except FaultSpecError as err:
        print(f"pretrain_gpt_recover.py: error: {err}", file=sys.stderr)
        return 2

    from megatron.training.initialize import build_groups, init_default_group, torch_group_factory
    from megatron.training.metrics import MetricsWriter
    from megatron.training.model import build_model
    from megatron.training.optimizer import build_optimizer, build_scheduler
    from megatron.training.training import Trainer, build_stage
    from recover_patches.p2p import StageLink
    from recover_patches.rng import install_cpu_tracker
    from recover_patches.topology import Topology

    torch.set_num_threads(1)
    rank, world = init_default_group(args.distributed_backend, args.distributed_timeout_minutes)
    topology = Topology.from_world(world, args.tensor_model_parallel_size,
                                   args.pipeline_model_parallel_size)
    groups = build_groups(topology, rank, torch_group_factory)
    tracker = install_cpu_tracker()
    vocab = padded_vocab_size(tokenizer.vocab_size, args.make_vocab_size_divisible_by,
                              args.tensor_model_parallel_size)
    model = build_model(args, groups.pg_collection(), groups.coord.pp, groups.coord.tp, vocab)
    optimizer = build_optimizer(model, args)
    scheduler = build_scheduler(optimizer, args)
    train_ds, valid_ds, _ = build_datasets(args, tokenizer)
    link = StageLink(groups.pp, groups.coord.pp, topology.pp,
                     (args.seq_length, args.micro_batch_size, args.hidden_size))
    trainer = Trainer(
        args=args, groups=groups, model=model, optimizer=optimizer, scheduler=scheduler,
        train_stage=build_stage(args, groups, model, train_ds, tracker),
        valid_stage=None if valid_ds is None else build_stage(args, groups, model, valid_ds, tracker),
        link=link, faults=faults, checkpointer=checkpointer,
        metrics=MetricsWriter(args.metrics_file if rank == 0 else None))
    try:
        trainer.train()
    except CheckpointError as err:  # found only when reading the files (e.g. a damaged archive)
        print(f"pretrain_gpt_recover.py: error: {err}", file=sys.stderr)
        return 2
    trainer.metrics.close()
    torch.distributed.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
