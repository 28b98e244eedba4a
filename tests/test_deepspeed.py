"""multi-gpu-deepspeed-cls.py under the deepspeed launcher: ZeRO-0 against one device, the options
refused before training, the memory estimate. ZeRO-1, 2 and 3 at 2 processes x 8 x 2 micro-batches,
under the deepspeed launcher too, are the profiled runner run's rows (test_grad_accum.py); ZeRO-1 with
its optimizer offloaded, in fp32 by default, and ZeRO-3's merged checkpoint are test_equivalence.py's
3 processes, ZeRO-3 also the 2-node cluster's job (test_several_machines.py)."""
import json
import runpy
import socket
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest

from conftest import (BIN, DEV_SAMPLES, EXACT, SMALL, assert_same_weights, assert_sends_what_its_formula_allows,
                      free_port, read_result, require, run, run_in_process)

SCRIPT = "multi-gpu-deepspeed-cls.py"
EQUIVALENCE = [*SMALL, *EXACT, "--precision", "fp32"]
# What the deepspeed launcher sets, for the checks that fail before any process group is formed.
LAUNCHED = {"RANK": "0", "WORLD_SIZE": "2", "LOCAL_RANK": "0", "LOCAL_SIZE": "2"}


@pytest.fixture(autouse=True)
def deepspeed_installed():
    require("deepspeed")


def launch(*args, output, env=None, check=True):
    """deepspeed --num_gpus 2 on a free port (the launcher's default 29500 may be taken). A run that
    ended well leaves none of DeepSpeed's 66 MB /dev/shm buffers behind: the script removes them."""
    port = free_port()
    command = [str(BIN / "deepspeed"), "--master_port", port, "--num_gpus", "2", SCRIPT, *args,
               "--output-dir", str(output)]
    process = run(command, env=env, check=check, timeout=600)
    left_behind = list(Path("/dev/shm").glob(f"deepspeed_allreduce_buffer_*_{port}_*"))
    for buffer in left_behind:
        buffer.unlink()
    if process.returncode == 0:
        assert not left_behind, left_behind
    return process


def check_result(output, zero_stage, **expected):
    result = read_result(output)
    assert result["strategy"] == "deepspeed" and result["launcher"] == "deepspeed"
    assert result["world_size"] == 2 and result["zero_stage"] == zero_stage
    assert result["dev_samples"] == DEV_SAMPLES and result["versions"]["deepspeed"]
    for key, value in expected.items():
        assert result[key] == value, key
    # The ZeRO shards were merged into model/ and removed.
    assert sorted(path.name for path in output.iterdir()) == ["model", "result.json", "tensorboard"]
    return result


def test_zero0_ends_with_the_single_device_weights(tmp_path, single_reference):
    """In fp32 at the same global batch of 32 (16 x 2 processes), the merged checkpoint holds the
    weights single-gpu-cls.py ends with, the short last batch included."""
    process = launch(*EQUIVALENCE, "--zero-stage", "0", "--batch-size", "16", output=tmp_path)
    assert "global batch: 32 |" in process.stdout
    result = check_result(tmp_path, 0, precision="fp32", global_batch_size=32, optimizer_steps=11, offload="none")
    assert_same_weights(single_reference / "model", tmp_path / "model")
    # ZeRO-0 is data parallelism: one all-reduce of the fp32 gradients per step, nothing else.
    assert assert_sends_what_its_formula_allows(result)["kinds"]["all-reduce"]["bytes"] == pytest.approx(
        4 * result["parameters"], abs=1024)


def assert_clean_error(process, fragment):
    assert process.returncode == 2, process.stderr
    assert "Traceback" not in process.stderr, process.stderr
    last = process.stderr.strip().splitlines()[-1]
    assert last.startswith("error: ") and fragment in last, last


def write_config(tmp_path, config):
    path = tmp_path / "ds.json"
    path.write_text(json.dumps(config), encoding="utf-8")
    return str(path)


@pytest.mark.parametrize("args, fragment", [
    (["--zero-stage", "2", "--offload", "optimizer+param"], "offloading the weights needs --zero-stage 3"),
    (["--deepspeed-config", "configs/deepspeed/zero3-offload.json", "--zero-stage", "2"],
     "offloading the weights needs --zero-stage 3"),
    (["--zero-stage", "0", "--offload", "optimizer"], "needs --zero-stage 1, 2 or 3"),
    (["--grad-accum", "0"], "--grad-accum must be at least 1"),
    ({"gradient_accumulation_steps": 4}, "sets gradient_accumulation_steps 4, but the command line gives 1"),
    (["--deepspeed-config", "configs/deepspeed/nope.json"], "DeepSpeed config not found"),
    ({"zero_optimization": {"stage": 2}, "optimizer": {"type": "Adam"}}, "remove its optimizer/scheduler section"),
    ({"train_micro_batch_size_per_gpu": 16}, "sets train_micro_batch_size_per_gpu 16, but the command line gives 32"),
    ({"fp16": True}, '"fp16" must be a JSON object (like {"enabled": true}), got true'),
    ({"zero_optimization": 2}, '"zero_optimization" must be a JSON object'),
], ids=["param-offload-stage2", "flag-overrides-file", "offload-stage0", "no-accumulation", "config-accumulation",
        "missing-config", "config-optimizer", "config-batch", "config-fp16-not-an-object", "config-zero-not-an-object"])
