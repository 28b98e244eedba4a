#!/usr/bin/env bash
# The set-up most users get, tried on this machine: a fresh clone of the committed HEAD, an environment
# made from the given Python with PyPI's torch (the CUDA build: several GB of downloads, then Horovod
# built against it), then the quick tier and, with --run, ./run.sh. Too slow for the regular suite,
# whose unit tests cover the detection logic (tests/test_setup_logic.py): run it by hand after changing
# the set-up. The clone is kept (its .venv is several GB: delete it after reading the logs).
#   scripts/try-pypi-torch.sh PYTHON [--run]     e.g. scripts/try-pypi-torch.sh "$(pyenv which python3.12)"
set -euo pipefail

python=${1:?usage: try-pypi-torch.sh PYTHON [--run]}
run=${2:-}
fail() { echo "error: $*" >&2; exit 1; }
root=$(cd "$(dirname "$0")/.." && pwd)
folder=$(mktemp -d "${TMPDIR:-/tmp}/pypi-torch-XXXXXX")
git clone --quiet "$root" "$folder" || fail "could not clone $root into $folder"
cd "$folder"
echo "A fresh clone of $(git rev-parse --short HEAD) in $folder, made from $python"

start=$SECONDS
TORCH_BUILD=pypi PYTHON=$python bash scripts/setup-env.sh
setup=$((SECONDS - start))
.venv/bin/python -c 'import sys, torch; sys.exit(torch.version.cuda is None)' \
    || fail "pip installed torch's CPU build (a pip setting names another index): this tries PyPI's CUDA build"

start=$SECONDS
quick=0
./test.sh --quick || quick=$?
tests=$((SECONDS - start))
report="set-up $((setup / 60)) min $((setup % 60)) s, quick tier $((tests / 60)) min $((tests % 60)) s (exit $quick)"
if [ "$run" = --run ]; then
    start=$SECONDS
    benchmark=0
    ./run.sh || benchmark=$?
    report+=", ./run.sh $(((SECONDS - start) / 60)) min $(((SECONDS - start) % 60)) s (exit $benchmark)"
fi
echo "$(.venv/bin/python -c 'import sys, torch; print(f"Python {sys.version.split()[0]}, torch {torch.__version__} (CUDA {torch.version.cuda})")'): $report"
[ "$quick" = 0 ] && [ "${benchmark:-0}" = 0 ]
