#!/usr/bin/env bash
# Set up (idempotent) and run the whole test suite. Extra arguments go to pytest.
#
# The tests run on min(cores, 4) pytest-xdist workers: about half of a test's time is spent waiting (on engines
# starting, heartbeats, timeouts, a shaped link), so on 2 cores one test at a time left 44 % of the CPU idle and two
# at a time took pytest from 1180 s to 786-832 s (docs/reliability.md, "The test machine").
# ZEROBAND_TEST_WORKERS=N runs N at a time; 0 or 1, one at a time.
set -euo pipefail
cd "$(dirname "$0")/.."
# the tests' own system packages too (not the hosts': setup.sh also runs on each host at `sync`): login shells that
# are not sh, for the SSH test of a host user whose shell is fish or tcsh
APT_EXTRA="fish tcsh" scripts/setup.sh
cores=$(nproc)
workers=${ZEROBAND_TEST_WORKERS:-$(( cores < 4 ? cores : 4 ))}
if ! [[ "$workers" =~ ^[0-9]+$ ]]; then
  echo "scripts/test.sh: ZEROBAND_TEST_WORKERS must be a whole number, got '$workers'" >&2
  exit 2
fi
parallel=()
if [ "$workers" -ge 2 ]; then
  if .venv/bin/python -c "import xdist" 2>/dev/null; then
    parallel=(-n "$workers" --dist worksteal)  # worksteal: a worker that runs out takes queued tests from another
  else  # a BASE_SITE set-up (scripts/setup.sh) whose packages lack it
    echo "scripts/test.sh: pytest-xdist is not installed: one test at a time" >&2
  fi
fi
exec .venv/bin/python -m pytest -q -p no:cacheprovider --durations=30 ${parallel[@]+"${parallel[@]}"} "$@"
