"""The GPU check's plan (scripts/gpu-check.sh calls this): which launches, in order of value, how long
each takes on one H200 (or H100), which fit a time budget, and the runner that launches them, each with
its own timeout, and packs everything they wrote into what the GPU machine brings back.
Planning imports nothing beyond the standard library (no torch): `--dry-run` works on any machine.

Order of value: the matrix-product peaks (measured once, for every table's MFU); the goals, one
process at batch 32 (fp32 and bf16, each eager and as CUDA graphs, torch.compile against eager); the
fastest bf16 row of the goals at larger batches; the other default rows; the GPU tests; the other
precisions and compiled rows. A unit is one launch: one row at one batch, the peaks, or the tests.

A launch's estimate is its wall time in the committed one-GPU tables (docs/results/1x-nvidia-h[12]00*,
base-shape), or one derived from them with a stated assumption. Its timeout is the estimate plus half
of it, at least 30 s more. The budget holds the worst case: the estimates plus the longest overrun one
launch can make before its timeout stops it. A unit that would break it is dropped (and named, with the
command that runs it); later, cheaper units may still fit. While running, each unit is launched only if
its estimate fits the time left, and stopped at the budget's end whatever happens.

What comes back: the GPU machine returns at most 8 files of $OUT, 2 folders deep, named in letters,
digits, '.', '_' and '-', 16 MiB each, and the last 12,000 characters of the output. So the launches
write under output/gpu-check-runs/, and --out gets three files, rewritten after every unit: one archive
of all they wrote (no weights), summary.json and summary.md; each group's table is printed as it ends,
every row's table last.
"""
import argparse
import hashlib
import importlib.util
import itertools
import json
import math
import os
import re
import shutil
import sys
import tarfile
import time
from dataclasses import dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
from support import launching  # noqa: E402 - the standard library only, as the planning needs
# The committed one-GPU tables at real size: the H100's now, the H200's once its check is published.
TABLES = "docs/results/1x-nvidia-h[12]00*-base-shape*/benchmark.json"
WORK_ROOT = ROOT / "output" / "gpu-check-runs"  # what the launches write (never under --out)
WORK = None  # this call's folder under WORK_ROOT (work_folder), set by run()
ARCHIVE, SUMMARY_JSON, SUMMARY_MD = "gpu-check.tar.gz", "summary.json", "summary.md"
RETURNED_FILE_BYTES = 16 * 2**20  # the GPU machine's limit per file
MEMBER_LIMIT_BYTES = 2 * 2**20  # a larger file (a profiler trace) stays out of the archive
DEFAULT_BUDGET = 480
MAX_STEPS = 20  # 20 steps: a steady median over the steps after the first that compiled or recorded nothing
DEV_SAMPLES = 100  # the dev set the check evaluates: the figures are the steps', not the accuracy
MIN_SAMPLES = 2000  # training samples the check loads, or as many as its steps need
SWEEP = (128, 512, 1024)
SWEEP_ORDER = (512, 1024, 128)  # the goal (MFU at a batch that fills the GPU) first
# Seconds reserved out of the budget: before the first launch (the wheels, the CUDA check, benchmark.py
# --list) and after the last (the archive). Assumed, not measured.
SETUP_SECONDS, CLOSING_SECONDS = 20, 5
# Assumed, not measured: the peaks (torch's start, four precisions); benchmark.py's own start and end
# around its launch (its table and chart; the peaks are not measured again); tests/test_gpu.py in 4
# workers (9 passed, 2 skipped on the H100); torch.compile of one process's whole graph per step shape
# (the H100's ddp+compile failed after 70 s compiling DDP's split graphs: not a measure of this);
# recording a CUDA graph per shape.
PEAKS_SECONDS, BENCHMARK_OVERHEAD_SECONDS, TESTS_SECONDS = 15, 5, 100
COMPILE_SECONDS, CUDA_GRAPH_SECONDS = 30, 5
CPU_TIMEOUT = 1800
PEAK_PRECISIONS = {"cuda": ("fp32", "tf32", "bf16", "fp16"), "cpu": ("fp32", "bf16")}

