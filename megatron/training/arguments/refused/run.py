"""Why ReCoVer refuses each Megatron-LM flag of training, checkpointing, distribution, data,
tokenizer and logging that no family of `arguments.refused.reasons` covers."""
from __future__ import annotations

from megatron.training.arguments.refused.reasons import Refusal, not_yet, own_way

_EVAL = not_yet("configures evaluation beyond --eval-interval / --eval-iters over the "
                "validation split, not supported yet")
_CKPT_DEBUG = not_yet("saves debugging tensors (params, activations, gradients, expert tokens) "
                      "on an interval, not supported yet")
_CKPT_CONVERT = not_yet("converts checkpoints between formats, not supported: ReCoVer reads and "
                        "writes torch_dist and torch")
_CKPT_ARGS = not_yet("takes model flags from the checkpoint, not supported yet: ReCoVer checks "
                     "the checkpoint's flags against the command line and names each difference",
                     "pass the checkpoint's model flags on the command line")
_FULLY_PARALLEL_TUNING = not_yet("tunes megatron-core's fully parallel save/load exchange, "
                                 "which ReCoVer does not use")
_FLIGHT = own_way("configures torch's NCCL flight recorder dumps, which ReCoVer turns off: a "
                  "dump on one rank's timeout stalls every survivor (docs/NCCL.md)",
                  "drop the flag")
_NCCL_TUNING = not_yet("tunes NCCL communicators (SHARP, user buffers, stream priorities, a "
                       "config file), not supported yet: ReCoVer creates and re-creates its own "
                       "communicators")
_BUCKETS = own_way("shapes megatron-core DDP's gradient buckets; ReCoVer's gradient buffer takes "
                   "--ddp-bucket-size and pads buckets for its distributed optimizer",
                   "drop the flag (use --ddp-bucket-size)")
_ALIGN = own_way("aligns megatron-core DDP's grad/param syncs with the pipeline; ReCoVer's "
                 "schedule starts each bucket's sync itself", "drop the flag")
_TOKENIZER = not_yet("configures a tokenizer ReCoVer does not build yet (GPT2BPETokenizer, "
                     "HuggingFaceTokenizer, NullTokenizer and TikTokenizer are built)")
_PRECISION_DTYPES = own_way("sets the dtype of main params, grads or Adam moments; ReCoVer keeps "
                            "them in fp32 (its bf16/fp16 recipe)", "drop the flag")
_BATCH_SCHEDULE = not_yet("changes the batch size during the run other than by "
                          "--rampup-batch-size or --step-batch-size-schedule, not supported yet")
_SIGNALS = not_yet("chooses the exit signal or its handlers, not supported yet: "
                   "--exit-signal-handler handles SIGTERM")
_FREEZE = not_yet("freezes parameters, not supported yet")
_LOGGING = not_yet("adds a log line or metric ReCoVer does not write yet")

