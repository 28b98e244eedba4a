"""The benchmark's report, from the report that benchmark.py collects (benchmark.json holds the same):
the tables for the terminal and for Markdown with their legends, the chart, and publishing a run to
docs/results/. It measures and computes nothing: benchmark.py has done that."""
import importlib.util
import os
import re
import shutil
from pathlib import Path

from support import files

from . import traffic

ROOT = Path(__file__).resolve().parents[1]
RESULTS_DIR = ROOT / "docs" / "results"

# ----------------------------------------------------------------------------- the tables

# Each column one statistic, named where it is not a plain count: over the whole training loop, or over the
# steady steps (after the first); a median, or a rate of totals (samples / seconds: the mean rate).
MAIN_COLUMNS = ["row", "processes", "precision", "global batch", "train s", "samples/s, whole loop", "speed-up",
                "dev acc", "dev n", "status"]
DETAIL_COLUMNS = ["row", "strategy", "launcher", "threads", "device", "tokens+pad", "peak MB", "macro-F1", "wall s",
                  "options"]
SCALING_COLUMNS = ["row", "processes", "samples/s, whole loop", "speed-up vs 1 process", "scaling efficiency"]
MEMORY_COLUMNS = ["row", "processes", "weights MB", "gradients MB", "optimizer state MB", "model state MB",
                  "ZeRO formula MB", "peak MB", "beyond model state MB"]
PHASE_COLUMNS = ["row", "mean step ms", "data loading", "forward", "backward", "optimizer step", "exposed comm.",
                 "overlapped comm.", "collectives: ms per step (exposed), phase", "sent per step MB (ring)"]
THROUGHPUT_COLUMNS = ["row", "computes in", "step shapes", "first step s", "median steady step ms",
                      "mean samples/s over steady steps", "mean tokens/s, whole loop",
                      "mean model TFLOP/s over steady steps", "MFU real (computed), published peak",
                      "MFU real (computed), measured peak"]
MODEL_STATE_PARTS = ("parameters", "gradients", "optimizer_state")


def spread_columns(columns, repeat):
    """`columns` with the seconds that show a spread named so (train s, wall s), with --repeat."""
    return [f"{name} (min-max)" if repeat > 1 and name in ("train s", "wall s") else name for name in columns]


def shown_run(repeat):
    """Which launch of a row the tables show (run.summarize: the lower median by training time)."""
    if repeat == 2:
        return "the faster of its 2 launches (the lower median of two)"
    return f"the median of its {repeat} launches" + (" (the lower of the middle two)" if repeat % 2 == 0 else "")


def precision_label(row):
    """The row's precision, marked when the device only emulates it: such a row measures the emulation."""
    if row["precision_native"]:
        return row["precision"]
    return f"{row['precision']}, emulated on this {'GPU' if row['device'].startswith('cuda') else 'CPU'}"


def row_label(row):
    """The row's name, with the ZeRO stage when the name does not say it (the default deepspeed row)."""
    if row.get("zero_stage") is not None and "zero" not in row["row"]:
        return f"{row['row']} (ZeRO-{row['zero_stage']})"
    return row["row"]


def spread(row, key, repeat):
    value = f"{row[key]:.1f}"
    return value if repeat == 1 else f"{value} ({row[key + '_min']:.1f}-{row[key + '_max']:.1f})"


def speedup_cell(row):
    if row.get("speedup") is None:
        return "n/a"
    return f"{row['speedup']:.2f}x" + (" ~" if row["indistinguishable_from"] else "")


# A row whose processes lacked this share or more of the cores they asked for, other work holding them,
# was starved: the table and the header say so, and by how much (run.machine_share's figures).
STARVED = 0.1


def starved(row):
    """The row's machine_share where it was starved, else None."""
    share = row.get("machine_share")
    return share if share and (share.get("starved") or 0) >= STARVED else None


def starved_note(share):
    return (f"starved: other work held {share['other_cores']:.1f} cores, the row lacked {share['starved']:.0%} of "
            f"the {share['threads']} it asked for; its CPU time {share['cpu_share']:.0%} of wall x threads, load "
            f"{share['load_before']:.1f} -> {share['load_after']:.1f}")


