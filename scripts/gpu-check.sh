#!/usr/bin/env bash
# The GPU check, on a machine with CUDA GPUs. At real size (the real model when its weights are where
# --model auto finds them, in model_hub/ or the Hugging Face cache; else its architecture with random
# weights: base-shape, no download) every default row at one
# process per GPU and the DDP row in each precision (IEEE fp32, TF32, bf16 autocast, fp16 autocast with its
# scaler); then every row compiled (--compile); then the GPU tests (tests/test_gpu.py) beside the benchmark
# with the offline tiny model. About 22 minutes on one H100: name steps to split it. Needs no network or .venv:
#
#   scripts/gpu-check.sh --dry-run                    # the plan, its estimate and the commands; any machine
#   scripts/gpu-check.sh                              # base-shape (or real), compiled, tests, tiny
#   scripts/gpu-check.sh base-shape tests             # only these steps, in this order
#   scripts/gpu-check.sh --out DIR                    # tables, JSON, charts and every row's log in DIR
#   scripts/gpu-check.sh --wheels DIR                 # install the wheels in DIR first (DeepSpeed's:
#                                                     #   scripts/fetch-gpu-wheels.sh DIR fetches them)
#   scripts/gpu-check.sh tiny -- --max-samples 2000   # options after -- go to benchmark.py
#   PYTHON=/usr/bin/python3 scripts/gpu-check.sh      # this Python (default: .venv/bin/python, else python3)
#
# Where the tables go: DIR/<step>/ (default output/gpu-check), and benchmark.py's --publish copies them
# beside the committed CPU runs: docs/results/<machine>/ (tiny: what ./run.sh gives there),
# <machine>-base-shape/ and <machine>-base-shape-compile/ (e.g. 1x-nvidia-h100-80gb-hbm3). Rows whose
# library is not installed are left out, and said so.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."

REAL_MODEL=model_hub/chinese-bert-wwm-ext
# The tiny step is ./run.sh's own run without real weights, so its table says what ./run.sh takes there.
# At real size a launch takes 18-45 s on one H100 (docs/gpu.md), its 20 steps 1-7 s of it: 20 steps of
# batch 32 give a steady median over 19 steps, and the whole dev set is evaluated as always.
TINY_OPTIONS=(--model tiny)
REAL_SIZE_OPTIONS=(--max-steps 20)
# The DDP row in each precision first (the check's questions, docs/gpu.md), then the other default rows;
# the compiled step: DDP in fp32 and bf16 first, then every other row but DataParallel's.
FIRST_ROWS=ddp,ddp-tf32,ddp-amp-bf16,ddp-amp
COMPILE_ROWS=ddp+compile,ddp-amp-bf16+compile,single+compile,ddp-spawn+compile,ddp-amp+compile,horovod+compile,deepspeed+compile,accelerate+compile,fsdp+compile,hf-trainer+compile,fabric+compile
COMPILE_PRECISIONS=2  # fp32 and bf16 compile cold; fp16's ddp-amp row shares most of bf16's graph
# Seconds on one H100, measured there (docs/gpu.md): a launch (start, 20 steps, evaluation, save); a cold
# compilation (once per precision: later rows find its kernels in the compile cache and pay the tracing);
# the tests, which run beside the tiny rows. A tiny launch took 22 s with 2,000 samples; the default
# 10,000 add about 230 steps of a few milliseconds.
LAUNCH_SECONDS_TINY=24 LAUNCH_SECONDS_REAL=30 COLD_COMPILE_SECONDS=65 WARM_COMPILE_SECONDS=20 TESTS_SECONDS=100

dry_run=0
out=output/gpu-check
wheels=""
steps=()
bench_args=()
while [ $# -gt 0 ]; do
    case "$1" in
        --) shift; bench_args=("$@"); break ;;
        --dry-run) dry_run=1; shift ;;
        --out) out=${2:?--out takes a folder}; shift 2 ;;
        --wheels) wheels=${2:?--wheels takes a folder of wheels}; shift 2 ;;
        tests|tiny|base-shape|real|compiled) steps+=("$1"); shift ;;
        -h|--help) sed -n '2,20p' "$0" | sed 's/^# \{0,1\}//'; exit 0 ;;
        *) echo "error: unknown step '$1': name base-shape, real, compiled, tests or tiny (options for benchmark.py go after --)" >&2
           exit 2 ;;
    esac
done

