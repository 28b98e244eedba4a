"""Run every strategy with its own launcher on the same model and data, and compare them in one table.

    python benchmark.py                               # all eight: one process per GPU, or 2 on CPU
    python benchmark.py --only single,ddp,deepspeed --repeat 3
    python benchmark.py --global-batch 64             # the same global batch for every strategy
    python benchmark.py --max-samples 2000 --lr 5e-4  # options it does not know go to every script
    python benchmark.py --precision bf16              # mixed precision wherever a strategy offers it

Each strategy trains with the same model, data, seed, learning rate, epochs and batch per device
(per process; DataParallel's one process gets it times its GPUs), so the global batch grows with
the devices, unless --global-batch asks for the same global batch for all. Every row trains in
fp32 except ddp-amp, whose point is mixed precision, unless --precision asks for another for every
strategy that offers one. Each process takes an equal share of the machine's cores (the scripts'
thread policy), whatever its launcher sets. Every launch writes
its result.json under <output-dir>/<strategy>/ and its whole output to <output-dir>/<strategy>.log;
the runner reads the result files and writes the comparison as benchmark.md, benchmark.json and
benchmark.png in <output-dir>.

A strategy whose script or dependency is missing, or whose launch fails or times out, is listed
with its reason and the others still run. The exit status is 0 only when every requested strategy
succeeded.
"""
import argparse
import datetime
import importlib.util
import json
import os
import platform
import shlex
import signal
import socket
import statistics
import subprocess
import sys
import time
from dataclasses import dataclass
from importlib import metadata
from pathlib import Path
from typing import Callable

import torch

import common

ROOT = common.ROOT
# The launchers come from the same environment as this Python, so every strategy runs the same libraries.
BIN = Path(sys.executable).parent
VERSIONED = ["torch", "transformers", "accelerate", "deepspeed", "horovod"]
SCRIPT_BATCH_SIZE = common.build_parser(__file__, "").get_default("batch_size")


# ----------------------------------------------------------------------------- the strategies

def free_port():
    """A TCP port nobody listens on now, for the launcher's rendezvous (never a fixed 29500 that an
    earlier or parallel run may still hold)."""
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def relative(path):
    """`path` relative to the repository root when it lies inside it: shorter, copy-pastable commands."""
    path = Path(os.path.abspath(ROOT / path))  # abspath, not resolve: keep .venv/bin/python a venv path
    return str(path.relative_to(ROOT)) if path.is_relative_to(ROOT) else str(path)


def python():
    return relative(sys.executable)


def executable(name):
    return relative(BIN / name)


# Each function returns the command up to and including the script; --output-dir and the shared
# options follow it. `n` is --nprocs, `gpus` the number of GPUs torch sees.

def launch_single(script, n, gpus):
    return [python(), script]


def launch_dataparallel(script, n, gpus):
    # One process drives all the GPUs; on CPU there is nothing to split over and it runs alone.
    gpu_ids = ["--gpu-ids", ",".join(str(i) for i in range(n))] if gpus else []
    return [python(), script, *gpu_ids]


def launch_torchrun(script, n, gpus):
    return [executable("torchrun"), "--nproc_per_node", str(n), "--master_port", str(free_port()), script]


def launch_spawn(script, n, gpus):
    # The script starts its own processes with torch.multiprocessing and picks a free port itself.
    return [python(), script, "--nprocs", str(n)]


def launch_horovodrun(script, n, gpus):
    # --gloo: scripts/build-horovod.sh builds Horovod with Gloo as its only controller (no MPI).
    return [executable("horovodrun"), "-np", str(n), "-H", f"localhost:{n}", "--gloo", python(), script]


def launch_deepspeed(script, n, gpus):
    # Without GPUs DeepSpeed picks its CPU accelerator; --num_gpus then counts CPU processes.
    return [executable("deepspeed"), "--num_gpus", str(n), "--master_port", str(free_port()), script]


