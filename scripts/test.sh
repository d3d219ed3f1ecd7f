#!/usr/bin/env bash
# Set up (idempotent) and run the whole test suite. Extra arguments go to pytest.
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/setup.sh
exec .venv/bin/python -m pytest -q -p no:cacheprovider --durations=30 "$@"  # the slowest tests, to keep the suite in budget