def test_bad_deepspeed_options_fail_before_training(tmp_path, args, fragment):
    if isinstance(args, dict):
        args = ["--deepspeed-config", write_config(tmp_path, args)]
    process = run_in_process([SCRIPT, *SMALL, *args], env=LAUNCHED)
    assert_clean_error(process, fragment)


def test_a_master_port_in_use_is_refused_before_the_ranks_wait_for_it(tmp_path):
    """Rank 0 of DeepSpeed's launch.py (which alone sets CROSS_RANK) hosts the rendezvous: on a port in
    use the other ranks would wait --dist-timeout seconds, and the error would blame the timeout."""
    with socket.socket() as taken:
        taken.bind(("", 0))
        taken.listen()
        port = taken.getsockname()[1]
        process = run_in_process([SCRIPT, *SMALL, "--dist-timeout", "5", "--output-dir", tmp_path],
                                 env={**LAUNCHED, "CROSS_RANK": "0", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port)})
    assert_clean_error(process, f"--master_port {port} is already in use on")
    assert process.stderr.strip().endswith("give the deepspeed command a free one")


def test_fp16_on_cpu_is_refused():
    process = run_in_process([SCRIPT, *SMALL, "--precision", "fp16"], env=LAUNCHED)
    assert_clean_error(process, "--precision fp16 needs a GPU")


def test_started_without_the_launcher_says_how_to_launch():
    process = run_in_process([SCRIPT, *SMALL])
    assert_clean_error(process, "deepspeed --num_gpus N multi-gpu-deepspeed-cls.py")


def test_memory_estimate_for_each_stage_and_offload():
    process = run_in_process([SCRIPT, "--model", "tiny", "--estimate-memory", "4", "2"])
    assert process.returncode == 0, process.stderr
    output = process.stdout
    assert "2 machine(s) x 4 GPU(s)" in output
    rows = [line.split() for line in output.splitlines() if line.strip()[:1].isdigit()]
    per_gpu = {(stage, offload): float(value) for stage, offload, value, unit, *_ in rows}
    assert list(per_gpu) == [("0", "none"), ("1", "none"), ("2", "none"), ("2", "optimizer"), ("3", "none"),
                             ("3", "optimizer"), ("3", "optimizer+param")]
    # Each stage partitions more, and offloading moves more off the GPU.
    assert per_gpu["0", "none"] > per_gpu["1", "none"] > per_gpu["2", "none"] > per_gpu["2", "optimizer"]
    assert per_gpu["3", "none"] > per_gpu["3", "optimizer"] > per_gpu["3", "optimizer+param"]


def test_a_resume_takes_the_newest_complete_step_when_latest_names_none(tmp_path, monkeypatch):
    """`latest` names a step folder a failed save removed, then one it left incomplete, beside a complete
    step8/: the resume takes step8 (here refused, as written with other settings, before the engine
    would load it). In this interpreter, for one process."""
    import common
    from libraries import deepspeed_setup
    from support import checkpoints, cli
    from support.options import build_parser
    lesson = runpy.run_path(SCRIPT)

    class OneProcess(lesson["DeepSpeed"]):
        broadcast_object, reduce_mean = common.Strategy.broadcast_object, common.Strategy.reduce_mean
    checkpoint = tmp_path / "checkpoint"
    monkeypatch.setattr(sys, "argv", [SCRIPT])  # the script that wrote it, as checkpoints.meaning records it
    with deepspeed_setup.step_folder(checkpoint / "step8", {"step": 8, "meaning": {"script": SCRIPT, "world_size": 2}},
                                     True):
        (checkpoint / "step8" / "mp_rank_00_model_states.pt").write_bytes(b"")  # the engine's files, `latest`
    (checkpoint / "latest").write_text("step12", encoding="utf-8")
    strategy = OneProcess("cpu", 0, 2, 2, "fp32", {"zero_optimization": {"stage": 2}})
    run = SimpleNamespace(args=build_parser(SCRIPT, "").parse_args(["--resume"]), output_dir=tmp_path,
                          strategy=strategy, global_batch_size=64, model_name="tiny", log=print)
    for step12 in ("missing", "without its meaning.json"):
        written = f"^--resume: the checkpoint in {checkpoint / 'step8'} was written with"
        with pytest.raises(cli.UserError, match=written):
            checkpoints.resume(run)
        (checkpoint / "step12").mkdir(exist_ok=True)
        (checkpoint / "step12" / "mp_rank_00_model_states.pt").write_bytes(b"")
