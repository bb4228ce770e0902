#!/usr/bin/env bash
# The embedded default: a tiny GPT trained on real text (the Python standard library's own source,
# read at run time), with a GPT-2-style byte-level BPE trained on it, on 4 CPU ranks.
# Cached data in .cache/demo is reused. Usage: bash scripts/demo.sh [extra pretrain flags]
set -euo pipefail
cd "$(dirname "$0")/.."
source scripts/env.sh
PY=python
OUT="${DEMO_DIR:-.cache/demo}"
RUN="${DEMO_RUN_DIR:-runs/demo}"
"$PY" scripts/prepare_demo_data.py --out-dir "$OUT"
mkdir -p "$RUN"
rm -f "$RUN/metrics.jsonl"
OMP_NUM_THREADS=1 "$PY" -m recover_patches.launch --nproc-per-node 4 pretrain_gpt_recover.py \
    --num-layers 2 --hidden-size 64 --num-attention-heads 4 \
    --seq-length 64 --max-position-embeddings 64 \
    --tensor-model-parallel-size 1 --pipeline-model-parallel-size 2 \
    --micro-batch-size 4 --global-batch-size 32 --train-iters 120 \
    --lr 3e-3 --min-lr 3e-4 --lr-decay-style cosine --lr-warmup-iters 10 --clip-grad 1.0 \
    --hidden-dropout 0 --attention-dropout 0 \
    --data-path "$OUT/stdlib_text_document" --split 98,1,1 \
    --tokenizer-type GPT2BPETokenizer --vocab-file "$OUT/vocab.json" --merge-file "$OUT/merges.txt" \
    --log-interval 10 --eval-interval 60 --eval-iters 2 \
    --metrics-file "$RUN/metrics.jsonl" "$@"