def launch_accelerate(script, n, gpus):
    # `accelerate launch` starts several processes only with --multi_gpu, on CPU too (--cpu starts one);
    # the script itself asks for CPU training when there is no GPU (see its docstring).
    several = ["--multi_gpu"] if n > 1 else []
    return [executable("accelerate"), "launch", "--num_processes", str(n), *several,
            "--main_process_port", str(free_port()), script]


@dataclass(frozen=True)
class Entry:
    name: str
    script: str
    launcher: str
    launch: Callable[[str, int, int], list]
    needs: str | None = None     # a Python module the strategy cannot run without
    splits_batch: bool = False   # one process splits its --batch-size over its GPUs (DataParallel)
    mixed_precision: bool = False  # the script takes --precision


STRATEGIES = {entry.name: entry for entry in [
    Entry("single", "single-gpu-cls.py", "python", launch_single),
    Entry("dataparallel", "multi-gpu-dataparallel-cls.py", "python", launch_dataparallel, splits_batch=True),
    Entry("ddp", "multi-gpu-distributed-cls.py", "torchrun", launch_torchrun),
    Entry("ddp-spawn", "multi-gpu-distributed-mp-cls.py", "python (mp.spawn)", launch_spawn),
    Entry("ddp-amp", "multi-gpu-distributed-mp-amp-cls.py", "python (mp.spawn)", launch_spawn, mixed_precision=True),
    Entry("horovod", "multi-gpu-horovod-cls.py", "horovodrun", launch_horovodrun, needs="horovod"),
    Entry("deepspeed", "multi-gpu-deepspeed-cls.py", "deepspeed", launch_deepspeed, needs="deepspeed",
          mixed_precision=True),
    Entry("accelerate", "multi-gpu-accelerate-cls.py", "accelerate launch", launch_accelerate, needs="accelerate",
          mixed_precision=True),
]}


def why_not_ready(entry, command):
    """The reason `entry` cannot be launched at all, or None."""
    if not (ROOT / entry.script).is_file():
        return f"script {entry.script} not found"
    if entry.needs and importlib.util.find_spec(entry.needs) is None:
        return f"needs the Python module {entry.needs}, which is not installed (scripts/setup-env.sh installs it)"
    launcher = ROOT / command[0]
    if not launcher.exists():
        return f"launcher {command[0]} not found"
    return None


# ----------------------------------------------------------------------------- command line

def parse_args():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter,
                                     epilog="Any other option goes to every script as it is (--lr, --seed, "
                                            "--dev-ratio, ...): `python single-gpu-cls.py --help` lists them.")
    parser.add_argument("--only", help=f"comma-separated strategies to run (default: all of {','.join(STRATEGIES)})")
    parser.add_argument("--skip", help="comma-separated strategies to leave out")
    parser.add_argument("--nprocs", type=int, default=torch.cuda.device_count() or 2,
                        help="processes (GPUs) per distributed strategy (default: all GPUs, or 2 without GPU: "
                             "%(default)s here)")
    parser.add_argument("--model", default="auto",
                        help="as the scripts' --model (default: auto, resolved once here and passed to all)")
    parser.add_argument("--max-samples", type=int, help="passed to every script (default: the scripts' 10000)")
    parser.add_argument("--epochs", type=int, help="passed to every script (default: the scripts' 1)")
    parser.add_argument("--repeat", type=int, default=1,
                        help="launches per strategy; the table shows the median run and the min-max spread "
                             "(default: 1)")
    parser.add_argument("--batch-size", type=int,
                        help="per device, for every strategy (default: the scripts' 32); DataParallel's "
                             "one process gets it times its GPUs")
    parser.add_argument("--global-batch", type=int,
                        help="the same global batch for all: per-device batch = N / devices")
    parser.add_argument("--precision", choices=common.PRECISIONS,
                        help="for every strategy that offers mixed precision (ddp-amp, deepspeed, accelerate); the "
                             "others stay in fp32 (default: the scripts' own: fp32, and for ddp-amp fp16 on GPUs, "
                             "bf16 on CPU)")
    parser.add_argument("--timeout", type=float, default=1800,
                        help="seconds one launch may take before it is killed (default: %(default)g)")
    parser.add_argument("--output-dir", default=str(ROOT / "output" / "benchmark"),
                        help="where the table, chart, logs and each run's files go (default: output/benchmark)")
    args, passthrough = parser.parse_known_args()
    return check_args(args, passthrough)