GROUPS = {
    "peaks": "the matrix-product peaks, measured once for every table's MFU",
    "goals": "one process at batch 32: fp32 and bf16, each eager and as CUDA graphs; torch.compile against eager",
    "sweep": "the fastest bf16 row of the goals at larger batches",
    "default": "the other default rows",
    "tests": "tests/test_gpu.py",
    "more": "bf16 compiled, TF32, fp16, per-batch padding, single's CUDA graphs, dynamic shapes",
}
GOAL_ROWS = ["ddp", "ddp-amp-bf16", "ddp+cudagraphs", "ddp-amp-bf16+cudagraphs", "ddp+compile"]
SWEEP_CANDIDATES = ["ddp-amp-bf16", "ddp-amp-bf16+cudagraphs"]  # the goals' bf16 rows; the fastest is swept
DEFAULT_ROWS = ["single", "dataparallel", "ddp-spawn", "deepspeed", "accelerate", "fsdp", "hf-trainer", "fabric",
                "horovod"]
MORE_ROWS = ["ddp-amp-bf16+compile", "ddp-tf32", "ddp-amp", "ddp-longest", "ddp-amp-bf16-longest",
             "single+cudagraphs", "ddp+compile-dynamic"]
ROWS = {"goals": GOAL_ROWS, "default": DEFAULT_ROWS, "more": MORE_ROWS}
TIME_LEFT = "does not fit the time left"
THERE = 'PYTHON=python3 scripts/gpu-check.sh --wheels .whl --out "$OUT"'


class PlanError(Exception):
    """Bad input: one line, exit status 2."""


@dataclass
class Unit:
    """What the budget keeps or drops whole: one launch (a row at a batch, the peaks, the tests)."""
    name: str
    group: str
    estimate: float
    source: str
    batch: int = None  # the sweep's


@dataclass
class Plan:
    units: list
    kept: list = field(default_factory=list)
    dropped: list = field(default_factory=list)


@dataclass
class Measured:
    walls: dict  # {row: wall seconds of its launch}
    step_flops: float  # the model FLOPs of one ddp step at batch 32
    fp32_rate: float  # the fp32 matrix-product rate measured there, FLOP/s


# ----------------------------------------------------------------------------- estimates

def measured_launches(root=ROOT):
    """The committed one-GPU launches at real size: each row's longest successful wall time, ddp's FLOPs
    per step and the fp32 matrix-product peak measured beside them."""
    walls, step_flops, rate = {}, None, None
    for path in sorted(root.glob(TABLES)):
        report = json.loads(path.read_text(encoding="utf-8"))
        if report.get("model") != "base-shape":
            continue
        rate = (report.get("matmul_peaks") or {}).get("cuda fp32", {}).get("tflops") or rate
        for row in report["rows"]:
            if row.get("status") == "ok" and row.get("wall_seconds"):
                walls[row["row"]] = max(walls.get(row["row"], 0), row["wall_seconds"])
                if row["row"] == "ddp" and row.get("global_batch") == 32:
                    step_flops = row["model_flops_per_second"] * row["train_seconds"] / report["max_steps"]
    if "ddp" not in walls or not step_flops or not rate:
        raise PlanError(f"no ddp launch at batch 32 with its fp32 peak in {TABLES}: the estimates come from it")
    return Measured(walls, step_flops, rate * 1e12)


def estimate(row, measured):
    """(seconds, where the figure comes from) of one launch of `row`, 20 steps of batch 32."""
    if row in measured.walls:
        return measured.walls[row], "measured (with a saved model and 800 dev samples: an upper bound)"
    for suffix, extra, what in (("+cudagraphs", COMPILE_SECONDS + CUDA_GRAPH_SECONDS, "compiling and recording"),
                                ("+compile-dynamic", COMPILE_SECONDS, "compiling"),
                                ("+compile", COMPILE_SECONDS, "compiling")):
        if row.endswith(suffix):
            base = row[:-len(suffix)]
            return estimate(base, measured)[0] + extra, f"{base}'s + {extra} s {what} (assumed)"
    if row.endswith("-longest"):
        return estimate(row[:-len("-longest")], measured)[0], f"{row[:-len('-longest')]}'s (the same work)"
    if row == "horovod":
        return measured.walls["ddp"], "ddp's (not installed on the H100: not measured)"
    raise PlanError(f"no estimate for row '{row}'")


