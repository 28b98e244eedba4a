"""The GPU check's plan (scripts/gpu-check.sh calls this): which launches, in order of value, how long
each takes on one H100, which fit a time budget, and the runner that launches them with a timeout each.
Planning imports nothing beyond the standard library (no torch): `--dry-run` works on any machine.

Order of value: the measured matrix-product peaks; the precision rows at real size; the compiled and
CUDA-graph rows; the batch sweep; the other default rows; the GPU tests. A launch's estimate is its
H100 wall time in the committed table (docs/results/1x-nvidia-h100-80gb-hbm3*/benchmark.json), or one
derived from it, and says which. Its timeout is the estimate plus half of it, at least 30 s more.

The budget holds the worst case: the estimates, plus the longest overrun one launch can make before its
timeout stops it. A unit that would break it is dropped, and later, cheaper units may still fit. While
running, each group is re-planned on the time left and stopped at the budget's end whatever happens,
so hangs cost the least valuable units, never the call.
"""
import argparse
import importlib.util
import json
import math
import os
import shutil
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
H100_TABLES = "docs/results/1x-nvidia-h100-80gb-hbm3*/benchmark.json"
# Launches' working folders (model weights among their files) and the wheels' site-packages: never
# under --out, which must come back whole.
WORK = ROOT / "output" / "gpu-check-runs"
DEFAULT_BUDGET = 480
MAX_STEPS = 20  # 20 steps of batch 32: a steady median over 19 (the committed table's runs)
SWEEP = (32, 128, 512)
# Seconds reserved out of the budget: before the first launch (the wheels, the CUDA check, benchmark.py
# --list) and after the last (the summary). Assumed, not measured.
SETUP_SECONDS, CLOSING_SECONDS = 20, 5
# Not in the table, so assumed: one process measuring four precisions (torch's import and CUDA's start
# dominate; the products take under a second each); a benchmark.py run's own start and end (imports,
# the machine's description, its peaks); tests/test_gpu.py in 4 workers (9 passed, 2 skipped on the H100).
PEAKS_SECONDS, BENCHMARK_OVERHEAD_SECONDS, TESTS_SECONDS = 15, 10, 100
CPU_TIMEOUT = 1800
PEAK_PRECISIONS = {"cuda": ("fp32", "tf32", "bf16", "fp16"), "cpu": ("fp32", "bf16")}

GROUPS = {
    "peaks": "the measured matrix-product peaks (microbenchmarks/matmul_peak.py)",
    "precision": "DDP in IEEE fp32, TF32, bf16, fp16; per-batch padding (-longest)",
    "compiled": "torch.compile and CUDA graphs",
    "sweep": "the batch sweep: ddp and ddp-amp-bf16",
    "default": "the other default rows",
    "tests": "tests/test_gpu.py",
}
PRECISION_ROWS = ["ddp", "ddp-tf32", "ddp-amp-bf16", "ddp-amp", "ddp-longest", "ddp-amp-bf16-longest"]
COMPILED_ROWS = ["ddp+compile", "ddp-amp-bf16+compile", "ddp+cudagraphs", "ddp-amp-bf16+cudagraphs",
                 "single+cudagraphs", "ddp+compile-static", "ddp+compile-dynamic"]
SWEEP_ROWS = ["ddp", "ddp-amp-bf16"]
# The sweep's 32 repeats the precision rows (their batch): it comes last of the sizes.
SWEEP_ORDER = (128, 512, 32)
DEFAULT_ROWS = ["single", "dataparallel", "ddp-spawn", "deepspeed", "accelerate", "fsdp", "hf-trainer", "fabric",
                "horovod"]


class PlanError(Exception):
    """Bad input: one line, exit status 2."""


@dataclass
class Launch:
    name: str
    estimate: float
    source: str


@dataclass
class Unit:
    """What the budget keeps or drops whole: one row, one batch size of the sweep, the peaks, the tests."""
    name: str
    group: str
    launches: list
    batch: int = None  # the sweep's


