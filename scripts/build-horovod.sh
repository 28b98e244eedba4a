#!/usr/bin/env bash
# Builds Horovod 0.28.1 (the last release) against the installed torch, once, and caches the wheel.
#
# Horovod 0.28.1 ships only as a source distribution whose CMake files ask for C++14, while the
# headers of torch >= 2.1 need C++17. We download the sdist, raise the standard to 17, and build a
# wheel with Gloo (CPU processes, and the controller everywhere) plus, for a CUDA build of torch
# on a machine with the CUDA toolkit (nvcc), NCCL operations for GPU tensors. The wheel is cached
# per Horovod, torch and Python version and GPU support, so later installs take seconds instead
# of minutes (2 on a quiet 2-core machine, 10+ on a busy one).
#
# Usage: scripts/build-horovod.sh PYTHON   (the virtual environment's python, torch installed)
# Environment: HOROVOD_WHEEL_CACHE   where the wheel is kept (default ~/.cache/distributed-nlp-suite/...)
#              HOROVOD_NCCL_HOME     NCCL's folder when it is not beside the CUDA toolkit
set -euo pipefail

python=${1:?usage: build-horovod.sh PYTHON}
version=0.28.1
fail() { echo "error: $*" >&2; exit 1; }

torch_version=$("$python" -c 'import torch; print(torch.__version__.replace("+", "_"))' 2>/dev/null) \
    || fail "$python cannot import torch: install requirements.txt first"
python_tag=$("$python" -c 'import sys; print(f"cp{sys.version_info.major}{sys.version_info.minor}")')

