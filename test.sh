#!/usr/bin/env bash
# Sets up .venv if needed, then runs the test suite. Extra arguments go to pytest.
#   ./test.sh           the whole suite (what CI runs)
#   ./test.sh --quick   the quick tier: the set-up works, and the core proofs in a few minutes
set -euo pipefail
cd "$(dirname "$0")"
bash scripts/setup-env.sh
if [ "${1:-}" = "--quick" ]; then
    shift
    set -- -m quick "$@"
fi
exec .venv/bin/python -m pytest tests "$@"
