"""benchmark.py: runs rows (strategies and their variants) with their launchers, interleaves repeats,
sweeps process counts, and reports (report.py) exactly what each run measured."""
import argparse
import importlib.util
import json
import re
import signal
import subprocess
import sys
import time

import pytest

import benchmark
from bench import estimate, options, provenance, rows
from bench import report as bench_report
from bench import run as bench_run
from support import cli, files, folder, launching, machine, models
from conftest import (CPU_ONLY, DEV_SAMPLES, PYTHON, ROOT, SAMPLES, processes_mentioning, read_result, run,
                      run_in_process)

# --device cpu goes through to every script; CPU_ONLY keeps the runner's own choices (process count,
# launcher options) on the CPU too, as on a machine without GPUs.
DATA = ["--model", "tiny", "--max-samples", str(SAMPLES), "--dev-ratio", "0.2", "--device", "cpu"]
# result.json key for each number of a benchmark.json row
SAME_AS_RESULT = {"processes": "world_size", "device": "device", "precision": "precision",
                  "precision_native": "precision_native", "threads_per_process": "threads_per_process",
                  "tokens_per_sample": "tokens_per_sample", "padded_tokens_per_sample": "padded_tokens_per_sample",
                  "global_batch": "global_batch_size", "train_seconds": "train_seconds",
                  "samples_per_second": "samples_per_second", "peak_memory_mb": "peak_memory_mb",
                  "dev_accuracy": "dev_accuracy", "dev_macro_f1": "dev_macro_f1", "dev_samples": "dev_samples"}


def load_report(output_dir):
    return json.loads((output_dir / "benchmark.json").read_text(encoding="utf-8"))


def table_line(text, name):
    return next(line for line in text.splitlines() if line.startswith(f"| {name} |"))


def answered_launches(monkeypatch, launched):
    """Each launch of benchmark.py run in this process answered at once by a result.json as its script
    writes one: the committed run's of its strategy, at the launch's process count and batch (the
    runner's options), `launched` the runs' train seconds in order of launch, 3 step shapes and 60% of the
    FLOPs on real tokens. A test of the runner's own part: the rows' launches are the profiled run's (warm)
    and the failing row's (real). Returns the launches: (row, command)."""
    committed = json.loads(estimate.REFERENCE_RUN.read_text(encoding="utf-8"))["rows"]
    launches = []

    def option(command, name, default):
        return int(command[command.index(name) + 1]) if name in command else default

    def launch_once(command, env, shown, run_dir, log, timeout):
        assert (ROOT / command[command.index("--output-dir") + 1]).resolve() == run_dir.resolve()
        processes, batch = option(command, "--nproc_per_node", 1), option(command, "--batch-size", 32)
        seconds = launched[len(launches)]
        launches.append((run_dir.name, command))
        template = next(row for row in committed if run_dir.name.startswith(f"{row['row']}-"))["runs"][0]
        result = {**template, "world_size": processes, "batch_size_per_process": batch,
                  "global_batch_size": batch * processes, "train_seconds": seconds,
                  "samples_per_second": round(32 * 11 * processes / seconds, 2), "dev_samples": DEV_SAMPLES,
                  "model": "tiny", "device": "cpu", "precision": "fp32", "step_shapes": 3, "real_flops_share": 0.6}
        files.write_json(run_dir / "result.json", result)
        return result, seconds + 5, None
    monkeypatch.setattr(bench_run, "launch_once", launch_once)
    return launches


def given_peaks(folder):
    """--matmul-peaks FILE, the committed run's peak in fp32 as scripts/gpu-check.sh writes peaks: none measured."""
    peaks = folder / "peaks.json"
    peaks.write_text(json.dumps({"device": "cpu", "peaks": {"fp32": {"tflops": 0.2149}}}), encoding="utf-8")
    return ["--matmul-peaks", str(peaks)]


def test_repeats_interleave_and_a_sweep_scales_each_row_against_its_own_one_process_run(tmp_path, monkeypatch):
    """ddp at 1 and 2 processes, twice each: 4 launches, answered in this process (answered_launches);
    single's place in a sweep: the test after. (The thread policy's every usable core for one process
    under an exported OMP_NUM_THREADS=1: the failing row's single; ddp at 1 process launched for real
    by the runner: test_gpu_plan.py's check on the CPU.)"""
    launches = answered_launches(monkeypatch, [10.0, 8.0, 11.0, 6.0])
    process = run_in_process(["benchmark.py", "--only", "ddp", "--nprocs", "1,2", "--repeat", "2", *DATA,
                              *given_peaks(tmp_path), "--output-dir", str(tmp_path)], env=CPU_ONLY)
    assert process.returncode == 0, process.stderr
    report = load_report(tmp_path)
    assert report["all_succeeded"] is True and report["model"] == "tiny" and report["counts"] == [1, 2]
    rows = {row["row"]: row for row in report["rows"]}
    assert list(rows) == ["ddp-n1", "ddp-n2"]
    # Round-robin: every row's first launch before any row's second (plain lines: output is not a terminal).
    assert [(name, command[command.index("--nproc_per_node") + 1]) for name, command in launches] == [
        ("ddp-n1", "1"), ("ddp-n2", "2")] * 2
    # Weak scaling: each process at its script's own batch of 32.
    assert not any("--batch-size" in command for _, command in launches)
    order = re.findall(r"^\[\d+/4\] (\S+) run (\d)/2: ok", process.stdout, re.M)
    assert order == [(name, repeat) for repeat in "12" for name in rows], process.stdout
    assert "\r" not in process.stdout and "\x1b" not in process.stdout

    for name, row in rows.items():
        assert row["status"] == "ok" and len(row["runs"]) == 2
        seconds = sorted(run["train_seconds"] for run in row["runs"])
        assert (row["train_seconds"], row["train_seconds_min"], row["train_seconds_max"]) == (
            seconds[0], seconds[0], seconds[1])  # the lower median of two, and the spread
        assert row["relative_spread"] == round((seconds[1] - seconds[0]) / seconds[0], 4)
        median = next(run for run in row["runs"] if run["train_seconds"] == row["train_seconds"])
        for key, result_key in SAME_AS_RESULT.items():
            assert row[key] == median[result_key], (name, key)
        assert [json.loads((tmp_path / name / f"result-{repeat}.json").read_text())["train_seconds"]
                for repeat in (1, 2)] == [run["train_seconds"] for run in row["runs"]]  # each launch's kept
    assert report["noise_floor"] == max(row["relative_spread"] for row in rows.values())

    ddp1, ddp2 = rows["ddp-n1"], rows["ddp-n2"]
    assert (ddp1["processes"], ddp2["processes"], ddp2["global_batch"]) == (1, 2, 64)  # weak scaling
    assert ddp2["speedup"] is None  # no single row to compare with
    assert ddp2["speedup_vs_1_process"] == round(ddp2["samples_per_second"] / ddp1["samples_per_second"], 3)
    assert ddp2["scaling_efficiency"] == round(ddp2["speedup_vs_1_process"] / 2, 3)

    table = (tmp_path / "benchmark.md").read_text(encoding="utf-8")
    assert f"noise floor: {report['noise_floor']:.1%}" in table and "Scaling:" in table
    line = table_line(table, "ddp-n2")
    for figure in (f"{ddp2['train_seconds']:.1f} ({ddp2['train_seconds_min']:.1f}-{ddp2['train_seconds_max']:.1f})",
                   f"{ddp2['samples_per_second']:.1f}", f"{ddp2['dev_accuracy']:.4f}", str(DEV_SAMPLES)):
        assert f" {figure} " in line, figure
    assert f"| ddp-n2 | 2 | {ddp2['samples_per_second']:.1f} | {ddp2['speedup_vs_1_process']:.2f}x |" in table
    assert report["git"]["commit"] and isinstance(report["git"]["modified"], bool)
    chart = (tmp_path / "benchmark.png").read_bytes()
    assert chart.startswith(b"\x89PNG") and len(chart) > 10_000
    assert not list(tmp_path.glob(".*tmp*")), "a temporary file was left behind"


