#!/usr/bin/env bash
# Sets up .venv if needed, then runs the main job: every strategy, one comparison table.
# Extra arguments go to benchmark.py (see --help); relative paths in them are the caller's folder's.
set -euo pipefail
root="$(cd "$(dirname "$0")" && pwd)"
(cd "$root" && bash scripts/setup-env.sh)
exec "$root/.venv/bin/python" "$root/benchmark.py" "$@"
