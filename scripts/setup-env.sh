#!/usr/bin/env bash
# Creates .venv with the pinned dependencies, once; later calls only check that it is up to date.
# Sourced by run.sh and test.sh, so those two commands are all a fresh machine needs.
# PYTHON names the interpreter the environment is made from (default: python3; 3.11, 3.12 and 3.13 were
# tried), e.g.  PYTHON=python3.12 ./run.sh
# TORCH_BUILD=pypi installs PyPI's torch (the CUDA build) where, without an NVIDIA driver, the set-up would
# take torch's CPU build (README, Prerequisites).
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."

venv=.venv
stamp="$venv/.requirements.sha256"
horovod_stamp="$venv/.horovod.sha256"
deepspeed_stamp="$venv/.deepspeed-ops.sha256"
wanted=$(cat requirements.txt scripts/setup-env.sh scripts/build-horovod.sh scripts/build-deepspeed-ops.sh \
         scripts/toolchain.py | sha256sum | cut -d' ' -f1)
if [ ! -x "$venv/bin/python" ]; then
    python=${PYTHON:-python3}
    # A missing interpreter or a pyenv shim that does not resolve fails here, named, before venv could
    # blame anything else.
    why=
    if ! command -v "$python" >/dev/null; then
        why="not found"
    elif ! version=$("$python" -c 'import sys; print("%d.%d" % sys.version_info[:2])' 2>&1); then
        why=${version%%$'\n'*}
    fi
    [ -z "$why" ] || { echo "error: the Python to make $venv from, $python, cannot be run: $why (PYTHON=..." \
                            "names a Python 3.11, 3.12 or 3.13 that runs, e.g. PYTHON=/usr/bin/python3.12)" >&2; exit 1; }
    case $version in
        3.11 | 3.12 | 3.13) ;;
        *) echo "warning: $python is Python $version; the set-up was tried on 3.11, 3.12 and 3.13 only" >&2 ;;
    esac
    venv_error=$("$python" -m venv "$venv" 2>&1) \
        || { echo "error: $python (Python $version) could not make $venv: $(tail -n 1 <<< "$venv_error")" \
                  "(Debian/Ubuntu: apt-get install python$version-venv)" >&2; rm -rf "$venv"; exit 1; }
fi
if [ "$(cat "$stamp" 2>/dev/null)" != "$wanted" ]; then
    # torch's CPU build, from its own index, where no NVIDIA driver is installed: 2 GB instead of PyPI's
    # CUDA build's 5 (README, Prerequisites says why). An index the user named is left alone.
    if [ "${TORCH_BUILD:-}" != pypi ] && [ -z "${PIP_INDEX_URL:-}${PIP_EXTRA_INDEX_URL:-}" ] \
            && [ ! -e /proc/driver/nvidia/version ] && ! command -v nvidia-smi >/dev/null; then
        cpu_index=https://download.pytorch.org/whl/cpu
        if "$venv/bin/python" -c 'import sys, urllib.request; urllib.request.urlopen(sys.argv[1], timeout=10)' \
                "$cpu_index/torch/" 2>/dev/null; then
            echo "No NVIDIA driver here: torch's CPU build comes from $cpu_index (TORCH_BUILD=pypi takes PyPI's)"
            export PIP_EXTRA_INDEX_URL=$cpu_index
        else
            echo "No NVIDIA driver here, but $cpu_index cannot be reached: torch comes from pip's own" \
                 "index (from PyPI, the CUDA build)"
        fi
    fi
    echo "Installing the pinned dependencies into $venv ..."
    if ! "$venv/bin/python" -m pip install --disable-pip-version-check -r requirements.txt > "$venv/pip-install.log" 2>&1; then
        "$venv/bin/python" scripts/toolchain.py build-error "$venv/pip-install.log" >&2
        echo "error: installing requirements.txt failed (cause above, from its log: $venv/pip-install.log)" >&2
        exit 1
    fi
    "$venv/bin/python" -c 'import torch; print(f"torch {torch.__version__}:",
        f"the CUDA {torch.version.cuda} build" if torch.version.cuda else "the CPU build")'
    echo "$wanted" > "$stamp"
fi
# DeepSpeed's CPU ops, built once into a cached wheel (a CPU-only machine; see the script). Without
# them DeepSpeed compiles its ops on first use, as from PyPI: slower, not fatal.
if [ "$(cat "$deepspeed_stamp" 2>/dev/null)" != "$wanted" ]; then
    if bash scripts/build-deepspeed-ops.sh "$venv/bin/python"; then
        echo "$wanted" > "$deepspeed_stamp"
    else
        echo "warning: DeepSpeed's CPU ops are not prebuilt; its first run in this environment compiles them" \
             "(a minute or two), and the next set-up tries the build again" >&2
    fi
fi
# Horovod is optional for every other strategy: a failed build is reported, not fatal. Its own stamp
# is written only once it is installed, so the next set-up tries again.
if [ "$(cat "$horovod_stamp" 2>/dev/null)" != "$wanted" ]; then
    if bash scripts/build-horovod.sh "$venv/bin/python"; then
        echo "$wanted" > "$horovod_stamp"
    else
        echo "warning: Horovod is not installed; multi-gpu-horovod-cls.py will not run, and the next set-up" \
             "tries the build again (see README)" >&2
    fi
fi