def test_in_a_sweep_single_runs_once_and_speedups_are_over_it():
    args = options.parse_args(["--only", "single,ddp", "--nprocs", "1,2", "--repeat", "2"], gpus=0)
    assert [cell["row"] for cell in options.plan(args, gpus=0)] == ["single", "ddp-n1", "ddp-n2"]

    def row(name, strategy, nprocs, samples_per_second):
        return {"row": name, "variant": strategy, "strategy": strategy, "nprocs": nprocs, "processes": nprocs,
                "status": "ok",
                "samples_per_second": samples_per_second, "relative_spread": None}
    report = {"rows": [row("single", "single", 1, 100.0), row("ddp-n1", "ddp", 1, 90.0),
                       row("ddp-n2", "ddp", 2, 150.0)]}
    bench_run.add_figures(report)
    single, ddp1, ddp2 = report["rows"]
    assert (single["speedup"], ddp1["speedup"], ddp2["speedup"]) == (1.0, 0.9, 1.5)
    assert ddp2["speedup_vs_1_process"] == round(150 / 90, 3)
    assert ddp2["scaling_efficiency"] == round(ddp2["speedup_vs_1_process"] / 2, 3)
    assert "speedup_vs_1_process" not in single  # one device has no 1-process run of its own to scale from


def test_variants_stand_side_by_side_and_strategy_args_reach_only_their_strategy(profiled_benchmark):
    """conftest's profiled run: DeepSpeed's stages and a variant of one's own beside single and DDP,
    with --strategy-args deepspeed=--offload none (single-gpu-cls.py would refuse --offload, had it
    leaked there), fsdp=--no-reshard-after-forward and single=--gradient-checkpointing."""
    output, rows = profiled_benchmark
    assert [row["status"] for row in rows.values()] == ["ok"] * len(rows)
    assert "--offload" not in rows["single"]["command"] and "--offload" not in rows["ddp"]["command"]
    for row, option in (("fsdp", "--no-reshard-after-forward"), ("single", "--gradient-checkpointing")):
        assert rows[row]["command"].endswith(f" {option}")
        assert not any(option in rows[name]["command"] for name in rows if name != row)
    for stage in (1, 2):
        row = rows[f"deepspeed-zero{stage}"]
        assert row["command"].endswith(f"--offload none --zero-stage {stage}")
        assert row["zero_stage"] == read_result(output / f"deepspeed-zero{stage}")["zero_stage"] == stage
        assert row["precision"] == "fp32" and row["dev_samples"] == DEV_SAMPLES
    assert " --offload none --zero-stage 3 --deepspeed-config " in rows["zero3-sharded-all"]["command"]
    assert rows["zero3-sharded-all"]["zero_stage"] == 3
    table = (output / "benchmark.md").read_text(encoding="utf-8")
    assert "noise floor: not measured" in table
    assert table_line(table, "zero3-sharded-all").startswith(
        "| zero3-sharded-all | 2 | fp32 | 32 (2 micro-batches) |")
    # Every row's pace against the limit: its MFU against this CPU's measured matrix-product peak.
    report = json.loads((output / "benchmark.json").read_text())
    assert report["matmul_peaks"]["cpu fp32"]["tflops"] > 0
    for row in rows.values():
        assert row["first_step_seconds"] > 0 and row["steady_samples_per_second"] > 0
        assert 0 < row["mfu_measured"] < 1 and row["mfu"] is None
        # Each script's share of FLOPs on real tokens, its batches padded: the batch sweep's MFU columns.
        assert row["step_shapes"] >= 1 and 0 < row["mfu_measured_real"] < row["mfu_measured"]
        assert row["mfu_measured_real"] == pytest.approx(
            row["mfu_measured"] * read_result(output / row["row"])["real_flops_share"], abs=1e-4)
    assert "Throughput against the limit:" in table and "- measured peak, cpu fp32: " in table


def test_a_batch_sweep_runs_each_row_at_each_batch_and_charts_its_mfu(tmp_path, monkeypatch):
    """--batch-size 8,16: a row per batch size, each launched at its batch, with its step shapes and MFU on
    the real tokens beside MFU on those computed (a CPU: against the peak measured, here given), and the
    chart's panel of MFU per batch. Its 2 launches answered in this process (answered_launches); a real
    run's share of real tokens: the profiled run's rows (test_variants_stand_side_by_side_...)."""
    launches = answered_launches(monkeypatch, [5.0, 4.0])
    output = tmp_path / "out"
    process = run_in_process(["benchmark.py", "--only", "single", "--batch-size", "8,16", "--max-steps", "4",
                              *given_peaks(tmp_path), *DATA, "--output-dir", str(output)], env=CPU_ONLY)
    assert process.returncode == 0, process.stderr
    report = load_report(output)
    assert report["batch_sizes"] == [8, 16]
    rows = {row["row"]: row for row in report["rows"]}
    assert list(rows) == ["single-b8", "single-b16"]
    table = (output / "benchmark.md").read_text(encoding="utf-8")
    for batch, row, (name, command) in zip((8, 16), rows.values(), launches):
        assert name == row["row"] and command[command.index("--batch-size") + 1] == str(batch)
        assert command[command.index("--max-steps") + 1] == "4"
        assert row["batch_per_process"] == batch and row["step_shapes"] >= 1
        assert 0 < row["mfu_measured_real"] < row["mfu_measured"]  # padding is computed, not real
        assert row["mfu_measured_real"] == pytest.approx(row["mfu_measured"] * row["real_flops_share"], abs=1e-4)
        assert f"| {row['mfu_measured_real']:.1%} ({row['mfu_measured']:.1%}) |" in table
    assert bench_report.batch_chart in bench_report.chart_panels(report)
    assert [len(points) for points in bench_report.sweep_points(report).values()] == [2]