has_weights() {  # a model folder with its config and weights
    [ -f "$1/config.json" ] && { compgen -G "$1/*.safetensors" > /dev/null || [ -f "$1/pytorch_model.bin" ]; }
}
real_model() {  # where --model auto finds the real weights without network: model_hub/, else the Hugging Face cache
    local snapshot
    for snapshot in "$REAL_MODEL" "${HF_HUB_CACHE:-${HF_HOME:-${XDG_CACHE_HOME:-$HOME/.cache}/huggingface}/hub}"/models--hfl--chinese-bert-wwm-ext/snapshots/*; do
        if has_weights "$snapshot"; then echo "$snapshot"; return 0; fi
    done
    return 1
}
explicit=$((${#steps[@]} > 0))
if [ "$explicit" = 0 ]; then
    if real_model > /dev/null; then steps=(real); else steps=(base-shape); fi
    steps+=(compiled tests tiny)
fi

count() { local IFS=,; set -- $1; echo $#; }
default_rows=11  # benchmark.py's strategies; a row whose library is missing is left out when it runs
real_rows=$((default_rows + $(count "$FIRST_ROWS") - 1))  # ddp is a default row too
beside_tiny=0
[[ " ${steps[*]} " != *" tests "* || " ${steps[*]} " != *" tiny "* ]] || beside_tiny=1
step_seconds() {
    case "$1" in
        tests) [ "$beside_tiny" = 1 ] && echo 0 || echo "$TESTS_SECONDS" ;;
        tiny) echo $((default_rows * LAUNCH_SECONDS_TINY)) ;;
        compiled) echo $(($(count "$COMPILE_ROWS") * (LAUNCH_SECONDS_REAL + WARM_COMPILE_SECONDS)
                          + COMPILE_PRECISIONS * COLD_COMPILE_SECONDS)) ;;
        *) echo $((real_rows * LAUNCH_SECONDS_REAL)) ;;
    esac
}
total=0
echo "gpu-check plan (estimates for one H100; output in $out/):"
for step in "${steps[@]}"; do
    seconds=$(step_seconds "$step")
    total=$((total + seconds))
    case "$step" in
        tests) what="tests/test_gpu.py, 4 tests at a time (pytest-xdist)$([ "$beside_tiny" = 0 ] || echo ", beside the tiny rows")" ;;
        tiny) what="the $default_rows default rows, tiny model: ${TINY_OPTIONS[*]}" ;;
        compiled) what="$(count "$COMPILE_ROWS") rows at real size (${REAL_SIZE_OPTIONS[*]}), each with --compile" ;;
        *) what="$real_rows rows at real size (${REAL_SIZE_OPTIONS[*]}): the $default_rows default rows, ddp-tf32, ddp-amp-bf16" ;;
    esac
    printf '  %-10s about %3d s  %s\n' "$step" "$seconds" "$what"
done
echo "  in all: about $((total / 60)) min $((total % 60)) s"
echo "on a GPU machine without network, with its own Python and DeepSpeed's wheels fetched here first:"
echo "  scripts/fetch-gpu-wheels.sh .whl          # here, with network: DeepSpeed and what it needs, for Python 3.12"
echo "  PYTHON=python3 scripts/gpu-check.sh --wheels .whl --out output/gpu-check   # there"
[ "$dry_run" = 0 ] || exit 0
out=$(realpath -m "$out")  # the launches below run from other folders

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

# --- wheels brought along (DeepSpeed on a machine without network) -----------------------------------
if [ -n "$wheels" ]; then
    if ! compgen -G "$wheels/*.whl" > /dev/null; then
        echo "error: no wheels in $wheels (scripts/fetch-gpu-wheels.sh $wheels fetches them)" >&2
        exit 1
    fi
    site=$out/site-packages
    rm -rf "$site"; mkdir -p "$site"
    "$exe" -m pip install -q --no-index --no-deps --no-compile --target "$site" "$wheels"/*.whl
    export PYTHONPATH="$site${PYTHONPATH:+:$PYTHONPATH}" PATH="$site/bin:$PATH"
    echo "gpu-check: installed the wheels of $wheels into $site"
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
# benchmark.py takes a launcher beside the Python, else from the PATH: add a --user install's launchers.
PATH="$PATH:$("$exe" -c 'import os, sysconfig; print(sysconfig.get_path("scripts", f"{os.name}_user"))')"

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
mkdir -p "$out"

# --- the benchmark's chart needs matplotlib ------------------------------------------------------------
if [[ " ${steps[*]} " == *" tiny "* || " ${steps[*]} " == *" base-shape "* || " ${steps[*]} " == *" real "* ]] \
   && [ -n "$(missing_modules matplotlib)" ]; then
    echo "error: matplotlib is not installed for $exe: benchmark.py draws its chart with it" >&2
    exit 1
fi

# Rows whose Python module is missing (benchmark.py would list them as skipped and exit 1): leave them
# out, unless the options name the rows themselves.
absent=""
if [[ " ${bench_args[*]-} " != *" --only"* && " ${bench_args[*]-} " != *" --skip"* ]]; then
    absent=$("$exe" -c 'import importlib.util, benchmark
print(",".join(v.name for v in benchmark.BUILT_IN_VARIANTS if benchmark.STRATEGIES[v.strategy].needs
               and importlib.util.find_spec(benchmark.STRATEGIES[v.strategy].needs) is None))' 2>/dev/null || true)
    [ -z "$absent" ] || echo "note: leaving out the rows whose library is not installed: $absent"
fi
without_absent() {  # the rows of the comma-separated list $1 that are not in $absent
    local row named kept=()
    IFS=, read -ra named <<< "$1"
    for row in "${named[@]}"; do [[ ",$absent," == *",$row,"* ]] || kept+=("$row"); done
    local IFS=,; echo "${kept[*]}"
}

strategies() { "$exe" -c 'import benchmark; print(",".join(benchmark.STRATEGIES))'; }

benchmark() {  # STEP [OPTIONS...]: benchmark.py into $out/STEP, published beside the committed runs
    local step=$1; shift
    echo; echo "== $step: benchmark.py $*"
    # The compiled rows are published beside the real-size table, not over it.
    local publish=(--publish); [ "$step" != compiled ] || publish=(--publish compile)
    # ${a[@]+"${a[@]}"}: an empty array under set -u, which bash before 4.4 calls unbound
    "$exe" benchmark.py --output-dir "$out/$step" "${publish[@]}" "$@" ${bench_args[@]+"${bench_args[@]}"} \
        || failed+=("$step")
}

gpu_tests() {  # tests/test_gpu.py, its output in $out/tests.log
    if [ -n "$(missing_modules pytest)" ]; then
        echo "error: pytest is not installed for $exe: the GPU tests cannot run" | tee "$out/tests.log" >&2
        return 1
    fi
    local workers=(); [ -n "$(missing_modules xdist)" ] || workers=(-n 4)
    "$exe" -m pytest tests/test_gpu.py -rs -q -p no:cacheprovider ${workers[@]+"${workers[@]}"} > "$out/tests.log" 2>&1
}

tests_pid=""
for step in "${steps[@]}"; do
    case "$step" in
        tests)
            echo; echo "== tests: tests/test_gpu.py (output: $out/tests.log)"
            if [ "$beside_tiny" = 1 ]; then
                gpu_tests & tests_pid=$!
            else
                gpu_tests || failed+=(tests)
                tail -n 15 "$out/tests.log"
            fi
            ;;
        tiny)
            benchmark tiny "${TINY_OPTIONS[@]}" --only "$(without_absent "$(strategies)")"
            ;;
        base-shape|real|compiled)
            model=base-shape
            if [ "$step" = real ] || { [ "$step" = compiled ] && real_model > /dev/null; }; then
                model=$(real_model) || { echo "error: no weights in $REAL_MODEL or the Hugging Face cache (model_hub/README.md)" >&2; failed+=(real); continue; }
            fi
            rows=$FIRST_ROWS,$(strategies)  # benchmark.py runs a row named twice once
            [ "$step" != compiled ] || rows=$COMPILE_ROWS
            benchmark "$step" --model "$model" "${REAL_SIZE_OPTIONS[@]}" --only "$(without_absent "$rows")"
            ;;
    esac
done

if [ -n "$tests_pid" ]; then
    echo; echo "== tests: tests/test_gpu.py, run beside the tiny rows (output: $out/tests.log)"
    wait "$tests_pid" || failed+=(tests)
    tail -n 15 "$out/tests.log"
fi

echo
if [ ${#failed[@]} -gt 0 ]; then
    echo "gpu-check: failed: ${failed[*]} (the output above says why; logs in $out/)" >&2
    exit 1
fi
echo "gpu-check: all requested steps passed"
