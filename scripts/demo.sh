#!/usr/bin/env bash
# The embedded default: a tiny GPT trained on real text (the Python standard library's own source,
# read at run time) with a GPT-2-style byte-level BPE trained on it, on 4 CPU ranks as
# (TP, PP, DP) = (1, 2, 2). It runs twice: failure-free (cached after the first time), then with a
# rank SIGKILLed mid-iteration -- the survivors finish that iteration and go on, the launcher
# starts a replacement that re-forms the broken replica with its waiting survivor, and the plot
# overlays both loss curves with the live replicas. Usage: bash scripts/demo.sh [extra pretrain flags for both runs]
set -euo pipefail
cd "$(dirname "$0")/.."
source scripts/env.sh
DATA="${DEMO_DIR:-.cache/demo}"
RUN="${DEMO_RUN_DIR:-runs/demo}"
FAULT="${DEMO_FAULT:-kill:rank=3,iter=40,phase=backward}"  # rank 3 = stage 1 of replica 1
python scripts/prepare_demo_data.py --out-dir "$DATA"
mkdir -p "$RUN"

train() {  # $1 = metrics file, then extra flags
    local metrics="$1"; shift
    rm -f "$metrics"
    python -m recover_patches.launch --nproc-per-node 4 --max-replacements 1 pretrain_gpt_recover.py \
        --num-layers 2 --hidden-size 64 --num-attention-heads 4 \
        --seq-length 64 --max-position-embeddings 64 \
        --tensor-model-parallel-size 1 --pipeline-model-parallel-size 2 \
        --micro-batch-size 4 --global-batch-size 32 --train-iters 100 \
        --lr 3e-3 --min-lr 3e-4 --lr-decay-style cosine --lr-warmup-iters 10 --clip-grad 1.0 \
        --hidden-dropout 0 --attention-dropout 0 \
        --data-path "$DATA/stdlib_text_document" --split 98,1,1 \
        --tokenizer-type GPT2BPETokenizer --vocab-file "$DATA/vocab.json" --merge-file "$DATA/merges.txt" \
        --log-interval 10 --eval-interval 50 --eval-iters 2 \
        --metrics-file "$metrics" "$@"
}

key="$(printf '%s ' "$@" | sha1sum | cut -c1-12)"
if [ -s "$RUN/reference-$key.jsonl" ]; then
    echo "== failure-free reference: cached in $RUN/reference-$key.jsonl"
else
    echo "== 1/2 failure-free reference run"
    train "$RUN/reference-$key.tmp" "$@"
    mv "$RUN/reference-$key.tmp" "$RUN/reference-$key.jsonl"
fi
echo "== 2/2 the same job with a failure injected: $FAULT"
train "$RUN/with_failure.jsonl" --inject-fault "$FAULT" "$@"
python scripts/compare_runs.py --reference "$RUN/reference-$key.jsonl" \
    --run "$RUN/with_failure.jsonl" --out "$RUN/losses.png"
