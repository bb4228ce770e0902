#!/usr/bin/env bash
# The GPU checks for a short lease (one ~9-minute call of a 15-minute device budget), each stage
# bounded so a hang costs only its stage, the failures first: kill and hang at small layouts
# (the H200 cases, which the emulated NCCL of tests/test_emulated_nccl_faults.py reproduced on
# CPU), then a 2x2x2 kill and a CP 2 kill, then the failure-free run, then layer 1's NCCL tests.
# Each run is bounded below its stage (--run-timeout): a run that times out keeps its output,
# with every rank's Python stacks (and native ones, with py-spy from .whl/). Only this script's
# own processes are ended: each stage's launchers record their sessions, killed by group.
#   bash scripts/gpu/short.sh        # results in ${OUT:-runs/gpu}/ (logs, summaries, a tarball)
set -uo pipefail
source "$(dirname "$0")/env.sh"
out="${OUT:-runs/gpu}"
mkdir -p "$out"
record_device "$out"
stage() {  # name seconds command...: bounded; the launcher sessions it started are ended after
    local name=$1 seconds=$2; shift 2
    local sessions="$out/sessions.$name"
    : > "$sessions"
    echo "== $name ($(date -u +%T), at most ${seconds} s)" | tee -a "$out/stages.txt"
    RECOVER_LAUNCH_SESSIONS="$sessions" timeout -k 10 "$seconds" "$@" 2>&1 | tee "$out/$name.txt"
    echo "== $name exit ${PIPESTATUS[0]} ($(date -u +%T))" | tee -a "$out/stages.txt"
    while read -r pgid; do
        kill -9 -- "-$pgid" 2> /dev/null || true
    done < "$sessions"
}
work=/tmp/recover-gpu t=tests/test_gpu.py
gpu_tests=(python3 -m pytest -q -p no:cacheprovider -m gpu --timeout 150 --durations=10)
stage multirank_faults 250 python3 scripts/gpu/multirank.py --out "$work/faults" \
    --run-timeout 75 --only 2x1x2-kill 1x2x2-hang 2x1x2-hang
stage multirank_more 200 python3 scripts/gpu/multirank.py --out "$work/more" --run-timeout 75 \
    --only 2x2x2-kill 1x1x2-cp2-kill 2x1x2-free
stage nccl_tests 80 "${gpu_tests[@]}" $t::test_nccl_size_one_group_reduces_and_aborts \
    $t::test_a_member_missing_at_connect_fails_the_build_within_its_bound \
    $t::test_a_resilient_nccl_group_leaves_the_host_free_and_times_only_what_could_start
tar czf "$out/runs.tgz" -C "$work" . 2>/dev/null