def names(option, value):
    chosen = [name.strip() for name in value.split(",") if name.strip()]
    unknown = [name for name in chosen if name not in STRATEGIES]
    if unknown:
        raise common.UserError(f"{option}: unknown strategy {', '.join(unknown)}; choose from {','.join(STRATEGIES)}")
    return chosen


def check_args(args, passthrough):
    for name in ("nprocs", "repeat", "max_samples", "epochs", "batch_size", "global_batch"):
        value = getattr(args, name)
        if value is not None and value < 1:
            raise common.UserError(f"--{name.replace('_', '-')} must be at least 1, got {value}")
    if args.timeout <= 0:
        raise common.UserError(f"--timeout must be positive, got {args.timeout:g}")
    only = names("--only", args.only) if args.only else list(STRATEGIES)
    skip = names("--skip", args.skip) if args.skip else []
    args.strategies = [STRATEGIES[name] for name in STRATEGIES if name in only and name not in skip]
    if not args.strategies:
        raise common.UserError("--only and --skip leave no strategy to run")
    if args.global_batch:
        if args.batch_size:
            raise common.UserError("--global-batch sets each script's --batch-size: pass one or the other")
        if args.global_batch % args.nprocs:
            raise common.UserError(f"--global-batch {args.global_batch} does not split evenly over "
                                   f"--nprocs {args.nprocs} processes")
    args.passthrough = passthrough
    args.output_dir = Path(args.output_dir).resolve()
    return args


def devices(entry, nprocs, gpus):
    """How many model replicas share each global batch."""
    if entry.name == "single" or (entry.splits_batch and not gpus):
        return 1
    return nprocs


def batch_options(args, entry, gpus):
    """--batch-size for the script, so that every device gets the same share of a batch."""
    replicas = devices(entry, args.nprocs, gpus)
    per_device = args.global_batch // replicas if args.global_batch else args.batch_size
    if entry.splits_batch and replicas > 1:
        return ["--batch-size", str((per_device or SCRIPT_BATCH_SIZE) * replicas)]
    return ["--batch-size", str(per_device)] if per_device else []


def script_options(args, entry, run_dir, model, gpus):
    """What every script gets after the launcher's part: the same options for all."""
    options = ["--output-dir", relative(run_dir), "--model", model]
    if args.max_samples:
        options += ["--max-samples", str(args.max_samples)]
    if args.epochs:
        options += ["--epochs", str(args.epochs)]
    if args.precision and entry.mixed_precision:
        options += ["--precision", args.precision]
    return options + batch_options(args, entry, gpus) + args.passthrough


# ----------------------------------------------------------------------------- running one launch

def stop(process):
    """End the launcher and every process it started (they share its session)."""
    for sig, grace in ((signal.SIGTERM, 15), (signal.SIGKILL, 5)):
        try:
            os.killpg(process.pid, sig)
        except ProcessLookupError:
            return
        try:
            process.wait(timeout=grace)
            return
        except subprocess.TimeoutExpired:
            pass


def failure_reason(log_path):
    """The first `error:` line a process printed (the cause; later ones are usually peers that lost
    their connection), else the last line that mentions an error, else the last line."""
    lines = [line.strip() for line in log_path.read_text(encoding="utf-8", errors="replace").splitlines()]
    lines = [line for line in lines if line and not line.startswith("$ ")]
    for line in lines:
        position = line.find("error: ")
        if position == 0 or (position > 0 and line[position - 1] in " :>]"):
            return line[position:]
    for line in reversed(lines):
        if "error" in line.lower() or "exception" in line.lower():
            return line
    return lines[-1] if lines else "no output"


