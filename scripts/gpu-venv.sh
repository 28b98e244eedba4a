#!/usr/bin/env bash
# The GPU machine's Python stack (docs/gpu.md) in .venv-gpu/, built once here: a Python 3.12 with that
# machine's versions, for the rehearsal on the CPU (scripts/gpu-rehearsal.sh) and for the wheels built for
# it (scripts/build-horovod-gpu-wheel.sh). Rebuilt only when the pins below change.
#   scripts/gpu-venv.sh        (PYTHON312=... a Python 3.12; else python3.12 or pyenv's 3.12.1)
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."

# torch 2.11.0 has no CPU build on PyPI for Linux: its wheel there is the CUDA 13.0 build, the GPU machine's
# (several GB with the nvidia wheels, NCCL's among them), which runs on a CPU as well.
# DeepSpeed's own requirements the machine has (einops ... py-cpuinfo); scripts/fetch-gpu-wheels.sh brings the others.
PINS=(torch==2.11.0 transformers==5.17.0 tokenizers==0.23.3 huggingface-hub==1.33.0 accelerate==1.15.0
      lightning==2.6.6 numpy==2.5.5 scikit-learn==1.9.1 matplotlib==3.11.2 safetensors==0.8.0 tqdm==4.70.1
      psutil==7.2.2 pytest==9.2.0 pytest-xdist==3.8.0 einops==0.8.2 msgpack==1.2.4 ninja==1.13.2 py-cpuinfo==9.0.0)
VENV=.venv-gpu

python312=${PYTHON312:-}
if [ -z "$python312" ]; then
    for candidate in python3.12 "$(pyenv root 2>/dev/null)/versions/3.12.1/bin/python3.12"; do
        if "$candidate" -c 'import sys; assert sys.version_info[:2] == (3, 12)' 2>/dev/null; then
            python312=$candidate; break
        fi
    done
fi
[ -n "$python312" ] || { echo "error: no Python 3.12 found (PYTHON312=... names one)" >&2; exit 1; }

if [ "$(cat "$VENV/.pins" 2>/dev/null)" != "${PINS[*]}" ]; then
    echo "gpu-venv: building $VENV with ${PINS[*]}"
    rm -rf "$VENV"
    "$python312" -m venv "$VENV"
    "$VENV/bin/python" -m pip install -q --progress-bar off "${PINS[@]}"
    echo "${PINS[*]}" > "$VENV/.pins"
fi
