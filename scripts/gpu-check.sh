#!/usr/bin/env bash
# The GPU check, on a machine with CUDA GPUs: the GPU tests (tests/test_gpu.py), then the benchmark
# (benchmark.py, what ./run.sh runs) with the offline tiny model, then with the real model when its
# weights are in model_hub/chinese-bert-wwm-ext. Needs no network and no .venv:
#
#   scripts/gpu-check.sh                              # tests, tiny, real (each step that can run)
#   scripts/gpu-check.sh tests                        # only the steps named: tests, tiny, real
#   scripts/gpu-check.sh tiny -- --max-samples 2000   # options after -- go to benchmark.py
#   PYTHON=/usr/bin/python3 scripts/gpu-check.sh      # this Python (default: .venv/bin/python, else python3)
#
# Where the tables go, beside the committed CPU run docs/results/amd-epyc-2-cores/ (benchmark.py's
# --publish names the folder after the machine, e.g. 1x-nvidia-h100-80gb-hbm3):
#   docs/results/<machine>/                        the tiny model (as the CPU run: the two compare)
#   docs/results/<machine>/chinese-bert-wwm-ext/   the real model
# and each run's logs and result.json files in output/gpu-check/<tiny|real>/.
# Rows whose library is not installed (horovod, deepspeed, ...) are left out, and said so.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."

REAL_MODEL=model_hub/chinese-bert-wwm-ext
WORK=output/gpu-check

steps=()
bench_args=()
while [ $# -gt 0 ]; do
    case "$1" in
        --) shift; bench_args=("$@"); break ;;
        tests|tiny|real) steps+=("$1"); shift ;;
        -h|--help) sed -n '2,17p' "$0" | sed 's/^# \{0,1\}//'; exit 0 ;;
        *) echo "error: unknown step '$1': name tests, tiny or real (options for benchmark.py go after --)" >&2
           exit 2 ;;
    esac
