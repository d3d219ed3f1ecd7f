#!/usr/bin/env bash
# Set up (idempotent) and run the whole test suite. Extra arguments go to pytest.
#
# The tests run on min(cores, 4) pytest-xdist workers: about half of a test's time is spent waiting (on engines
# starting, heartbeats, timeouts, a shaped link), so on 2 cores one test at a time left 44 % of the CPU idle and two
# at a time took pytest from 1180 s to 789-832 s (docs/reliability.md, "The test machine").
# ZEROBAND_TEST_WORKERS=0 runs them one at a time.
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/setup.sh
cores=$(nproc)
workers=${ZEROBAND_TEST_WORKERS:-$(( cores < 4 ? cores : 4 ))}
parallel=()
if [ "$workers" -ge 2 ]; then
  parallel=(-n "$workers" --dist worksteal)  # worksteal: a worker that runs out takes queued tests from the other
fi
exec .venv/bin/python -m pytest -q -p no:cacheprovider --durations=30 "${parallel[@]}" "$@"  # the slowest tests
