#!/usr/bin/env bash
# The GPU machine's stack rehearsed on a CPU, so that a version problem shows here and not in its minutes
# (docs/gpu.md): that machine's versions in .venv-gpu/ (scripts/gpu-venv.sh, built once), DeepSpeed
# from the wheels scripts/fetch-gpu-wheels.sh brings, then scripts/gpu-check.sh's whole plan on the CPU
# (--device cpu: gloo, CUDA hidden) at tiny and base-shape size, a few steps each. Not faked: rows and
# precisions that need a GPU (TF32, fp16's peak, CUDA graphs) are left out, each said so, and the tests
# group runs tests/test_gpu.py (skipped without a GPU: collected with these versions) beside
# tests/test_gpu_paths_on_cpu.py (the CUDA paths, with tensors told they are on a GPU).
#   scripts/gpu-rehearsal.sh [--out DIR]   (default output/gpu-rehearsal; PYTHON312=... a Python 3.12)
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."

VENV=.venv-gpu WHEELS=.whl
out=output/gpu-rehearsal
case "${1:-}" in
    --out) out=${2:?--out takes a folder} ;;
    "") ;;
    *) echo "error: unknown option '$1' (scripts/gpu-rehearsal.sh [--out DIR])" >&2; exit 2 ;;
esac

started=$(date +%s)
scripts/gpu-venv.sh
if ! compgen -G "$WHEELS/deepspeed-*.whl" > /dev/null; then
    scripts/fetch-gpu-wheels.sh "$WHEELS" 3.12
fi
"$VENV/bin/python" -c 'import platform, torch, transformers, accelerate, lightning, numpy, sklearn
print(f"gpu-rehearsal: python {platform.python_version()}, torch {torch.__version__}, transformers {transformers.__version__},",
      f"accelerate {accelerate.__version__}, lightning {lightning.__version__}, numpy {numpy.__version__},",
      f"scikit-learn {sklearn.__version__}")'

# The GPU plan as it will run there (its estimates, its budget), then the whole plan on the CPU: no budget
# (the estimates are the H100's), 1 process per row as on one GPU, small data.
PYTHON=$VENV/bin/python scripts/gpu-check.sh --dry-run
export PYTEST_ADDOPTS="${PYTEST_ADDOPTS:-} --basetemp=/tmp/pt-gpu-rehearsal"
failed=()
for model in tiny base-shape; do
    groups=()  # every group at tiny; at base-shape all but the tests, which run once
    [ "$model" = tiny ] || groups=(peaks goals sweep default more)
    echo; echo "=== gpu-rehearsal: the plan at $model on the CPU"
    PYTHON=$VENV/bin/python scripts/gpu-check.sh ${groups[@]+"${groups[@]}"} --device cpu --wheels "$WHEELS" \
        --budget 0 --out "$out/$model" --model "$model" --max-steps 2 --sweep 2,4,8 \
        -- --nprocs 1 --max-samples 200 --batch-size 4 || failed+=("$model")
done
echo
took=$(($(date +%s) - started))
if [ ${#failed[@]} -gt 0 ]; then
    echo "gpu-rehearsal: failed at ${failed[*]} after $((took / 60)) min $((took % 60)) s (logs in $out/)" >&2
    exit 1
fi
echo "gpu-rehearsal: the plan ran with the GPU machine's versions in $((took / 60)) min $((took % 60)) s (logs in $out/)"
