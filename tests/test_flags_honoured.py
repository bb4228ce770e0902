"""No flag is accepted and ignored: every option the parser accepts is either read by the code
outside the argument modules (as `args.<dest>`), refused when it asks for something ReCoVer
cannot do, or listed below with the reason it needs no reader."""
from __future__ import annotations

import argparse
import re
from pathlib import Path

from megatron.training.arguments import build_parser

REPO = Path(__file__).resolve().parents[1]

# dest -> why nothing outside megatron/training/arguments*.py reads it. Keep this list short and
# true: a flag belongs here only if its whole meaning is carried out by the argument checks.
HONOURED_BY_THE_ARGUMENT_CHECKS = {
    "context_parallel_size": "only 1 is accepted (anything else is refused), which is the behaviour",
    "optimizer": "only adam is accepted (sgd is refused)",
    "ckpt_fully_parallel_save": "refused when set; --no-ckpt-fully-parallel-save (one replica "
                                "writes) is ReCoVer's only behaviour",
    "ckpt_assume_constant_structure": "refused when set",
    "cross_entropy_loss_fusion": "refused when set",
    "use_mcore_models": "a no-op in Megatron-LM too: megatron-core models are the only kind",
    "calculate_per_token_loss": "ReCoVer always divides by the global token count (its only mode)",
    "accumulate_allreduce_grads_in_fp32": "always on: the main-grad buffer is fp32 (set by the checks)",
    "recompute_activations": "means --recompute-granularity selective (Megatron's rule); the model "
                             "reads recompute_granularity",
    "group_query_attention": "turns --num-query-groups on; the model reads num_query_groups",
    "transformer_impl": "resolved by the checks, read into ModelConfig.implementation",
    "num_workers": "ReCoVer reads microbatches by id in the training process: there is no data-"
                   "loader worker pool for this performance knob to size",
    "local_rank": "the launcher's LOCAL_RANK wins (Megatron's rule); read as args.local_rank",
    "use_cpu_initialization": "always on: weights are drawn on the CPU by global name",
    "rerun_mode": "only disabled is accepted (the other modes are refused), which is the behaviour",
    "num_layers_per_virtual_pipeline_stage": "turned into args.virtual_pipeline_model_parallel_size "
                                             "by the checks; the model, link and schedule read it",
    "num_virtual_stages_per_pipeline_rank": "likewise: virtual_pipeline_model_parallel_size",
    "overlap_p2p_comm": "--no-overlap-p2p-communication is refused with model chunks (the "
                        "interleaved schedule's sends are always asynchronous); without them it "
                        "means nothing in Megatron-LM either",
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


def code_outside_argument_modules() -> str:
    files = [p for p in REPO.rglob("*.py")
             if ".venv" not in p.parts and "tests" not in p.parts
             and not (p.parent.name == "training" and p.name.startswith("arguments"))]
    return "\n".join(p.read_text(errors="ignore") for p in files)


def test_every_accepted_flag_is_read_or_explained():
    code = code_outside_argument_modules()
    unread = []
    for dest, flag in accepted_dests().items():
        if dest in HONOURED_BY_THE_ARGUMENT_CHECKS:
            continue
        if not re.search(rf"\bargs\.{re.escape(dest)}\b", code):
            unread.append(flag)
    assert not unread, f"accepted but never read (honour them, refuse them, or explain): {unread}"


def test_the_explanations_are_not_stale():
    dests = accepted_dests()
    assert set(HONOURED_BY_THE_ARGUMENT_CHECKS) <= set(dests), \
        set(HONOURED_BY_THE_ARGUMENT_CHECKS) - set(dests)


def test_the_check_sees_an_unread_flag():
    """Negative control: a flag added to the parser and read nowhere is caught."""
    code = code_outside_argument_modules()
    assert not re.search(r"\bargs\.no_such_flag_anywhere\b", code)
    assert re.search(r"\bargs\.micro_batch_size\b", code)  # and a real reader is found