def test_a_failing_row_is_reported_and_the_others_still_run(tmp_path):
    """The runner's real launches (the profiled run's are warm): single under python, DDP under torchrun,
    from benchmark.py run in this process."""
    # A stale result from an earlier run must not be reported for a launch that fails.
    (tmp_path / "ddp").mkdir()
    (tmp_path / "ddp" / "result.json").write_text('{"train_seconds": 1.0}', encoding="utf-8")
    # Rank 1 exists only in the 2-process DDP run: the single-device run is untouched.
    # With OMP_NUM_THREADS=1 exported, as torchrun sets it for several processes: the thread policy
    # still gives the one process of single every usable core.
    process = run_in_process(["benchmark.py", "--only", "single,ddp", *DATA, "--output-dir", str(tmp_path)],
                             env={**CPU_ONLY, "SUITE_FAIL_AT": "1:2", "OMP_NUM_THREADS": "1"})

    assert process.returncode == 1, process.stdout + process.stderr
    assert "not all rows succeeded: ddp" in process.stderr
    report = load_report(tmp_path)
    single, ddp = report["rows"]
    assert report["all_succeeded"] is False
    assert single["status"] == "ok" and single["train_seconds"] == read_result(tmp_path / "single")["train_seconds"]
    assert single["threads_per_process"] == machine.usable_cores()
    assert ddp["status"] == "failed"
    assert ddp["reason"] == ("exit status 1: error: rank 1 failed: RuntimeError: "
                             "failure injected by SUITE_FAIL_AT at step 2")
    assert "train_seconds" not in ddp and not (tmp_path / "ddp" / "result.json").exists()
    assert "Traceback" in (tmp_path / "ddp.log").read_text(encoding="utf-8")  # the whole log is kept
    table = (tmp_path / "benchmark.md").read_text(encoding="utf-8")
    assert "failed: exit status 1: error: rank 1 failed" in table_line(table, "ddp")
    assert (tmp_path / "benchmark.png").is_file()
    # What the machine gave the row: its CPU time against wall x threads, the load, the other work's cores.
    share = single["machine_share"]
    assert share["cpu_seconds"] > 0 and 0 < share["cpu_share"] and share["threads"] == single["threads_per_process"]
    assert share["load_before"] >= 0 and share["other_cores"] >= 0 and 0 <= share["starved"] <= 1


def test_a_row_starved_by_other_work_is_said_in_the_table_and_the_header_and_by_how_much():
    """Over 10 s of wall, the machine was busy 20 CPU s, the row's 2 threads took 5 of them: other work
    held 1.5 of the 2 cores, the row lacked 75% of what it asked for."""
    before, after = launching.CpuTimes(100.0, 1.0, 0.0, 2.5), launching.CpuTimes(120.0, 1.0, 5.0, 3.5)
    share = bench_run.machine_share(before, after, 10.0, {"world_size": 1, "threads_per_process": 2})
    assert share == {"cpu_seconds": 5.0, "threads": 2, "cpu_share": 0.25, "load_before": 2.5, "load_after": 3.5,
                     "other_cores": 1.5, "starved": 0.75}
    report = json.loads((ROOT / "docs" / "results" / "amd-epyc-2-cores" / "benchmark.json").read_text(encoding="utf-8"))
    single = next(row for row in report["rows"] if row["row"] == "single")
    single["machine_share"] = share
    text = bench_report.markdown(report)
    assert table_line(text, "single").endswith(
        "| ok, starved: other work held 1.5 cores, the row lacked 75% of the 2 it asked for; its CPU time 25% of "
        "wall x threads, load 2.5 -> 3.5 |")
    assert "note: other work on this machine took CPU from single (status: starved, by how much)" in text
    single["machine_share"] = {**share, "other_cores": 0.1, "starved": 0.0}
    assert "starved" not in bench_report.terminal_report(report)


def test_the_paths_a_user_passes_on_are_in_the_users_folder_not_the_repository(tmp_path, monkeypatch):
    """The runner launches every script in the repository: a relative --data, --deepspeed-config or
    --model folder names the user's file, made absolute before the plan reads it (the data's size)."""
    (tmp_path / "data").mkdir()
    (tmp_path / "data" / "train.json").write_text(json.dumps([["今天 天气 真好", 5]] * 30), encoding="utf-8")
    (tmp_path / "ds.json").write_text("{}", encoding="utf-8")
    (tmp_path / "my-model").mkdir()
    monkeypatch.chdir(tmp_path)
    args = options.parse_args(["--max-samples", "20", "--data", "data/train.json", "--model", "my-model",
                               "--strategy-args", "deepspeed=--deepspeed-config ds.json"], gpus=0)
    assert args.passthrough == ["--data", str(tmp_path / "data" / "train.json")]
    assert args.strategy_options["deepspeed"] == ["--deepspeed-config", str(tmp_path / "ds.json")]
    assert args.model == str(tmp_path / "my-model")
    assert options.parse_args(["--model", "tiny"], gpus=0).model == "tiny"  # a keyword, not a folder
    with pytest.raises(cli.UserError, match=r"^--max-samples 100 asks for more records than the data has \(30\)"):
        options.parse_args(["--max-samples", "100", "--data=data/train.json"], gpus=0)