def sweep_estimate(row, batch, measured):
    """`row` at another batch: its launch at 32, plus the steps' FLOPs at `batch` at the fp32 matrix-product
    peak measured (bf16 computes faster: an upper bound)."""
    seconds, _ = estimate(row, measured)
    steps = MAX_STEPS * measured.step_flops * batch / 32 / measured.fp32_rate
    return seconds + steps, f"{row}'s + {steps:.0f} s of steps at the measured fp32 peak"


def sweep_row_estimate(batch, measured, device):
    """The sweep's unit before the goals have run: its costliest candidate (CUDA graphs need a GPU)."""
    candidates = [row for row in SWEEP_CANDIDATES if device == "cuda" or "+cudagraphs" not in row]
    return max(sweep_estimate(row, batch, measured) for row in candidates)


def timeout(seconds):
    """A launch's timeout: its estimate plus half of it, at least 30 s more, rounded up to 5 s."""
    return 5 * math.ceil((seconds + max(30, seconds / 2)) / 5)


def units_of(selected, measured, sweep=SWEEP, batch_size=32, device="cuda"):
    """The units of the groups and units named in `selected`, in that order, each once."""
    units = {}
    for name in selected:
        for unit in all_units(measured, sweep, batch_size, device):
            if name in (unit.group, unit.name):
                units.setdefault(unit.name, unit)
    return list(units.values())


def all_units(measured, sweep, batch_size, device):
    """Every unit, in order of value."""
    for group in GROUPS:
        if group == "peaks":
            yield Unit("peaks", group, PEAKS_SECONDS, "assumed")
        elif group == "tests":
            yield Unit("tests", group, TESTS_SECONDS, "assumed")
        elif group == "sweep":
            order = [batch for batch in SWEEP_ORDER if batch in sweep] + [b for b in sweep if b not in SWEEP_ORDER]
            for batch in order:
                if batch != batch_size:  # the goals' batch: their rows are these launches
                    yield Unit(f"b{batch}", group, *sweep_row_estimate(batch, measured, device), batch=batch)
        else:
            for row in ROWS[group]:
                yield Unit(row, group, *estimate(row, measured))


def unit_names(sweep, batch_size):
    """Every name a command line may give: groups and units."""
    return [*GROUPS, *(row for rows in ROWS.values() for row in rows),
            *(f"b{batch}" for batch in sweep if batch != batch_size)]


# ----------------------------------------------------------------------------- the budget

def overhead(unit):
    """Seconds a unit takes beyond its launch: benchmark.py's own start and end."""
    return 0 if unit.group in ("peaks", "tests") else BENCHMARK_OVERHEAD_SECONDS


def seconds(units):
    """The estimate of `units`: their launches and benchmark.py's own start and end around each."""
    return sum(unit.estimate + overhead(unit) for unit in units)


def worst_case(units):
    """The estimate plus the longest overrun one launch can make before its timeout stops it."""
    return seconds(units) + max((timeout(unit.estimate) - unit.estimate for unit in units), default=0)


def select(units, available):
    """The units kept, in order of value: each one kept if the worst case still fits `available` seconds
    (None: no limit); the others dropped."""
    kept, dropped = [], []
    for unit in units:
        if available is None or worst_case(kept + [unit]) <= available:
            kept.append(unit)
        else:
            dropped.append(unit)
    return kept, dropped


def unit_limit(unit, time_left):
    """While running: the seconds `unit` may take (its timeout and benchmark.py's own time, never more
    than the time left; None: no limit), or 0 where its estimate no longer fits the time left."""
    if time_left is None:
        return None
    if unit.estimate + overhead(unit) > time_left:
        return 0
    return min(timeout(unit.estimate) + overhead(unit), time_left)


def plan(selected, budget, measured, sweep=SWEEP, batch_size=32, device="cuda"):
    units = units_of(selected, measured, sweep, batch_size, device)
    available = None if budget is None else budget - SETUP_SECONDS - CLOSING_SECONDS
    return Plan(units, *select(units, available))


def second_command(units, planned):
    """The command that runs `units` (dropped or left out) in another call: the peaks first, for their MFU;
    a group whose every unit of `planned` is among them, by its name."""
    names = {unit.name for unit in units}
    words = []
    for unit in units:
        group = [other.name for other in planned if other.group == unit.group]
        words.append(unit.group if set(group) <= names else unit.name)
    return f"{THERE} " + " ".join(dict.fromkeys(["peaks", *words]))


# ----------------------------------------------------------------------------- the command line

