#!/usr/bin/env bash
# Sets up .venv if needed, then runs the main job. Extra arguments go to the script.
set -euo pipefail
cd "$(dirname "$0")"
bash scripts/setup-env.sh
exec .venv/bin/python single-gpu-cls.py "$@"
