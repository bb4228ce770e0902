"""The typed configuration: built once from the validated flags, frozen, checked
where declared, and the conversion writes nothing back into the flags."""
from __future__ import annotations

import dataclasses

import pytest
import torch

from megatron.training.arguments import parse_and_validate
from megatron.training.config import (BatchSchedule, ModelConfig, OptimizerSetup, RunLayout,
                                      ScheduleConfig, StepConfig, TrainingConfig,
                                      transformer_config)
from megatron.training.config.io import CheckpointConfig, DataConfig
from megatron.training.config.rules import megatron_differences
from tests._launch_util import TINY_GPT


def flags(*extra: str, world: int = 1):
    return parse_and_validate([*TINY_GPT, "--train-iters", "10", *extra], world_size=world)


def every_config(args, vocab: int = 256) -> list:
    return [ModelConfig.from_args(args, vocab), OptimizerSetup.from_args(args),
            ScheduleConfig.from_args(args), TrainingConfig.from_args(args),
            StepConfig.from_args(args, recovering=True), DataConfig.from_args(args),
            CheckpointConfig.from_args(args)]


def test_the_conversion_reads_the_flags_and_writes_nothing_back():
    args = flags("--lr-warmup-iters", "2")
    before = dict(vars(args))
    model, setup, schedule, training, step, data, checkpoint = every_config(args)
    assert vars(args) == before
    assert model.transformer.num_layers == args.num_layers and model.padded_vocab_size == 256
    assert setup.adam.lr == args.lr and setup.adam.use_distributed_optimizer is False
    gbs = args.global_batch_size
    assert (schedule.warmup_steps, schedule.decay_steps) == (2 * gbs, 10 * gbs)  # in samples
    assert training.train_iters == 10 and training.batches.global_batch_size == gbs
    assert step.micro_batch_size == args.micro_batch_size and step.recovering
    assert data.mock and data.sizes[0] == 10 * gbs
    assert checkpoint.load_optim and checkpoint.megatron_args is not args  # a copy: the payload


def test_every_config_is_frozen():
    for config in every_config(flags()):
        field = dataclasses.fields(config)[0].name
        with pytest.raises(dataclasses.FrozenInstanceError):
            setattr(config, field, None)


def test_one_optimizer_copy_means_one_distributed_optimizer_instance():
    assert not TrainingConfig.from_args(flags()).one_optimizer_copy
    assert TrainingConfig.from_args(flags("--use-distributed-optimizer", world=2)).one_optimizer_copy
    assert not TrainingConfig.from_args(flags(
        "--use-distributed-optimizer", "--num-distributed-optimizer-instances", "2",
        world=2)).one_optimizer_copy


def test_each_config_checks_itself_where_it_is_declared():
    args = flags("--tensor-model-parallel-size", "2", world=2)
    with pytest.raises(ValueError, match="does not split over 2 TP ranks"):
        ModelConfig.from_args(args, 255)
    with pytest.raises(ValueError, match="not a multiple of the micro batch"):
        BatchSchedule(micro_batch_size=4, global_batch_size=6, rampup=None)
    setup = OptimizerSetup.from_args(flags())
    with pytest.raises(ValueError, match="distributed optimizer instances"):
        dataclasses.replace(setup, instances=0)
    with pytest.raises(ValueError, match="negative step count"):
        dataclasses.replace(ScheduleConfig.from_args(flags()), warmup_steps=-1)


def test_a_sample_based_schedule_keeps_its_warmup_and_decay_samples():
    """--train-samples with --lr-warmup-samples / --lr-decay-samples: the schedule counts those
    samples (the checks also derive --train-iters, which must not switch to the iteration rule)."""
    args = parse_and_validate([*TINY_GPT, "--train-samples", "64", "--lr-warmup-samples", "16",
                               "--lr-decay-samples", "48"], world_size=1)
    schedule = ScheduleConfig.from_args(args)
    assert (schedule.warmup_steps, schedule.decay_steps, schedule.wd_incr_steps) == (16, 48, 64)


def test_the_run_layout_is_derived_once_and_megatrons_checkpoints_still_carry_it():
    args = flags("--local-rank", "1", "--bf16", world=4)
    assert RunLayout.from_args(args, 4, "cpu", environ={}).local_rank == 1  # the flag, no env
    layout = RunLayout.from_args(args, 4, "cpu", environ={"RANK": "3", "LOCAL_RANK": "2"})
    assert (layout.rank, layout.local_rank, layout.data_parallel_size) == (3, 2, 4)  # env wins
    with pytest.raises(ValueError, match="rank 4 of 4"):
        RunLayout.from_args(args, 4, "cpu", environ={"RANK": "4"})
    saved = CheckpointConfig.from_args(args, 256, layout).megatron_args
    assert (saved.data_parallel_size, saved.rank, saved.params_dtype) == (4, 3, torch.bfloat16)
    assert saved.padded_vocab_size == 256 and not hasattr(args, "data_parallel_size")


