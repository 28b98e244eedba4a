#!/usr/bin/env bash
# Sets up .venv if needed, then runs the test suite. Extra arguments go to pytest.
#   ./test.sh           the whole suite (what CI runs), but the quick tier's launcher checks, which its
#                       training runs make again
#   ./test.sh --quick   the quick tier: the set-up works, and the core proofs in a few minutes
set -euo pipefail
cd "$(dirname "$0")"
bash scripts/setup-env.sh
if [ "${1:-}" = "--quick" ]; then
    shift
    set -- -m quick "$@"
else
    set -- -m "not quick_only" "$@"
fi
# Two workers (pytest-xdist), a file each at a time: while one test's launcher waits or one of its
# processes imports, the other core runs another file. Runs that several files read are launched once
# (conftest.once_per_session). Later options win: -n 0 runs in one process.
exec .venv/bin/python -m pytest tests -n 2 --dist loadfile "$@"
