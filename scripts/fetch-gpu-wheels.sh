#!/usr/bin/env bash
# The wheels a GPU machine without network needs beyond its own Python's packages, fetched here (where
# the package index answers) for its Python: DeepSpeed and the requirements of DeepSpeed's that such a
# machine lacks (hjson, and pydantic with its own). The GPU machine of docs/gpu.md has torch, transformers,
# accelerate, lightning, pytest and matplotlib, and the rest of DeepSpeed's requirements.
#   scripts/fetch-gpu-wheels.sh DIR [PYTHON_VERSION]      (default 3.12, the GPU machine's)
# then there: scripts/gpu-check.sh --wheels DIR
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."

dir=${1:?usage: fetch-gpu-wheels.sh DIR [PYTHON_VERSION]}
python_version=${2:-3.12}
python=.venv/bin/python
[ -x "$python" ] || { echo "error: no .venv: run scripts/setup-env.sh first (its pip and torch build DeepSpeed's wheel)" >&2; exit 1; }
pinned() { sed -n "s/^$1==\([^ ]*\).*/\1/p" requirements.txt; }
mkdir -p "$dir"

# DeepSpeed is published as source only. Its wheel without prebuilt ops is pure Python, for any
# Python 3 and any torch: on a GPU it compiles an op on first use, and this suite's runs use none.
DS_BUILD_OPS=0 "$python" -m pip wheel -q --no-deps --no-build-isolation -w "$dir" "deepspeed==$(pinned deepspeed)"

# The versions this suite's .venv runs with; pydantic-core is compiled, so for that Python and Linux x86-64.
versions=$("$python" -c 'import importlib.metadata as m
print(" ".join(f"{n}=={m.version(n)}" for n in ("hjson", "pydantic", "pydantic_core", "annotated_types", "typing_inspection")))')
"$python" -m pip download -q --no-deps --only-binary=:all: --python-version "$python_version" --implementation cp \
    --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
    -d "$dir" $versions
echo "fetched into $dir:"; for wheel in "$dir"/*.whl; do echo "  ${wheel##*/}"; done