@dataclass
class Plan:
    units: list
    kept: list = field(default_factory=list)
    dropped: list = field(default_factory=list)


# ----------------------------------------------------------------------------- estimates

def h100_launches(root=ROOT):
    """{row: (wall seconds, train seconds)} of the committed H100 runs at real size (base-shape, 20 steps);
    a row measured in several tables keeps its longest launch."""
    measured = {}
    for path in sorted(root.glob(H100_TABLES)):
        report = json.loads(path.read_text(encoding="utf-8"))
        if report.get("model") != "base-shape":
            continue
        for row in report["rows"]:  # a failed launch has its wall time too: ddp+compile's, compiling
            wall, train = row.get("wall_seconds"), row.get("train_seconds") or 0.0
            if wall is not None and wall > measured.get(row["row"], (0, 0))[0]:
                measured[row["row"]] = (wall, train)
    if "ddp" not in measured or "ddp+compile" not in measured:
        raise PlanError(f"no H100 launches of ddp and ddp+compile in {H100_TABLES}: the estimates come from them")
    return measured


def estimate(row, measured):
    """(seconds, where the figure comes from) of one launch of `row` on one H100, 20 steps of batch 32."""
    if row in measured:
        return measured[row][0], "measured" + (" (failed while compiling)" if row == "ddp+compile" else "")
    compile_cost = measured["ddp+compile"][0] - measured["ddp"][0]
    for suffix, extra, how in (("+cudagraphs", 10, " + 10 s capture (assumed)"),
                               ("+compile-static", compile_cost, " again: shapes recompiled (assumed)"),
                               ("+compile-dynamic", 0, ""), ("+compile", 0, "")):
        if row.endswith(suffix):
            base = estimate(row[:-len(suffix)], measured)[0]
            seconds = base + compile_cost + extra
            return seconds, f"{row[:-len(suffix)]} + {compile_cost:.0f} s compilation (ddp+compile's){how}"
    if row.endswith("-longest"):
        return estimate(row[:-len("-longest")], measured)[0], f"{row[:-len('-longest')]}'s (the same work)"
    if row == "horovod":
        return measured["ddp"][0], "ddp's (not installed on the H100: not measured)"
    raise PlanError(f"no H100 estimate for row '{row}'")


def sweep_estimate(row, batch, measured):
    """A row at another batch: its 20 steps scaled with the batch (an upper bound: at 32 a step waits on
    the CPU), the rest of the launch as measured."""
    wall, train = measured[row]
    return wall + train * (batch / 32 - 1), f"{row}'s, its {train:.1f} s of steps x {batch}/32"


def timeout(seconds):
    """A launch's timeout: its estimate plus half of it, at least 30 s more, rounded up to 5 s."""
    return 5 * math.ceil((seconds + max(30, seconds / 2)) / 5)


def units_of(groups, measured, sweep=SWEEP, batch_size=32):
    """The plan's units in order of value, for the groups named; the rows train at `batch_size`."""
    units = []
    for group in groups:
        if group == "peaks":
            units.append(Unit("peaks", group, [Launch("peaks", PEAKS_SECONDS, "assumed")]))
        elif group == "tests":
            units.append(Unit("tests", group, [Launch("tests", TESTS_SECONDS, "assumed")]))
        elif group == "sweep":
            order = [batch for batch in SWEEP_ORDER if batch in sweep] + [b for b in sweep if b not in SWEEP_ORDER]
            for batch in order:
                if batch == batch_size and "precision" in groups:
                    continue  # the precision rows ddp and ddp-amp-bf16 are these launches
                launches = [Launch(f"{row}-b{batch}", *sweep_estimate(row, batch, measured)) for row in SWEEP_ROWS]
                units.append(Unit(f"b{batch}", group, launches, batch))
        else:
            rows = {"precision": PRECISION_ROWS, "compiled": COMPILED_ROWS, "default": DEFAULT_ROWS}[group]
            units += [Unit(row, group, [Launch(row, *estimate(row, measured))]) for row in rows]
    return units


