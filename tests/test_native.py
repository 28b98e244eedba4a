"""The native PyTorch strategies on CPU with gloo and 2 processes: DataParallel (its CPU fallback),
DDP under torchrun, the legacy torch.distributed.launch and torch.multiprocessing.spawn, DDP + AMP."""
import json
import re

import pytest
import torch

from support import machine
from conftest import (DEV_SAMPLES, EXACT, PYTHON, SMALL, assert_same_weights, read_result, run, run_in_process,
                      untrained_dev_loss)

# 2 processes at batch 16 see the same global batches as single-gpu-cls.py at 32 (single_reference).
EQUIVALENT = [*SMALL, *EXACT, "--batch-size", "16"]


def assert_distributed_result(output_dir, strategy, launcher, precision="fp32"):
    result = read_result(output_dir)
    assert (result["strategy"], result["launcher"], result["precision"]) == (strategy, launcher, precision)
    assert result["world_size"] == 2 and result["dev_samples"] == DEV_SAMPLES
    return result


def logged_losses(output):
    return [float(loss) for loss in re.findall(r"【train】 .* loss：([\d.]+)", output)]


@pytest.mark.quick
@pytest.mark.quick_only  # the whole suite: DDP under torchrun in the runner's run and at 3 processes
def test_ddp_under_torchrun_equals_the_single_device_run(ddp_run, single_reference):
    process, output = ddp_run(1)
    assert_distributed_result(output, "ddp", "torchrun")
    assert process.stdout.count("耗时：") == 1  # only rank 0 reports
    assert_same_weights(single_reference / "model", output / "model")


def test_ddp_under_the_legacy_launcher_equals_the_single_device_run(ddp_run, single_reference):
    """python -m torch.distributed.launch, 2 processes x 4 x 4 micro-batches (conftest's ddp_run), each
    batch padded to a multiple of 16 tokens and the last step's short micro-batch filled with repeats of
    weight 0, as on a GPU: a handful of shapes, and still one device's weights."""
    process, output = ddp_run(4)
    result = assert_distributed_result(output, "ddp", "torch.distributed.launch")
    assert result["global_batch_size"] == 32 and result["steps"] == 11  # 10 of 32 and one of 12
    assert result["pad_to_multiple_of"] == 16 and result["step_shapes"] <= 128 // 16
    assert read_result(single_reference)["step_shapes"] > 128 // 16  # what padding to the longest gives
    # 10 steps of 4 micro-batches and a last one of 2 (12 samples: 8, then 4 filled to 8), 8 rows each.
    assert result["real_sequences"] == 332 and result["computed_sequences"] == (10 * 4 + 2) * 8
    assert process.stdout.count("耗时：") == 1
    assert_same_weights(single_reference / "model", output / "model")


def test_ddp_under_spawn_equals_the_single_device_run(accumulating_run, single_reference):
    """2 processes x 8 x 2 micro-batches (conftest's accumulating run) against one device x 32."""
    process, output = accumulating_run("ddp-spawn")
    assert_distributed_result(output, "ddp", "spawn")
    assert process.stdout.count("耗时：") == 1
    assert_same_weights(single_reference / "model", output / "model")


def test_bf16_amp_learns_and_tracks_fp32(tmp_path, single_reference):
    process = run([PYTHON, "multi-gpu-distributed-mp-amp-cls.py", *EQUIVALENT, "--output-dir", str(tmp_path)])
    result = assert_distributed_result(tmp_path, "ddp-amp", "spawn", precision="bf16")  # bf16 is the CPU default
    # Whether this CPU computes bf16 itself is recorded, and said when it does not.
    native = machine.computes_natively("bf16", torch.device("cpu"))
    assert result["precision_native"] is native
    assert ("has no native bf16: torch emulates it" in process.stdout) is not native
    losses = logged_losses(process.stdout + process.stderr)
    assert len(losses) == 3 and losses[-1] < losses[0]  # logged at steps 5, 10 and 11
    assert result["dev_loss"] < untrained_dev_loss() - 0.03
    assert abs(result["dev_loss"] - read_result(single_reference)["dev_loss"]) < 0.01


def test_fp16_amp_is_refused_on_cpu_with_a_clear_message():
    # SMALL's --device cpu: refused on every machine, GPUs or not.
    process = run_in_process(["multi-gpu-distributed-mp-amp-cls.py", *SMALL, "--precision", "fp16"])
    assert process.returncode == 2 and "Traceback" not in process.stderr
    assert process.stderr.strip().splitlines()[-1].startswith("error: --precision fp16 needs a GPU")


def test_dataparallel_without_gpus_runs_one_cpu_process(crashed_run):
    """conftest's crashed DataParallel run: SMALL's --device cpu leaves it no GPU on every machine, so
    its --gpu-ids 0,1 is ignored. (Resumed, it ends with the single-device weights: test_resume.py; its
    accumulating run too: test_grad_accum.py.)"""
    crashed = crashed_run("dataparallel")
    assert "DataParallel needs GPUs" in crashed.process.stderr
    assert "processes: 1 |" in crashed.process.stdout
    meaning = json.loads((crashed.output / "checkpoint" / "meaning.json").read_text(encoding="utf-8"))
    assert (meaning["world_size"], meaning["global_batch_size"]) == (1, 32)


def assert_failure_names_rank_1(crashed):
    """conftest's crashed run: rank 1 failed at step 10, after the step-8 checkpoint."""
    assert crashed.process.returncode != 0
    assert crashed.seconds < 120, "the job took too long to stop after rank 1 failed"
    assert "error: rank 1 failed: RuntimeError: failure injected" in crashed.process.stderr
    assert not (crashed.output / "result.json").exists()
    assert crashed.orphans == [], "orphan processes left running"
    return crashed.process.stderr


def test_a_failing_rank_stops_torchrun(crashed_run):
    stderr = assert_failure_names_rank_1(crashed_run("ddp"))
    # torchrun's summary names the first rank that failed as the root cause, and repeats its line from
    # the error file the script wrote (not a link to torchrun's docs).
    root_cause = stderr.split("Root Cause")[-1]
    assert re.search(r"rank\s*:\s*1 \(local_rank: 1\)", root_cause), stderr
    assert "traceback : error: rank 1 failed: RuntimeError: failure injected" in root_cause, stderr


def test_a_failing_rank_stops_spawn(crashed_run):
    stderr = assert_failure_names_rank_1(crashed_run("ddp-spawn"))
    assert stderr.strip().splitlines()[-1].startswith("error: rank 1 failed (exit code 1)")


def test_spawn_on_several_machines_needs_the_rendezvous_address():
    process = run_in_process(["multi-gpu-distributed-mp-cls.py", *SMALL, "--nnodes", "2", "--node-rank", "1"])
    assert process.returncode == 2 and "Traceback" not in process.stderr
    assert "--master-addr" in process.stderr.strip().splitlines()[-1]


def test_native_bf16_is_read_from_the_cpu_flags(monkeypatch):
    cpu = torch.device("cpu")
    monkeypatch.setattr(machine, "cpu_flags", lambda: {"avx2", "fma"})
    assert not machine.computes_natively("bf16", cpu) and machine.computes_natively("fp32", cpu)
    monkeypatch.setattr(machine, "cpu_flags", lambda: {"avx2", "avx512_bf16"})
    assert machine.computes_natively("bf16", cpu) and not machine.computes_natively("fp16", cpu)
    monkeypatch.setattr(machine, "cpu_flags", lambda: {"amx_bf16", "amx_fp16"})
    assert machine.computes_natively("bf16", cpu) and machine.computes_natively("fp16", cpu)