def main_cells(row, repeat):
    if row["status"] != "ok":
        reason = row["reason"] or "not run yet"
        reason = reason if len(reason) <= 160 else reason[:157] + "..."
        return [row["row"]] + [""] * (len(MAIN_COLUMNS) - 2) + [f"{row['status']}: {reason}"]
    return [row_label(row), str(row["processes"]), precision_label(row), global_batch_label(row),
            spread(row, "train_seconds", repeat), f"{row['samples_per_second']:.1f}", speedup_cell(row),
            f"{row['dev_accuracy']:.4f}", str(row["dev_samples"]),
            f"ok, {starved_note(starved(row))}" if starved(row) else "ok"]


def global_batch_label(row):
    accumulation = row.get("gradient_accumulation", 1)
    return f"{row['global_batch']} ({accumulation} micro-batches)" if accumulation > 1 else str(row["global_batch"])


def detail_cells(row, repeat):
    if row["status"] != "ok":
        return [row["row"], row["strategy"], row["launcher"]] + [""] * (len(DETAIL_COLUMNS) - 4) + [
            " ".join(row["options"])]
    return [row_label(row), row["strategy"], row["launcher"], str(row["threads_per_process"]), row["device"],
            f"{row['tokens_per_sample']:.1f}+{row['padded_tokens_per_sample']:.1f}", f"{row['peak_memory_mb']:.0f}",
            f"{row['dev_macro_f1']:.4f}", spread(row, "wall_seconds", repeat), " ".join(row["options"])]


def scaling_cells(row):
    return [row_label(row), str(row["processes"]), f"{row['samples_per_second']:.1f}",
            f"{row['speedup_vs_1_process']:.2f}x", f"{row['scaling_efficiency']:.0%}"]


def memory_cells(row):
    held, formula = row["model_state_bytes"], row["model_state_formula_bytes"]
    stage = f" (stage {formula['zero_stage']})" if formula["zero_stage"] else ""
    return [row_label(row), str(row["processes"])] + [f"{held[part] / 2**20:.2f}" for part in MODEL_STATE_PARTS] + [
        f"{held['total'] / 2**20:.2f}", f"{formula['total'] / 2**20:.2f}{stage}", f"{row['peak_memory_mb']:.0f}",
        f"{row['peak_memory_mb'] - held['total'] / 2**20:.0f}"]


def phase_cells(row):
    profile = row["profile"]
    collectives = ", ".join(f"{name} {c['ms']:.1f} ({c['exposed_ms']:.1f}), {c['during']}"
                            for name, c in profile["collectives"].items())
    return [row_label(row), f"{profile['step_ms']:.1f}"] + [f"{ms:.1f}" for ms in profile["phases_ms"].values()] + [
        f"{profile['overlapped_communication_ms']:.1f}", collectives or "none",
        f"{profile['ring_bytes_per_step'] / 2**20:.2f}" if profile.get("ring_bytes_per_step") is not None else "n/a"]


def throughput_cells(row):
    def figure(key, form, scale=1):
        return form.format(row[key] * scale) if row.get(key) is not None else "n/a"
    def mfu(key):
        return f"{figure(key + '_real', '{:.1%}')} ({figure(key, '{:.1%}')})" if row.get(key) is not None else "n/a"
    graphs, cuda_graphs = row.get("compiled_graphs"), row.get("cuda_graphs")
    compiled = f", compiled ({graphs} graph{'s' * (graphs != 1)}" if row.get("compiled") else ""
    compiled += (f", {cuda_graphs} CUDA graphs)" if cuda_graphs is not None else ")") if compiled else ""
    return [row_label(row), f"{row['compute_precision']}{compiled}", figure("step_shapes", "{}"),
            figure("first_step_seconds", "{:.2f}"), figure("steady_step_seconds", "{:.1f}", 1000),
            figure("steady_samples_per_second", "{:.1f}"), figure("real_tokens_per_second", "{:.0f}"),
            figure("steady_model_flops_per_second", "{:.3g}", 1e-12), mfu("mfu"), mfu("mfu_measured")]