@pytest.mark.parametrize("options, message", [
    (["--only", "single,fsdp1"], "error: --only: unknown row fsdp1; choose from single,dataparallel,"),
    (["--global-batch", "64", "--nprocs", "1,2,3"], "error: --global-batch 64 does not split evenly over 3 processes"),
    (["--global-batch", "64", "--batch-size", "16"], "error: --global-batch sets each script's --batch-size"),
    (["--only", "single", "--skip", "single"], "error: --only and --skip leave no row to run"),
    (["--only", ""], "error: --only names no row; choose from"),
    (["--nprocs", "1,x"], "error: --nprocs takes process counts of at least 1"),
    (["--variant", "mine=fsdp1:--x"], "error: --variant mine: unknown strategy fsdp1"),
    (["--variant", "mine"], "error: --variant 'mine': write NAME=STRATEGY:\"OPTIONS\""),
    (["--strategy-args", "zero=--zero-stage 3"], "error: --strategy-args 'zero=--zero-stage 3': write STRATEGY="),
    (["--real-size", "--model", "tiny"], "error: --real-size trains --model base-shape, not tiny"),
    (["--real-size", "--nprocs", "3"], "error: --real-size runs 2 process(es) per row, 2,4 for the sharded ones"),
    (["--max-steps", "0"], "error: --max-steps must be at least 1, got 0"),
    (["--publish", "../x"], "error: --publish ../x: a suffix of lower-case letters, digits and dashes"),
    (["--nnodes", "1,0"], "error: --nnodes takes node counts of at least 1"),
    (["--batch-size", "32,0"], "error: --batch-size takes batch sizes of at least 1, like 2 or 1,2,4; got '32,0'"),
    (["--batch-size", "8,8"], "error: --batch-size 8,8: 8 given twice; each batch size makes its own rows"),
    (["--nprocs", "1,2,1"], "error: --nprocs 1,2,1: 1 given twice; each process count makes its own rows"),
    # Each script would refuse it, one launch after another.
    (["--only", "single,ddp", "--max-samples", "40", "--batch-size", "19"],
     "error: 1 row(s) would train on a global batch larger than the 37 training samples (ddp: 38)"),
    (["--global-batch", "64", "--batch-size", "16,32"], "error: --global-batch sets each script's --batch-size"),
    (["--nnodes", "2"], "error: --nnodes 2 runs each row across the nodes of a Slurm job: submit slurm/benchmark.sbatch"),
    (["--max-samples", "1"], "error: --max-samples must be at least 2, got 1"),
    (["--max-samples", "5"], "error: --max-samples 5 with --dev-ratio 0.08 leaves an empty dev set"),
    (["--max-samples", "50000"], "error: --max-samples 50000 asks for more records than the data has (40133)"),
    (["--timeout", "nan"], "error: --timeout must be a positive number of seconds, got nan"),
    (["--model", "/nope"], "error: model not found: /nope is neither a folder nor a hub id"),
])
def test_bad_options_fail_at_once_in_one_line(tmp_path, options, message):
    process = run_in_process(["benchmark.py", *options, "--output-dir", str(tmp_path)], env=CPU_ONLY)
    assert process.returncode == 2 and process.stderr.startswith(message), process.stderr
    assert "Traceback" not in process.stderr and not list(tmp_path.iterdir())


def test_an_output_dir_that_is_a_file_or_in_use_is_refused_in_one_line(tmp_path):
    path = tmp_path / "a-file"
    path.write_text("x", encoding="utf-8")
    process = run_in_process(["benchmark.py", "--output-dir", str(path)], env=CPU_ONLY)
    assert process.returncode == 2 and process.stderr == f"error: --output-dir {path} is a file, not a folder\n"
    # The runner locks its folder as the scripts do: a second one would replace the report and the row logs.
    import fcntl
    with open(tmp_path / folder.LOCK_FILE, "w", encoding="utf-8") as first:
        fcntl.flock(first, fcntl.LOCK_EX | fcntl.LOCK_NB)
        process = run_in_process(["benchmark.py", "--only", "single", "--output-dir", str(tmp_path)], env=CPU_ONLY)
    assert process.returncode == 2 and process.stderr == (f"error: --output-dir {tmp_path} is in use by another run: "
                                                          "wait for that run to end, or choose another --output-dir\n")


def test_more_processes_than_cores_are_said_before_the_first_launch(tmp_path, monkeypatch):
    def no_launch(*args):
        raise SystemExit("the launches would start here")
    monkeypatch.setattr(bench_run, "run_all", no_launch)
    cores = machine.usable_cores()
    process = run_in_process(["benchmark.py", "--only", "ddp", "--nprocs", str(cores + 1), "--model", "tiny",
                              "--output-dir", str(tmp_path)], env=CPU_ONLY)
    assert process.stderr.strip() == "the launches would start here"
    assert f"note: {cores + 1} processes exceed the {cores} usable cores" in process.stdout


def test_a_launch_dies_with_the_runner_even_when_the_runner_is_killed(tmp_path):
    """SIGKILL leaves the runner no time to stop the launch, which runs in a session of its own: the
    kernel sends the launch SIGTERM (prctl's parent-death signal) and the launchers pass it on."""
    pid_file = tmp_path / "launch.pid"
    launch = [PYTHON, "-c", f"import os, time; open({str(pid_file)!r}, 'w').write(str(os.getpid())); time.sleep(60)"]
    runner = subprocess.Popen([PYTHON, "-c", "import sys; from pathlib import Path; from bench import run; "
                               f"run.launch_once({launch!r}, {{}}, 'sleep', Path({str(tmp_path)!r}), "
                               f"Path({str(tmp_path / 'launch.log')!r}), 60)"], cwd=ROOT)
    deadline = time.monotonic() + 30
    while not pid_file.exists() or not pid_file.read_text():
        assert time.monotonic() < deadline and runner.poll() is None, "the launch never started"
        time.sleep(0.1)
    launched = int(pid_file.read_text())
    runner.kill()
    runner.wait()
    deadline = time.monotonic() + 10
    while launching.group_runs(launched):  # its own session: its process group is its pid
        assert time.monotonic() < deadline, "the launch outlived the runner"
        time.sleep(0.1)


def test_list_shows_every_row_and_a_variant_of_ones_own():
    process = run_in_process(["benchmark.py", "--list", "--variant", "mine=deepspeed:--zero-stage 1"])
    assert process.returncode == 0, process.stderr
    output = process.stdout
    for variant in rows.BUILT_IN_VARIANTS:
        assert re.search(rf"^  {re.escape(variant.name)} +{variant.strategy} ", output, re.M), variant.name
    assert re.search(r"^  mine +deepspeed +--zero-stage 1 +from the command line", output, re.M)


def options_for(row, gpus=0, nprocs=2, **overrides):
    values = dict(max_samples=None, epochs=None, max_steps=None, batch_size=None, global_batch=None, precision=None,
                  grad_accum=None, profile=None, passthrough=[], strategy_options={})
    args = argparse.Namespace(**{**values, **overrides})
    variants = {variant.name: variant for variant in rows.BUILT_IN_VARIANTS}
    return options.script_options(args, variants[row], rows.ROOT / "out", "tiny", gpus, nprocs, args.batch_size)


