"""The reasons ReCoVer refuses Megatron-LM flags it does not take: the kinds of refusal, the
argument groups that serve other programs than pretrain_gpt.py, and the families of flags (by
name) that belong to a feature ReCoVer does not build or builds its own way."""
from __future__ import annotations

from typing import NamedTuple

NOT_FOR_PRETRAINING = "not for GPT pre-training"
NOT_YET = "not supported yet"
OWN_WAY = "ReCoVer does this its own way"


class Refusal(NamedTuple):
    kind: str  # one of NOT_FOR_PRETRAINING, NOT_YET, OWN_WAY
    why: str
    fix: str = "drop the flag"


def not_yet(why: str, fix: str = "drop the flag") -> Refusal:
    return Refusal(NOT_YET, why, fix)


def own_way(why: str, fix: str) -> Refusal:
    return Refusal(OWN_WAY, why, fix)


# Argument groups of Megatron-LM whose flags serve other programs than pretrain_gpt.py.
GROUPS_NOT_FOR_PRETRAINING: dict[str, str] = {
    "inference": "configures Megatron-LM's inference engine and text-generation server",
    "rl": "configures reinforcement-learning post-training (GRPO)",
    "vision": "configures vision models (ViT, DINO, Swin)",
    "biencoder": "configures retrieval (ICT / bi-encoder) models",
    "Logits Distillation": "configures logits distillation from a teacher",
    "sft": "configures supervised fine-tuning data",
    "heterogeneous architecture": "configures NAS-derived heterogeneous models, not the GPT model",
    "workload inspector": "starts NVIDIA's workload inspector server",
    "modelopt-generic": "configures NVIDIA Model Optimizer (quantisation, distillation, export, "
                        "its fine-tuning data and model builder), which Megatron-LM's "
                        "pretrain_gpt.py takes where ModelOpt is installed; ReCoVer builds "
                        "megatron-core's GPT and loads no ModelOpt checkpoint",
}

_MOE = not_yet("is a mixture-of-experts option not supported yet (--num-experts and the MoE "
               "flags docs/megatron_flags.md marks honoured are)")
_CP = not_yet("belongs to dynamic (hybrid) context parallelism, not supported yet (a fixed "
               "--context-parallel-size is)")
_LOW_PRECISION = not_yet("belongs to fp8/fp4 training (transformer-engine recipes), not "
                          "supported yet: ReCoVer trains in bf16, fp16 or fp32",
                          "drop the flag (use --bf16)")
_FSDP = not_yet("is a Megatron-FSDP or torch FSDP2 option not supported yet (--use-megatron-fsdp "
                "and the flags docs/megatron_flags.md marks honoured are: parameters sharded "
                "over shard groups that fail and grow back as one)", "drop the flag (use "
                "--use-megatron-fsdp)")
_CUDA_GRAPHS = not_yet("captures CUDA graphs, not supported yet: a recovery rebuilds the process "
                        "groups a captured graph would hold")
_OFFLOAD = not_yet("offloads activations or optimizer state to the CPU, not supported yet")
_NOT_GPT_LAYERS = Refusal(NOT_FOR_PRETRAINING, "configures hybrid (Mamba or sparse "
                          "attention) models; pretrain_gpt_recover.py builds megatron-core's GPT")
_TELEMETRY = own_way("sends telemetry to an NVIDIA service; ReCoVer logs to stdout, TensorBoard, "
                      "W&B and --metrics-file", "drop the flag")
_FAULT_TOLERANCE = own_way(
    "configures NVIDIA Resiliency Extension's restarts; ReCoVer keeps the job alive in place: "
    "a dead or hung rank is found by its coordinator within --recover-timeout and the survivors "
    "finish the iteration", "drop the flag (set --recover-timeout)")
_PROFILING = not_yet("is a profiling option not supported yet (--profile, --use-pytorch-profiler "
                     "and its shapes/callstack options, --profile-ranks are)", "drop the flag")
_OPTIMIZER = not_yet("configures an optimizer other than Adam, not supported yet "
                      "(--optimizer adam)")

# (pattern over the flag without its dashes, refusal): the first match decides.
FAMILIES: tuple[tuple[str, Refusal], ...] = (
    (r"(no-)?moe-|expert-|overlap-moe|ep-overlap|overlap-dispatch|use-grouped-gemm|"
     r"high-priority-a2a|gtp-", _MOE),
    (r"max-seqlen-per-dp-cp|hybrid-context", _CP),
    (r"(no-)?fp8|fp4|first-last-layers-bf16|num-layers-at-(start|end)-in-bf16|"
     r"reuse-grad-buf-for-mxfp8|keep-fp8|te-precision-config|use-kitchen|kitchen-", _LOW_PRECISION),
    (r"(no-)?tp-comm-", not_yet("is transformer-engine's userbuffers overlap of TP "
                                 "communication, not supported yet")),
    (r"use-megatron-fsdp|use-torch-fsdp2|megatron-fsdp|fsdp-|torch-fsdp2|data-parallel-sharding|"
     r"outer-dp-sharding|enable-full-sharding-in-hsdp|suggested-communication-unit|"
     r"(no-)?strict-fsdp|(no-)?use-layer-wise", _FSDP),
    (r"(enable|external|inference)-cuda-graph|cuda-graph|optimizer-cuda-graph", _CUDA_GRAPHS),
    (r"cpu-offloading|(fine-grained-)?(activation-)?offload|min-offloaded|delay-offload|"
     r"delta-offload|optimizer-cpu-offload|optimizer-offload|use-torch-optimizer-for-cpu|"
     r"overlap-cpu-optimizer|no-pin-cpu", _OFFLOAD),
    (r"mamba-|is-hybrid-model|hybrid-|gdp-|(no-)?dsa-|mlp-chunks|mhc-|enable-mhc",
     _NOT_GPT_LAYERS),
    (r"mtp-", not_yet("belongs to multi-token prediction, not supported yet")),
    (r"(use-)?mup", not_yet("belongs to muP parametrisation, not supported yet")),
    (r"muon-|lion-|sgd-", _OPTIMIZER),
    (r"cache-mla", Refusal(NOT_FOR_PRETRAINING, "caches multi-latent attention's latents "
                                                 "for inference")),
    (r"mla-", not_yet("is a transformer-engine kernel choice of multi-latent attention, not "
                      "supported yet (--multi-latent-attention runs megatron-core's local "
                      "layers)")),
    (r"inference-|flash-decode|batch-invariant|symmetric-ar|nccl-all-reduce-for-prefill",
     Refusal(NOT_FOR_PRETRAINING, "configures inference")),
    (r"(use-pytorch-)?profile|pytorch-profiler|nvtx|record-memory|memory-snapshot|record-shapes",
     _PROFILING),
    (r"fault-injector-", own_way("is NVIDIA Resiliency Extension's fault injector",
                                  "inject faults with ReCoVer's --inject-fault (docs/running.md)")),
    (r"inprocess-", _FAULT_TOLERANCE),
    (r"(no-)?one-logger|app-tag-|otel-", _TELEMETRY),
    (r"(enable|disable)-msc|object-storage", not_yet(
        "reads through NVIDIA's multi-storage client, not supported: paths are local files",
        "drop the flag")),
    (r"adlr-autoresume", own_way("is ADLR's cluster auto-resume; ReCoVer resumes in the running "
                                  "job, and from --load after a restart", "drop the flag")),
)