def throughput_rows(report):
    return [row for row in report["rows"] if row.get("first_step_seconds") is not None]


def peak_lines(report):
    """What each MFU column divides by."""
    lines = []
    for precision, peak in (report.get("matmul_peaks") or {}).items():
        lines.append(f"measured peak, {precision}: {peak['tflops']:.3f} TFLOP/s" if peak.get("tflops") else
                     f"measured peak, {precision}: not measured ({peak.get('error')})")
    published = {(row["compute_precision"], row["peak_tflops"], row["peak_source"])
                 for row in throughput_rows(report) if row.get("peak_tflops")}
    lines += [f"published peak, {precision}: {tflops:g} TFLOP/s per GPU ({source})"
              for precision, tflops, source in sorted(published)]
    return lines


def memory_rows(report):
    return [row for row in report["rows"] if row.get("model_state_bytes")]


def phase_rows(report):
    return [row for row in report["rows"] if row.get("profile")]


def scaling_rows(report):
    return [row for row in report["rows"] if row.get("speedup_vs_1_process") is not None]


def header_lines(report):
    git = report["git"]
    code = f"{git['commit'][:12]}{' (modified)' if git['modified'] else ''}" if git["commit"] else "not a git checkout"
    lines = [f"machine: {report['machine']['summary']}",
             "libraries: " + ", ".join(f"{name} {version}" for name, version in report["versions"].items()),
             f"code: commit {code}",
             f"model: {report['model']}" + (f", {report['model_note']}" if report["model_note"] else "")]
    done = [row for row in report["rows"] if row["status"] == "ok"]
    batch = (f"global batch {report['global_batch']} for all (strong scaling)" if report["global_batch"]
             else "the same batch per device for all, so the global batch grows with the devices (weak scaling)")
    data = f"{done[0]['train_samples']} train samples, {done[0]['epochs']} epoch(s), " if done else ""
    precision = (f"--precision {report['precision']} where a strategy offers it, else fp32" if report["precision"]
                 else "fp32 except ddp-amp")
    stop = f"--max-steps {report['max_steps']} then the whole dev set, " if report.get("max_steps") else ""
    nodes = f" on each of --nnodes {report['nnodes']} Slurm nodes" if report.get("nnodes") else ""
    lines.append(f"runs: {data}{stop}{batch}, {precision}, --nprocs {report['nprocs']}{nodes}, "
                 f"{report['repeat']} launch(es) per row" +
                 (f", interleaved; each row shows {shown_run(report['repeat'])} by training time, min-max of "
                  "its launches in brackets" if report["repeat"] > 1 else "") +
                 f", finished {report['finished']}")
    if report["noise_floor"] is None:
        lines.append("noise floor: not measured (one launch per row; --repeat 3 measures it)")
    else:
        lines.append(f"noise floor: {report['noise_floor']:.1%}, the largest (max - min) / shown run of any "
                     "row's training times; a speed-up marked ~ is within it of another row's: their order is not "
                     "significant")
    if oversubscription_note(report):
        lines.append(oversubscription_note(report))
    hungry = [row["row"] for row in report["rows"] if row["status"] == "ok" and starved(row)]
    if hungry:
        lines.append(f"note: other work on this machine took CPU from {', '.join(hungry)} (status: starved, by how "
                     "much): their times and the speed-ups with them are skewed; run again on an idle machine")
    return lines


def oversubscription_note(report):
    """A line where a CPU run starts more processes than the usable cores, else None."""
    oversubscribed = [count for count in report["counts"] if count > report["machine"]["cores"]]
    if oversubscribed and not report["machine"]["gpus"]:
        return (f"note: {' and '.join(map(str, oversubscribed))} processes exceed the {report['machine']['cores']} "
                "usable cores: those runs prove the mechanics, not the speed")
    return None


LEGEND = ("train s: the training loop only (rank 0). samples/s, whole loop: samples trained / train s. "
          "speed-up: that samples/s over the single-device run's. A precision marked 'emulated' is computed in "
          "software by this device: the row measures the emulation, not mixed precision. dev n: dev samples evaluated.")
