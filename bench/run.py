"""Launching the rows: round-robin over the repeats, each launch in its own session with a timeout,
its result.json summarised into a row of the report, and the matrix-product peaks the MFU needs."""
import json
import os
import shlex
import statistics
import sys
import time
from pathlib import Path

from tqdm import tqdm

from instruments import flops
from support import cli, files, launching

from . import report
from .options import not_runnable, script_options
from .rows import (BATCH_FILES, CANNOT_SPAN_NODES, ROOT, STRATEGIES, launch_across_nodes, library_missing, relative,
                   why_not_ready)


class LaunchProgress:
    """In a terminal, one updating line: the launch running and the time left for the whole
    benchmark. Otherwise (CI, a log file), one plain line per finished launch."""

    def __init__(self, total):
        self.interactive = sys.stdout.isatty()
        self.bar = tqdm(total=total, unit="launch", dynamic_ncols=True) if self.interactive else None
        self.total, self.done = total, 0

    def start(self, label):
        if self.bar:
            self.bar.set_description(label)

    def finish(self, label, message):
        self.done += 1
        if self.bar:
            self.bar.update()
            if not message.startswith("ok"):
                self.bar.write(f"{label}: {message}")
        else:
            print(f"[{self.done}/{self.total}] {label}: {message}", flush=True)

    def close(self):
        if self.bar:
            self.bar.close()


def run_all(args, cells, model, gpus, after_each):
    """Launch every cell --repeat times, round-robin: repeat 1 of every cell, then repeat 2, ...;
    `after_each()` runs after every launch (to keep the report up to date)."""
    progress = LaunchProgress(len(cells) * args.repeat)
    for cell in cells:
        (args.output_dir / f"{cell['row']}.log").unlink(missing_ok=True)
    try:
        for repeat in range(1, args.repeat + 1):
            for cell in cells:
                label = f"{cell['row']} run {repeat}/{args.repeat}"
                if cell["status"] in ("failed", "skipped", "not run"):
                    progress.finish(label, f"not run: {cell['status']}")
                    continue
                progress.start(label)
                progress.finish(label, launch_cell(args, cell, model, gpus))
                after_each()
    finally:
        progress.close()


def launch_cell(args, cell, model, gpus):
    """One launch of `cell`; its run is added to the cell, or the cell is marked failed or skipped."""
    variant, entry = args.variants[cell["variant"]], STRATEGIES[cell["strategy"]]
    run_dir, log_path = args.output_dir / cell["row"], args.output_dir / f"{cell['row']}.log"
    # Each launch gets a new free port.
    if args.node_counts and entry.launcher in BATCH_FILES:
        launcher, env = launch_across_nodes(entry, cell["nnodes"], cell["nprocs"], run_dir, args.hosts)
        launcher_file = launcher[1]  # bash's batch file
    else:
        launcher, env = entry.launch(entry.script, cell["nprocs"], gpus), {}
        launcher_file = launcher[0]
    command = launcher + script_options(args, variant, run_dir, model, gpus, cell["nnodes"] * cell["nprocs"],
                                        cell["batch_size"])
    cell["command"] = shlex.join([f"{name}={value}" for name, value in env.items()] + command)
    reason = (why_not_ready(entry, launcher_file) or not_runnable(variant, gpus)
              or (args.node_counts and CANNOT_SPAN_NODES.get(entry.name)))
    if reason:
        log_path.write_text(f"$ {cell['command']}\nnot launched: {reason}\n", encoding="utf-8")
        # An optional library left out is the set-up's news (its warning said why), not this run's failure;
        # nor is a row that cannot span nodes.
        cannot = library_missing(entry) or (args.node_counts and entry.name in CANNOT_SPAN_NODES)
        status = "not run" if cannot and (ROOT / entry.script).is_file() else "skipped"
        cell.update(status=status, reason=reason)
        return f"{status}: {reason}"
    result, wall, reason = launch_once(command, env, cell["command"], run_dir, log_path, args.timeout)
    if reason:
        cell.update(status="failed", reason=reason, wall_seconds=round(wall, 2))
        return f"FAILED after {wall:.0f} s: {reason} (log: {relative(log_path)})"
    if args.repeat > 1:
        files.write_json(run_dir / f"result-{len(cell['runs']) + 1}.json", result)
    cell["runs"].append({**result, "wall_seconds": round(wall, 2), "launch_command": cell["command"]})
    cell["status"] = "ok"
    starved = report.starved(result)  # said as it happens, and in the table
    return (f"ok, {result['train_seconds']:.1f} s training, {wall:.1f} s wall, "
            f"dev accuracy {result['dev_accuracy']:.4f}" + (f"; {report.starved_note(starved)}" if starved else ""))


