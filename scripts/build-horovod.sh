#!/usr/bin/env bash
# Builds Horovod 0.28.1 (the last release) against the installed torch, once, and caches the wheel.
#
# Horovod 0.28.1 ships only as a source distribution whose CMake files ask for C++14, while the
# headers of torch >= 2.1 need C++17. We download the sdist, raise the standard to 17, and build a
# wheel with Gloo (CPU) and, for a CUDA build of torch with a CUDA toolkit (nvcc), NCCL operations.
# The wheel is cached per torch version, so later installs take seconds instead of ~10 minutes.
#
# Usage: scripts/build-horovod.sh PYTHON   (the virtual environment's python, torch installed)
set -euo pipefail

python=${1:?usage: build-horovod.sh PYTHON}
version=0.28.1
torch_version=$("$python" -c 'import torch; print(torch.__version__.replace("+", "_"))')
cache=${HOROVOD_WHEEL_CACHE:-${XDG_CACHE_HOME:-$HOME/.cache}/distributed-nlp-suite/horovod-$version-torch-$torch_version}
mkdir -p "$cache"

if ! compgen -G "$cache/horovod-$version-*.whl" >/dev/null; then
    for tool in cmake g++; do
        command -v "$tool" >/dev/null || { echo "error: building Horovod needs '$tool' (apt-get install cmake g++)" >&2; exit 1; }
    done
    work=$(mktemp -d)
    trap 'rm -rf "$work"' EXIT
    echo "Building Horovod $version against torch $torch_version (about 10 minutes on 2 cores)..."
    "$python" -m pip download --quiet --no-deps --no-binary :all: --dest "$work" "horovod==$version"
    tar -xzf "$work/horovod-$version.tar.gz" -C "$work"
    src="$work/horovod-$version"
    sed -i 's/set(CMAKE_CXX_STANDARD 14)/set(CMAKE_CXX_STANDARD 17)/' \
        "$src/CMakeLists.txt" "$src/horovod/torch/CMakeLists.txt"
    grep -q 'CMAKE_CXX_STANDARD 17' "$src/horovod/torch/CMakeLists.txt" \
        || { echo "error: could not patch Horovod's C++ standard to 17" >&2; exit 1; }

    export HOROVOD_WITH_PYTORCH=1 HOROVOD_WITHOUT_TENSORFLOW=1 HOROVOD_WITHOUT_MXNET=1
    export HOROVOD_WITH_GLOO=1 HOROVOD_WITHOUT_MPI=1 HOROVOD_CPU_OPERATIONS=GLOO
    if "$python" -c 'import sys, torch; sys.exit(torch.version.cuda is None)' && command -v nvcc >/dev/null; then
        export HOROVOD_GPU_OPERATIONS=NCCL
    fi
    "$python" -m pip wheel --quiet --no-deps --no-build-isolation --wheel-dir "$work/dist" "$src" \
        > "$work/build.log" 2>&1 || { tail -n 40 "$work/build.log" >&2; echo "error: the Horovod build failed (log above)" >&2; exit 1; }
    mv "$work"/dist/horovod-*.whl "$cache/"
fi
"$python" -m pip install --quiet --no-deps "$cache"/horovod-$version-*.whl
"$python" -m pip install --quiet cloudpickle psutil pyyaml
echo "Horovod $version installed from $cache"