DETAIL_LEGEND = ("threads: torch threads per process. tokens+pad: real tokens and the padding computed with them, "
                 "per training sample. peak MB: GPU memory allocated by torch on CUDA, else peak resident memory "
                 "of rank 0. wall s: the whole launch, start-up included.")
MEMORY_LEGEND = ("Model state held by each process at its optimizer step (rank 0), counted from its tensors: the "
                 "weights, the gradients and the optimizer state (Adam's moments, and the fp32 master weights "
                 "DeepSpeed keeps). ZeRO formula: what the ZeRO paper predicts for the row's stage, precision and "
                 "processes; docs/anatomy.md explains each difference. peak MB: as in the details (on a CPU the "
                 "process's peak resident memory, libraries included); beyond model state: peak MB - model state "
                 "(activations, buffers, communication buckets, and on a CPU the libraries).")
PHASE_LEGEND = ("Milliseconds per recorded step on rank 0 (--profile), the mean over the recorded steps: the "
                "phases add up to the step. Communication "
                "that runs while the process computes is overlapped; what the process waits for is exposed, and "
                "is taken out of the phase that waited.")
THROUGHPUT_LEGEND = ("The first step is timed apart: it pays the one-time costs (compilation with --compile, "
                     "loading the kernels of new shapes); a compiled row says how many graphs dynamo compiled while "
                     "training (a recompile or a graph break adds one). The steady steps are the later ones that "
                     "compiled no graph and recorded no CUDA graph: their median step, and their samples and model "
                     "FLOPs over their seconds, the mean rates. "
                     "step shapes: the distinct (batch, length) shapes trained (--pad-to-multiple-of). "
                     "tokens/s: real tokens (no padding) over the whole loop's seconds. Model FLOPs: the matrix "
                     "products of forward and backward at the shapes computed, padding included (flops.py); MFU "
                     "real counts only the FLOPs of the real tokens, each text at its own length. MFU: model FLOP/s "
                     "per "
                     "device over the device's peak for the precision the row computes in: the GPU's published dense "
                     "peak, and the matrix-product rate microbenchmarks/matmul_peak.py measures on this machine (on a CPU, "
                     "all its cores are the one device the processes share).")
SCALING_LEGEND = ("speed-up vs 1 process: samples/s over the same row's 1-process run's; scaling efficiency: that "
                  "speed-up / processes (100% is ideal).")


def markdown_table(columns, rows):
    def line(values):
        return "| " + " | ".join(value.replace("|", "\\|") for value in values) + " |"
    return [line(columns), line(["---"] * len(columns))] + [line(row) for row in rows]


def sections(report):
    """The tables after the main one that the run has figures for: (title, columns, cells, notes, legend)."""
    repeat = report["repeat"]
    return [section for section in [
        ("Throughput against the limit", THROUGHPUT_COLUMNS, [throughput_cells(r) for r in throughput_rows(report)],
         peak_lines(report), THROUGHPUT_LEGEND),
        ("Scaling", SCALING_COLUMNS, [scaling_cells(r) for r in scaling_rows(report)], [], SCALING_LEGEND),
        ("Model state per process", MEMORY_COLUMNS, [memory_cells(r) for r in memory_rows(report)], [], MEMORY_LEGEND),
        ("Step anatomy", PHASE_COLUMNS, [phase_cells(r) for r in phase_rows(report)], [], PHASE_LEGEND),
        *traffic.sections(report, row_label),
        ("Details", spread_columns(DETAIL_COLUMNS, repeat), [detail_cells(row, repeat) for row in report["rows"]], [],
         DETAIL_LEGEND),
    ] if section[2]]


def markdown(report):
    rows, repeat = report["rows"], report["repeat"]
    text = ["# Benchmark", ""] + [f"- {line}" for line in header_lines(report)] + [""]
    text += markdown_table(spread_columns(MAIN_COLUMNS, repeat), [main_cells(row, repeat) for row in rows])
    text += ["", LEGEND, ""]
    for title, columns, cells, notes, legend in sections(report):
        text += [f"{title}:", ""] + markdown_table(columns, cells) + [""]
        text += [f"- {note}" for note in notes] + [""] * bool(notes) + [legend, ""]
    text += ["Commands:", ""] + [f"- {row['row']}: `{row['command']}`" for row in rows if row.get("command")]
    return "\n".join(text) + "\n"