def launch_once(command, run_dir, log_path, timeout):
    """Run one launch to its end; returns (result dict or None, wall seconds, reason of a failure)."""
    result_file = run_dir / "result.json"
    result_file.unlink(missing_ok=True)  # a failed launch must never report an earlier run's result
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    started = time.time()
    start = time.perf_counter()
    with open(log_path, "a", encoding="utf-8") as log:
        log.write(f"$ {shlex.join(command)}\n")
        log.flush()
        process = subprocess.Popen(command, cwd=ROOT, stdout=log, stderr=subprocess.STDOUT, env=env,
                                   stdin=subprocess.DEVNULL, start_new_session=True)
        try:
            code = process.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            stop(process)
            code = None
        except BaseException:
            stop(process)
            raise
    wall = time.perf_counter() - start
    with open(log_path, "a", encoding="utf-8") as log:
        log.write(f"$ # exit status {code}, {wall:.1f} s wall\n")
    if code is None:
        return None, wall, f"timed out after {timeout:g} s (--timeout)"
    if code != 0:
        return None, wall, f"exit status {code}: {failure_reason(log_path)}"
    if not result_file.is_file() or result_file.stat().st_mtime < started:
        return None, wall, f"exit status 0 but no fresh {relative(result_file)}"
    return json.loads(result_file.read_text(encoding="utf-8")), wall, None


def run_strategy(entry, args, model, gpus, announce):
    """Launch `entry` --repeat times; a row for the table, from the run with the median training time."""
    run_dir = args.output_dir / entry.name
    log_path = args.output_dir / f"{entry.name}.log"
    log_path.unlink(missing_ok=True)

    def new_command():  # each launch gets a new free port
        return entry.launch(entry.script, args.nprocs, gpus) + script_options(args, entry, run_dir, model, gpus)

    command = new_command()
    row = {"strategy": entry.name, "script": entry.script, "launcher": entry.launcher,
           "command": shlex.join(command), "log": relative(log_path)}
    reason = why_not_ready(entry, command)
    if reason:
        log_path.write_text(f"$ {shlex.join(command)}\nnot launched: {reason}\n", encoding="utf-8")
        announce(f"skipped: {reason}")
        return {**row, "status": "skipped", "reason": reason}
    runs = []
    for repeat in range(1, args.repeat + 1):
        if repeat > 1:
            command = new_command()
        result, wall, reason = launch_once(command, run_dir, log_path, args.timeout)
        if reason:
            announce(f"FAILED after {wall:.0f} s: {reason} (log: {relative(log_path)})")
            return {**row, "command": shlex.join(command), "status": "failed", "reason": reason,
                    "wall_seconds": round(wall, 2), "runs": runs}
        if args.repeat > 1:
            common.write_json(run_dir / f"result-{repeat}.json", result)
        runs.append({**result, "wall_seconds": round(wall, 2), "launch_command": shlex.join(command)})
        announce(f"run {repeat}/{args.repeat}: {result['train_seconds']:.1f} s training, {wall:.1f} s wall, "
                 f"dev accuracy {result['dev_accuracy']:.4f}")
    return {**row, "status": "ok", "reason": None, **summarize(runs)}


def summarize(runs):
    """The median run by training time (the lower middle one for an even count) and the spread."""
    median_seconds = statistics.median_low(run["train_seconds"] for run in runs)
    chosen = next(run for run in runs if run["train_seconds"] == median_seconds)
    return {
        "command": chosen["launch_command"],
        "launcher": chosen["launcher"],
        "processes": chosen["world_size"],
        "device": chosen["device"],
        "threads_per_process": chosen["threads_per_process"],
        "precision": chosen["precision"],
        "precision_native": chosen["precision_native"],
        "model": chosen["model"],
        "global_batch": chosen["global_batch_size"],
        "batch_per_process": chosen["batch_size_per_process"],
        "train_samples": chosen["train_samples"],
        "epochs": chosen["epochs"],
        "train_seconds": chosen["train_seconds"],
        "samples_per_second": chosen["samples_per_second"],
        "tokens_per_sample": chosen["tokens_per_sample"],
        "padded_tokens_per_sample": chosen["padded_tokens_per_sample"],
        "peak_memory_mb": chosen["peak_memory_mb"],
        "dev_accuracy": chosen["dev_accuracy"],
        "dev_macro_f1": chosen["dev_macro_f1"],
        "dev_samples": chosen["dev_samples"],
        "wall_seconds": chosen["wall_seconds"],
        "train_seconds_min": min(run["train_seconds"] for run in runs),
        "train_seconds_max": max(run["train_seconds"] for run in runs),
        "wall_seconds_min": min(run["wall_seconds"] for run in runs),
        "wall_seconds_max": max(run["wall_seconds"] for run in runs),
        "runs": runs,
    }


