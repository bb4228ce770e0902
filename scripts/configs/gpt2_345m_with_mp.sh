# GPT-2 345M with model parallelism (TP 2, PP 2, sequence parallel), the flag set of Megatron-LM's
# examples/pretrain_gpt_distributed_with_mp.sh (8 GPUs: TP 2 x PP 2 x DP 2).
# Source it, then: python pretrain_gpt_recover.py "${MODEL_ARGS[@]}" "${PARALLEL_ARGS[@]}" \
#   "${BATCH_ARGS[@]}" "${OPT_ARGS[@]}" "${DATA_ARGS[@]}" "${CKPT_ARGS[@]}" "${LOG_ARGS[@]}" \
#   "${PRECISION_ARGS[@]}"
# Set DATA_PATH, VOCAB_FILE, MERGE_FILE and CKPT_DIR before sourcing.
# Left out on purpose (both removed from current Megatron-LM):
#   --data-impl mmap                         indexed datasets are always mmap
#   --activations-checkpoint-method uniform  replaced by --recompute-granularity full
#                                            --recompute-method uniform (both honoured)

MODEL_ARGS=(
    --num-layers 24
    --hidden-size 1024
    --num-attention-heads 16
    --seq-length 1024
    --max-position-embeddings 1024
)
PARALLEL_ARGS=(
    --tensor-model-parallel-size 2
    --pipeline-model-parallel-size 2
    --sequence-parallel
)
BATCH_ARGS=(
    --micro-batch-size 4
    --global-batch-size 16
    --train-iters 500000
)
OPT_ARGS=(
    --lr 0.00015
    --lr-decay-iters 320000
    --lr-decay-style cosine
    --min-lr 1.0e-5
    --weight-decay 1e-2
    --lr-warmup-fraction .01
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
)
PRECISION_ARGS=(
    --fp16
)
