# GPT-3 175B, the flag set of Megatron-LM's examples/gpt3/train_gpt3_175b_distributed.sh
# (TP 8 x PP 16 = 128 GPUs per replica).
# Source it, then: python pretrain_gpt_recover.py "${MODEL_ARGS[@]}" "${PARALLEL_ARGS[@]}" \
#   "${BATCH_ARGS[@]}" "${OPT_ARGS[@]}" "${DATA_ARGS[@]}" "${CKPT_ARGS[@]}" "${LOG_ARGS[@]}" \
#   "${PRECISION_ARGS[@]}"
# Set DATA_PATH, VOCAB_FILE, MERGE_FILE, CKPT_DIR and TENSORBOARD_DIR before sourcing.
# Note: current Megatron-LM rejects --rampup-batch-size together with --train-iters; ReCoVer accepts
# it (the batch ramps up by sample count either way).

MODEL_ARGS=(
    --num-layers 96
    --hidden-size 12288
    --num-attention-heads 96
    --seq-length 2048
    --max-position-embeddings 2048
    --attention-backend auto
)
PARALLEL_ARGS=(
    --tensor-model-parallel-size 8
    --pipeline-model-parallel-size 16
)
BATCH_ARGS=(
    --micro-batch-size 1
    --global-batch-size 1536
    --rampup-batch-size 16 16 5859375
    --train-iters 500000
)
OPT_ARGS=(
    --lr 6.0e-5
    --min-lr 6.0e-6
    --lr-decay-style cosine
    --lr-warmup-fraction .001
    --lr-decay-iters 430000
    --weight-decay 0.1
    --adam-beta1 0.9
    --adam-beta2 0.95
    --init-method-std 0.006
    --clip-grad 1.0
)
DATA_ARGS=(
    --data-path "$DATA_PATH"
    --vocab-file "$VOCAB_FILE"
    --merge-file "$MERGE_FILE"
    --split 949,50,1
)
CKPT_ARGS=(
    --save "$CKPT_DIR"
    --load "$CKPT_DIR"
    --save-interval 10000
)
LOG_ARGS=(
    --log-interval 100
    --eval-interval 1000
    --eval-iters 10
    --tensorboard-dir "$TENSORBOARD_DIR"
)
PRECISION_ARGS=(
    --fp16
)