def add_speedups(rows):
    """Throughput over the single-device run's, measured in this same benchmark; none without it."""
    single = next((row for row in rows if row["strategy"] == "single" and row["status"] == "ok"), None)
    for row in rows:
        if row["status"] == "ok":
            row["speedup"] = round(row["samples_per_second"] / single["samples_per_second"], 3) if single else None


# ----------------------------------------------------------------------------- the machine

def cpu_model():
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def describe_machine():
    gpus = [torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())]
    counted = ", ".join(f"{gpus.count(name)} x {name}" for name in dict.fromkeys(gpus)) or "no GPU"
    cores = common.usable_cores()
    native = [p for p in ("bf16", "fp16") if common.computes_natively(p, torch.device("cpu"))]
    cpu = f"{cpu_model()} ({', '.join(native) + ' native' if native else 'no native bf16/fp16'})"
    return {"cpu": cpu_model(), "cores": cores, "cpu_native_16bit": native, "gpus": gpus,
            "summary": f"{cpu}, {cores} usable cores, {counted}"}


def library_versions():
    versions = {"python": platform.python_version()}
    for package in VERSIONED:
        try:
            versions[package] = metadata.version(package)
        except metadata.PackageNotFoundError:
            versions[package] = "not installed"
    return versions


def resolve_model(choice):
    """--model auto once, here, so that every strategy trains the same model (and says which)."""
    model = common.resolve_model(choice)
    if model == "tiny":
        note = ("the offline tiny BERT (2 layers, hidden 128, random weights): "
                "the figures compare strategies, not models")
        if choice == "auto":
            note += f"; chosen because {relative(common.LOCAL_MODEL_DIR)} is absent and the hub is unreachable"
        return model, note
    return model, None


# ----------------------------------------------------------------------------- the report

COLUMNS = ["strategy", "launcher", "processes", "threads", "device", "precision", "global batch", "train s",
           "samples/s", "speed-up", "tokens+pad", "peak MB", "dev acc", "macro-F1", "dev n", "wall s", "status"]


def spread(row, key, repeat):
    value = f"{row[key]:.1f}"
    return value if repeat == 1 else f"{value} ({row[key + '_min']:.1f}-{row[key + '_max']:.1f})"


def cells(row, repeat):
    if row["status"] != "ok":
        reason = row["reason"] if len(row["reason"]) <= 160 else row["reason"][:157] + "..."
        wall = f"{row['wall_seconds']:.1f}" if "wall_seconds" in row else ""
        return [row["strategy"], row["launcher"]] + [""] * (len(COLUMNS) - 4) + [wall, f"{row['status']}: {reason}"]
    return [row["strategy"], row["launcher"], str(row["processes"]), str(row["threads_per_process"]), row["device"],
            precision_label(row), str(row["global_batch"]), spread(row, "train_seconds", repeat),
            f"{row['samples_per_second']:.1f}", f"{row['speedup']:.2f}x" if row["speedup"] is not None else "n/a",
            f"{row['tokens_per_sample']:.1f}+{row['padded_tokens_per_sample']:.1f}", f"{row['peak_memory_mb']:.0f}",
            f"{row['dev_accuracy']:.4f}", f"{row['dev_macro_f1']:.4f}", str(row["dev_samples"]),
            spread(row, "wall_seconds", repeat), "ok"]