def test_every_launch_line_and_the_options_each_row_gets():
    lines = {name: entry.launch(entry.script, 2, 0) for name, entry in rows.STRATEGIES.items()}
    assert len(lines) == 11 and all(entry.script in lines[name] for name, entry in rows.STRATEGIES.items())
    assert lines["ddp"][:3] == [".venv/bin/torchrun", "--nproc_per_node", "2"] and lines["ddp"][4].isdigit()
    assert lines["fsdp"][:3] == lines["ddp"][:3] and lines["fsdp"][-1] == "multi-gpu-fsdp-cls.py"
    assert lines["fabric"][:6] == [".venv/bin/fabric", "run", "--accelerator", "cpu", "--devices", "2"]
    assert lines["ddp-spawn"][-2:] == ["--nprocs", "2"] and lines["ddp-amp"][-2:] == ["--nprocs", "2"]
    assert lines["horovod"][:6] == [".venv/bin/horovodrun", "-np", "2", "-H", "localhost:2", "--gloo"]
    assert lines["deepspeed"][:3] == [".venv/bin/deepspeed", "--num_gpus", "2"]
    assert "--multi_gpu" in lines["accelerate"]
    assert "--multi_gpu" not in rows.launch_accelerate("a.py", 1, 0)  # accelerate refuses it with 1 process
    assert "--gpu-ids" not in lines["dataparallel"]
    assert rows.launch_dataparallel("dp.py", 2, 2)[-2:] == ["--gpu-ids", "0,1"]

    def batch(row, gpus, nprocs=2, **sizes):
        options = options_for(row, gpus, nprocs, **sizes)
        return options[options.index("--batch-size"):][:2] if "--batch-size" in options else []

    # The same batch per device: DataParallel's one process splits its batch over its GPUs.
    assert batch("single", 0) == batch("ddp", 0) == batch("dataparallel", 0) == []  # the scripts' own 32
    assert batch("dataparallel", 2) == ["--batch-size", "64"]
    assert batch("ddp", 2, batch_size=16) == ["--batch-size", "16"]
    assert batch("dataparallel", 2, batch_size=16) == ["--batch-size", "32"]
    # The same global batch (strong scaling): per device, N / devices, at every process count.
    assert batch("single", 0, global_batch=64) == ["--batch-size", "64"]
    assert batch("deepspeed", 0, global_batch=64) == ["--batch-size", "32"]
    assert batch("deepspeed", 0, nprocs=4, global_batch=64) == ["--batch-size", "16"]
    assert batch("dataparallel", 2, global_batch=64) == ["--batch-size", "64"]
    # With accumulation each micro-batch is a share of it, and every row gets the option.
    assert batch("ddp", 0, global_batch=64, grad_accum=2) == ["--batch-size", "16"]
    assert options_for("fsdp", grad_accum=2)[-2:] == ["--grad-accum", "2"]
    assert options_for("ddp", profile=5)[-2:] == ["--profile", "5"]
    assert "--profile" not in options_for("hf-trainer", profile=5)  # transformers' own loop
    assert bench_report.global_batch_label({"global_batch": 64, "gradient_accumulation": 2}) == (
        "64 (2 micro-batches)")

    assert options_for("ddp", epochs=2, passthrough=["--lr", "1e-4"]) == [
        "--output-dir", "out", "--model", "tiny", "--epochs", "2", "--lr", "1e-4"]
    # --precision reaches the strategies that offer mixed precision, and only those.
    offered = {entry for entry in rows.STRATEGIES if "--precision" in options_for(entry, precision="bf16")}
    assert offered == {"ddp-amp", "deepspeed", "accelerate", "fsdp", "hf-trainer", "fabric"}
    # Per-strategy options reach every row of that strategy and no other; a variant's own come last.
    chosen = {"deepspeed": ["--offload", "none"]}
    assert options_for("deepspeed-zero3", strategy_options=chosen)[-4:] == ["--offload", "none", "--zero-stage", "3"]
    assert "--offload" not in options_for("ddp", strategy_options=chosen)


def test_across_nodes_each_row_runs_its_batch_file_on_the_first_nodes_of_the_job(monkeypatch):
    """slurm/benchmark.sbatch on 2 nodes with --nnodes 1,2: a row's batch file sees a job of that many
    nodes, one task per node for a launcher per node, one per process for Horovod's srun (a row per
    launcher runs on tests/test_several_machines.py's cluster)."""
    monkeypatch.setattr(options, "job_hosts", lambda option: ["gpu07", "gpu08"])
    args = options.parse_args(["--only", "single,dataparallel,ddp", "--nnodes", "1,2", "--nprocs", "4"], gpus=0)
    assert [cell["row"] for cell in options.plan(args, gpus=0)] == [
        "single", "dataparallel", "ddp-nodes1", "ddp-nodes2"]
    assert set(rows.BATCH_FILES) == {entry.launcher for entry in rows.STRATEGIES.values()
                                          if entry.distributed}
    command, env = rows.launch_across_nodes(rows.STRATEGIES["horovod"], 1, 4, rows.ROOT / "out",
                                                 args.hosts)
    assert command == ["bash", "slurm/horovod.sbatch"] and env["SCRIPT"] == "multi-gpu-horovod-cls.py"
    assert [env[name] for name in ("SLURM_JOB_NODELIST", "SLURM_NNODES", "SLURM_NTASKS", "SLURM_NTASKS_PER_NODE",
                                   "GPUS_PER_NODE", "OUTPUT_DIR")] == ["gpu07", "1", "4", "4", "4", "out"]
    command, env = rows.launch_across_nodes(rows.STRATEGIES["fsdp"], 2, 4, rows.ROOT / "out",
                                                 args.hosts)
    assert command == ["bash", "slurm/torchrun.sbatch"] and env["SCRIPT"] == "multi-gpu-fsdp-cls.py"
    assert env["MAX_RESTARTS"] == "0"  # a failing row fails, as on one machine
    assert [env[name] for name in ("SLURM_JOB_NODELIST", "SLURM_NNODES", "SLURM_NTASKS", "SLURM_NTASKS_PER_NODE")] == [
        "gpu07,gpu08", "2", "2", "1"]
    # The global batch is shared by every process of every node: 36 splits over 4, not over 2 x 4.
    with pytest.raises(cli.UserError, match=r"--global-batch 36 does not split evenly over 8 processes \(--nprocs 4 "
                                            r"x --nnodes 1,2\)"):
        options.parse_args(["--nnodes", "1,2", "--nprocs", "4", "--global-batch", "36"], gpus=0)
    with pytest.raises(cli.UserError, match="--nnodes 3: this Slurm job has 2 node"):
        options.parse_args(["--nnodes", "3"], gpus=0)