# A CUDA build of torch makes Horovod's torch part compile against the CUDA toolkit whatever the
# operations asked for (horovod/torch/CMakeLists.txt calls add_cuda()): the toolkit is found as torch
# finds it, wrappers of nvcc followed (scripts/toolchain.py), and handed to CMake (CUDAToolkit_ROOT) and
# to Horovod's own build (HOROVOD_CUDA_HOME: its nvcc compiles the NCCL build's kernels).
# GPU tensors need NCCL operations compiled in; without them Horovod copies every GPU gradient to
# the CPU and reduces it there (what made the reference tutorial's Horovod run slow, see README).
# NCCL's header and library come from HOROVOD_NCCL_HOME, the toolkit's folder, /usr, or the
# nvidia-nccl wheel that CUDA builds of torch install; without them the build uses CPU operations.
find_nccl() {  # prints the folder holding include/nccl.h, or nothing
    local home
    for home in "${HOROVOD_NCCL_HOME:-}" "$cuda_home" /usr \
                "$("$python" -c 'import nvidia.nccl; print(list(nvidia.nccl.__path__)[0])' 2>/dev/null)"; do
        if [ -n "$home" ] && [ -f "$home/include/nccl.h" ] && compgen -G "$home/lib*/libnccl.so*" >/dev/null; then
            echo "$home"
            return
        fi
    done
}
here=${BASH_SOURCE[0]%/*}  # not dirname: the tests run this with a PATH of a few tools
[ "$here" != "${BASH_SOURCE[0]}" ] || here=.
toolchain="$here/toolchain.py"
gpu_operations=
nccl_home=
cuda_home=
if "$python" -c 'import sys, torch; sys.exit(torch.version.cuda is None)'; then
    cuda_home=$("$python" "$toolchain" cuda-home 2>/dev/null) \
        || fail "torch $torch_version is a CUDA build, whose Horovod build needs the CUDA toolkit ($cuda_home):" \
                "install it and set CUDA_HOME to its folder, or take torch's CPU build (README, Prerequisites)"
    export CUDA_HOME=$cuda_home CUDAToolkit_ROOT=$cuda_home HOROVOD_CUDA_HOME=$cuda_home
    nccl_home=$(find_nccl)
    if [ -n "$nccl_home" ]; then
        gpu_operations=${HOROVOD_GPU_OPERATIONS:-NCCL}
    else
        echo "warning: no NCCL found (include/nccl.h and libnccl under HOROVOD_NCCL_HOME, $cuda_home, /usr or" \
             "the nvidia-nccl wheel): building Horovod with CPU operations only, so GPU gradients will be" \
             "reduced on the CPU (slow). Install NCCL's development files or set HOROVOD_NCCL_HOME, and rerun." >&2
    fi
fi

cache_for() {  # the wheel's folder, named for what it was built with
    echo "${HOROVOD_WHEEL_CACHE:-${XDG_CACHE_HOME:-$HOME/.cache}/distributed-nlp-suite/horovod-$version-torch-$torch_version${gpu_operations:+-${gpu_operations,,}}}"
}
cache=$(cache_for)
wheel_pattern="horovod-$version-$python_tag-*.whl"
mkdir -p "$cache"

if ! compgen -G "$cache/$wheel_pattern" >/dev/null; then
    for tool in cmake make g++; do
        command -v "$tool" >/dev/null || fail "building Horovod needs '$tool' (Debian/Ubuntu: apt-get install cmake make g++)"
    done
    "$python" -c 'import sysconfig, os, sys; sys.exit(not os.path.exists(sysconfig.get_paths()["include"] + "/Python.h"))' \
        || fail "building Horovod needs the Python headers (Python.h; Debian/Ubuntu: apt-get install python3-dev)"

    work=$(mktemp -d)
    trap 'rm -rf "$work"' EXIT
    echo "Building Horovod $version against torch $torch_version (${gpu_operations:-CPU} operations${cuda_home:+, CUDA toolkit $cuda_home}; a few minutes)..."
    "$python" -m pip download --quiet --no-deps --no-binary :all: --dest "$work" "horovod==$version" \
        || fail "could not download the Horovod $version source distribution from PyPI"
    tar -xzf "$work/horovod-$version.tar.gz" -C "$work"
    src="$work/horovod-$version"
    for cmake_file in "$src/CMakeLists.txt" "$src/horovod/torch/CMakeLists.txt"; do
        sed -i 's/set(CMAKE_CXX_STANDARD 14)/set(CMAKE_CXX_STANDARD 17)/' "$cmake_file"
        grep -q 'set(CMAKE_CXX_STANDARD 17)' "$cmake_file" || fail "could not raise the C++ standard to 17 in $cmake_file"
    done

    export HOROVOD_WITH_PYTORCH=1 HOROVOD_WITHOUT_TENSORFLOW=1 HOROVOD_WITHOUT_MXNET=1
    export HOROVOD_WITH_GLOO=1 HOROVOD_WITHOUT_MPI=1 HOROVOD_CPU_OPERATIONS=GLOO
    unset HOROVOD_GPU_OPERATIONS
    if [ -n "$gpu_operations" ]; then
        export HOROVOD_GPU_OPERATIONS=$gpu_operations HOROVOD_NCCL_INCLUDE="$nccl_home/include"
        # The wheel ships libnccl.so.2 without the libnccl.so that linking asks for: link a folder of its own.
        mkdir -p "$work/nccl-lib"
        ln -s "$(compgen -G "$nccl_home/lib*/libnccl.so*" | head -n 1)" "$work/nccl-lib/libnccl.so"
        export HOROVOD_NCCL_LIB="$work/nccl-lib" HOROVOD_NCCL_LINK=SHARED
    fi
    build() {  # one attempt, its own log (HOROVOD_WHEEL_CACHE makes one folder of both); on failure its cause
        log="$cache/build${gpu_operations:+-${gpu_operations,,}}.log"
        "$python" -m pip wheel --no-deps --no-build-isolation --wheel-dir "$work/dist" "$src" > "$log" 2>&1 && return
        "$python" "$toolchain" build-error "$log" >&2
        return 1
    }
    start=$SECONDS
    if ! build; then
        [ -n "$gpu_operations" ] || fail "the Horovod build failed (cause above, from its log: $log)"
        echo "warning: the Horovod build with NCCL failed (cause above, from its log: $log): building it" \
             "with CPU operations only, so GPU gradients will be reduced on the CPU (slow)" >&2
        unset HOROVOD_GPU_OPERATIONS HOROVOD_NCCL_INCLUDE HOROVOD_NCCL_LIB HOROVOD_NCCL_LINK
        gpu_operations=
        cache=$(cache_for)  # the CPU build's own folder: the NCCL one never holds a CPU wheel
        mkdir -p "$cache"
        build || fail "the Horovod build failed (cause above, from its log: $log)"
    fi
    # Copy under a temporary name, then rename: an interrupted copy never looks like a cached wheel.
    built=$(echo "$work"/dist/horovod-*.whl)
    cp "$built" "$cache/.partial"
    mv "$cache/.partial" "$cache/$(basename "$built")"
    echo "Built Horovod in $(( (SECONDS - start) / 60 )) min $(( (SECONDS - start) % 60 )) s"
fi
# Its runtime dependencies are pinned in requirements.txt (cffi, also declared, serves only the
# TensorFlow and MXNet parts that this build leaves out).
"$python" -m pip install --quiet --no-deps --force-reinstall "$cache"/$wheel_pattern
"$python" -c 'import horovod.torch, horovod.runner.launch' || fail "Horovod was installed but does not import"
echo "Horovod $version installed from $cache"
