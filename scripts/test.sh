#!/usr/bin/env bash
# The test suite (unit tests + a few small multi-process runs over gloo). Usage: bash scripts/test.sh
# CI leaves out the `extended` set (tests/extended.py); RECOVER_TESTS=all runs it too, and a -m
# given here replaces the selection (`bash scripts/test.sh -m extended`: that set alone).
set -euo pipefail
cd "$(dirname "$0")/.."
source scripts/env.sh
select=(-m "not extended")
if [ "${RECOVER_TESTS:-}" = all ]; then select=(); fi
python -m pytest -q -p no:cacheprovider --durations=25 "${select[@]}" tests "$@"  # keep CI < 30 min
