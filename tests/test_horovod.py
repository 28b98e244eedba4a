"""multi-gpu-horovod-cls.py under horovodrun (2 CPU processes over Gloo), and the Horovod build script."""
import shutil

from conftest import (BIN, DEV_SAMPLES, PYTHON, SMALL, assert_same_weights, assert_sends_what_its_formula_allows,
                      read_result, require, run, run_in_process, untrained_dev_loss)

SCRIPT = "multi-gpu-horovod-cls.py"


def horovodrun(*args, processes=2):
    require("horovod")
    # --start-timeout: horovodrun's 30 s default for starting the processes is tight on a busy 2-core machine.
    return run([BIN / "horovodrun", "-np", str(processes), "-H", f"localhost:{processes}", "--gloo",
                "--start-timeout", "120", PYTHON, SCRIPT, *SMALL, *args], timeout=600)


def assert_horovod_result(result, global_batch):
    assert result["strategy"] == "horovod" and result["launcher"] == "horovodrun"
    assert result["world_size"] == 2 and result["global_batch_size"] == global_batch
    assert result["dev_samples"] == DEV_SAMPLES  # each dev sample counted once, not once per process
    assert result["versions"]["horovod"]


def test_horovod_learns_with_fp16_allreduce_and_logs_once(tmp_path):
    process = horovodrun("--fp16-allreduce", "--output-dir", str(tmp_path))
    result = read_result(tmp_path)
    assert_horovod_result(result, global_batch=64)
    assert result["steps"] == 6 and result["precision"] == "fp32" and result["gradient_compression"] == "fp16"
    assert "[0]<stdout>:【train】 epoch：1/1 step：6/6 loss：" in process.stdout
    assert result["dev_loss"] < untrained_dev_loss() - 0.03  # it learned: the reference run's Horovod did not
    assert "[1]<stdout>:【train】" not in process.stdout  # only rank 0 logs
    assert (tmp_path / "model" / "model.safetensors").is_file()
    # fp16 compression sends each gradient in 2 bytes: half of test_grad_accum.py's fp32 all-reduce.
    sent = assert_sends_what_its_formula_allows(result)
    assert sent["kinds"]["all-reduce"]["bytes"] == 2 * result["parameters"]


def test_horovod_equals_one_device_at_the_same_global_batch(accumulating_run, single_reference):
    """2 processes x 8 x 2 micro-batches with averaged gradients (conftest's accumulating run) take
    the same steps as 1 process x 32."""
    _, output = accumulating_run("horovod")
    result = read_result(output)
    assert_horovod_result(result, global_batch=32)
    assert result["steps"] == read_result(single_reference)["steps"] == 11
    assert_same_weights(single_reference / "model", output / "model")


def test_without_horovodrun_it_says_how_to_launch():
    require("horovod")
    process = run_in_process([SCRIPT, *SMALL])
    assert process.returncode == 2
    assert process.stderr.strip().splitlines()[-1].startswith("error: this script runs under horovodrun")


def test_build_script_names_a_missing_build_tool(tmp_path):
    """Without cmake (and no cached wheel) the build stops at once with one line saying what to install."""
    tools = tmp_path / "bin"
    tools.mkdir()
    (tools / "mkdir").symlink_to(shutil.which("mkdir"))
    process = run([shutil.which("bash"), "scripts/build-horovod.sh", PYTHON], check=False, timeout=120,
                  env={"PATH": str(tools), "HOROVOD_WHEEL_CACHE": str(tmp_path / "cache")})
    assert process.returncode == 1
    assert process.stderr.strip().splitlines()[-1].startswith("error: building Horovod needs 'cmake'")