def precision_label(row):
    """The row's precision, marked when the device only emulates it: such a row measures the emulation."""
    if row["precision_native"]:
        return row["precision"]
    return f"{row['precision']}, emulated on this {'GPU' if row['device'].startswith('cuda') else 'CPU'}"


def header_lines(report):
    lines = [f"machine: {report['machine']['summary']}",
             "libraries: " + ", ".join(f"{name} {version}" for name, version in report["versions"].items()),
             f"model: {report['model']}" + (f", {report['model_note']}" if report["model_note"] else "")]
    done = [row for row in report["strategies"] if row["status"] == "ok"]
    batch = (f"global batch {report['global_batch']} for all" if report["global_batch"]
             else "the same batch per device for all, so the global batch grows with the devices")
    data = f"{done[0]['train_samples']} train samples, {done[0]['epochs']} epoch(s), " if done else ""
    precision = (f"--precision {report['precision']} where a strategy offers it, else fp32" if report["precision"]
                 else "fp32 except ddp-amp")
    lines.append(f"runs: {data}{batch}, {precision}, --nprocs {report['nprocs']}, "
                 f"{report['repeat']} launch(es) per strategy" +
                 (" (median run shown, min-max in brackets)" if report["repeat"] > 1 else "") +
                 f", finished {report['finished']}")
    return lines


LEGEND = ("threads: torch threads per process. train s: the training loop only (rank 0); wall s: the whole "
          "launch, start-up included. speed-up: samples/s over the single-device run's. tokens+pad: real tokens "
          "and padding computed per training sample. peak MB: GPU memory allocated by torch on CUDA, else peak "
          "resident memory of rank 0. dev n: dev samples evaluated. A precision 'emulated' is computed in "
          "software by this device: the row measures the emulation, not mixed precision.")


def markdown(report):
    def line(values):
        return "| " + " | ".join(value.replace("|", "\\|") for value in values) + " |"
    rows = report["strategies"]
    table = [line(COLUMNS + ["command"]), line(["---"] * (len(COLUMNS) + 1))]
    table += [line(cells(row, report["repeat"]) + [f"`{row['command']}`"]) for row in rows]
    return "\n".join(["# Benchmark", ""] + [f"- {text}" for text in header_lines(report)]
                     + [""] + table + ["", LEGEND, ""])


def terminal_table(report):
    rows = [COLUMNS] + [cells(row, report["repeat"]) for row in report["strategies"]]
    widths = [max(len(row[i]) for row in rows) for i in range(len(COLUMNS) - 1)] + [0]
    text = ["  ".join(value.ljust(width) for value, width in zip(row, widths)).rstrip() for row in rows]
    commands = [f"  {row['strategy']}: {row['command']}" for row in report["strategies"]]
    return "\n".join(header_lines(report) + [""] + text + ["", LEGEND, "commands:"] + commands)


def write_text(path, text):
    """Atomically, as common.write_json: a reader never sees half a file."""
    staging = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    staging.write_text(text, encoding="utf-8")
    os.replace(staging, path)


