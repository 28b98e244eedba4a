#!/usr/bin/env bash
# DeepSpeed with its two CPU ops built in: the shared-memory collectives every CPU run loads, and the
# CPU Adam of optimizer offload. Installed from PyPI, DeepSpeed compiles them on first use into the torch
# extensions cache, and compiles them again for every new environment (the cache is keyed to the
# sources' paths): a minute or two of each fresh clone's first DeepSpeed run. Built once into a wheel,
# cached beside Horovod's, they load at once. DeepSpeed takes its CPU accelerator wherever torch sees no
# GPU, whichever torch build is installed (PyPI's CUDA build included), so that decides; GPU machines keep
# DeepSpeed's own just-in-time build of the GPU ops they use. One line says which was done.
#   scripts/build-deepspeed-ops.sh PYTHON      (scripts/setup-env.sh calls it)
set -euo pipefail

python=${1:?usage: build-deepspeed-ops.sh PYTHON}
fail() { echo "error: $*" >&2; exit 1; }

version=$("$python" -c 'import importlib.metadata as m; print(m.version("deepspeed"))' 2>/dev/null) \
    || fail "$python cannot import deepspeed: install requirements.txt first"
gpus=$("$python" -c 'import torch; print(torch.cuda.device_count())' 2>/dev/null) \
    || fail "$python cannot import torch: install requirements.txt first"
if [ "$gpus" != 0 ]; then
    echo "DeepSpeed $version: no op prebuilt, torch sees $gpus GPU(s): DeepSpeed compiles the GPU ops it uses on first use"
    exit 0
fi
torch_version=$("$python" -c 'import torch; print(torch.__version__.replace("+", "_"))')
python_tag=$("$python" -c 'import sys; print(f"cp{sys.version_info.major}{sys.version_info.minor}")')
cache=${DEEPSPEED_WHEEL_CACHE:-${XDG_CACHE_HOME:-$HOME/.cache}/distributed-nlp-suite/deepspeed-$version-cpu-ops-torch-$torch_version}
mkdir -p "$cache"

# The folder is shared by every Python of this torch: install this Python's wheel only.
cached() { compgen -G "$cache/deepspeed-$version-$python_tag-*.whl" || compgen -G "$cache/deepspeed-$version-py3-*.whl"; }
if ! cached >/dev/null; then
    command -v g++ >/dev/null || fail "building DeepSpeed's CPU ops needs g++ (Debian/Ubuntu: apt-get install g++)"
    work=$(mktemp -d)
    trap 'rm -rf "$work"' EXIT
    echo "Building DeepSpeed $version with its CPU ops against torch $torch_version (a few minutes, once)..."
    log="$cache/build.log"
    start=$SECONDS
    DS_ACCELERATOR=cpu DS_BUILD_OPS=0 DS_BUILD_SHM_COMM=1 DS_BUILD_CPU_ADAM=1 \
        "$python" -m pip wheel --no-deps --no-build-isolation --no-binary deepspeed --no-cache-dir \
        --wheel-dir "$work" "deepspeed==$version" > "$log" 2>&1 \
        || { "$python" "$(dirname "$0")/toolchain.py" build-error "$log" >&2
             fail "the DeepSpeed build failed (cause above, from its log: $log)"; }
    built=$(echo "$work"/deepspeed-*.whl)
    cp "$built" "$cache/.partial"
    mv "$cache/.partial" "$cache/$(basename "$built")"
    echo "Built DeepSpeed's CPU ops in $(( (SECONDS - start) / 60 )) min $(( (SECONDS - start) % 60 )) s"
fi
"$python" -m pip install --quiet --no-deps --force-reinstall "$(cached | head -n 1)"
# Read from the file the wheel wrote, without importing deepspeed (which would probe for an accelerator).
"$python" -c 'import importlib.util, sys; found = {}
package = importlib.util.find_spec("deepspeed").submodule_search_locations[0]
exec(open(package + "/git_version_info_installed.py").read(), found)
sys.exit(not (found["installed_ops"]["cpu_adam"] and found["installed_ops"]["deepspeed_shm_comm"]))' \
    || fail "the DeepSpeed wheel in $cache lacks its CPU ops: remove the folder and set up again"
echo "DeepSpeed $version: CPU ops cpu_adam and shm_comm prebuilt for the CPU (torch sees no GPU)"