def failure_reason(log_path):
    """The first `error:` line a process printed (the cause; later ones are usually peers that lost
    their connection), else the last line that mentions an error, else the last line."""
    lines = [line.strip() for line in launching.printed(log_path)]
    for line in lines:
        position = line.find("error: ")
        if position == 0 or (position > 0 and line[position - 1] in " :>]"):
            return line[position:]
    for line in reversed(lines):
        if "error" in line.lower() or "exception" in line.lower():
            return line
    return lines[-1] if lines else "no output"


def machine_share(before, after, wall, result):
    """How the machine was shared during a launch of `wall` seconds that wrote `result`: the CPU seconds
    its processes got against wall x the threads they asked for (world size x threads, at most the
    cores), the load before and after, the cores other work held on average, and the share of the
    asked cores it lacked for them (`starved`, 0 when it had them all)."""
    cores = os.cpu_count() or 1
    asked = min(result["world_size"] * result["threads_per_process"], cores)
    used = after.children - before.children
    share = {"cpu_seconds": round(used, 1), "threads": asked, "cpu_share": round(used / (wall * asked), 3),
             "load_before": round(before.load, 2), "load_after": round(after.load, 2), "other_cores": None,
             "starved": None}
    if before.busy is not None and after.busy is not None:
        other = max(0.0, after.busy - before.busy - used - (after.runner - before.runner)) / wall
        share.update(other_cores=round(other, 2), starved=round(max(0.0, 1 - (cores - other) / asked), 3))
    return share


def launch_once(command, env, shown, run_dir, log_path, timeout):
    """Run one launch (`command` with the variables `env`, `shown` as a shell line) to its end; returns
    (result dict or None, wall seconds, reason of a failure). The result holds machine_share's figures."""
    result_file = run_dir / "result.json"
    result_file.unlink(missing_ok=True)  # a failed launch must never report an earlier run's result
    started = time.time()
    code, wall, before, after, _ = launching.launch(command, log_path, timeout, ROOT, env, shown)
    if code is None:
        return None, wall, f"timed out after {timeout:g} s (--timeout)"
    if code != 0:
        return None, wall, f"exit status {code}: {failure_reason(log_path)}"
    if not result_file.is_file() or result_file.stat().st_mtime < started:
        return None, wall, f"exit status 0 but no fresh {relative(result_file)}"
    result = json.loads(result_file.read_text(encoding="utf-8"))
    return {**result, "machine_share": machine_share(before, after, wall, result)}, wall, None


# What a row copies from its chosen run's result.json under the same name: what every result has, then what
# only some have (None where absent), measure.Throughput's pace against the limit among them.
RESULT_FIELDS = ("launcher", "device", "threads_per_process", "precision", "precision_native", "model", "train_samples",
                 "epochs", "train_seconds", "samples_per_second", "tokens_per_sample", "padded_tokens_per_sample",
                 "peak_memory_mb", "dev_accuracy", "dev_macro_f1", "dev_samples", "wall_seconds")
OPTIONAL_FIELDS = ("zero_stage", "model_state_bytes", "model_state_formula_bytes", "profile", "collective_bytes",
                   "collective_formula_bytes", "train_loss_curve", "machine_share", "compiled", "compiled_graphs",
                   "cuda_graphs", "step_shapes", "pad_to_multiple_of", "compute_precision", "devices",
                   "first_step_seconds", "compile_seconds", "steady_steps", "steady_step_seconds",
                   "steady_samples_per_second", "real_tokens_per_second", "computed_tokens_per_second",
                   "model_flops_per_second", "steady_model_flops_per_second", "mfu", "mfu_real", "real_flops_share",
                   "peak_tflops", "peak_source", "mfu_note")


