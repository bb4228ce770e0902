#!/usr/bin/env bash
# The GPU checks for a short lease (one ~9-minute call of a 15-minute device budget), each stage
# bounded so a hang costs only its stage, most wanted first: the multi-rank NCCL harness's
# failure-free run, kill and hang at small layouts, then a 2x2x2 kill and a CP 2 kill ([O], not
# run on a GPU yet), then layer 1's NCCL
# tests (they and the one-rank training tests passed on an H200 on 2026-11-26; VP = 2 and the
# rest: `multirank.py --only`, check.sh). Each run is bounded below its stage (--run-timeout):
# a run that times out keeps its output, with every rank's Python stacks (and native ones, with
# py-spy from .whl/) for the diagnosis.
#   bash scripts/gpu/short.sh        # results in ${OUT:-runs/gpu}/ (logs, summaries, a tarball)
set -uo pipefail
source "$(dirname "$0")/env.sh"
out="${OUT:-runs/gpu}"
mkdir -p "$out"
record_device "$out"
stage() {  # name seconds command...: bounded; ranks a killed stage left behind are killed too
    local name=$1 seconds=$2; shift 2
    echo "== $name ($(date -u +%T), at most ${seconds} s)" | tee -a "$out/stages.txt"
    timeout -k 10 "$seconds" "$@" 2>&1 | tee "$out/$name.txt"
    echo "== $name exit ${PIPESTATUS[0]} ($(date -u +%T))" | tee -a "$out/stages.txt"
    pkill -9 -f pretrain_gpt_recover || true
}
work=/tmp/recover-gpu t=tests/test_gpu.py
gpu_tests=(python3 -m pytest -q -p no:cacheprovider -m gpu --timeout 150 --durations=10)
stage multirank_small 250 python3 scripts/gpu/multirank.py --out "$work/small" --run-timeout 75 \
    --only 2x1x2-free 2x1x2-kill 1x2x2-hang
stage multirank_more 200 python3 scripts/gpu/multirank.py --out "$work/more" --run-timeout 75 \
    --only 2x2x2-kill 1x1x2-cp2-kill
stage nccl_tests 80 "${gpu_tests[@]}" $t::test_nccl_size_one_group_reduces_and_aborts \
    $t::test_a_member_missing_at_connect_fails_the_build_within_its_bound \
    $t::test_a_resilient_nccl_group_leaves_the_host_free_and_times_only_what_could_start
tar czf "$out/runs.tgz" -C "$work" . 2>/dev/null
