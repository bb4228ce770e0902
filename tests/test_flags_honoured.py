"""No flag is accepted and ignored: every option the parser accepts flows into a field of the
typed configuration (`megatron/training/config/`: what the conversions read of a validated
command line is recorded), is read by the entry point itself, is refused when it asks for
something ReCoVer cannot do, or is listed below with the reason it needs no reader."""
from __future__ import annotations

import argparse
import re

from megatron.training.arguments import build_parser, parse_and_validate
from megatron.training.config import OptimizerSetup, RunLayout
from megatron.training.config.rules import megatron_differences
from megatron.training.config.run import RunConfig
from tests._launch_util import REPO, TINY_GPT

# dest -> why no typed config and not the entry point reads it. Keep this list short and true: a
# flag belongs here only if its whole meaning is carried out by the argument checks.
HONOURED_BY_THE_ARGUMENT_CHECKS: dict[str, str] = {
    # Megatron-FSDP: each takes only the values that are what ReCoVer does (`validate.fsdp`)
    "megatron_fsdp_version": "1 only (2 is refused there)",
    "megatron_fsdp_main_params_dtype": "fp32 (or auto, fp32 here): the main weights' dtype",
    "megatron_fsdp_main_grads_dtype": "auto or fp32: the gradient buffers' dtype",
    "outer_dp_sharding_strategy": "no_shard only: each shard group holds a whole copy",
}


def accepted_dests() -> dict[str, str]:
    parser = build_parser()
    out = {}
    for action in parser._actions:
        if not action.option_strings or isinstance(action, argparse._HelpAction):
            continue
        if action.default == argparse.SUPPRESS:  # the refused flags: they raise when given
            continue
        out[action.dest] = action.option_strings[0]
    return out


class RecordingNamespace(argparse.Namespace):
    """A validated command line that remembers which flags were read."""

    def __init__(self, args: argparse.Namespace):
        super().__init__(**vars(args))
        object.__setattr__(self, "_read", set())

    def __getattribute__(self, name: str):
        if not name.startswith("_"):
            object.__getattribute__(self, "_read").add(name)
        return object.__getattribute__(self, name)


def read_by_the_typed_configs(args: argparse.Namespace) -> set[str]:
    """Every dest the conversions into the typed configuration read (with TensorBoard and W&B on,
    so their conversions read past the switch)."""
    recording = RecordingNamespace(args)
    layout = RunLayout.from_args(recording, 1, "cpu", environ={})  # --local-rank without env
    RunConfig.from_args(recording, layout, 256, recovering=True)  # the root: every conversion
    megatron_differences(recording, "cuda")  # the start-up lines a GPU run adds
    return recording._read


def validated(*extra: str, length: tuple[str, str] = ("--train-iters", "4")
              ) -> argparse.Namespace:
    return parse_and_validate([*TINY_GPT, *length, "--tensorboard-dir", "tb",
                               "--wandb-project", "p", *extra], world_size=1)


# command lines that take each conditional branch of the conversions once
BRANCHES = [validated(),
            validated("--quick-geglu", "--openai-gelu", "--onnx-safe", "1", "--rope-type", "rope",
                      "--auto-detect-ckpt-format"),
            validated("--group-query-attention", "--num-query-groups", "2",
                      "--recompute-granularity", "full", "--recompute-method", "uniform",
                      "--recompute-num-layers", "1"),
            validated(length=("--train-samples", "64")),
            validated("--eod-mask-loss", "--fp16", "--save", "ck", "--save-interval", "2",
                      "--async-save", "--swiglu", "--use-flash-attn", "--log-straggler"),
            validated("--non-persistent-ckpt-type", "local", "--non-persistent-local-ckpt-dir",
                      "local", "--replication", "--replication-jump", "1",
                      "--replication-factor", "1"),
            validated("--num-experts", "4", "--disable-bias-linear"),  # the MoE fields
            validated("--multi-latent-attention", "--rope-type", "yarn"),  # the MLA fields
            validated("--experimental-attention-variant", "gdn", "--linear-attention-freq", "2"),
            validated("--use-torch-fsdp2", "--megatron-fsdp-grad-comm-dtype", "bf16",
                      "--fsdp-double-buffer"),  # the Megatron-FSDP fields and lines
            parse_and_validate([*(f for f in TINY_GPT if f != "--mock-data"), "--train-iters", "4",
                                "--data-path", "corpus", "--tokenizer-type",
                                "HuggingFaceTokenizer", "--tokenizer-model", "tokenizer.json",
                                "--fim-data", "--fim-split-sample", "|", "--fim-fragment-rate",
                                "0.5"], world_size=1)]  # the FIM fields


def read_by_the_entry_point() -> set[str]:
    text = (REPO / "pretrain_gpt_recover.py").read_text()
    return set(re.findall(r"\bargs\.([a-z_0-9]+)\b", text))


def unread_flags(read: set[str]) -> list[str]:
    return [flag for dest, flag in accepted_dests().items()
            if dest not in HONOURED_BY_THE_ARGUMENT_CHECKS and dest not in read]


def test_every_accepted_flag_is_read_or_explained():
    read = set().union(*map(read_by_the_typed_configs, BRANCHES)) | read_by_the_entry_point()
    unread = unread_flags(read)
    assert not unread, f"accepted but never read (honour them, refuse them, or explain): {unread}"


def test_the_explanations_are_not_stale():
    dests = accepted_dests()
    assert set(HONOURED_BY_THE_ARGUMENT_CHECKS) <= set(dests), \
        set(HONOURED_BY_THE_ARGUMENT_CHECKS) - set(dests)


def test_the_check_sees_an_unread_flag():
    """Negative control: a flag that no conversion reads is caught -- here, the model's flags
    when ModelConfig is left out of the recording."""
    recording = RecordingNamespace(validated())
    OptimizerSetup.from_args(recording)
    unread = unread_flags(recording._read | read_by_the_entry_point())
    assert "--num-layers" in unread and "--swiglu" in unread
    assert "--lr" not in unread  # and what OptimizerSetup read is seen
