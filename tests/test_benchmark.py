"""benchmark.py: runs strategies with their launchers and reports exactly what each run measured."""
import argparse
import json

import pytest

import benchmark
from conftest import DEV_SAMPLES, PYTHON, SAMPLES, read_result, run

# Two launches per runner test: the single-device baseline and DDP under torchrun.
RUNNER = [PYTHON, "benchmark.py", "--only", "single,ddp", "--nprocs", "2",
          "--model", "tiny", "--max-samples", str(SAMPLES), "--dev-ratio", "0.2"]
# result.json key for each number of a benchmark.json row
SAME_AS_RESULT = {"processes": "world_size", "device": "device", "precision": "precision",
                  "precision_native": "precision_native", "threads_per_process": "threads_per_process",
                  "tokens_per_sample": "tokens_per_sample", "padded_tokens_per_sample": "padded_tokens_per_sample",
                  "global_batch": "global_batch_size", "train_seconds": "train_seconds",
                  "samples_per_second": "samples_per_second", "peak_memory_mb": "peak_memory_mb",
                  "dev_accuracy": "dev_accuracy", "dev_macro_f1": "dev_macro_f1", "dev_samples": "dev_samples"}


def load_report(output_dir):
    return json.loads((output_dir / "benchmark.json").read_text(encoding="utf-8"))


def test_runner_writes_table_json_and_chart_from_each_runs_result(tmp_path):
    process = run([*RUNNER, "--output-dir", str(tmp_path)], timeout=900)

    report = load_report(tmp_path)
    assert report["all_succeeded"] is True and report["model"] == "tiny" and report["nprocs"] == 2
    rows = {row["strategy"]: row for row in report["strategies"]}
    assert list(rows) == ["single", "ddp"]
    for name, row in rows.items():
        result = read_result(tmp_path / name)
        assert row["status"] == "ok" and row["reason"] is None
        for key, result_key in SAME_AS_RESULT.items():
            assert row[key] == result[result_key], (name, key)
        assert row["dev_samples"] == DEV_SAMPLES and row["wall_seconds"] > row["train_seconds"] > 0
        assert row["precision"] == "fp32" and row["precision_native"] is True
        assert len(row["runs"]) == 1 and (tmp_path / f"{name}.log").is_file()
    assert rows["single"]["processes"] == 1 and rows["single"]["global_batch"] == 32
    assert rows["ddp"]["processes"] == 2 and rows["ddp"]["global_batch"] == 64
    assert rows["single"]["speedup"] == 1.0
    assert rows["ddp"]["speedup"] == round(rows["ddp"]["samples_per_second"] / rows["single"]["samples_per_second"], 3)
    assert rows["ddp"]["command"].startswith(".venv/bin/torchrun --nproc_per_node 2 --master_port ")
    assert f"--output-dir {tmp_path / 'ddp'}" in rows["ddp"]["command"]
    assert rows["ddp"]["command"].endswith(f"--model tiny --max-samples {SAMPLES} --dev-ratio 0.2")

    # The Markdown table and the terminal show the same figures, with the machine and the model.
    table = (tmp_path / "benchmark.md").read_text(encoding="utf-8")
    assert "machine: " in table and "cores" in table and "torch " in table and "model: tiny" in table
    for name, row in rows.items():
        line = next(line for line in table.splitlines() if line.startswith(f"| {name} |"))
        for figure in (f"{row['train_seconds']:.1f}", f"{row['samples_per_second']:.1f}", f"{row['dev_accuracy']:.4f}",
                       f"{row['dev_macro_f1']:.4f}", f"{row['wall_seconds']:.1f}", f"`{row['command']}`",
                       f"{row['tokens_per_sample']:.1f}+{row['padded_tokens_per_sample']:.1f}",
                       f"{row['processes']} | {row['threads_per_process']}"):
            assert f" {figure} |" in line, (name, figure)
        assert any(l.startswith(f"{name} ") and f"{row['dev_accuracy']:.4f}" in l for l in process.stdout.splitlines())
    chart = (tmp_path / "benchmark.png").read_bytes()
    assert chart.startswith(b"\x89PNG") and len(chart) > 10_000
    assert not list(tmp_path.glob(".*tmp*")), "a temporary file was left behind"


def test_a_failing_strategy_is_reported_and_the_others_still_run(tmp_path):
    # A stale result from an earlier run must not be reported for a launch that fails.
    (tmp_path / "ddp").mkdir()
    (tmp_path / "ddp" / "result.json").write_text('{"train_seconds": 1.0}', encoding="utf-8")
    # Rank 1 exists only in the 2-process DDP run: the single-device run is untouched.
    process = run([*RUNNER, "--output-dir", str(tmp_path)], env={"SUITE_FAIL_AT": "1:2"}, check=False, timeout=900)

    assert process.returncode == 1, process.stdout + process.stderr
    assert "not all strategies succeeded: ddp" in process.stderr
    report = load_report(tmp_path)
    single, ddp = report["strategies"]
    assert report["all_succeeded"] is False
    assert single["status"] == "ok" and single["train_seconds"] == read_result(tmp_path / "single")["train_seconds"]
    assert ddp["status"] == "failed"
    assert ddp["reason"] == ("exit status 1: error: rank 1 failed: RuntimeError: "
                             "failure injected by SUITE_FAIL_AT at step 2")
    assert "train_seconds" not in ddp and not (tmp_path / "ddp" / "result.json").exists()
    assert "Traceback" in (tmp_path / "ddp.log").read_text(encoding="utf-8")  # the whole log is kept
    table = (tmp_path / "benchmark.md").read_text(encoding="utf-8")
    ddp_line = next(line for line in table.splitlines() if line.startswith("| ddp |"))
    assert "failed: exit status 1: error: rank 1 failed" in ddp_line
    assert (tmp_path / "benchmark.png").is_file()


