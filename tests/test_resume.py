"""--save-steps / --resume for every strategy: a run that crashed and resumed ends with the weights
of the run that never stopped, with dropout on and across an epoch boundary; a checkpoint resumes
only into a run where its step means the same samples, and only where every process can read it."""
import json
import subprocess

import pytest

import measure
import models
from conftest import BIN, PYTHON, ROOT, SMALL, assert_same_weights, free_port, read_result, require, run

# Dropout on (the model's 0.1): the random states must come back too. 11 steps per epoch, 22 in all;
# a checkpoint every 4 steps and a crash at step 10: the resumed run continues from step 8, in epoch 1,
# and crosses into epoch 2.
RESUME = [*SMALL, "--epochs", "2", "--save-steps", "4"]
CRASH = {measure.FAIL_AT_ENV: "0:10"}


LAUNCH = {
    "single": lambda: [PYTHON, "single-gpu-cls.py"],
    "dataparallel": lambda: [PYTHON, "multi-gpu-dataparallel-cls.py"],
    "ddp": lambda: [BIN / "torchrun", "--nproc_per_node", "2", "--master_port", free_port(),
                    "multi-gpu-distributed-cls.py", "--batch-size", "16"],
    "ddp-spawn": lambda: [PYTHON, "multi-gpu-distributed-mp-cls.py", "--nprocs", "2", "--batch-size", "16"],
    "ddp-amp": lambda: [PYTHON, "multi-gpu-distributed-mp-amp-cls.py", "--nprocs", "2", "--batch-size", "16"],
    "horovod": lambda: [BIN / "horovodrun", "-np", "2", "-H", "localhost:2", "--gloo", "--start-timeout", "120",
                        PYTHON, "multi-gpu-horovod-cls.py", "--batch-size", "16"],
    "fsdp": lambda: [BIN / "torchrun", "--nproc_per_node", "2", "--master_port", free_port(), "multi-gpu-fsdp-cls.py",
                     "--batch-size", "16"],
    # Under torchrun, which sets what the deepspeed launcher would, so that an exported
    # DS_ACCELERATOR=cuda (see ENV) reaches the script: --device cpu must win over it.
    "deepspeed": lambda: [BIN / "torchrun", "--nproc_per_node", "2", "--master_port", free_port(),
                          "multi-gpu-deepspeed-cls.py", "--zero-stage", "2", "--device", "cpu", "--batch-size", "16"],
    "accelerate": lambda: [BIN / "accelerate", "launch", "--multi_gpu", "--num_processes", "2",
                           "--main_process_port", free_port(), "multi-gpu-accelerate-cls.py", "--device", "cpu",
                           "--batch-size", "16"],
}
NEEDS = {"horovod": "horovod", "deepspeed": "deepspeed", "accelerate": "accelerate"}
# The uninterrupted run each resumed one must equal: one device; 2 processes x 16 in fp32 (DDP, and
# every strategy that draws the same dropout masks); 2 x 16 in bf16.
REFERENCE = {"single": "single", "dataparallel": "single", "ddp-amp": "ddp-amp"}
ENV = {"deepspeed": {"DS_ACCELERATOR": "cuda"}}


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory):
    runs = {}

    def get(name):
        if name not in runs:
            output = tmp_path_factory.mktemp(f"uninterrupted-{name}")
            run([*LAUNCH[name](), *RESUME, "--output-dir", str(output)])
            runs[name] = output
        return runs[name]
    return get


def crash_and_resume(strategy, output):
    command = [*LAUNCH[strategy](), *RESUME, "--output-dir", str(output)]
    env = ENV.get(strategy, {})
    crashed = run(command, env={**CRASH, **env}, check=False)
    assert crashed.returncode != 0 and not (output / "result.json").exists(), crashed.stderr[-2000:]
    resumed = run([*command, "--resume"], env=env)
    assert "--resume: continuing from step 8" in resumed.stdout
    return resumed


@pytest.mark.parametrize("strategy", list(LAUNCH))
def test_a_resumed_run_with_dropout_ends_like_the_uninterrupted_one(tmp_path, uninterrupted, strategy):
    if strategy in NEEDS:
        require(NEEDS[strategy])
    crash_and_resume(strategy, tmp_path)
    result = read_result(tmp_path)
    assert result["resumed_from_step"] == 8 and result["steps"] == 22 and result["epochs"] == 2
    # Throughput counts what this launch trained: 14 steps, the last of each epoch short (12 samples).
    assert result["samples_trained"] == 2 * 332 - 8 * 32
    if strategy == "deepspeed":
        assert (tmp_path / "checkpoint" / "latest").read_text() == "step20"
        assert result["device"] == "cpu"
    assert_same_weights(uninterrupted(REFERENCE.get(strategy, "ddp")) / "model", tmp_path / "model")


def checkpoint_of_a_crashed_ddp_run(output):
    run([*LAUNCH["ddp"](), *RESUME, "--output-dir", str(output)], env=CRASH, check=False)
    meaning = json.loads((output / "checkpoint" / "meaning.json").read_text(encoding="utf-8"))
    assert meaning["step"] == 8 and meaning["world_size"] == 2 and meaning["global_batch_size"] == 32
    assert meaning["precision"] == "fp32"  # an fp16 checkpoint (a gradient scaler) resumes only into fp16


def test_a_checkpoint_resumes_only_where_its_step_means_the_same_samples(tmp_path):
    checkpoint_of_a_crashed_ddp_run(tmp_path)
    # 3 processes: the step would mean other samples. --model auto is resolved once, by rank 0.
    auto = [argument for argument in RESUME if argument not in ("--model", "tiny")]
    process = run([BIN / "torchrun", "--nproc_per_node", "3", "--master_port", free_port(),
                   "multi-gpu-distributed-cls.py", *auto, "--model", "auto", "--batch-size", "16", "--resume",
                   "--output-dir", str(tmp_path)], env={"HF_HUB_OFFLINE": "1"}, check=False)
    assert process.returncode != 0
    errors = [line for line in process.stderr.splitlines() if line.startswith("error: ")]
    assert errors == [f"error: --resume: the checkpoint in {tmp_path / 'checkpoint'} was written with world_size 2 "
                      "(now 3), global_batch_size 32 (now 48): its step means other samples here. Resume with its "
                      "settings, or remove it"], process.stderr
    if not models.LOCAL_MODEL_DIR.is_dir():
        assert process.stderr.count("using the TINY randomly") == 1


def test_a_checkpoint_one_machine_cannot_read_fails_the_job_in_one_line(tmp_path):
    """Two 'machines' of one process each, without a shared --output-dir: only rank 0's has the checkpoint."""
    checkpoint_of_a_crashed_ddp_run(tmp_path / "node0")
    port = free_port()
    nodes = [subprocess.Popen([BIN / "torchrun", "--nnodes", "2", "--node_rank", str(node), "--nproc_per_node", "1",
                               "--master_addr", "127.0.0.1", "--master_port", port, "multi-gpu-distributed-cls.py",
                               *RESUME, "--batch-size", "16", "--threads", "1", "--resume",
                               "--output-dir", str(tmp_path / f"node{node}")],
                              cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
             for node in (0, 1)]
    try:
        outputs = [node.communicate(timeout=300) for node in nodes]
    finally:
        for node in nodes:
            node.kill()
    assert all(node.returncode != 0 for node in nodes)
    stderr = outputs[0][1]
    assert "error: --resume: rank 0 found a checkpoint" in stderr
    assert "--output-dir must be on a filesystem every machine shares" in stderr
    assert "error: --resume" not in outputs[1][1]  # rank 0 speaks for all