def chart(report, path):
    """Training and wall seconds, and dev accuracy, per strategy; failed ones marked as such."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = report["strategies"]
    labels = [row["strategy"] for row in rows]
    ok = [row["status"] == "ok" for row in rows]
    positions = range(len(rows))
    figure, (time_axis, accuracy_axis) = plt.subplots(1, 2, figsize=(13, 4.8))
    train = [row["train_seconds"] if good else 0 for row, good in zip(rows, ok)]
    wall = [row["wall_seconds"] if good else 0 for row, good in zip(rows, ok)]
    time_axis.bar([p - 0.2 for p in positions], train, 0.4, label="training loop")
    time_axis.bar([p + 0.2 for p in positions], wall, 0.4, label="whole launch (wall)", alpha=0.5)
    if report["repeat"] > 1:
        for p, row, good in zip(positions, rows, ok):
            if good:
                time_axis.plot([p - 0.2] * 2, [row["train_seconds_min"], row["train_seconds_max"]], color="black")
    time_axis.set_ylabel("seconds")
    time_axis.set_title("time per strategy (lower is better)")
    time_axis.legend()
    accuracy = [row["dev_accuracy"] if good else 0 for row, good in zip(rows, ok)]
    accuracy_axis.bar(list(positions), accuracy, 0.6, color="tab:green")
    # A model that always answers 其他 scores about this (data/README: 13,993 of 40,133 records).
    accuracy_axis.axhline(0.35, color="gray", linestyle="--", label="majority class (35% of the data)")
    accuracy_axis.legend(loc="upper right")
    accuracy_axis.set_ylim(0, 1)
    accuracy_axis.set_ylabel("dev accuracy")
    accuracy_axis.set_title("dev accuracy per strategy")
    for axis in (time_axis, accuracy_axis):
        axis.set_xticks(list(positions), labels, rotation=30, ha="right")
        for p, row, good in zip(positions, rows, ok):
            if not good:
                axis.text(p, 0, row["status"], rotation=90, ha="center", va="bottom", color="tab:red")
    figure.suptitle(f"{report['machine']['summary']} | model {report['model']}", fontsize=9)
    figure.tight_layout()
    staging = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    figure.savefig(staging, format="png", dpi=110)
    plt.close(figure)
    os.replace(staging, path)


def write_report(report, output_dir, final):
    add_speedups(report["strategies"])
    common.write_json(output_dir / "benchmark.json", report)
    write_text(output_dir / "benchmark.md", markdown(report))
    if final:
        chart(report, output_dir / "benchmark.png")


# ----------------------------------------------------------------------------- main

def main():
    # A launch runs in its own session, out of reach of signals sent to this one: on SIGTERM, as on
    # Ctrl-C, unwind so that launch_once stops the launch before this process exits.
    signal.signal(signal.SIGTERM, lambda signum, frame: sys.exit(128 + signum))
    args = parse_args()
    args.output_dir.mkdir(parents=True, exist_ok=True)
    gpus = torch.cuda.device_count()
    model, model_note = resolve_model(args.model)
    report = {
        "machine": describe_machine(),
        "versions": library_versions(),
        "model": relative(model) if Path(model).is_dir() else model,
        "model_note": model_note,
        "nprocs": args.nprocs,
        "repeat": args.repeat,
        "spread": "min-max over the repeats; the row is the run with the median training time",
        "global_batch": args.global_batch,
        "precision": args.precision,
        "passthrough": args.passthrough,
        "output_dir": relative(args.output_dir),
        "started": datetime.datetime.now().isoformat(timespec="seconds"),
        "finished": None,
        "all_succeeded": None,
        "strategies": [],
    }
    for line in header_lines(report)[:3]:
        print(line, flush=True)
    for index, entry in enumerate(args.strategies, 1):
        prefix = f"[{index}/{len(args.strategies)}] {entry.name}"
        print(f"{prefix}: {entry.launcher} {entry.script} ...", flush=True)
        row = run_strategy(entry, args, model, gpus, lambda message: print(f"{prefix}: {message}", flush=True))
        report["strategies"].append(row)
        report["finished"] = datetime.datetime.now().isoformat(timespec="seconds")
        write_report(report, args.output_dir, final=False)  # what finished so far survives an interruption
    report["all_succeeded"] = all(row["status"] == "ok" for row in report["strategies"])
    write_report(report, args.output_dir, final=True)
    print("\n" + terminal_table(report))
    print(f"\nwritten: {relative(args.output_dir)}/benchmark.md, benchmark.json, benchmark.png and a log per strategy")
    if not report["all_succeeded"]:
        failed = [row["strategy"] for row in report["strategies"] if row["status"] != "ok"]
        print(f"not all strategies succeeded: {', '.join(failed)} (the table and their logs say why)", file=sys.stderr)
        sys.exit(1)


if __name__ == "__main__":
    common.run(main)
