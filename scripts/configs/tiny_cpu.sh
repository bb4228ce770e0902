# A tiny GPT that trains on CPU in seconds (ReCoVer's own config, for tests, demos and benchmarks).
# Source it, then: python pretrain_gpt_recover.py "${MODEL_ARGS[@]}" "${PARALLEL_ARGS[@]}" \
#   "${BATCH_ARGS[@]}" "${OPT_ARGS[@]}" "${DATA_ARGS[@]}" "${CKPT_ARGS[@]}" "${LOG_ARGS[@]}" \
#   "${PRECISION_ARGS[@]}"
# Set CKPT_DIR before sourcing. Runs on mock data with a NullTokenizer, so it needs no files; for real
# data replace DATA_ARGS with: --data-path "$DATA_PATH" --vocab-file "$VOCAB_FILE"
#   --merge-file "$MERGE_FILE" --split 949,50,1
# No PRECISION_ARGS: fp32 (--bf16 / --fp16 run on CPU too). With 4 ranks and TP=PP=1 there are 4 replicas, and
# each iteration deals its 8 microbatches (16 / 2) to whichever replicas are alive.

MODEL_ARGS=(
    --num-layers 4
    --hidden-size 64
    --num-attention-heads 4
    --seq-length 64
    --max-position-embeddings 64
)
PARALLEL_ARGS=(
    --tensor-model-parallel-size 1
    --pipeline-model-parallel-size 1
    --distributed-backend gloo
)
BATCH_ARGS=(
    --micro-batch-size 2
    --global-batch-size 16
    --train-iters 50
)
OPT_ARGS=(
    --lr 1.0e-3
    --min-lr 1.0e-4
    --lr-decay-style cosine
    --lr-warmup-iters 5
    --weight-decay 0.01
    --clip-grad 1.0
)
DATA_ARGS=(
    --mock-data
    --tokenizer-type NullTokenizer
    --vocab-size 512
)
CKPT_ARGS=(
    --save "$CKPT_DIR"
    --save-interval 25
)
LOG_ARGS=(
    --log-interval 1
    --eval-interval 25
    --eval-iters 2
)
PRECISION_ARGS=()
