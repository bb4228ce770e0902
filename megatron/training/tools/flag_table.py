"""docs/megatron_flags.md: every flag of Megatron-LM's GPT parser and what ReCoVer does with it.

    python -m megatron.training.tools.flag_table > docs/megatron_flags.md

The rows come from the facts file (`megatron_lm_flags.json`) and this parser; where ReCoVer
declares a flag with another dest or default than Megatron-LM, or takes only some of its values,
or accepts it and says at start-up that it changes nothing, the reason is written here, and
`tests/test_megatron_flags.py` fails for a difference that has none.
"""
from __future__ import annotations

import argparse

from megatron.training.arguments import build_parser
from megatron.training.arguments.refused import is_megatrons_default, megatron_flags

# flag -> why ReCoVer's dest or default differs from Megatron-LM's (same meaning otherwise)
DIFFERENCES: dict[str, str] = {
    "--attention-backend": "default `auto` as a string (megatron-core's AttnBackend[name])",
    "--apply-layernorm-1p": "dest apply_layernorm_1p (Megatron: layernorm_zero_centered_gamma)",
    "--no-rope-fusion": "dest rope_fusion (Megatron: apply_rope_fusion)",
    "--use-mcore-models": "dest use_mcore_models: accepted, changes nothing (said at start-up)",
    "--recompute-num-layers": "default 1 (Megatron: None, then 1 where a method needs it)",
    "--recompute-modules": "moe_act and layernorm are kept in memory, not recomputed "
                           "(megatron-core recomputes them only in transformer-engine's and "
                           "grouped-GEMM modules); the same results",
    "--transformer-impl": "default: transformer_engine where it is importable on a GPU, else "
                          "local (Megatron: transformer_engine)",
    "--exit-on-missing-checkpoint": "exits with status 2 (a user error, one line); Megatron-LM "
                                    "exits 1",
    "--local-rank": "default: the launcher's LOCAL_RANK environment variable",
    "--eval-interval": "default 1000, as Megatron-LM's before it made evaluation opt-in",
    "--tokenizer-type": "default GPT2BPETokenizer (Megatron: none, then an error)",
    "--wandb-project": "default '' (Megatron: None); both mean off",
    "--wandb-exp-name": "default '' (Megatron: None)",
    "--wandb-save-dir": "default '' (Megatron: None)",
    "--wandb-entity": "default '' (Megatron: None)",
    "--linear-attention-freq": "without flash-linear-attention (always on a CPU), megatron-core's "
                               "torch path of the chunked delta rule, and an L2 norm of fla's "
                               "definition",
    "--fim-data": "each sample draws from a generator of its own (--seed and its index), not "
                  "from one per dataset in reading order, so no replica's failure changes the "
                  "data; given the same draws, Megatron-LM's bytes. With GPT2BPETokenizer or "
                  "HuggingFaceTokenizer",
}
# flag -> why the argument checks refuse it whenever it is given
REFUSED_BY_THE_CHECKS: dict[str, str] = {}
# flag -> the values ReCoVer refuses (each refused in one line naming the flag)
SOME_VALUES: dict[str, str] = {
    "--recompute-modules": "mla_up_proj (a transformer-engine module of multi-latent attention)",
    "--context-parallel-size": "any; not yet with --use-distributed-optimizer, "
                               "--overlap-grad-reduce, --sequence-parallel, a virtual pipeline, "
                               "checkpoints, --reset-attention-mask, transformer-engine",
    "--cp-comm-type": "allgather (with --context-parallel-size > 1: ReCoVer's own attention)",
    "--optimizer": "only adam",
    "--experimental-attention-variant": "gated_delta_net and gdn (megatron-core 0.16.1's layer; "
                                        "not gdn2 or dsa); not yet with CP > 1, MLA or "
                                        "transformer-engine layers",
    "--ckpt-format": "torch and torch_dist; fsdp_dtensor with --use-megatron-fsdp, written as "
                     "torch_dist (not torch_dcp)",
    "--tokenizer-type": "GPT2BPETokenizer, HuggingFaceTokenizer, NullTokenizer, TikTokenizer, "
                        "GPTSentencePieceTokenizer, SentencePieceTokenizer, Llama2Tokenizer",
    "--position-embedding-type": "learned_absolute and rope",
    "--normalization": "LayerNorm and RMSNorm",
    "--attention-backend": "on CPU: auto, unfused, local",
    "--cross-entropy-fusion-impl": "native (not te)",
    "--non-persistent-ckpt-type": "local and global (in_memory: Megatron-LM refuses it too)",
    "--replication-jump": "jumps whose copies land on the same (tp, pp) in other replicas: their "
                          "own local checkpoints are the copies, nothing is sent",
}
# flag -> why it is accepted but changes nothing here (each said in one start-up line)
NO_EFFECT: dict[str, str] = {
    "--use-mcore-models": "megatron-core models are the only kind",
    "--distrib-optim-fully-reshardable-mem-efficient": "how Megatron gathers, not what it writes",
    "--ckpt-fully-parallel-load": "every rank already reads only its own slices",
    "--ckpt-fully-parallel-save": "deprecated in Megatron-LM too: sharing is the default",
    "--non-persistent-local-ckpt-algo": "each rank writes its own file and sends nothing",
    "--ddp-average-in-collective": "gradients are summed and divided by the global token count",
    "--overlap-param-gather-with-optimizer-step": "the all-gathers overlap the next forward",
    "--defer-embedding-wgrad-compute": "a GEMM schedule; the same gradient",
    "--wgrad-deferral-limit": "the limit of that GEMM schedule; the same gradient",
    "--moe-grouped-gemm": "a kernel choice: the experts' products one GEMM per expert "
                          "(SequentialMLP), not grouped; the same results, slower",
    "--moe-permute-fusion": "a kernel choice: megatron-core's unfused permutation, the same tokens",
    "--moe-router-fusion": "a kernel choice: megatron-core's unfused router, the same routing",
    "--moe-shared-expert-overlap": "a schedule: the shared experts run in turn, not beside the "
                                   "dispatch on a CUDA stream; the same outputs",
    "--async-strategy": "--async-save uses ReCoVer's own background writer",
    "--num-workers": "microbatches are read by id in the training process",
    "--no-overlap-p2p-communication": "without model chunks, as in Megatron-LM",
    "--use-cpu-initialization": "ReCoVer always initialises on the CPU",
    "--accumulate-allreduce-grads-in-fp32": "ReCoVer's only mode",
    "--calculate-per-token-loss": "ReCoVer's only mode",
    "--auto-detect-ckpt-format": "--load always detects the format",
    "--openai-gelu": "read nowhere in current Megatron-LM either",
    "--onnx-safe": "read nowhere in current Megatron-LM either",
    "--straggler-ctrlr-port": "there is no straggler control server",
    "--use-flash-attn": "read nowhere for megatron-core models in Megatron-LM either "
                        "(the kernel is --attention-backend)",
    "--export-force-local-attention": "ModelOpt's model builder only (a ModelOpt checkpoint or "
                                      "a teacher), as in Megatron-LM's pre-training recipes",
    "--enable-gpt-oss": "ModelOpt's model builder only (a ModelOpt checkpoint or a teacher), as "
                        "in Megatron-LM's pre-training recipes",
}