def terminal_table(columns, rows):
    rows = [columns] + rows
    widths = [max(len(row[i]) for row in rows) for i in range(len(columns))]
    return ["  ".join(value.ljust(width) for value, width in zip(row, widths)).rstrip() for row in rows]


def terminal_report(report):
    rows, repeat = report["rows"], report["repeat"]
    text = header_lines(report) + [""] + terminal_table(spread_columns(MAIN_COLUMNS, repeat),
                                                        [main_cells(row, repeat) for row in rows])
    text += ["", LEGEND]
    for title, columns, cells, notes, _ in sections(report):
        text += ["", f"{title[0].lower()}{title[1:]}:"] + terminal_table(columns, cells) + notes
    return "\n".join(text + ["", "commands:"] + [f"  {row['row']}: {row['command']}" for row in rows
                                                 if row.get("command")])


# ----------------------------------------------------------------------------- the chart

def chart(report, path):
    """The panels the run has figures for (chart_panels), three to a line."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    panels = chart_panels(report)
    columns = 2 if len(panels) in (2, 4) else min(3, len(panels))
    lines = -(-len(panels) // columns)
    figure, axes = plt.subplots(lines, columns, figsize=(6.4 * columns, 5.2 * lines), squeeze=False)
    for panel, axis in zip(panels, axes.flat):
        panel(axis, report)
    for axis in axes.flat[len(panels):]:
        axis.remove()
    figure.suptitle(f"{report['machine']['summary']} | model {report['model']}", fontsize=9)
    figure.tight_layout()
    staging = files.staged_name(path, "tmp")
    figure.savefig(staging, format="png", dpi=100)
    plt.close(figure)
    os.replace(staging, path)


def chart_panels(report):
    """Time and dev accuracy per row always; then, where the run has their figures, the training loss per
    step, the speed-up per row, the speed-up against processes (--nprocs 1,2,...), MFU, the batch sweep, the
    time per step by phase (--profile) and the model state per process."""
    shown = {loss_chart: loss_rows(report),
             speedup_chart: any(row.get("speedup") is not None for row in report["rows"]),
             scaling_chart: len(report["counts"]) > 1 and scaling_rows(report),
             mfu_chart: any(row.get("mfu") is not None or row.get("mfu_measured") is not None
                            for row in throughput_rows(report)),
             batch_chart: sweep_points(report), phase_chart: phase_rows(report), memory_chart: memory_rows(report)}
    return [time_chart, accuracy_chart] + [panel for panel, figures in shown.items() if figures]


def row_bars(axis, report, values, offset=0.0, **style):
    """One bar per row (shifted by `offset` from its label), a failed row marked with its status instead."""
    rows = report["rows"]
    positions = range(len(rows))
    axis.bar([p + offset for p in positions], [value if row["status"] == "ok" else 0
                                               for row, value in zip(rows, values)], **style)
    axis.set_xticks(list(positions), [row_label(row) if row["status"] == "ok" else row["row"] for row in rows],
                    rotation=30, ha="right", fontsize=8)
    for position, row in zip(positions, rows):
        if row["status"] != "ok":
            axis.text(position, 0, row["status"], rotation=90, ha="center", va="bottom", color="tab:red")


def time_chart(axis, report):
    rows = report["rows"]
    ok = [row["status"] == "ok" for row in rows]
    train = [row["train_seconds"] if good else 0 for row, good in zip(rows, ok)]
    wall = [row["wall_seconds"] if good else 0 for row, good in zip(rows, ok)]
    positions = range(len(rows))
    row_bars(axis, report, train, offset=-0.2, width=0.4, label="training loop")
    axis.bar([p + 0.2 for p in positions], wall, 0.4, label="whole launch (wall)", alpha=0.5)
    if report["repeat"] > 1:
        for p, row, good in zip(positions, rows, ok):
            if good:
                axis.plot([p - 0.2] * 2, [row["train_seconds_min"], row["train_seconds_max"]], color="black")
    axis.set_ylabel("seconds")
    axis.set_title("time per row (lower is better; black: min-max of the repeats)", fontsize=9)
    axis.legend()


def accuracy_chart(axis, report):
    row_bars(axis, report, [row.get("dev_accuracy") or 0 for row in report["rows"]], width=0.6, color="tab:green")
    # A model that always answers 其他 scores this on the default dev set (271 of its 800 samples).
    axis.axhline(271 / 800, color="gray", linestyle="--", label="always 'other' (33.9% of the default dev set)")
    axis.legend(loc="upper right")
    axis.set_ylim(0, 1)
    axis.set_ylabel("dev accuracy")
    axis.set_title("dev accuracy per row", fontsize=9)


def loss_rows(report):
    """The rows with a training loss for more than one step (result.json's train_loss_curve)."""
    return [row for row in report["rows"]
            if row["status"] == "ok" and len((row.get("train_loss_curve") or {}).get("loss", [])) > 1]


def loss_chart(axis, report):
    """Each row's loss over its global batch, step by step: rows at the same global batch and precision
    train the same steps, so their lines lie on one another (single's, thick and grey, underneath)."""
    for row in loss_rows(report):
        curve, single = row["train_loss_curve"], row["strategy"] == "single"
        steps = range(curve["first_step"], curve["first_step"] + len(curve["loss"]))
        style = {"color": "gray", "linewidth": 5, "alpha": 0.5, "zorder": 1} if single else {"linewidth": 1}
        axis.plot(steps, curve["loss"], label=f"{row_label(row)}: batch {row['global_batch']}, {row['precision']}",
                  **style)
    axis.set_xlabel("optimizer step")
    axis.set_ylabel("training loss (mean over the global batch)")
    axis.set_title("training loss per step: the rows of one global batch and precision share a line", fontsize=9)
    axis.legend(fontsize=7, ncol=2)


def speedup_chart(axis, report):
    row_bars(axis, report, [row.get("speedup") or 0 for row in report["rows"]], width=0.6, color="tab:purple")
    axis.axhline(1, color="gray", linestyle="--", label="single (1.00x)")
    axis.legend(loc="upper right")
    axis.set_ylabel("samples/s over the single row's")
    axis.set_title("speed-up per row (higher is better)", fontsize=9)


def mfu_chart(axis, report):
    rows = report["rows"]
    published = [100 * (row.get("mfu") or 0) for row in rows]
    measured = [100 * (row.get("mfu_measured") or 0) for row in rows]
    row_bars(axis, report, published, offset=-0.2, width=0.4, label="of the published peak")
    axis.bar([p + 0.2 for p in range(len(rows))], measured, 0.4, label="of the measured matmul peak")
    axis.set_ylabel("MFU, % (steady steps)")
    axis.set_title("model FLOPs utilisation per row (higher is better)", fontsize=9)
    axis.legend(fontsize=8)


def scaling_chart(axis, report):
    counts = report["counts"]
    axis.plot([1, counts[-1]], [1, counts[-1]], color="gray", linestyle="--", label="ideal")
    for variant in dict.fromkeys(row["variant"] for row in scaling_rows(report)):
        points = sorted((row["processes"], row["speedup_vs_1_process"]) for row in scaling_rows(report)
                        if row["variant"] == variant)
        axis.plot(*zip(*points), marker="o", label=variant)
    kind = "strong scaling: global batch fixed" if report["global_batch"] else "weak scaling: batch per process fixed"
    axis.set_title(f"speed-up vs processes ({kind})", fontsize=9)
    axis.set_xlabel("processes")
    axis.set_ylabel("samples/s over the same row's 1-process run")
    axis.set_xticks(counts)
    axis.legend(fontsize=8)


def sweep_points(report):
    """Each variant's (batch size, MFU on the real tokens) over a batch sweep (--batch-size 32,128,...):
    against the published peak where there is one, else the measured."""
    if len(report.get("batch_sizes") or []) < 2:
        return {}
    points = {}
    for row in throughput_rows(report):
        mfu = row.get("mfu_real") if row.get("mfu_real") is not None else row.get("mfu_measured_real")
        if mfu is not None:
            points.setdefault(row["variant"], []).append((row["batch_per_process"], 100 * mfu))
    return {variant: sorted(values) for variant, values in points.items()}


def batch_chart(axis, report):
    for variant, points in sweep_points(report).items():
        axis.plot(*zip(*points), marker="o", label=variant)
    axis.set_xscale("log", base=2)
    axis.set_xlabel("batch per process")
    axis.set_ylabel("MFU on the real tokens, % (steady steps)")
    axis.set_title("batch sweep: MFU rises while steps wait on launches, flattens once they fill the device",
                   fontsize=9)
    axis.legend(fontsize=8)


def stacked_bars(axis, labels, parts):
    """One bar per label, stacked from {part name: [value per label]}."""
    bottom = [0.0] * len(labels)
    for name, values in parts.items():
        axis.bar(range(len(labels)), values, 0.6, bottom=bottom, label=name)
        bottom = [b + v for b, v in zip(bottom, values)]
    axis.set_xticks(range(len(labels)), labels, rotation=30, ha="right", fontsize=8)
    axis.legend(fontsize=8)
    return bottom


def phase_chart(axis, report):
    rows = phase_rows(report)
    axis.set_title("time per step by phase, rank 0 (--profile; lower is better)", fontsize=9)
    axis.set_ylabel("milliseconds per step")
    phases = list(rows[0]["profile"]["phases_ms"])
    stacked_bars(axis, [row_label(row) for row in rows],
                 {phase: [row["profile"]["phases_ms"][phase] for row in rows] for phase in phases})


def memory_chart(axis, report):
    rows = memory_rows(report)
    axis.set_title("model state per process, rank 0 (black: the ZeRO formula)", fontsize=9)
    axis.set_ylabel("MB")
    stacked_bars(axis, [row_label(row) for row in rows],
                 {part.replace("_", " "): [row["model_state_bytes"][part] / 2**20 for row in rows]
                  for part in MODEL_STATE_PARTS})
    axis.scatter(range(len(rows)), [row["model_state_formula_bytes"]["total"] / 2**20 for row in rows], color="black",
                 marker="_", s=400, zorder=3)


def write(report, output_dir, final):
    """benchmark.md, and at the end of the run benchmark.png (where matplotlib is installed)."""
    files.write_text(output_dir / "benchmark.md", markdown(report))
    if final and importlib.util.find_spec("matplotlib") is None:
        print("benchmark.png not drawn: matplotlib is not installed here (pip install -r requirements.txt)")
    elif final:
        chart(report, output_dir / "benchmark.png")


# ----------------------------------------------------------------------------- publishing

def publish(report, output_dir, suffix=""):
    """Copy the run's tables, JSON and chart to docs/results/<folder>/: the record the pages link to."""
    target = RESULTS_DIR / results_folder(report, suffix)
    target.mkdir(parents=True, exist_ok=True)
    for name in ("benchmark.md", "benchmark.json", "benchmark.png"):
        shutil.copyfile(output_dir / name, target / name)
    return f"{target.relative_to(ROOT)}/"


def results_folder(report, suffix=""):
    """<machine>[-<model>][-<suffix>]: a real-size run keeps its own folder beside the machine's tiny-model one."""
    model = "" if report["model"] == "tiny" else f"-{Path(report['model']).name}"
    return machine_slug(report["machine"]) + model + (f"-{suffix}" if suffix else "")


def machine_slug(machine):
    """A folder name for the machine's published results, e.g. amd-epyc-2-cores."""
    if machine["gpus"]:
        name = f"{len(machine['gpus'])}x-{machine['gpus'][0]}"
    else:
        name = f"{machine['cpu']}-{machine['cores']}-cores"
    return re.sub(r"[^a-z0-9]+", "-", name.lower()).strip("-")
