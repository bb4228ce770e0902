#!/usr/bin/env bash
# The GPU checks for a short lease (one ~9-minute call of a 15-minute device budget), each stage
# bounded so a hang costs only its stage, most wanted first: the multi-rank NCCL harness (quick),
# layer 1's NCCL tests, the harness's hang, 2x2x2 and VP = 2 runs, then one-rank training tests
# (the precision tests, which ran on an H100 before, are left to check.sh).
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
stage multirank_quick 150 python3 scripts/gpu/multirank.py --quick --out "$work/quick"
stage nccl_tests 80 "${gpu_tests[@]}" $t::test_nccl_size_one_group_reduces_and_aborts \
    $t::test_a_member_missing_at_connect_fails_the_build_within_its_bound \
    $t::test_a_resilient_nccl_group_leaves_the_host_free_and_times_only_what_could_start
stage multirank_more 130 python3 scripts/gpu/multirank.py --out "$work/more" \
    --only 1x2x2-hang 2x2x2-kill 1x2x2-vp2-kill
stage launch_tests 110 "${gpu_tests[@]}" $t::test_distributed_optimizer_with_overlap_trains_like_the_plain_one_on_gpu \
    $t::test_torch_dist_async_save_resumes_bitwise_on_gpu $t::test_fp32_gpu_matches_cpu
tar czf "$out/runs.tgz" -C "$work" . 2>/dev/null