def test_a_launcher_not_beside_the_python_is_taken_from_the_path(tmp_path, monkeypatch):
    """A venv keeps its launchers beside its Python; a system Python, or wheels installed with --target
    (scripts/gpu-check.sh --wheels), put them on the PATH."""
    venv, elsewhere = tmp_path / "venv", tmp_path / "elsewhere"
    venv.mkdir(), elsewhere.mkdir()
    for launcher in (venv / "torchrun", elsewhere / "deepspeed"):
        launcher.write_text("#!/bin/sh\n")
        launcher.chmod(0o755)
    monkeypatch.setattr(rows, "BIN", venv)
    monkeypatch.setenv("PATH", str(elsewhere))
    assert rows.executable("torchrun") == str(venv / "torchrun")
    assert rows.executable("deepspeed") == str(elsewhere / "deepspeed")
    assert rows.executable("horovodrun") == str(venv / "horovodrun")  # nowhere: its row says so


def test_an_emulated_precision_and_the_zero_stage_are_marked_in_the_table():
    row = {"precision": "bf16", "precision_native": False, "device": "cpu"}
    assert bench_report.precision_label(row) == "bf16, emulated on this CPU"
    assert bench_report.precision_label({**row, "precision_native": True}) == "bf16"
    assert bench_report.row_label({"row": "deepspeed", "zero_stage": 2}) == "deepspeed (ZeRO-2)"
    assert bench_report.row_label({"row": "deepspeed-zero3", "zero_stage": 3}) == "deepspeed-zero3"


def test_more_processes_than_cores_are_said_to_prove_the_mechanics_not_the_speed():
    report = json.loads((ROOT / "docs" / "results" / "amd-epyc-2-cores" / "benchmark.json").read_text(encoding="utf-8"))
    report["machine"].update(cores=2, gpus=[])
    report["counts"] = [1, 2]
    assert not any("exceed" in line for line in bench_report.header_lines(report))
    report["counts"] = [1, 3, 4]
    assert bench_report.header_lines(report)[-1] == (
        "note: 3 and 4 processes exceed the 2 usable cores: those runs prove the mechanics, not the speed")


def test_each_column_names_its_statistic_and_the_header_which_launch_a_row_shows():
    """Of 2 launches the table shows the faster (summarize's lower median), not a median: the header says
    which; a column with a spread says so, and the throughput table's median step stands beside mean
    rates, each named."""
    report = json.loads((ROOT / "docs" / "results" / "amd-epyc-2-cores" / "benchmark.json").read_text(encoding="utf-8"))
    assert report["repeat"] == 2
    text = bench_report.markdown(report)
    assert "each row shows the faster of its 2 launches (the lower median of two) by training time" in text
    assert "| global batch | train s (min-max) | samples/s, whole loop | speed-up |" in text
    assert "| wall s (min-max) | options |" in text
    assert "| first step s | median steady step ms | mean samples/s over steady steps | mean tokens/s, whole loop |" in text
    report["repeat"] = 3
    assert "each row shows the median of its 3 launches by training time" in bench_report.markdown(report)
    report["repeat"] = 4
    assert "the median of its 4 launches (the lower of the middle two)" in bench_report.markdown(report)
    report["repeat"] = 1
    assert "| global batch | train s | samples/s, whole loop |" in bench_report.markdown(report)
    assert "(min-max)" not in bench_report.terminal_report(report)


def test_a_speedup_within_the_noise_floor_of_another_is_marked():
    def row(name, samples_per_second, seconds):
        return {"row": name, "variant": name, "strategy": "ddp" if name != "single" else "single", "nprocs": 2,
                "processes": 2, "status": "ok", "runs": [{}] * len(seconds), "samples_per_second": samples_per_second,
                "relative_spread": round((max(seconds) - min(seconds)) / sorted(seconds)[0], 4)}
    report = {"rows": [row("single", 100.0, [10.0, 10.5]), row("a", 120.0, [8.0, 8.2]), row("b", 124.0, [8.1, 8.3])]}
    bench_run.add_figures(report)
    assert report["noise_floor"] == 0.05
    single, a, b = report["rows"]
    assert a["indistinguishable_from"] == ["b"] and b["indistinguishable_from"] == ["a"]
    assert single["indistinguishable_from"] == []
    assert bench_report.speedup_cell(a) == "1.20x ~" and bench_report.speedup_cell(single) == "1.00x"


def test_missing_script_or_dependency_is_a_reason_not_a_crash(tmp_path):
    missing_script = rows.Entry("x", "no-such-script.py", "python", rows.launch_single)
    assert rows.why_not_ready(missing_script, "python") == "script no-such-script.py not found"
    missing_module = rows.Entry("x", "single-gpu-cls.py", "python", rows.launch_single,
                                     needs="no_such_module_here")
    assert "needs the Python module no_such_module_here" in rows.why_not_ready(missing_module, "python")

    log = tmp_path / "x.log"
    log.write_text("$ horovodrun ...\n[1]<stderr>:error: rank 1 failed: RuntimeError: boom\n"
                   "[0]<stderr>:error: rank 0 failed: RuntimeError: Connection closed by peer\n", encoding="utf-8")
    assert bench_run.failure_reason(log) == "error: rank 1 failed: RuntimeError: boom"
    log.write_text("Traceback (most recent call last):\nValueError: bad\nexit\n", encoding="utf-8")
    assert bench_run.failure_reason(log) == "ValueError: bad"


def test_a_row_whose_optional_library_is_missing_is_not_run_and_does_not_fail_the_run(tmp_path, monkeypatch,
                                                                                      capsys):
    """Horovod's build can fail while the rest installs: ./run.sh then lists its row as not run, with the
    reason, and exits 0 when the rows that could run succeeded. In this process, each launch answered by
    a committed run's result: the decision is the runner's, not the launches'."""
    committed = json.loads(estimate.REFERENCE_RUN.read_text(encoding="utf-8"))
    results = {row["row"]: row["runs"][0] for row in committed["rows"]}
    find_spec = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *rest: None if name == "horovod"
                        else find_spec(name, *rest))
    monkeypatch.setattr(bench_run, "launch_once", lambda command, env, shown, run_dir, log, timeout: (
        results[run_dir.name], 1.0, None))
    monkeypatch.setattr(benchmark, "measure_matmul_peaks", lambda rows, measured: {})
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "")
    monkeypatch.setattr(signal, "signal", lambda *args: None)

    def main(rows):
        monkeypatch.setattr(sys, "argv", ["benchmark.py", "--only", rows, *DATA, "--output-dir", str(tmp_path)])
        try:
            benchmark.main()
        except SystemExit as exit:
            return exit.code
        return 0

    assert main("single,horovod") == 0
    single, horovod = load_report(tmp_path)["rows"]
    assert single["status"] == "ok" and horovod["status"] == "not run"
    table = (tmp_path / "benchmark.md").read_text(encoding="utf-8")
    assert "| not run: needs the Python module horovod, which is not installed" in table_line(table, "horovod")
    # Alone, it leaves nothing measured: that run fails.
    assert main("horovod") == 1
    assert "no row ran: their libraries are not installed" in capsys.readouterr().err