def summarize(cell):
    """The cell's median run by training time (the lower middle one for an even count) and the spread."""
    runs = cell["runs"]
    if cell["status"] != "ok":
        return cell
    median_seconds = statistics.median_low(run["train_seconds"] for run in runs)
    chosen = next(run for run in runs if run["train_seconds"] == median_seconds)
    seconds = [run["train_seconds"] for run in runs]
    return {
        **cell,
        "command": chosen["launch_command"],
        "processes": chosen["world_size"],
        "global_batch": chosen["global_batch_size"],
        "gradient_accumulation": chosen.get("gradient_accumulation_steps", 1),
        "batch_per_process": chosen["batch_size_per_process"],
        **{key: chosen[key] for key in RESULT_FIELDS},
        "train_seconds_min": min(seconds),
        "train_seconds_max": max(seconds),
        "relative_spread": round((max(seconds) - min(seconds)) / median_seconds, 4) if len(runs) > 1 else None,
        "wall_seconds_min": min(run["wall_seconds"] for run in runs),
        "wall_seconds_max": max(run["wall_seconds"] for run in runs),
        **{key: chosen.get(key) for key in OPTIONAL_FIELDS},
    }


def add_figures(report):
    """Speed-ups over single, scaling against each row's own 1-process run, the noise floor and
    which speed-ups it cannot tell apart."""
    rows = [row for row in report["rows"] if row["status"] == "ok"]
    single = next((row for row in rows if row["strategy"] == "single"), None)
    for row in rows:
        row["speedup"] = round(row["samples_per_second"] / single["samples_per_second"], 3) if single else None
        one = next((other for other in rows if other["variant"] == row["variant"] and other["processes"] == 1
                    and STRATEGIES[other["strategy"]].distributed), None)
        if one and STRATEGIES[row["strategy"]].distributed:
            row["speedup_vs_1_process"] = round(row["samples_per_second"] / one["samples_per_second"], 3)
            row["scaling_efficiency"] = round(row["speedup_vs_1_process"] / row["processes"], 3)
    spreads = [row["relative_spread"] for row in rows if row["relative_spread"] is not None]
    report["noise_floor"] = max(spreads) if spreads else None
    floor = report["noise_floor"]
    for row in rows:
        # Rows whose speed-ups differ by less than the noise floor: their order is not significant.
        row["indistinguishable_from"] = [
            other["row"] for other in rows
            if other is not row and floor is not None and row["speedup"] is not None
            and abs(row["speedup"] - other["speedup"]) / max(row["speedup"], other["speedup"]) < floor]


def read_matmul_peaks(path):
    """{"<device> <precision>": {"tflops"}} of a peaks.json that scripts/gpu-check.sh measured once for all
    its benchmark runs; a precision it lacks is not measured again (its row has no measured MFU)."""
    try:
        measured = json.loads(Path(path).read_text(encoding="utf-8"))
        return {f"{measured['device']} {precision}": peak for precision, peak in measured["peaks"].items()}
    except (OSError, ValueError, KeyError, TypeError, AttributeError) as error:
        raise cli.UserError(f"--matmul-peaks {path}: not a peaks.json of scripts/gpu-check.sh "
                            f"({type(error).__name__})") from None


def measure_matmul_peaks(rows, measured=None):
    """This machine's achievable matrix-product rate for each device and precision the rows computed in
    (microbenchmarks/matmul_peak.py, on all the cores or the first GPU), and each row's MFU against it;
    `measured` (read_matmul_peaks): the rates measured already, and no others."""
    from microbenchmarks import matmul_peak  # imports torch: for the run, not for the planning
    peaks = {}
    for row in rows:
        if row["status"] != "ok" or row.get("compute_precision") is None:
            continue
        device = "cuda" if row["device"].startswith("cuda") else "cpu"
        key = f"{device} {row['compute_precision']}"
        if key not in peaks and measured is not None:
            peaks[key] = measured.get(key, {"error": "not in --matmul-peaks"})
        if key not in peaks:
            try:
                peaks[key] = {"tflops": round(matmul_peak.measure(device, row["compute_precision"]), 4)}
            except (cli.UserError, RuntimeError) as error:
                peaks[key] = {"error": str(error).splitlines()[0] if str(error) else type(error).__name__}
        flop_per_second = row.get("steady_model_flops_per_second")
        mfu = flops.mfu(flop_per_second and flop_per_second / row["devices"], peaks[key].get("tflops"))
        if mfu is not None:
            row["mfu_measured"] = round(mfu, 4)
            row["mfu_measured_real"] = round(mfu * row["real_flops_share"], 4)
    return peaks
