#!/usr/bin/env bash
# Creates .venv with the pinned dependencies, once; later calls only check that it is up to date.
# Sourced by run.sh and test.sh, so those two commands are all a fresh machine needs.
# PYTHON names the interpreter the environment is made from (default: python3), e.g.
#   PYTHON=python3.11 ./run.sh
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."

venv=.venv
stamp="$venv/.requirements.sha256"
horovod_stamp="$venv/.horovod.sha256"
deepspeed_stamp="$venv/.deepspeed-ops.sha256"
wanted=$(cat requirements.txt scripts/setup-env.sh scripts/build-horovod.sh scripts/build-deepspeed-ops.sh | sha256sum \
         | cut -d' ' -f1)
if [ ! -x "$venv/bin/python" ]; then
    "${PYTHON:-python3}" -m venv "$venv" \
        || { echo "error: could not make $venv with ${PYTHON:-python3} (PYTHON=... names another Python 3.11)" >&2; exit 1; }
fi
if [ "$(cat "$stamp" 2>/dev/null)" != "$wanted" ]; then
    echo "Installing the pinned dependencies into $venv ..."
    if ! "$venv/bin/python" -m pip install --disable-pip-version-check -r requirements.txt > "$venv/pip-install.log" 2>&1; then
        tail -n 30 "$venv/pip-install.log" >&2
        echo "error: installing requirements.txt failed (full log: $venv/pip-install.log)" >&2
        exit 1
    fi
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
