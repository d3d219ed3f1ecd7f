#!/usr/bin/env bash
# Set up (idempotent) and start the console on a profile (default: three CPU nodes on this machine).
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/setup.sh
profile=${1:-profiles/local.toml}
[ $# -gt 0 ] && shift
exec .venv/bin/zeroband-console "$profile" "$@"
