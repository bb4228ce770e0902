# GPT-3 857M, the flag set of Megatron-LM's examples/gpt3/train_gpt3_857m_distributed.sh
# (8 GPUs: TP 8, PP 1).
# Source it, then: python pretrain_gpt_recover.py "${MODEL_ARGS[@]}" "${PARALLEL_ARGS[@]}" \
#   "${BATCH_ARGS[@]}" "${OPT_ARGS[@]}" "${DATA_ARGS[@]}" "${CKPT_ARGS[@]}" "${LOG_ARGS[@]}" \
#   "${PRECISION_ARGS[@]}"
# Set DATA_PATH, VOCAB_FILE, MERGE_FILE, CKPT_DIR and TENSORBOARD_DIR before sourcing
# (--tensorboard-dir needs the tensorboard package).

MODEL_ARGS=(
    --num-layers 24
    --hidden-size 1024
    --num-attention-heads 16
    --seq-length 2048
    --max-position-embeddings 2048
    --attention-backend auto
)
PARALLEL_ARGS=(
    --tensor-model-parallel-size 8
    --pipeline-model-parallel-size 1
)
BATCH_ARGS=(
    --micro-batch-size 8
    --global-batch-size 128
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