def test_where_megatron_would_differ_is_said_once_per_flag():
    """Flags ReCoVer takes in its only mode, or that change nothing, say so at start-up."""
    quiet = megatron_differences(flags(), "cpu")
    assert quiet == []  # Megatron's defaults: nothing to say
    said = " | ".join(megatron_differences(flags(
        "--fp16", "--eod-mask-loss", "--ckpt-fully-parallel-save", "--use-mcore-models",
        "--no-overlap-p2p-communication", "--num-workers", "4", "--ddp-average-in-collective",
        "--defer-embedding-wgrad-compute", "--overlap-param-gather-with-optimizer-step"), "cuda"))
    for flag in ("--accumulate-allreduce-grads-in-fp32", "--calculate-per-token-loss",
                 "--ckpt-fully-parallel-save", "--use-mcore-models",
                 "--no-overlap-p2p-communication", "--num-workers 4",
                 "--ddp-average-in-collective changes nothing",
                 "--defer-embedding-wgrad-compute changes nothing",
                 "--overlap-param-gather-with-optimizer-step changes nothing"):
        assert flag in said, flag
    assert "--calculate-per-token-loss" not in " ".join(megatron_differences(flags(
        "--eod-mask-loss", "--calculate-per-token-loss"), "cpu"))
    kept = flags("--recompute-granularity", "selective", "--recompute-modules", "moe_act", "mlp",
                 "layernorm")  # what megatron-core recomputes only in TE's or grouped modules
    assert "--recompute-modules moe_act layernorm: kept in memory" in " ".join(
        megatron_differences(kept, "cpu"))
    assert transformer_config(kept).recompute_modules == ["mlp"]


def test_the_rerun_and_profiling_configs_check_themselves():
    from megatron.training.profiling import ProfilingConfig
    from megatron.training.rerun import RerunConfig
    assert RerunConfig("validate_results", 5, "correct_result", None).injects(10, 0, 2)
    for bad in (("sometimes", 0, "transient_error"), ("disabled", -1, "transient_error"),
                ("disabled", 0, "bit_flip")):
        with pytest.raises(ValueError):
            RerunConfig(*bad, None)
    with pytest.raises(ValueError):
        ProfilingConfig(True, 5, 5)
    assert not ProfilingConfig(True, 1, 3, ranks=(0,)).profiles(1)


@pytest.mark.parametrize("style, coeff_at_half", [
    ("linear", 0.5), ("exponential", 2 * 0.5 ** 0.5 - 1), ("cosine", 0.5),
    ("minus_sqrt", 1 - 0.5 ** 0.5)])
def test_wsd_holds_the_peak_then_anneals_over_its_last_iterations(style, coeff_at_half):
    """--lr-decay-style WSD over 10 iterations, the last 4 annealing: megatron-core's scheduler,
    against the shape written out here (stable until 6, half-way at 8, --min-lr at 10)."""
    from megatron.training.optimizer.setup import build_scheduler
    args = flags("--lr", "1.0", "--min-lr", "0.1", "--lr-decay-style", "WSD",
                 "--lr-wsd-decay-iters", "4", "--lr-wsd-decay-style", style)
    gbs = args.global_batch_size
    optimizer = torch.optim.AdamW([torch.nn.Parameter(torch.zeros(1))], lr=0.0)
    scheduler = build_scheduler(optimizer, ScheduleConfig.from_args(args))
    lrs = {}
    for iteration in range(1, 11):
        scheduler.step(increment=gbs)
        lrs[iteration] = optimizer.param_groups[0]["lr"]
    assert lrs[3] == lrs[6] == 1.0
    assert lrs[8] == pytest.approx(0.1 + 0.9 * coeff_at_half)
    assert lrs[10] == pytest.approx(0.1)


def test_wsd_without_its_annealing_length_is_one_line(capsys):
    with pytest.raises(SystemExit) as exit_info:
        flags("--lr-decay-style", "WSD")
    assert exit_info.value.code == 2
    assert capsys.readouterr().err.startswith(
        "pretrain_gpt_recover.py: error: --lr-wsd-decay-iters: ")


def namespace_reads(source: str) -> dict[str, list[str]]:
    """Per top-level function of an entry point's source: the `args.<flag>` it reads."""
    import ast
    found: dict[str, list[str]] = {}
    for node in ast.parse(source).body:
        if isinstance(node, ast.FunctionDef):
            found[node.name] = sorted(n.attr for n in ast.walk(node) if isinstance(n, ast.Attribute)
                                      and isinstance(n.value, ast.Name) and n.value.id == "args")
    return found


def test_the_run_configuration_is_built_once_and_the_entry_point_reads_it_not_the_flags():
    """One frozen root, built after validation: past `_check_inputs` (which builds it) the entry
    point reads `RunConfig`, never Megatron's Namespace. Control: the reader sees a read."""
    from pathlib import Path

    from megatron.training.config.run import RunConfig
    from megatron.training.config import RunLayout
    args = flags("--inject-fault", "kill:rank=0,iter=2,phase=forward")
    run = RunConfig.from_args(args, RunLayout.from_args(args, 1, "cpu", environ={}), 256,
                              recovering=False)
    assert run.model.padded_vocab_size == run.checkpoint.megatron_args.padded_vocab_size == 256
    assert run.fault_tolerance.inject_fault == ("kill:rank=0,iter=2,phase=forward",)
    assert run.parallel.optimizer_instances is None and run.restart_from.startswith("(no")
    with pytest.raises(dataclasses.FrozenInstanceError):
        run.model = None  # type: ignore[misc]
    source = (Path(__file__).resolve().parents[1] / "pretrain_gpt_recover.py").read_text()
    reads = {name: attrs for name, attrs in namespace_reads(source).items() if attrs}
    assert set(reads) <= {"_parse", "_check_inputs"}, reads
    assert namespace_reads("def f(args):\n    return args.lr\n") == {"f": ["lr"]}
