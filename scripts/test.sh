#!/usr/bin/env bash
# The test suite (unit tests + a few small multi-process runs over gloo). Usage: bash scripts/test.sh
set -euo pipefail
cd "$(dirname "$0")/.."
source scripts/env.sh
python -m pytest -q -p no:cacheprovider --durations=25 tests "$@"  # the slowest 25: keep CI < 30 min