@pytest.mark.parametrize("options, message", [
    (["--only", "single,fsdp"], "error: --only: unknown strategy fsdp; choose from single,dataparallel,"),
    (["--global-batch", "33", "--nprocs", "2"], "error: --global-batch 33 does not split evenly over --nprocs 2"),
    (["--global-batch", "64", "--batch-size", "16"], "error: --global-batch sets each script's --batch-size"),
    (["--only", "single", "--skip", "single"], "error: --only and --skip leave no strategy to run"),
])
def test_bad_options_fail_at_once_in_one_line(tmp_path, options, message):
    process = run([PYTHON, "benchmark.py", *options, "--output-dir", str(tmp_path)], check=False, timeout=120)
    assert process.returncode == 2 and process.stderr.startswith(message), process.stderr
    assert "Traceback" not in process.stderr and not list(tmp_path.iterdir())


def test_every_launch_line_and_the_batch_per_device():
    lines = {name: entry.launch(entry.script, 2, 0) for name, entry in benchmark.STRATEGIES.items()}
    assert len(lines) == 8 and all(entry.script in lines[name] for name, entry in benchmark.STRATEGIES.items())
    assert lines["ddp"][:3] == [".venv/bin/torchrun", "--nproc_per_node", "2"] and lines["ddp"][4].isdigit()
    assert lines["ddp-spawn"][-2:] == ["--nprocs", "2"] and lines["ddp-amp"][-2:] == ["--nprocs", "2"]
    assert lines["horovod"][:6] == [".venv/bin/horovodrun", "-np", "2", "-H", "localhost:2", "--gloo"]
    assert lines["deepspeed"][:3] == [".venv/bin/deepspeed", "--num_gpus", "2"]
    assert "--multi_gpu" in lines["accelerate"]
    assert "--multi_gpu" not in benchmark.launch_accelerate("a.py", 1, 0)  # accelerate refuses it with 1 process
    assert "--gpu-ids" not in lines["dataparallel"]
    assert benchmark.launch_dataparallel("dp.py", 2, 2)[-2:] == ["--gpu-ids", "0,1"]

    def batch(strategy, gpus, batch_size=None, global_batch=None):
        args = argparse.Namespace(nprocs=2, batch_size=batch_size, global_batch=global_batch)
        return benchmark.batch_options(args, benchmark.STRATEGIES[strategy], gpus)

    # The same batch per device: DataParallel's one process splits its batch over its GPUs.
    assert batch("single", 0) == batch("ddp", 0) == batch("dataparallel", 0) == []  # the scripts' own 32
    assert batch("dataparallel", 2) == ["--batch-size", "64"]
    assert batch("ddp", 2, batch_size=16) == ["--batch-size", "16"]
    assert batch("dataparallel", 2, batch_size=16) == ["--batch-size", "32"]
    # The same global batch: per device, N / devices.
    assert batch("single", 0, global_batch=64) == ["--batch-size", "64"]
    assert batch("deepspeed", 0, global_batch=64) == ["--batch-size", "32"]
    assert batch("dataparallel", 0, global_batch=64) == ["--batch-size", "64"]
    assert batch("dataparallel", 2, global_batch=64) == ["--batch-size", "64"]

    args = argparse.Namespace(max_samples=None, epochs=2, batch_size=None, global_batch=64, nprocs=2,
                              precision=None, passthrough=["--lr", "1e-4"])
    options = benchmark.script_options(args, benchmark.STRATEGIES["ddp"], benchmark.ROOT / "out", "tiny", 0)
    assert options == ["--output-dir", "out", "--model", "tiny", "--epochs", "2", "--batch-size", "32", "--lr", "1e-4"]
    # --precision reaches the strategies that offer mixed precision, and only those.
    args.precision = "bf16"
    offered = {name for name, entry in benchmark.STRATEGIES.items()
               if "--precision" in benchmark.script_options(args, entry, benchmark.ROOT / "out", "tiny", 0)}
    assert offered == {"ddp-amp", "deepspeed", "accelerate"}


def test_an_emulated_precision_is_marked_in_the_table():
    row = {"precision": "bf16", "precision_native": False, "device": "cpu"}
    assert benchmark.precision_label(row) == "bf16, emulated on this CPU"
    assert benchmark.precision_label({**row, "precision_native": True}) == "bf16"


def test_missing_script_or_dependency_is_a_reason_not_a_crash(tmp_path):
    missing_script = benchmark.Entry("x", "no-such-script.py", "python", benchmark.launch_single)
    assert benchmark.why_not_ready(missing_script, ["python"]) == "script no-such-script.py not found"
    missing_module = benchmark.Entry("x", "single-gpu-cls.py", "python", benchmark.launch_single,
                                      needs="no_such_module_here")
    assert "needs the Python module no_such_module_here" in benchmark.why_not_ready(missing_module, ["python"])

    log = tmp_path / "x.log"
    log.write_text("$ horovodrun ...\n[1]<stderr>:error: rank 1 failed: RuntimeError: boom\n"
                   "[0]<stderr>:error: rank 0 failed: RuntimeError: Connection closed by peer\n", encoding="utf-8")
    assert benchmark.failure_reason(log) == "error: rank 1 failed: RuntimeError: boom"
    log.write_text("Traceback (most recent call last):\nValueError: bad\nexit\n", encoding="utf-8")
    assert benchmark.failure_reason(log) == "ValueError: bad"