def test_a_row_that_could_run_and_failed_still_fails_the_run():
    rows = [{"row": "single", "status": "ok"}, {"row": "horovod", "status": "not run"}]
    assert benchmark.unsuccessful(rows) is None
    for status in ("failed", "skipped"):  # a failed launch; a missing script or GPU
        assert benchmark.unsuccessful(rows + [{"row": "ddp", "status": status}]).startswith(
            "not all rows succeeded: ddp ")


def test_without_matplotlib_the_tables_are_written_and_the_chart_is_left_out(tmp_path, monkeypatch, capsys):
    """A GPU machine's own Python may lack matplotlib: the runs must not end in a traceback."""
    find_spec = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name: None if name == "matplotlib" else find_spec(name))
    committed = json.loads((ROOT / "docs/results/amd-epyc-2-cores/benchmark.json").read_text(encoding="utf-8"))
    benchmark.write_report(committed, tmp_path, final=True)
    assert sorted(path.name for path in tmp_path.iterdir()) == ["benchmark.json", "benchmark.md"]
    assert "benchmark.png not drawn: matplotlib is not installed" in capsys.readouterr().out


def test_every_published_run_is_whole_and_the_readme_quotes_one_with_a_noise_floor():
    """--publish copies a run's tables, JSON and chart to docs/results/<folder>/, which the pages link
    to; the run the README's table quotes was repeated, so it has a noise floor."""
    folders = sorted(path for path in (ROOT / "docs" / "results").iterdir() if path.is_dir())
    assert folders, "docs/results/ holds no published run"
    for folder in folders:
        assert all((folder / name).is_file() for name in ("benchmark.md", "benchmark.json", "benchmark.png")), folder
    assert json.loads(estimate.REFERENCE_RUN.read_text(encoding="utf-8"))["repeat"] >= 2
    assert "(docs/results/amd-epyc-2-cores/benchmark.md)" in (ROOT / "README.md").read_text(encoding="utf-8")


def test_more_processes_than_gpus_are_refused_before_any_launch():
    """Each process takes one GPU: on 2 GPUs a sweep to 4 would fail at its first 4-process row, after
    the others had run. CPU processes (--device cpu) have no such limit."""
    with pytest.raises(cli.UserError, match="--nprocs 1,2,4: this machine has 2 GPU"):
        options.parse_args(["--nprocs", "1,2,4"], gpus=2)
    assert options.parse_args(["--nprocs", "1,2"], gpus=2).counts == [1, 2]
    assert options.parse_args(["--nprocs", "4", "--device", "cpu"], gpus=2).counts == [4]
    assert options.parse_args(["--nprocs", "4"], gpus=0).counts == [4]


def test_without_a_gpu_the_runner_trains_the_tiny_model_unless_told_otherwise(monkeypatch):
    """Eleven rows of the real BERT on a laptop's CPU take hours: without GPUs and without --model the
    runner picks the tiny model and says why; a --model given, or GPUs, keep the scripts' choice."""
    monkeypatch.setattr(models, "resolve_model", lambda choice: "hub-model" if choice == "auto" else choice)
    model, note = provenance.choose_model(None, gpus=0)
    assert model == "tiny" and "no GPU" in note
    assert provenance.choose_model(None, gpus=1) == ("hub-model", None)
    assert provenance.choose_model("auto", gpus=0) == ("hub-model", None)


def test_the_header_versions_each_library_as_the_rows_import_it(monkeypatch):
    """The header read lightning-fabric's metadata while the fabric row imported lightning_fabric, which
    the whole lightning also installs: "not installed" beside a row that ran. Each module is versioned by
    the distributions that provide it, named where their name is not the module's."""
    installed = {"torch": "2.13.0", "lightning": "2.5.0", "lightning-fabric": "2.6.6"}

    def version(distribution):
        if distribution not in installed:
            raise provenance.metadata.PackageNotFoundError(distribution)
        return installed[distribution]
    monkeypatch.setattr(provenance.metadata, "version", version)
    monkeypatch.setattr(provenance, "importable", lambda module: module in ("torch", "lightning_fabric", "accelerate"))
    versions = provenance.library_versions({"torch": ["torch"], "lightning_fabric": ["lightning"],
                                            "horovod": ["horovod"]})
    assert versions["torch"] == "2.13.0"
    assert versions["lightning_fabric"] == "2.5.0 (lightning)"
    assert versions["horovod"] == "not installed"  # metadata left behind, no module
    assert versions["accelerate"] == "installed, no distribution metadata"
    both = provenance.library_versions({"lightning_fabric": ["lightning-fabric", "lightning"]})
    assert both["lightning_fabric"] == "2.6.6, 2.5.0 (lightning)"


def test_the_header_versions_this_environment_as_requirements_pins_them():
    pins = dict(line.split("#")[0].strip().split("==") for line in (ROOT / "requirements.txt").read_text().splitlines()
                if "==" in line.split("#")[0])
    versions = provenance.library_versions()
    assert versions["lightning_fabric"] == pins["lightning-fabric"]
    assert versions["torch"].split("+")[0] == pins["torch"]


def test_a_plan_whose_largest_count_leaves_too_few_steps_says_which_option_fixes_it():
    """One epoch of 9,200 samples is 36 steps at 8 GPUs x 32, 9 at 32: the runner warns before any launch,
    and each fix it names, applied, silences it; --max-steps below the threshold is the user's choice."""
    def warning(*argv, gpus=0):
        args = options.parse_args(list(argv), gpus)
        return estimate.few_steps_warning(args, options.plan(args, gpus), gpus)
    assert warning("--nprocs", "8", gpus=8) is None
    assert warning() is None
    line = warning("--nprocs", "32", "--device", "cpu")
    assert re.search(r"9 row\(s\) \(ddp, .*fewer than 20 optimizer steps, 9 at a global batch of 1,024 "
                     r"\(9,200 training", line)
    fixes = re.findall(r"(--epochs|--max-samples) (\d+)", line)
    assert [option for option, _ in fixes] == ["--epochs", "--max-samples"]
    less = {"--epochs": 1, "--max-samples": 1200}  # a global batch of 1,024 is 1,113 samples before the dev set
    for option, value in fixes:
        assert warning("--nprocs", "32", "--device", "cpu", option, value) is None
        assert warning("--nprocs", "32", "--device", "cpu", option, str(int(value) - less[option])) is not None
    assert warning("--nprocs", "8", "--batch-size", "32,128", gpus=8).count("dataparallel") == 1
    assert warning("--nprocs", "32", "--device", "cpu", "--max-steps", "5") is None
    # Half the samples held out for dev: no --max-samples of the data's 40,133 records is enough.
    assert "--max-samples" not in warning("--nprocs", "32", "--device", "cpu", "--dev-ratio", "0.5")