# ----------------------------------------------------------------------------- the budget

def group_timeout(units, group):
    """One timeout for every launch of a group (benchmark.py's --timeout): its longest launch's."""
    return max(timeout(launch.estimate) for unit in units if unit.group == group for launch in unit.launches)


def seconds(units):
    """The estimate of `units`: their launches, and each benchmark.py run's own start and end."""
    benchmark_groups = {unit.group for unit in units if unit.group not in ("peaks", "tests")}
    return (sum(launch.estimate for unit in units for launch in unit.launches)
            + BENCHMARK_OVERHEAD_SECONDS * len(benchmark_groups))


def worst_case(units):
    """The estimate plus the longest overrun one launch can make before its timeout stops it."""
    overrun = max((group_timeout(units, unit.group) - launch.estimate for unit in units for launch in unit.launches),
                  default=0)
    return seconds(units) + overrun


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


def fit_group(units, time_left):
    """While running: which of a group's planned units to launch, and the seconds the group may take
    (None: no limit). Re-planned on the time left (None: no limit) with the estimates alone: the plan's reserve for one
    launch running to its timeout is what a hang has used, so after one hang every unit planned still
    runs; after more, the least valuable go. The group may take its worst case, never more than the time
    left: then it is stopped."""
    if time_left is None:
        return units, None
    kept = []
    for unit in units:
        if seconds(kept + [unit]) <= time_left:
            kept.append(unit)
    return kept, min(worst_case(kept), time_left) if kept else 0


def plan(groups, budget, measured, sweep=SWEEP, batch_size=32):
    units = units_of(groups, measured, sweep, batch_size)
    available = None if budget is None else budget - SETUP_SECONDS - CLOSING_SECONDS
    kept, dropped = select(units, available)
    return Plan(units, kept, dropped)


# ----------------------------------------------------------------------------- the command line

def parse(argv):
    parser = argparse.ArgumentParser(prog="scripts/gpu-check.sh", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter,
                                     epilog="Options after -- go to benchmark.py (and from it to every script).")
    parser.add_argument("groups", nargs="*", metavar="GROUP",
                        help=f"only these groups, in this order (default: all): {', '.join(GROUPS)}")
    parser.add_argument("--dry-run", action="store_true", help="print the plan and the command to run it; launch nothing")
    parser.add_argument("--budget", default=str(DEFAULT_BUDGET),
                        help="seconds the whole call may take; the units that do not fit are dropped, the most "
                             "valuable kept; 0: no limit (default: %(default)s)")
    parser.add_argument("--out", default="output/gpu-check",
                        help="everything that comes back: tables, JSON, charts, logs (default: %(default)s)")
    parser.add_argument("--wheels", help="install the wheels of this folder first (scripts/fetch-gpu-wheels.sh)")
    parser.add_argument("--model", default="base-shape", help="the rows' model (default: %(default)s)")
    parser.add_argument("--max-steps", type=int, default=MAX_STEPS, help="steps per launch (default: %(default)s)")
    parser.add_argument("--sweep", default=",".join(map(str, SWEEP)),
                        help="the batch sweep's batch sizes (default: %(default)s)")
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
    for group in args.groups:
        if group not in GROUPS:
            raise PlanError(f"unknown group '{group}': name {', '.join(GROUPS)} (options for benchmark.py go after --)")
    args.groups = args.groups or list(GROUPS)
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
        raise PlanError(f"--sweep {args.sweep}: give batch sizes separated by commas, like 32,128,512")
    if args.max_steps < 1:
        raise PlanError(f"--max-steps must be at least 1, got {args.max_steps}")
    return args