# flag -> what ReCoVer does instead of what it asks (`arguments.flags.own_way`; said at start-up)
OWN_WAY: dict[str, str] = {
    "--no-check-for-nan-in-loss-and-grad": "the non-finite-loss check stays (--rerun-mode "
                                           "governs it): one replica's NaN must not be committed",
    "--disable-gloo-process-groups": "no effect: ReCoVer builds none of Megatron-LM's gloo groups",
    "--async-ckpt-use-cpu-shm": "no effect: --async-save's writer is a thread, not a process",
    "--test-mode": "all weights compared over the DP replicas every iteration instead of the "
                   "q/k norms' over DP and TP in every forward",
    "--grad-reduce-in-bf16": "gradients reduced in fp32 (exact reduction): 4 bytes per "
                             "parameter on the wire, not 2",
    "--fsdp-double-buffer": "no effect: each Megatron-FSDP gather allocates what it needs",
    "--use-torch-fsdp2": "runs as --use-megatron-fsdp's sharded parameters (ReCoVer's, not "
                         "torch's fully_shard), in K shard groups",
}


def _cell(value) -> str:
    text = "" if value is None else str(value)
    return f"`{text}`" if text else ""


def _default_is_accepted(default) -> bool:
    """A refused flag given its Megatron default on the command line is accepted: can that
    default be written there (not None, not an enum member's repr)?"""
    written = [str(item) for item in (default if isinstance(default, list) else [default])]
    return is_megatrons_default(written, default)


def _row(flags: list[str], default, group: str | None, nargs, parser) -> str:
    action = parser._option_string_actions[flags[0]]
    flag = flags[0]
    if action.default is argparse.SUPPRESS:  # registered to refuse
        refusal = getattr(action, "refusal", None)
        if refusal is None:  # ReCoVer's own refused list (arguments_unsupported)
            own = getattr(action, "refused")
            status, why = "refused", f"{own.message}; {own.fix}"
        else:
            status, why = f"refused: {refusal.kind}", f"{refusal.why}; {refusal.fix}"
            if nargs != 0 and _default_is_accepted(default):
                why += f" (given its default {_cell(default)}: accepted, changes nothing)"
    elif flag in REFUSED_BY_THE_CHECKS:
        status, why = "refused: not supported yet", REFUSED_BY_THE_CHECKS[flag]
    elif flag in NO_EFFECT:
        status, why = "accepted, no effect", NO_EFFECT[flag]
    elif flag in OWN_WAY:
        status, why = "accepted, done ReCoVer's way", OWN_WAY[flag]
    else:
        status = "honoured"
        why = "; ".join(x for x in (DIFFERENCES.get(flag), SOME_VALUES.get(flag) and
                                    f"values: {SOME_VALUES[flag]}") if x)
    names = " ".join(f"`{f}`" for f in flags)
    return f"| {names} | {_cell(default)} | {group or ''} | {status} | {why} |"


def flag_table() -> str:
    facts = megatron_flags()
    parser = build_parser()
    rows = sorted(facts["flags"], key=lambda r: (r["group"] or "", r["flags"][0]))
    counts: dict[str, int] = {}
    lines = []
    for r in rows:
        line = _row(r["flags"], r["default"], r["group"], r["nargs"], parser)
        status = line.rsplit(" | ", 2)[1]
        counts[status] = counts.get(status, 0) + 1
        lines.append(line)
    summary = ", ".join(f"{n} {status}" for status, n in sorted(counts.items()))
    return "\n".join([
        "# Megatron-LM's flags in ReCoVer", "",
        f"Every option of Megatron-LM's GPT parser at {facts['source']}, commit "
        f"`{facts['commit']}`, and what `pretrain_gpt_recover.py` does with it: {summary}.",
        "A refused flag stops the run with one line naming it, why, and what to do instead "
        "(exit code 2), unless it is given Megatron-LM's own default value: that changes "
        "nothing, and is accepted with a start-up line saying so. Written by `python -m megatron.training.tools.flag_table`; "
        "`tests/test_megatron_flags.py` checks it is current.", "",
        "| Flag | Megatron default | Megatron group | ReCoVer | Why / differences |",
        "|---|---|---|---|---|", *lines, ""])


if __name__ == "__main__":
    print(flag_table(), end="")
