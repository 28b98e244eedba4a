#!/usr/bin/env bash
# Sets up .venv if needed, then runs the main job: every strategy, one comparison table.
# Extra arguments go to benchmark.py (see --help).
set -euo pipefail
cd "$(dirname "$0")"
bash scripts/setup-env.sh
exec .venv/bin/python benchmark.py "$@"