def batch_size(passthrough):
    """The rows' batch: --batch-size among benchmark.py's options, else the scripts' 32."""
    for at, option in enumerate(passthrough):
        if option.startswith("--batch-size="):
            return int(option.split("=", 1)[1])
        if option == "--batch-size" and at + 1 < len(passthrough):
            return int(passthrough[at + 1])
    return 32


THERE = 'PYTHON=python3 scripts/gpu-check.sh --wheels .whl --out "$OUT"'


def describe(plan, args, measured_from):
    """The dry-run's text: every unit, kept or dropped, with its estimate and timeout, and the command."""
    lines = [f"gpu-check plan: --model {args.model} --max-steps {args.max_steps}, "
             f"budget {f'{args.budget:.0f} s' if args.budget else 'none'}; estimates for one H100 from {measured_from}"]
    lines.append(f"  {'unit':<26} {'est s':>6} {'timeout':>8}  source")
    kept = set(id(unit) for unit in plan.kept)
    for group in args.groups:
        units = [unit for unit in plan.units if unit.group == group]
        kept_here = [unit for unit in units if id(unit) in kept]
        overhead = (f"; benchmark.py's own start and end {BENCHMARK_OVERHEAD_SECONDS} s"
                    if kept_here and group not in ("peaks", "tests") else "")
        lines.append(f"{group}: {GROUPS[group]}{overhead}")
        for unit in units:
            for launch in unit.launches:
                if id(unit) in kept:
                    limit = group_timeout(plan.kept, group)
                    lines.append(f"  {launch.name:<26} {launch.estimate:6.0f} {limit:7d}s  {launch.source}")
                else:
                    lines.append(f"  {launch.name:<26} {launch.estimate:6.0f}  dropped  does not fit the budget")
    total, worst = seconds(plan.kept), worst_case(plan.kept)
    lines.append(f"in all: {len(plan.kept)} units, about {total:.0f} s of launches ({total / 60:.1f} min), "
                 f"{worst:.0f} s with one launch running to its timeout, + {SETUP_SECONDS + CLOSING_SECONDS} s "
                 f"set-up and summary" + (f": {worst + SETUP_SECONDS + CLOSING_SECONDS:.0f} s of the {args.budget:.0f} s budget"
                                          if args.budget else ""))
    if plan.dropped:
        lines.append(f"dropped: {', '.join(unit.name for unit in plan.dropped)} (a larger --budget, or name their "
                     "groups in another call)")
    lines.append("run it on one H100 without network, with the wheels made here (scripts/fetch-gpu-wheels.sh .whl, "
                 "scripts/build-horovod-gpu-wheel.sh .whl):")
    lines.append(f"  {THERE}")
    return "\n".join(lines)


# ----------------------------------------------------------------------------- running it

def rows_known(python, env):
    """({row: (its strategy, GPU only?)} that this benchmark.py knows, whether its --batch-size takes a list)."""
    def listing(*extra):
        return subprocess.run([python, "benchmark.py", "--list", *extra], cwd=ROOT, env=env, capture_output=True,
                              text=True, timeout=120)
    done = listing("--batch-size", "32,128")
    lists = done.returncode == 0
    if not lists:
        done = listing()
    if done.returncode != 0:
        raise PlanError(f"benchmark.py --list failed: {(done.stderr.strip().splitlines() or ['no output'])[-1]}")
    known = {}
    for line in done.stdout.splitlines()[1:]:
        if line.startswith("  ") and len(line.split()) > 1:
            name, strategy = line.split()[:2]
            known[name] = (strategy, "[GPU only]" in line)
    return known, lists


def sync(source, target, limit_bytes=2 * 2**20):
    """Copy the small text, JSON and chart files of `source` to `target`: never a model's weights."""
    if not source.is_dir():
        return
    for path in source.rglob("*"):
        relative = path.relative_to(source)
        if (not path.is_file() or path.suffix not in (".md", ".json", ".png", ".log", ".txt")
                or any(part == "model" or part.startswith("checkpoint") for part in relative.parts)
                or path.stat().st_size > limit_bytes):
            continue
        copy = target / relative
        if not copy.exists() or copy.stat().st_mtime < path.stat().st_mtime:
            copy.parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(path, copy)