done
explicit=$((${#steps[@]} > 0))
[ "$explicit" = 1 ] || steps=(tests tiny real)
wants() { [[ " ${steps[*]-} " == *" $1 "* ]]; }

# --- which Python: $PYTHON, else the project's .venv, else python3 ---------------------------------
if [ -n "${PYTHON:-}" ]; then
    py=$PYTHON
elif [ -x .venv/bin/python ]; then
    py=.venv/bin/python
else
    py=python3
fi
if ! exe=$("$py" -c 'import sys; print(sys.executable)' 2>/dev/null); then
    echo "error: cannot run Python '$py' (set PYTHON to an interpreter with torch)" >&2
    exit 1
fi

# --- a CUDA GPU, or one clear line ------------------------------------------------------------------
if ! gpu_line=$("$exe" - 2>&1 <<'EOF'
import sys
try:
    import torch
except ImportError:
    sys.exit("torch is not installed")
if not torch.cuda.is_available():
    build = f"built for CUDA {torch.version.cuda}" if torch.version.cuda else "a CPU-only build"
    sys.exit(f"torch {torch.__version__} ({build}) sees no CUDA GPU")
names = [torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())]
print(f"{len(names)} CUDA GPU(s): {', '.join(names)} | torch {torch.__version__}, CUDA {torch.version.cuda}")
EOF
); then
    echo "error: no CUDA GPU: ${gpu_line##*$'\n'} (python $exe); this check runs on a machine with one" \
         "(PYTHON=... picks another Python)" >&2
    exit 1
fi
echo "gpu-check: $gpu_line | python $exe"

missing_modules() {  # the modules of "$@" this Python cannot import
    "$exe" -c 'import importlib.util, sys; print(" ".join(m for m in sys.argv[1:] if importlib.util.find_spec(m) is None))' "$@"
}
# What every training script imports (common.py and its modules), the checks (safetensors) and the runner's chart.
SUITE_MODULES=(transformers sklearn numpy tqdm safetensors)
missing=$(missing_modules "${SUITE_MODULES[@]}")
if [ -n "$missing" ]; then
    echo "error: the suite needs these Python modules, not installed for $exe: $missing" \
         "(pip install -r requirements.txt, or PYTHON=... for another Python)" >&2
    exit 1
fi

failed=()
mkdir -p "$WORK"

# --- 1. the GPU tests ---------------------------------------------------------------------------------
if wants tests; then
    echo; echo "== GPU tests: tests/test_gpu.py"
    if [ -n "$(missing_modules pytest)" ]; then
        echo "error: pytest is not installed for $exe: the GPU tests cannot run" >&2
        failed+=(tests)
    elif ! "$exe" -m pytest tests/test_gpu.py -rs -q -p no:cacheprovider; then
        failed+=(tests)
    fi
fi

# --- the benchmark's Python: its launchers (torchrun, accelerate, ...) must be beside it ---------------
# benchmark.py starts each launcher from the folder of the Python running it, as in a venv. A system
# Python keeps them elsewhere (/usr/local/bin, ~/.local/bin): link the Python and its launchers into
# one folder, and run the benchmark from there.
bench_py=$exe
if wants tiny || wants real; then
    if [ -n "$(missing_modules matplotlib)" ]; then
        echo "error: matplotlib is not installed for $exe: benchmark.py draws its chart with it" >&2
        failed+=(benchmark)
        steps=()  # no benchmark step can run
    elif [ ! -e "$(dirname "$exe")/torchrun" ]; then
        shim="$PWD/$WORK/bin"
        rm -rf "$shim"; mkdir -p "$shim"
        ln -s "$exe" "$shim/python"
        "$exe" - "$shim" <<'EOF'
import os, shutil, sys, sysconfig
shim = sys.argv[1]
folders = [sysconfig.get_path("scripts"), sysconfig.get_path("scripts", f"{os.name}_user")]
for name in ("torchrun", "accelerate", "deepspeed", "horovodrun", "fabric"):
    found = next((os.path.join(f, name) for f in folders if os.path.exists(os.path.join(f, name))), None)
    found = found or shutil.which(name)
    if found:
        os.symlink(found, os.path.join(shim, name))
print(f"note: the launchers are not beside {sys.executable}: linked into {shim}: "
      + (" ".join(sorted(n for n in os.listdir(shim) if n != "python")) or "none found"))
EOF
        bench_py="$shim/python"
    fi
fi

slug=""
machine_slug() {
    [ -n "$slug" ] || slug=$("$bench_py" -c 'import benchmark; print(benchmark.machine_slug(benchmark.describe_machine()))')
    echo "$slug"
}

# Rows whose Python module is missing (benchmark.py would list them as skipped and exit 1): leave them
# out, unless the options name the rows themselves.
row_options=()
if [[ " ${bench_args[*]-} " != *" --only"* && " ${bench_args[*]-} " != *" --skip"* ]]; then
    absent=$("$bench_py" -c 'import importlib.util, benchmark
print(",".join(e.name for e in benchmark.STRATEGIES.values() if e.needs and importlib.util.find_spec(e.needs) is None))' \
        2>/dev/null || true)
    if [ -n "$absent" ]; then
        echo "note: leaving out the rows whose library is not installed: $absent"
        row_options=(--skip "$absent")
    fi
fi

has_weights() {  # a model folder with its config and weights
    [ -f "$1/config.json" ] && { compgen -G "$1/*.safetensors" > /dev/null || [ -f "$1/pytorch_model.bin" ]; }
}

benchmark() {  # benchmark.py OUTPUT_DIR [OPTIONS...]
    local output=$1; shift
    # ${a[@]+"${a[@]}"}: an empty array under set -u, which bash before 4.4 calls unbound
    "$bench_py" benchmark.py --output-dir "$output" ${row_options[@]+"${row_options[@]}"} "$@" \
        ${bench_args[@]+"${bench_args[@]}"}
}

# --- 2. the benchmark, tiny model ---------------------------------------------------------------------
if wants tiny; then
    echo; echo "== benchmark, tiny model"
    # --publish copies the tables, JSON and chart to docs/results/<machine>/; a published run
    # repeats each row, so that its noise floor is measured.
    if benchmark "$WORK/tiny" --model tiny --repeat 2 --publish; then :; else failed+=(tiny); fi
fi

# --- 3. the benchmark, real model ---------------------------------------------------------------------
if wants real; then
    echo; echo "== benchmark, real model ($REAL_MODEL)"
    if has_weights "$REAL_MODEL"; then
        status=0
        benchmark "$WORK/real" --model "$REAL_MODEL" || status=$?
        target="docs/results/$(machine_slug)/$(basename "$REAL_MODEL")"
        if [ -f "$WORK/real/benchmark.md" ]; then
            mkdir -p "$target"
            for name in benchmark.md benchmark.json benchmark.png; do
                [ ! -f "$WORK/real/$name" ] || cp "$WORK/real/$name" "$target/"
            done
            echo "written: $target/"
        fi
        [ "$status" = 0 ] || failed+=(real)
    elif [ "$explicit" = 1 ]; then
        echo "error: no weights in $REAL_MODEL (model_hub/README.md says how to get them)" >&2
        failed+=(real)
    else
        echo "skipped: no weights in $REAL_MODEL (model_hub/README.md says how to get them)"
    fi
fi

echo
if [ ${#failed[@]} -gt 0 ]; then
    echo "gpu-check: failed: ${failed[*]} (the output above says why; logs in $WORK/)" >&2
    exit 1
fi
echo "gpu-check: all requested steps passed"
