#!/usr/bin/env bash
# Horovod 0.28.1 with NCCL as a wheel for the GPU machine (docs/gpu.md), built here on a CPU: that machine
# has no network and no Horovod. Its Python is 3.12 and its torch 2.11.0+cu130, whose Horovod must be built
# against that very torch, CUDA 13's toolkit and NCCL.
#   scripts/build-horovod-gpu-wheel.sh [DIR]   (default .whl, the folder `scripts/gpu-check.sh --wheels` installs)
# It builds in .venv-gpu/ (scripts/gpu-venv.sh: that machine's versions; PyPI's torch 2.11.0 is the cu130
# build, and its nvidia-nccl-cu13 wheel brings NCCL's header and library) through scripts/build-horovod.sh,
# which finds the toolkit (CUDA_HOME, else the nvcc on PATH) and NCCL. For another machine's CPU and GPU:
# the CPU flags named (HOROVOD_BUILD_ARCH_FLAGS) rather than guessed from this CPU, and the GPU kernels built
# for HOROVOD_BUILD_CUDA_CC_LIST (Turing, Ampere, Hopper; PTX for newer). The wheel is stripped of its debug
# symbols to fit the 64 MiB that a GPU call carries with the working tree, and cloudpickle's wheel, which
# horovod.torch imports, goes beside it; cffi, which Horovod declares, serves only its TensorFlow and MXNet
# parts: the check below imports Horovod without it, as that machine has none.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."

dir=${1:-.whl}
[[ $# -le 1 && $dir != -* ]] || { echo "usage: scripts/build-horovod-gpu-wheel.sh [DIR]" >&2; exit 2; }
python=.venv-gpu/bin/python
fail() { echo "error: $*" >&2; exit 1; }
pinned() { sed -n "s/^$1==\([^ ]*\).*/\1/p" requirements.txt; }
started=$SECONDS

scripts/gpu-venv.sh
# What Horovod's setup.py asks for while it builds and wheel's repacking, kept out of .venv-gpu (that
# machine's packages) on the PYTHONPATH of this script.
tools=$(mktemp -d)
site=$(mktemp -d)
trap 'rm -rf "$tools" "$site"' EXIT
"$python" -m pip install -q --progress-bar off --target "$tools" "cloudpickle==$(pinned cloudpickle)" cffi==2.1.1 \
    wheel==0.48.0
export PYTHONPATH="$tools${PYTHONPATH:+:$PYTHONPATH}"

cache_root=${XDG_CACHE_HOME:-$HOME/.cache}/distributed-nlp-suite
export HOROVOD_WHEEL_CACHE=${HOROVOD_WHEEL_CACHE:-$cache_root/horovod-gpu-wheel}
export HOROVOD_BUILD_ARCH_FLAGS=${HOROVOD_BUILD_ARCH_FLAGS:--mf16c -mavx -mfma}
export HOROVOD_BUILD_CUDA_CC_LIST=${HOROVOD_BUILD_CUDA_CC_LIST:-75,80,90}
bash scripts/build-horovod.sh "$python"
raw=$(compgen -G "$HOROVOD_WHEEL_CACHE/horovod-*-cp312-*.whl" | head -n 1)
if ! "$python" -c 'import sys, horovod.torch as hvd; sys.exit(not hvd.nccl_built())'; then
    rm -f "$raw"  # a CPU-operations wheel (build-horovod.sh's fallback): never reused as this one
    fail "Horovod was built without NCCL (the build's cause: $HOROVOD_WHEEL_CACHE/build-nccl.log)"
fi

# Debug symbols stripped, the wheel repacked (its RECORD rewritten with the new hashes) into DIR.
"$python" -m wheel unpack --dest "$site/unpacked" "$raw" > /dev/null
find "$site/unpacked" -name '*.so' -exec strip --strip-debug {} +
mkdir -p "$dir"
rm -f "$dir"/horovod-*.whl "$dir"/cloudpickle-*.whl
"$python" -m wheel pack --dest-dir "$dir" "$site"/unpacked/horovod-* > /dev/null
"$python" -m pip download -q --no-deps --only-binary=:all: -d "$dir" "cloudpickle==$(pinned cloudpickle)"
wheel=$(compgen -G "$dir/horovod-*.whl")

# Installed as scripts/gpu-check.sh installs it there, and loaded with that machine's packages only.
PYTHONPATH= "$python" -m pip install -q --no-index --no-deps --no-compile --target "$site/target" "$wheel" \
    "$dir"/cloudpickle-*.whl
PYTHONPATH="$site/target" "$python" - "$site/target" <<'EOF' || fail "the stripped wheel does not load"
import sys
sys.modules["cffi"] = None  # the GPU machine has no cffi: importing it would fail there
import cloudpickle
import horovod
import horovod.runner.launch
import horovod.torch as hvd
import torch
assert horovod.__file__.startswith(sys.argv[1]) and cloudpickle.__file__.startswith(sys.argv[1])
print(f"horovod {horovod.__version__} with torch {torch.__version__}: nccl_built() = {hvd.nccl_built()},",
      f"gloo_built() = {hvd.gloo_built()}, mpi_built() = {hvd.mpi_built()}")
assert hvd.nccl_built() and hvd.gloo_built() and not hvd.mpi_built()
EOF
mib() { awk -v bytes="$(du -sb "$1" | cut -f1)" 'BEGIN { printf "%.1f", bytes / 1048576 }'; }
echo "Horovod's GPU wheel: $wheel, $(mib "$wheel") MiB ($(mib "$raw") MiB before stripping), with" \
     "$(compgen -G "$dir/cloudpickle-*.whl"); $dir holds $(mib "$dir") MiB in all" \
     "($(( (SECONDS - started) / 60 )) min $(( (SECONDS - started) % 60 )) s)"