def launch(command, log, limit, env, work=None, out=None, grace=15):
    """Run `command` in its own session, its output in `log`, for at most `limit` seconds (then SIGTERM, and
    after `grace` seconds SIGKILL to all it started), copying `work`'s small files to `out` as they change.
    Returns (exit status, or None when stopped, and the seconds it took)."""
    start = time.monotonic()
    with open(log, "w", encoding="utf-8") as output:
        process = subprocess.Popen(command, cwd=ROOT, env=env, stdout=output, stderr=subprocess.STDOUT,
                                   start_new_session=True)
        status = None
        while True:
            try:
                status = process.wait(timeout=2)
                break
            except subprocess.TimeoutExpired:
                if work:
                    sync(work, out)
                if limit is not None and time.monotonic() - start > limit:
                    break
        if status is None:  # SIGTERM first: benchmark.py then stops its own launch and keeps its table
            os.killpg(process.pid, signal.SIGTERM)
            try:
                process.wait(timeout=grace)
            except subprocess.TimeoutExpired:
                pass
            try:  # and whatever it started that is still there
                os.killpg(process.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            process.wait()
            output.write(f"\ngpu-check: stopped after {limit:.0f} s\n")
    if work:
        sync(work, out)
    return status, time.monotonic() - start


def run(args, plan_units):
    started = args.started or time.time()
    deadline = None if args.budget is None else started + args.budget - CLOSING_SECONDS
    out = Path(args.out).resolve()
    out.mkdir(parents=True, exist_ok=True)
    env = dict(os.environ)
    if args.device == "cpu":
        env["CUDA_VISIBLE_DEVICES"] = ""
    known, lists = rows_known(args.python, env)
    summary = {"started": time.strftime("%Y-%m-%dT%H:%M:%S", time.localtime(started)), "budget": args.budget,
               "device": args.device, "model": args.model, "groups": []}
    for group in args.groups:
        units = [unit for unit in plan_units if unit.group == group]
        entry = {"group": group, "status": None, "seconds": 0, "left_out": {}}
        summary["groups"].append(entry)
        launchable = []
        for unit in units:  # what cannot run here, said so
            reason = cannot_run(unit, known, lists, args.device)
            if reason:
                entry["left_out"][unit.name] = reason
            else:
                launchable.append(unit)
        launchable, limit = fit_group(launchable, None if deadline is None else deadline - time.time())
        for unit in units:
            if unit not in launchable and unit.name not in entry["left_out"]:
                entry["left_out"][unit.name] = "does not fit the time left"
        for name, reason in entry["left_out"].items():
            print(f"gpu-check: {group}: left out {name}: {reason}", flush=True)
        if not launchable:
            entry["status"] = "nothing to run"
            write_summary(out, summary)
            continue
        print(f"\n== {group}: {', '.join(unit.name for unit in launchable)}"
              + (f" (at most {limit:.0f} s)" if limit is not None else ""), flush=True)
        status, took = run_group(group, launchable, args, env, out, limit)
        entry.update(status="ok" if status == 0 else ("stopped" if status is None else f"failed ({status})"),
                     seconds=round(took, 1))
        print(f"== {group}: {entry['status']} in {took:.0f} s (logs: {out}/{group}.log)", flush=True)
        write_summary(out, summary)
    failed = [entry["group"] for entry in summary["groups"] if entry["status"] not in ("ok", "nothing to run")]
    print(f"\ngpu-check: {'failed: ' + ', '.join(failed) if failed else 'every group ran'} in "
          f"{time.time() - started:.0f} s; summary in {out / 'summary.json'}", flush=True)
    return 1 if failed else 0


# The strategies' optional libraries (benchmark.py's STRATEGIES[...].needs): a row without its library is
# left out before it takes any of the budget.
NEEDS = {"deepspeed": "deepspeed", "horovod": "horovod", "accelerate": "accelerate", "fabric": "lightning_fabric"}


def cannot_run(unit, known, lists, device):
    """Why `unit` cannot run with this benchmark.py, Python and device, or None."""
    if unit.group in ("peaks", "tests"):
        return None
    if unit.group == "sweep" and not lists:
        return "this benchmark.py's --batch-size takes no list"
    for launch in unit.launches:
        row = launch.name if unit.group != "sweep" else launch.name.rsplit("-b", 1)[0]
        if row not in known:
            return f"{row} is not a row of this benchmark.py (benchmark.py --list)"
        strategy, gpu_only = known[row]
        if gpu_only and device == "cpu":
            return "GPU only: not launched on a CPU"
        if strategy in NEEDS and importlib.util.find_spec(NEEDS[strategy]) is None:
            return f"{NEEDS[strategy]} is not installed"
    return None


def run_group(group, units, args, env, out, limit):
    python = args.python
    if group == "peaks":
        command = [python, str(Path(__file__).resolve()), "--peaks", args.device, str(out / "peaks")]
        return launch(command, out / "peaks.log", limit, env)
    if group == "tests":
        workers = ["-n", "4"] if args.device == "cuda" else ["-n", "0"]
        tests = ["tests/test_gpu.py"] + (["tests/test_gpu_paths_on_cpu.py"] if args.device == "cpu" else [])
        command = [python, "-m", "pytest", *tests, "-rs", "-q", "-p", "no:cacheprovider", *workers]
        return launch(command, out / "tests.log", limit, env)
    work = WORK / group
    shutil.rmtree(work, ignore_errors=True)
    # On a CPU the H100's timeouts mean nothing: benchmark.py's own (30 minutes) applies.
    per_launch = group_timeout(units, group) if args.device == "cuda" else CPU_TIMEOUT
    command = [python, "benchmark.py", "--output-dir", str(work), "--model", args.model,
               "--max-steps", str(args.max_steps), "--timeout", str(per_launch), *args.passthrough]
    if group == "sweep":
        rows = SWEEP_ROWS
        command += ["--batch-size", ",".join(str(unit.batch) for unit in sorted(units, key=lambda u: u.batch))]
    else:
        rows = [unit.name for unit in units]
    command += ["--only", ",".join(rows)]
    return launch(command, out / f"{group}.log", limit, env, work, out / group)


def write_summary(out, summary):
    (out / "summary.json").write_text(json.dumps(summary, indent=2) + "\n", encoding="utf-8")


def measure_peaks(device, folder):
    """The matrix-product peak of each precision (microbenchmarks/matmul_peak.py), written after each."""
    sys.path.insert(0, str(ROOT))
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
        (folder / "peaks.json").write_text(json.dumps({"device": device, "peaks": peaks}, indent=2) + "\n",
                                           encoding="utf-8")
    return 1 if any("error" in peak for peak in peaks.values()) else 0


def main(argv):
    if argv[:1] == ["--peaks"]:
        return measure_peaks(argv[1], Path(argv[2]))
    execute = argv[:1] == ["--execute"]
    args = parse(argv[1:] if execute else argv)
    measured = h100_launches()
    the_plan = plan(args.groups, args.budget, measured, args.sweep, batch_size(args.passthrough))
    from_tables = ", ".join(str(path.relative_to(ROOT).parent) + "/" for path in sorted(ROOT.glob(H100_TABLES)))
    if not execute:
        print(describe(the_plan, args, from_tables))
        return 0
    return run(args, the_plan.kept)


if __name__ == "__main__":
    try:
        sys.exit(main(sys.argv[1:]))
    except PlanError as error:
        print(f"error: {error}", file=sys.stderr)
        sys.exit(2)