def test_the_plan_says_how_long_it_should_take(monkeypatch):
    """Before the first launch: the tiny model from the committed run's rows on 2 cores, a real-size
    model on a CPU from one timed step (hours), GPUs without an estimate."""
    reference = json.loads(estimate.REFERENCE_RUN.read_text(encoding="utf-8"))
    minutes = sum(row["wall_seconds"] for row in reference["rows"]) / 60
    args = options.parse_args([], gpus=0)
    cells = options.plan(args, gpus=0)
    assert len(cells) == len(reference["rows"]) == 11
    assert estimate.expected_duration(args, cells, "tiny", gpus=0).startswith(
        f"plan: 11 launch(es), about {minutes:.0f} minutes on 2 cores as in docs/results/amd-epyc-2-cores")
    twice = options.parse_args(["--repeat", "2", "--only", "single,deepspeed"], gpus=0)
    walls = {row["row"]: row["wall_seconds"] for row in reference["rows"]}
    assert f"about {(walls['single'] + walls['deepspeed']) * 2 / 60:.0f} minutes" in estimate.expected_duration(
        twice, options.plan(twice, gpus=0), "tiny", gpus=0)
    monkeypatch.setattr(estimate, "time_one_step", lambda args: 3.0)
    real = estimate.expected_duration(args, cells, "model_hub/chinese-bert-wwm-ext", gpus=0)
    hours = float(re.search(r"about ([\d.]+) hours", real).group(1))
    # 11 launches, each an epoch of 9,200 samples in batches of 32 at 3 s a batch over the cores.
    assert hours == pytest.approx(11 * (estimate.LAUNCH_SECONDS + 3.0 * 9200 / 32 / machine.usable_cores()) / 3600,
                                  abs=0.05)
    assert "--model tiny" in real
    assert estimate.expected_duration(args, cells, "auto", gpus=2) == (
        "plan: 11 launch(es) on 2 GPU(s); no estimate for GPUs yet")


def test_the_chart_draws_only_the_panels_the_run_has_figures_for():
    """A default run has no sweep and no profile: its chart must not show their panels empty."""
    row = {"status": "ok", "speedup": 1.0, "model_state_bytes": {"total": 1}}
    default = {"rows": [row], "counts": [2]}
    from bench.report import (accuracy_chart, chart_panels, memory_chart, mfu_chart, phase_chart,
                                  scaling_chart, speedup_chart, time_chart)
    assert chart_panels(default) == [time_chart, accuracy_chart, speedup_chart, memory_chart]
    swept = {"rows": [{**row, "speedup_vs_1_process": 1.8, "profile": {"phases_ms": {}}}], "counts": [1, 2]}
    assert chart_panels(swept)[-3:] == [scaling_chart, phase_chart, memory_chart]
    assert chart_panels({"rows": [{"status": "failed"}], "counts": [2]}) == [time_chart, accuracy_chart]
    measured = {"rows": [{**row, "first_step_seconds": 1.0, "mfu_measured": 0.1}], "counts": [2]}
    assert mfu_chart in chart_panels(measured)


def test_the_loss_panel_draws_each_rows_curve_step_by_step():
    """Every row with a loss curve (result.json's, the median run's) gets a line at its own steps, single's
    underneath the rest: where they train the same steps, the lines lie on one another."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from bench.report import chart_panels, loss_chart

    def row(name, strategy, loss, first_step=1, status="ok"):
        return {"row": name, "strategy": strategy, "status": status, "global_batch": 32, "precision": "fp32",
                "train_loss_curve": {"first_step": first_step, "loss": loss}}
    report = {"counts": [2], "rows": [row("single", "single", [1.8, 1.7, 1.5]), row("ddp", "ddp", [1.8, 1.7, 1.5]),
                                      row("fsdp", "fsdp", [1.6, 1.4], first_step=2),
                                      row("horovod", "horovod", [1.0, 2.0], status="failed"),
                                      row("deepspeed", "deepspeed", [1.8])]}
    assert loss_chart in chart_panels(report)
    figure, axis = plt.subplots()
    loss_chart(axis, report)
    lines = {line.get_label().split(":")[0]: (list(line.get_xdata()), list(line.get_ydata())) for line in axis.lines}
    plt.close(figure)
    assert lines == {"single": ([1, 2, 3], [1.8, 1.7, 1.5]), "ddp": ([1, 2, 3], [1.8, 1.7, 1.5]),
                     "fsdp": ([2, 3], [1.6, 1.4])}
    assert loss_chart not in chart_panels({"counts": [2], "rows": [row("single", "single", [1.8])]})


def test_the_report_presents_from_the_report_alone():
    """report.py reads the report dict (benchmark.json) and nothing else: no torch, no common."""
    loaded = run([PYTHON, "-c", "import sys, bench.report; print(sorted({'torch', 'common'} & set(sys.modules)))"])
    assert loaded.stdout.strip() == "[]"


def test_the_runner_plans_without_torch():
    """benchmark.py plans from support's cli, options, folder, files and task alone, --real-size's memory check
    included (the task's labels, base-shape's config): torch, and the modules that import it, load only for the
    run (timing a step, describing the machine, resolving the model)."""
    plan = ("import sys, benchmark; from bench import estimate, options; "
            "cells = options.plan(options.parse_args(['--nprocs', '1,2'], gpus=0), gpus=0); "
            "real = options.parse_args(['--real-size'], gpus=0); "
            "estimate.check_memory(options.plan(real, gpus=0), estimate.real_size_parameters(), 2**50); "
            "print(len(cells), sorted({'torch', 'common', 'support.machine', 'support.models'} & set(sys.modules)))")
    planned, loaded = run([PYTHON, "-c", plan]).stdout.split(maxsplit=1)
    assert int(planned) > 1 and loaded.strip() == "[]"


def test_a_stopped_launch_leaves_no_process_of_its_own(tmp_path):
    """As DeepSpeed's launch.py outlives the deepspeed command by seconds: the launcher ends at once on
    SIGTERM, a process it started takes a second to end, and the runner waits for that one too."""
    marker = str(tmp_path)
    slow_to_stop = f"trap 'sleep 1; exit' TERM; : {marker}; sleep 30 & wait"
    launch = subprocess.Popen(["bash", "-c", f'bash -c "{slow_to_stop}" & wait'], start_new_session=True)
    deadline = time.monotonic() + 10
    while not processes_mentioning(marker) and time.monotonic() < deadline:
        time.sleep(0.05)
    time.sleep(0.2)  # its trap set
    launching.stop(launch)
    assert processes_mentioning(marker) == []