RUN_FLAGS: dict[str, Refusal] = {
    # training
    "--decrease-batch-size-if-needed": _BATCH_SCHEDULE, "--batch-size": not_yet("is Megatron-LM's deprecated spelling",
                                                 "use --micro-batch-size"),
    "--gpu-sniff-test-interval": not_yet("runs GPU health tests, not supported yet"),
    "--train-sync-interval": not_yet("synchronises the host every N iterations, not supported "
                                     "yet"),
    "--exit-signal": _SIGNALS, "--exit-signal-handler-for-dataloader": _SIGNALS,
    "--exit-signal-handler-for-training": _SIGNALS,
    "--disable-manual-gc-eval": not_yet("changes garbage collection around evaluation, not "
                                        "supported yet"),
    "--iterations-to-skip": not_yet("skips iterations' data, not supported yet"),
    "--dump-param-to-param-group-map": not_yet("dumps the optimizer's parameter groups, not "
                                               "supported yet"),
    "--dataloader-type": own_way("picks Megatron's data loader; ReCoVer reads each microbatch "
                                 "by its id, so a recomputed one reads the same samples",
                                 "drop the flag"),
    # learning rate
    "--warmup": not_yet(
        "is Megatron-LM's deprecated spelling", "use --lr-warmup-iters or --lr-warmup-fraction"),
    "--freeze-all-layers": _FREEZE, "--no-weight-decay-cond-type": not_yet(
        "chooses which parameters skip weight decay, not supported yet (megatron-core's "
        "standard rule: biases and 1-D parameters)"),
    # checkpointing
    "--persistent-save-interval": _CKPT_DEBUG, "--save-params-interval": _CKPT_DEBUG,
    "--save-activations-interval": _CKPT_DEBUG, "--save-tokens-per-expert-interval": _CKPT_DEBUG,
    "--save-wgrads-interval": _CKPT_DEBUG, "--save-dgrads-interval": _CKPT_DEBUG,
    "--load-main-params-from-ckpt": not_yet("loads fp32 main params alone, not supported yet"),
    "--pretrained-checkpoint": not_yet("starts from a pretrained checkpoint, not supported yet",
                                       "use --load with --finetune"),
    "--use-checkpoint-args": _CKPT_ARGS, "--use-mp-args-from-checkpoint-args": _CKPT_ARGS,
    "--no-use-tokenizer-model-from-checkpoint-args": _CKPT_ARGS,
    "--disable-use-tokenizer-model-from-checkpoint-args": _CKPT_ARGS,
    "--ckpt-convert-format": _CKPT_CONVERT, "--ckpt-convert-save": _CKPT_CONVERT,
    "--ckpt-convert-update-legacy-dist-opt-format": _CKPT_CONVERT,
    "--async-ckpt-cpu-priority": _FULLY_PARALLEL_TUNING,
    "--async-ckpt-io-priority": _FULLY_PARALLEL_TUNING,
    "--ckpt-fully-parallel-load-exchange-algo": _FULLY_PARALLEL_TUNING,
    "--ckpt-fully-parallel-load-per-rank-objects": _FULLY_PARALLEL_TUNING,
    "--ckpt-fully-parallel-save-process-group": _FULLY_PARALLEL_TUNING,
    "--ckpt-fully-parallel-load-process-group": _FULLY_PARALLEL_TUNING,
    "--ckpt-pg-tensors-cache-path": _FULLY_PARALLEL_TUNING,
    "--ckpt-pg-tensors-cache-create": _FULLY_PARALLEL_TUNING,
    "--no-ckpt-load-validate-sharding-integrity": _FULLY_PARALLEL_TUNING,
    "--disable-ckpt-load-validate-sharding-integrity": _FULLY_PARALLEL_TUNING,
    "--dist-ckpt-save-pre-mcore-014": _CKPT_CONVERT,
    "--no-save-tokenizer-assets": not_yet("skips saving tokenizer files, not supported yet"),
    "--disable-save-tokenizer-assets": not_yet("skips saving tokenizer files, not supported "
                                               "yet"),
    "--override-ckpt-iteration": not_yet("overrides the loaded iteration, not supported yet"),
    "--use-dist-ckpt": not_yet("is Megatron-LM's deprecated spelling",
                               "use --ckpt-format torch_dist (the default)"),
    "--dist-ckpt-format": not_yet("is Megatron-LM's deprecated spelling", "use --ckpt-format"),
    "--dist-ckpt-workers": _FULLY_PARALLEL_TUNING,
    "--ckpt-drop-redundant-extra-state": _FULLY_PARALLEL_TUNING,
    # mixed precision
    "--fp16-lm-cross-entropy": not_yet(
        "computes the cross entropy in fp16, not supported yet"),
    "--output-logit-dtype": not_yet("sets the logits' dtype, not supported yet"),
    "--use-precision-aware-optimizer": _PRECISION_DTYPES, "--main-grads-dtype": _PRECISION_DTYPES,
    "--main-params-dtype": _PRECISION_DTYPES, "--exp-avg-dtype": _PRECISION_DTYPES,
    "--exp-avg-sq-dtype": _PRECISION_DTYPES,
    # distributed
    "--no-align-grad-reduce": _ALIGN, "--disable-align-grad-reduce": _ALIGN,
    "--no-align-param-gather": _ALIGN,
    "--lazy-mpu-init": not_yet("defers process-group set-up to an external caller, not "
                               "supported"),
    "--fake-process-group": not_yet("runs on a fake process group, not supported"),
    "--nccl-communicator-config-path": _NCCL_TUNING, "--use-sharp": _NCCL_TUNING,
    "--sharp-enabled-group": _NCCL_TUNING, "--high-priority-stream-groups": _NCCL_TUNING,
    "--use-nccl-ub": _NCCL_TUNING, "--disable-symmetric-registration": _NCCL_TUNING,
    "--create-all-gather-group": _NCCL_TUNING,
    "--distributed-timeout-seconds-after-init": own_way(
        "sets the timeout of collectives; ReCoVer bounds every operation by --recover-timeout",
        "drop the flag (set --recover-timeout)"),
    "--flight-recorder-dump-path": _FLIGHT, "--flight-recorder-trace-buffer-size": _FLIGHT,
    "--no-flight-recorder-dump-on-timeout": _FLIGHT,
    "--disable-flight-recorder-dump-on-timeout": _FLIGHT,
    "--flight-recorder-include-stack-trace": _FLIGHT,
    "--no-flight-recorder-include-only-active": _FLIGHT,
    "--disable-flight-recorder-include-only-active": _FLIGHT,
    "--no-flight-recorder-extra-dump-on-exec": _FLIGHT,
    "--disable-flight-recorder-extra-dump-on-exec": _FLIGHT,
    "--ddp-num-buckets": _BUCKETS, "--ddp-pad-buckets-for-high-nccl-busbw": _BUCKETS,
    "--ddp-reduce-scatter-with-fp32-accumulation": _PRECISION_DTYPES,
    "--ddp-param-name-patterns-for-fp32-local-accumulation": _PRECISION_DTYPES,
    "--no-gradient-reduce-div-fusion": own_way(
        "changes where megatron-core DDP divides gradients; ReCoVer divides by the global "
        "token count once", "drop the flag"),
    # validation
    "--start-eval-at-iter": _EVAL, "--eval-global-batch-size": _EVAL,
    "--eval-micro-batch-size": _EVAL, "--skip-train": _EVAL, "--full-validation": _EVAL,
    "--multiple-validation-sets": _EVAL, "--validation-set-names": _EVAL,
    # data
    "--phase-transition-iterations": _BATCH_SCHEDULE,
    "--per-dataset-sequences-path": not_yet("reads per-dataset sequence counts, not supported "
                                            "yet"),
    "--dataloader-fast-cache-load": not_yet("changes how dataset indices are cached, not "
                                            "supported yet"),
    "--dataloader-defer-npy-index-mmap": not_yet("changes how dataset indices are cached, not "
                                                 "supported yet"),
    "--dataloader-inter-document-masking": not_yet("masks attention across documents, not "
                                                   "supported yet"),
    "--allow-ambiguous-pad-tokens": not_yet("allows a pad token equal to another special token, "
                                            "not supported yet"),
    # tokenizer
    "--padded-vocab-size": not_yet("sets the padded vocabulary size, not supported yet: it is "
                                   "derived with --make-vocab-size-divisible-by"),
    "--no-pad-vocab-size": not_yet("skips vocabulary padding, not supported yet"),
    "--disable-pad-vocab-size": not_yet("skips vocabulary padding, not supported yet"),
    "--tokenizer-metadata": _TOKENIZER,
    "--tokenizer-sentencepiece-legacy": _TOKENIZER,
    "--no-tokenizer-sentencepiece-ignore-extra-whitespaces": _TOKENIZER,
    "--disable-tokenizer-sentencepiece-ignore-extra-whitespaces": _TOKENIZER,
    "--tokenizer-hf-no-use-fast": _TOKENIZER, "--tokenizer-hf-no-include-special-tokens":
        _TOKENIZER, "--trust-remote-code": _TOKENIZER, "--null-tokenizer-eod-id": _TOKENIZER,
    "--null-tokenizer-pad-id": _TOKENIZER, "--chat-template": _TOKENIZER,
    "--use-gigatoken": _TOKENIZER,
    # logging
    "--log-progress": _LOGGING, "--timing-log-option": _LOGGING,
    "--no-log-loss-scale-to-tensorboard": _LOGGING,
    "--disable-log-loss-scale-to-tensorboard": _LOGGING, "--log-memory-interval": _LOGGING,
    "--log-device-memory-used": _LOGGING, "--no-barrier-with-level-1-timing": _LOGGING,
    "--log-world-size-to-tensorboard": _LOGGING, "--log-energy": _LOGGING,
    # experimental
    "--enable-experimental": not_yet("turns on megatron-core's experimental features, not "
                                     "supported"),
    "--spec": own_way("picks a layer spec module; ReCoVer builds megatron-core's GPT spec from "
                      "--transformer-impl", "drop the flag"),
    "--yaml-cfg": not_yet("reads the flags from a YAML file, not supported yet",
                          "pass the flags on the command line"),
}
