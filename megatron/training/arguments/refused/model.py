"""Why ReCoVer refuses each Megatron-LM model flag that no family of `arguments.refused.reasons`
covers.

One entry per flag (its `--no-`/`--disable-` spellings share it). A flag missing here and in the
families is refused as "not supported yet"; `tests/test_megatron_flags.py` keeps that fallback
from growing.
"""
from __future__ import annotations

from megatron.training.arguments.refused.reasons import (NOT_FOR_PRETRAINING, Refusal, not_yet,
                                                          own_way)

_KERNEL = "selects a GPU kernel or fusion that ReCoVer does not build yet"
_T5_BERT = Refusal(NOT_FOR_PRETRAINING, "configures encoder-decoder (T5) or BERT models")
_INIT = not_yet("changes weight initialisation; ReCoVer draws every weight by name from "
                "--init-method-std so that any layout starts from the same weights")
_ATTENTION_VARIANT = not_yet("changes attention (softmax variants, clipping, logit logging), not "
                             "supported by ReCoVer's attention yet")
_YARN = not_yet("configures YaRN rope scaling, not supported yet")
_DEPRECATED_POSITION = not_yet("is a deprecated spelling Megatron-LM keeps; not supported",
                               "use --position-embedding-type")

MODEL_FLAGS: dict[str, Refusal] = {
    # model
    "--encoder-num-layers": _T5_BERT, "--decoder-num-layers": _T5_BERT,
    "--encoder-seq-length": _T5_BERT, "--decoder-seq-length": _T5_BERT,
    "--relative-attention-num-buckets": _T5_BERT, "--relative-attention-max-distance": _T5_BERT,
    "--bert-no-binary-head": _T5_BERT, "--vocab-extra-ids": _T5_BERT, "--mask-prob": _T5_BERT,
    "--short-seq-prob": _T5_BERT,
    "--sample-rate": not_yet("subsamples the datasets, not supported yet"),
    "--softmax-type": _ATTENTION_VARIANT,
    "--qk-clip": _ATTENTION_VARIANT,
    "--qk-clip-alpha": _ATTENTION_VARIANT, "--qk-clip-threshold": _ATTENTION_VARIANT,
    "--log-max-attention-logit": _ATTENTION_VARIANT,
    "--flash-attention-version": not_yet(_KERNEL), "--use-te-activation-func": not_yet(_KERNEL),
    "--use-fused-weighted-squared-relu": not_yet(_KERNEL),
    "--fused-residual-rmsnorm": not_yet(_KERNEL),
    "--use-transformer-engine-op-fuser": not_yet(_KERNEL),
    "--disable-jit-fuser": not_yet(_KERNEL),
    "--yarn-original-max-position-embeddings": _YARN, "--yarn-beta-fast": _YARN,
    "--yarn-beta-slow": _YARN, "--yarn-correction-range-round-to-int": _YARN,
    "--no-yarn-correction-range-round-to-int": _YARN, "--mrope-section": _YARN,
    "--no-rope-freq": not_yet("skips rope on some layers, not supported yet"),
    "--no-position-embedding": _DEPRECATED_POSITION,
    "--apply-residual-connection-post-layernorm": not_yet("moves the residual after the norm "
                                                          "(BERT style), not supported yet"),
    "--fp32-residual-connection": not_yet("keeps the residual stream in fp32, not supported yet"),
    "--embedding-init-method-std": _INIT, "--init-method-xavier-uniform": _INIT,
    "--data-parallel-random-init": _INIT, "--no-initialization": _INIT,
    "--init-model-with-meta-device": _INIT,
    "--te-rng-tracker": not_yet("uses transformer-engine's RNG tracker, not supported yet"),
    "--distribute-saved-activations": not_yet("splits recomputed activations over TP ranks, not "
                                              "supported yet"),
    "--no-clone-scatter-output-in-embedding": not_yet(_KERNEL),
    "--disable-clone-scatter-output-in-embedding": not_yet(_KERNEL),
    "--config-logger-dir": not_yet("dumps module configurations, not supported yet"),
    "--tensor-parallel-num-weight-shards": not_yet("shards TP weights further, not supported yet"),
    "--pipeline-model-parallel-comm-backend": own_way(
        "picks the pipeline's p2p backend; ReCoVer's pipeline p2p goes through its resilient "
        "groups (NCCL on GPUs, gloo on CPU)", "drop the flag"),
    "--pipeline-model-parallel-layout": not_yet("places layers per stage by a layout string, not "
                                                "supported yet", "use --decoder-first-pipeline-"
                                                "num-layers / --decoder-last-pipeline-num-layers"),
    "--use-ring-exchange-p2p": not_yet("uses ring-exchange p2p, not supported yet"),
    "--delay-wgrad-compute": not_yet("delays weight-gradient GEMMs, not supported yet"),
    "--model-parallel-size": not_yet("is Megatron-LM's deprecated spelling",
                                     "use --tensor-model-parallel-size"),
}