def parse(argv):
    parser = argparse.ArgumentParser(prog="scripts/gpu-check.sh", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("names", nargs="*", metavar="GROUP|UNIT",
                        help=f"groups ({', '.join(GROUPS)}) or units (a row, b512 of the sweep) to run, in this "
                             "order (default: every group)")
    parser.add_argument("--dry-run", action="store_true", help="print the plan and the command; launch nothing")
    parser.add_argument("--budget", default=str(DEFAULT_BUDGET),
                        help="seconds the whole call may take: the units that do not fit are dropped, the most "
                             "valuable kept; 0: no limit (default: %(default)s)")
    parser.add_argument("--out", default="output/gpu-check",
                        help=f"the folder that comes back: {ARCHIVE} (all the launches wrote, no weights), "
                             f"{SUMMARY_JSON} and {SUMMARY_MD} (default: %(default)s)")
    parser.add_argument("--wheels", help="install the wheels of this folder first (scripts/fetch-gpu-wheels.sh)")
    parser.add_argument("--model", default="base-shape", help="the rows' model (default: %(default)s)")
    parser.add_argument("--max-steps", type=int, default=MAX_STEPS, help="steps per launch (default: %(default)s)")
    parser.add_argument("--sweep", default=",".join(map(str, SWEEP)),
                        help="the sweep's batch sizes (default: %(default)s)")
    parser.add_argument("--device", choices=["cuda", "cpu"], default="cuda",
                        help="cpu: the rehearsal (scripts/gpu-rehearsal.sh): GPU-only rows and precisions left "
                             "out, said so (default: %(default)s)")
    parser.add_argument("--started", type=float, help=argparse.SUPPRESS)  # gpu-check.sh's start: the budget's
    parser.add_argument("--python", default=sys.executable, help=argparse.SUPPRESS)
    argv = list(argv)
    passthrough = []
    if "--" in argv:
        at = argv.index("--")
        argv, passthrough = argv[:at], argv[at + 1:]
    args, unknown = parser.parse_known_args(argv)
    if unknown:
        raise PlanError(f"unknown option {unknown[0]} (options for benchmark.py go after --)")
    args.passthrough = passthrough
    check_numbers(args)
    known = unit_names(args.sweep, batch_size(passthrough))
    for name in args.names:
        if name not in known:
            raise PlanError(f"unknown group '{name}': name groups ({', '.join(GROUPS)}) or units "
                            "(--dry-run lists them; options for benchmark.py go after --)")
    args.names = args.names or list(GROUPS)
    if Path(args.out).exists() and not Path(args.out).is_dir():
        raise PlanError(f"--out {args.out} is a file: name a folder (it gets {ARCHIVE}, {SUMMARY_JSON}, {SUMMARY_MD})")
    return args


def check_numbers(args):
    try:
        budget = float(args.budget)
    except ValueError:
        budget = -1
    if budget < 0 or not math.isfinite(budget):
        raise PlanError(f"--budget {args.budget}: give seconds, like 480 (0: no limit)")
    args.budget = budget or None
    try:
        args.sweep = tuple(sorted({int(size) for size in args.sweep.split(",")}))
    except ValueError:
        args.sweep = ()
    if not args.sweep or args.sweep[0] < 1:
        raise PlanError(f"--sweep {args.sweep}: give batch sizes separated by commas, like 128,512,1024")
    if args.max_steps < 1:
        raise PlanError(f"--max-steps must be at least 1, got {args.max_steps}")


def batch_size(passthrough):
    """The rows' batch: --batch-size among benchmark.py's options, else the scripts' 32."""
    for at, option in enumerate(passthrough):
        if option.startswith("--batch-size="):
            return int(option.split("=", 1)[1])
        if option == "--batch-size" and at + 1 < len(passthrough):
            return int(passthrough[at + 1])
    return 32


def describe(plan, args, measured_from):
    """The dry-run's text: every unit, kept or dropped, with its estimate and timeout, and the command."""
    lines = [f"gpu-check plan: --model {args.model} --max-steps {args.max_steps}, budget "
             f"{f'{args.budget:.0f} s' if args.budget else 'none'}; estimates for one H200 (an H100's compute) from "
             f"{measured_from}; each unit one launch: benchmark.py's own start and end {BENCHMARK_OVERHEAD_SECONDS} s",
             f"  {'unit':<26} {'est s':>6} {'timeout':>8}  source"]
    kept = {id(unit) for unit in plan.kept}
    group = None
    for unit in plan.units:
        if unit.group != group:
            group = unit.group
            lines.append(f"{group}: {GROUPS[group]}")
        if id(unit) in kept:
            lines.append(f"  {unit.name:<26} {unit.estimate:6.0f} {timeout(unit.estimate):7d}s  {unit.source}")
        else:
            lines.append(f"  {unit.name:<26} {unit.estimate:6.0f}  dropped  does not fit the budget")
    total, worst = seconds(plan.kept), worst_case(plan.kept)
    reserve = SETUP_SECONDS + CLOSING_SECONDS
    lines.append(f"in all: {len(plan.kept)} units, about {total:.0f} s of launches ({total / 60:.1f} min), "
                 f"{worst:.0f} s with one launch running to its timeout, + {reserve} s set-up and packing"
                 + (f": {worst + reserve:.0f} s of the {args.budget:.0f} s budget" if args.budget else ""))
    if plan.dropped:
        lines += [f"dropped: {', '.join(unit.name for unit in plan.dropped)}; a second call runs them:",
                  f"  {second_command(plan.dropped, plan.units)}"]
    lines += ["run it on one GPU without network, with the wheels made here (scripts/fetch-gpu-wheels.sh .whl, "
              "scripts/build-horovod-gpu-wheel.sh .whl):", f"  {THERE}",
              f"it brings back $OUT/{ARCHIVE} (every unit's benchmark.json, .md and .png, result.json and logs; "
              f"no weights), $OUT/{SUMMARY_JSON} and $OUT/{SUMMARY_MD}, rewritten after every unit; each group's "
              "table printed as it ends and every row's table last"]
    return "\n".join(lines)


# ----------------------------------------------------------------------------- running it

def rows_known(python, env):
    """{row: (its strategy, GPU only?)} that this benchmark.py knows."""
    log = WORK / "rows.log"
    if launching.launch([python, "benchmark.py", "--list"], log, 120, ROOT, env).status != 0:
        raise PlanError(f"benchmark.py --list failed: {(launching.printed(log) or ['no output'])[-1]}")
    known = {}
    for line in launching.printed(log)[1:]:
        if line.startswith("  ") and len(line.split()) > 1:
            name, strategy = line.split()[:2]
            known[name] = (strategy, "[GPU only]" in line)
    return known


# The strategies' optional libraries (benchmark.py's STRATEGIES[...].needs): a row without its library is
# left out before it takes any of the budget.
NEEDS = {"deepspeed": "deepspeed", "horovod": "horovod", "accelerate": "accelerate", "fabric": "lightning_fabric"}


def cannot_run(row, known, device):
    """Why `row` cannot run with this benchmark.py, Python and device, or None."""
    if row not in known:
        return f"{row} is not a row of this benchmark.py (benchmark.py --list)"
    strategy, gpu_only = known[row]
    if gpu_only and device == "cpu":
        return "GPU only: not launched on a CPU"
    if strategy in NEEDS and importlib.util.find_spec(NEEDS[strategy]) is None:
        return f"{NEEDS[strategy]} is not installed"
    return None


def data_options(batch, max_steps):
    """The samples a launch loads: enough for its steps, and a small dev set."""
    samples = max(MIN_SAMPLES, batch * max_steps + DEV_SAMPLES)
    return ["--max-samples", str(samples), "--dev-ratio", f"{DEV_SAMPLES / samples:.6f}"]


def unit_command(unit, row, args, per_launch):
    """The command of one unit: the peaks, the tests, or benchmark.py launching one row."""
    python = args.python
    if unit.group == "peaks":
        return [python, str(Path(__file__).resolve()), "--peaks", args.device, str(WORK / "peaks")]
    if unit.group == "tests":
        workers = ["-n", "4"] if args.device == "cuda" else ["-n", "0"]
        tests = ["tests/test_gpu.py"] + (["tests/test_gpu_paths_on_cpu.py"] if args.device == "cpu" else [])
        return [python, "-m", "pytest", *tests, "-rs", "-q", "-p", "no:cacheprovider", *workers]
    batch = unit.batch or batch_size(args.passthrough)
    return [python, "benchmark.py", "--output-dir", str(WORK / unit.name), "--model", args.model,
            "--max-steps", str(args.max_steps), "--timeout", str(per_launch), "--only", row,
            "--matmul-peaks", str(WORK / "peaks" / "peaks.json"), *data_options(batch, args.max_steps),
            "--no-save-model", *args.passthrough, *(["--batch-size", str(unit.batch)] if unit.batch else [])]


def fastest_bf16(measured, args):
    """The goals' bf16 row with the most steady samples/s (the first candidate where none ran), and the
    sweep's estimate for it."""
    rates = {}
    for row in SWEEP_CANDIDATES:
        for result in rows_of(row):
            if result.get("status") == "ok" and result.get("steady_samples_per_second"):
                rates[row] = result["steady_samples_per_second"]
    row = max(rates, key=rates.get) if rates else SWEEP_CANDIDATES[0]
    return row, (f"{row}, the fastest bf16 row of the goals ({rates[row]:.0f} samples/s)" if rates
                 else f"{row}: no bf16 row of the goals ran")


def rows_of(unit_name):
    """The rows of a unit's benchmark.json (none before it ran)."""
    path = WORK / unit_name / "benchmark.json"
    try:
        return json.loads(path.read_text(encoding="utf-8"))["rows"]
    except (OSError, ValueError, KeyError):
        return []


def work_folder(out):
    """Where the launches of the call into `out` write: a folder of its own, so that two calls from one
    checkout into two folders never clear each other's."""
    return WORK_ROOT / f"{out.name}-{hashlib.sha1(str(out).encode()).hexdigest()[:8]}"


def fresh_compile_cache(env, first=False):
    """A new, empty inductor cache (its Triton kernels within) for the launches to come: one per call
    (`first`: those of an earlier call into the same --out go), and another after a launch stopped, which
    may have left a kernel half-written there (an empty .so, seen on the CPU) that fails every later compile."""
    pattern = f"{WORK.name}-inductor-*"
    if first:
        for old in WORK_ROOT.glob(pattern):
            shutil.rmtree(old, ignore_errors=True)
    cache = WORK_ROOT / f"{WORK.name}-inductor-{len(list(WORK_ROOT.glob(pattern))) + 1}"
    cache.mkdir(parents=True)
    env["TORCHINDUCTOR_CACHE_DIR"] = str(cache)


def run(args, plan_units, measured):
    started = args.started or time.time()
    deadline = None if args.budget is None else started + args.budget - CLOSING_SECONDS
    out = Path(args.out).resolve()
    out.mkdir(parents=True, exist_ok=True)
    global WORK
    WORK = work_folder(out)
    shutil.rmtree(WORK, ignore_errors=True)
    (WORK / "peaks").mkdir(parents=True)
    write_peaks(WORK / "peaks", args.device, {})  # none until the peaks run: benchmark.py measures none itself
    env = {"CUDA_VISIBLE_DEVICES": ""} if args.device == "cpu" else {}  # added to ours
    known = rows_known(args.python, env)
    fresh_compile_cache(env, first=True)
    summary = {"started": time.strftime("%Y-%m-%dT%H:%M:%S", time.localtime(started)), "budget": args.budget,
               "device": args.device, "model": args.model, "units": []}
    for group, units in itertools.groupby(plan_units, key=lambda unit: unit.group):
        print(f"\n== {group}: {GROUPS[group]}", flush=True)
        for unit in units:
            summary["units"].append(run_unit(unit, args, measured, known, env, deadline))
            if summary["units"][-1]["status"] == "stopped":
                fresh_compile_cache(env)
            pack(out, summary)
        print_group(group, summary)
    pack(out, summary)
    return finish(out, summary, started)


def run_unit(unit, args, measured, known, env, deadline):
    """Launch one unit if it can run here and fits the time left; its entry in the summary."""
    row, entry = unit.name, {"unit": unit.name, "group": unit.group, "estimate": round(unit.estimate)}
    if unit.group == "sweep":
        row, why = fastest_bf16(measured, args)
        unit = Unit(unit.name, unit.group, *sweep_estimate(row, unit.batch, measured), batch=unit.batch)
        print(f"gpu-check: {unit.name}: {why}", flush=True)
    entry["row"] = row if unit.group not in ("peaks", "tests") else None
    reason = cannot_run(row, known, args.device) if entry["row"] else None
    limit = unit_limit(unit, None if deadline is None else deadline - time.time())
    if reason or limit == 0:
        entry.update(status="left out", reason=reason or TIME_LEFT)
        print(f"gpu-check: {unit.name}: left out: {entry['reason']}", flush=True)
        return entry
    per_launch = timeout(unit.estimate) if args.device == "cuda" else CPU_TIMEOUT  # the H200's mean nothing on a CPU
    log = WORK / f"{unit.name}.log"
    status, took, _, _, cpu = launching.launch(unit_command(unit, row, args, per_launch), log, limit, ROOT, env)
    entry.update(status="ok" if status == 0 else ("stopped" if status is None else f"failed ({status})"),
                 seconds=round(took, 1), cpu_seconds=round(cpu, 1), timeout=per_launch)
    print(f"gpu-check: {unit.name}: {entry['status']} in {took:.0f} s (estimate {unit.estimate:.0f} s)", flush=True)
    return entry


# ----------------------------------------------------------------------------- what comes back

TABLE_COLUMNS = ["unit", "row", "batch", "status", "wall s", "train s", "overhead s", "first step s", "compile s",
                 "steady steps", "steady ms", "samples/s", "MFU real (computed)", "MFU measured peak",
                 "graphs", "CUDA graphs", "shapes"]


def table_cells(entry):
    """One line of the table: a unit's row as its benchmark.json has it, or why it has none."""
    rows = rows_of(entry["unit"]) if entry.get("row") else []
    row = rows[0] if rows else {}
    if row.get("status") != "ok":
        reason = row.get("reason") or entry.get("reason") or ""
        return [entry["unit"], entry.get("row") or "", "", f"{row.get('status') or entry['status']}: {reason}"[:100]]

    def figure(key, form="{}", scale=1):
        return form.format(row[key] * scale) if row.get(key) is not None else "-"
    mfu = (f"{figure('mfu_real', '{:.1%}')} ({figure('mfu', '{:.1%}')})" if row.get("mfu") is not None else "-")
    measured = (f"{figure('mfu_measured_real', '{:.1%}')} ({figure('mfu_measured', '{:.1%}')})"
                if row.get("mfu_measured") is not None else "-")
    return [entry["unit"], row["row"], str(row["global_batch"]), "ok", f"{row['wall_seconds']:.1f}",
            f"{row['train_seconds']:.1f}", f"{row['wall_seconds'] - row['train_seconds']:.1f}",
            figure("first_step_seconds", "{:.2f}"), figure("compile_seconds", "{:.1f}"), figure("steady_steps"),
            figure("steady_step_seconds", "{:.1f}", 1000), figure("steady_samples_per_second", "{:.1f}"), mfu,
            measured, figure("compiled_graphs"), figure("cuda_graphs"), figure("step_shapes")]


def table(entries):
    """Every launched row's figures, aligned (markdown-style columns, readable in a log)."""
    lines = [TABLE_COLUMNS] + [table_cells(entry) for entry in entries if entry.get("row")]
    widths = [max(len(line[i]) for line in lines if i < len(line)) for i in range(len(TABLE_COLUMNS))]
    return ["| " + " | ".join(cell.ljust(width) for cell, width in zip(line, widths)) + " |" for line in lines]


def peaks_line():
    """The peaks measured, in TFLOP/s, or why there are none."""
    peaks = json.loads((WORK / "peaks" / "peaks.json").read_text(encoding="utf-8"))["peaks"]
    return "measured peaks, TFLOP/s: " + (", ".join(
        f"{precision} {peak['tflops']:g}" if "tflops" in peak else f"{precision} {peak['error']}"
        for precision, peak in peaks.items()) or "none (the peaks did not run)")


def print_group(group, summary):
    entries = [entry for entry in summary["units"] if entry["group"] == group]
    if group == "peaks":
        print(peaks_line(), flush=True)
    elif group == "tests" and (WORK / "tests.log").is_file():
        print("tests: " + (launching.printed(WORK / "tests.log") or ["no output"])[-1], flush=True)
    elif any(entry.get("row") for entry in entries):
        print("\n".join(table(entries)), flush=True)


def pack(out, summary):
    """What comes back, rewritten whole: the archive of all the launches wrote (no weights, no checkpoint,
    no file over 2 MiB), the summary as JSON and as tables. Written beside, then renamed: a call stopped
    mid-write keeps the previous one."""
    (WORK / SUMMARY_JSON).write_text(json.dumps(summary, indent=2) + "\n", encoding="utf-8")
    files = [path for path in sorted(WORK.rglob("*")) if path.is_file() and path.stat().st_size <= MEMBER_LIMIT_BYTES
             and not any(part == "model" or part.startswith("checkpoint") for part in path.relative_to(WORK).parts)]
    for kept in (files, [path for path in files if path.suffix in (".json", ".md")]):
        partial = out / f"{ARCHIVE}.partial"
        with tarfile.open(partial, "w:gz") as archive:
            for path in kept:
                archive.add(path, arcname=f"gpu-check/{path.relative_to(WORK)}")
        if partial.stat().st_size <= RETURNED_FILE_BYTES:
            break
    os.replace(partial, out / ARCHIVE)
    for name, text in ((SUMMARY_JSON, json.dumps(summary, indent=2) + "\n"),
                       (SUMMARY_MD, "\n".join(["# GPU check", "", peaks_line(), "", *table(summary["units"])]) + "\n")):
        (out / f"{name}.partial").write_text(text, encoding="utf-8")
        os.replace(out / f"{name}.partial", out / name)


def finish(out, summary, started):
    """Every row's table last (the output's last 12,000 characters come back), what was left out with the
    command that runs it, and what --out holds."""
    print("\n== every row (" + peaks_line() + ")\n" + "\n".join(table(summary["units"])), flush=True)
    not_run = [entry for entry in summary["units"] if entry["status"] != "ok"]
    failed = [entry["unit"] for entry in not_run if entry["status"] != "left out"]
    planned = [Unit(entry["unit"], entry["group"], 0, "") for entry in summary["units"]]
    left_out = [unit for unit, entry in zip(planned, summary["units"]) if entry.get("reason") == TIME_LEFT]
    if left_out:
        print(f"gpu-check: the time left held no more; a second call runs the rest:\n  "
              f"{second_command(left_out, planned)}")
    size = (out / ARCHIVE).stat().st_size
    print(f"gpu-check: {'failed: ' + ', '.join(failed) if failed else 'every unit launched ran'} in "
          f"{time.time() - started:.0f} s; {out}: {ARCHIVE} ({size / 2**10:.0f} KiB), {SUMMARY_JSON}, {SUMMARY_MD}",
          flush=True)
    return 1 if failed else 0


def write_peaks(folder, device, peaks):
    (folder / "peaks.json").write_text(json.dumps({"device": device, "peaks": peaks}, indent=2) + "\n",
                                       encoding="utf-8")


def measure_peaks(device, folder):
    """The matrix-product peak of each precision (microbenchmarks/matmul_peak.py), written after each."""
    from microbenchmarks import matmul_peak  # imports torch: only here, in the launch
    folder.mkdir(parents=True, exist_ok=True)
    peaks = {}
    for precision in PEAK_PRECISIONS[device]:
        try:
            rates = matmul_peak.rates_by_size(device, precision)
            best = max(rates, key=rates.get)
            peaks[precision] = {"tflops": round(rates[best], 3), "size": best,
                                "by_size": {str(size): round(rate, 3) for size, rate in rates.items()}}
        except Exception as error:  # noqa: BLE001 - one precision's failure is a finding; the others go on
            peaks[precision] = {"error": f"{type(error).__name__}: {str(error).splitlines()[0] if str(error) else ''}"}
        print(f"{precision}: {peaks[precision]}", flush=True)
        write_peaks(folder, device, peaks)
    return 1 if any("error" in peak for peak in peaks.values()) else 0


def main(argv):
    if argv[:1] == ["--peaks"]:
        return measure_peaks(argv[1], Path(argv[2]))
    execute = argv[:1] == ["--execute"]
    args = parse(argv[1:] if execute else argv)
    measured = measured_launches()
    the_plan = plan(args.names, args.budget, measured, args.sweep, batch_size(args.passthrough), args.device)
    from_tables = ", ".join(str(path.relative_to(ROOT).parent) + "/" for path in sorted(ROOT.glob(TABLES)))
    if not execute:
        print(describe(the_plan, args, from_tables))
        return 0
    return run(args, the_plan.kept, measured)


if __name__ == "__main__":
    try:
        sys.exit(main(sys.argv[1:]))
    except PlanError as error:
        print(f"error: {error}", file=sys.stderr)
        sys.exit(2)
