#!/usr/bin/env bash
# The GPU check: one call of at most --budget seconds (480) on a machine with one CUDA GPU and no network.
# In order of value: the matrix-product peaks; the goals at real size (base-shape), one process at batch
# 32: fp32 and bf16, each eager and as CUDA graphs, torch.compile against eager; the fastest bf16 row at
# batch 512 (1024 if it fits); the other default rows; tests/test_gpu.py; the other precisions and
# compiled rows. Each launch has its own timeout; what does not fit the budget is dropped, least
# valuable first, and named with the command that runs it. --out gets three files, rewritten after every
# launch: gpu-check.tar.gz (all the launches wrote: tables, JSON, charts, logs; no weights), summary.json
# and summary.md; each group's table is printed as it ends, every row's last. The plan: scripts/gpu_plan.py.
#
#   scripts/gpu-check.sh --dry-run                  # the plan, its H200 estimate and the command; any machine
#   PYTHON=python3 scripts/gpu-check.sh --wheels .whl --out "$OUT"   # there (wheels: scripts/fetch-gpu-wheels.sh .whl)
#   scripts/gpu-check.sh peaks b1024 tests --budget 300  # only these groups and units, within 300 s
#   scripts/gpu-check.sh -- --max-samples 2000      # options after -- go to benchmark.py
#   scripts/gpu-check.sh --device cpu ...           # the rehearsal on a CPU (scripts/gpu-rehearsal.sh)
#   scripts/gpu-check.sh --help                     # every option
set -euo pipefail
started=$(date +%s)
cd "$(dirname "${BASH_SOURCE[0]}")/.."

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

# The plan, printed, and every option checked (one line and status 2 for a wrong one).
"$exe" scripts/gpu_plan.py "$@" || exit $?
dry_run=0 wheels="" device=cuda
args=("$@")
for ((i = 0; i < ${#args[@]}; i++)); do
    case "${args[i]}" in
        --) break ;;
        -h|--help|--dry-run) exit 0 ;;
        --wheels) wheels=${args[i + 1]} ;;
        --wheels=*) wheels=${args[i]#--wheels=} ;;
        --device) device=${args[i + 1]} ;;
        --device=*) device=${args[i]#--device=} ;;
    esac
done

# --- wheels brought along (DeepSpeed on a machine without network), installed outside --out ----------
if [ -n "$wheels" ]; then
    if ! compgen -G "$wheels/*.whl" > /dev/null; then
        echo "error: no wheels in $wheels (scripts/fetch-gpu-wheels.sh $wheels fetches them)" >&2
        exit 1
    fi
    site=output/gpu-check-site
    rm -rf "$site"; mkdir -p "$site"
    "$exe" -m pip install -q --no-index --no-deps --no-compile --target "$site" "$wheels"/*.whl
    export PYTHONPATH="$PWD/$site${PYTHONPATH:+:$PYTHONPATH}" PATH="$PWD/$site/bin:$PATH"
    echo "gpu-check: installed the wheels of $wheels into $site"
fi

# --- a CUDA GPU, or one clear line (the rehearsal, --device cpu, hides any) ----------------------------
if [ "$device" = cpu ]; then
    export CUDA_VISIBLE_DEVICES=
    echo "gpu-check: on the CPU (--device cpu): GPU-only rows and precisions are left out, each said so"
elif ! gpu_line=$("$exe" - 2>&1 <<'EOF'
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
         "(PYTHON=... picks another Python; --device cpu rehearses it)" >&2
    exit 1
else
    echo "gpu-check: $gpu_line | python $exe"
fi
# benchmark.py takes a launcher beside the Python, else from the PATH: add a --user install's launchers.
PATH="$PATH:$("$exe" -c 'import os, sysconfig; print(sysconfig.get_path("scripts", f"{os.name}_user"))')"

# What every training script imports (common.py and its modules), the checks, the chart and the tests.
missing=$("$exe" -c 'import importlib.util, sys; print(" ".join(m for m in sys.argv[1:] if importlib.util.find_spec(m) is None))' \
          transformers sklearn numpy tqdm safetensors matplotlib pytest)
if [ -n "$missing" ]; then
    echo "error: the suite needs these Python modules, not installed for $exe: $missing" \
         "(pip install -r requirements.txt, or PYTHON=... for another Python)" >&2
    exit 1
fi

exec "$exe" scripts/gpu_plan.py --execute --started "$started" --python "$exe" "$@"
