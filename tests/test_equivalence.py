"""Every strategy is single-device training at the same global batch: 3 processes x 11 against one
device x 33, on data whose last global batch (2 samples) cannot be shared by 3 processes and whose
83 dev samples do not split over them. One launch per strategy checks the weights, the dev count
and the thread policy; DDP's run compiled, DeepSpeed ZeRO-1's optimizer offloaded. Lightning
Fabric's is test_fabric.py's FSDP2 run, the Hugging Face Trainer's test_hf_trainer.py's."""

import pytest

import warm
from support import machine
from conftest import (BIN, DEV_SAMPLES, EXACT, PYTHON, SMALL, assert_same_weights, assert_sends_what_its_formula_allows,
                      free_port, read_curves, read_result, require, run)

THREE = [*SMALL, *EXACT, "--batch-size", "11"]


LAUNCH = {
    # Compiled with static shapes (a graph per length: --pad-to-multiple-of 64 gives two, each traced anew
    # in every run, as DDP splits it) at 3 processes, the short last micro-batch filled by repeats of weight
    # 0. Eager DDP is the 2-process runs' (conftest), and every other row here shares its sampler at 3;
    # the spawn script is DDP's with another launch (test_native.py).
    "ddp": lambda: [BIN / "torchrun", "--nproc_per_node", "3", "--master_port", free_port(),
                    "multi-gpu-distributed-cls.py", "--compile", "--pad-to-multiple-of", "64"],
    "fsdp": lambda: [BIN / "torchrun", "--nproc_per_node", "3", "--master_port", free_port(), "multi-gpu-fsdp-cls.py"],
    "horovod": lambda: [BIN / "horovodrun", "-np", "3", "-H", "localhost:3", "--gloo", "--start-timeout", "120",
                        PYTHON, "multi-gpu-horovod-cls.py"],
    # Under torchrun, which sets what the deepspeed launcher would and starts no two Pythons of its own
    # first (test_deepspeed.py and the accumulating run take the deepspeed launcher). ZeRO-1 offloads
    # its optimizer to DeepSpeed's CPU Adam, in the precision a CPU gets by default: fp32.
    "deepspeed-zero1": lambda: [BIN / "torchrun", "--nproc_per_node", "3", "--master_port", free_port(),
                                "multi-gpu-deepspeed-cls.py", "--zero-stage", "1", "--offload", "optimizer"],
    "deepspeed-zero3": lambda: [BIN / "torchrun", "--nproc_per_node", "3", "--master_port", free_port(),
                                "multi-gpu-deepspeed-cls.py", "--zero-stage", "3", "--precision", "fp32"],
    "accelerate": lambda: [BIN / "accelerate", "launch", "--multi_gpu", "--num_processes", "3",
                           "--main_process_port", free_port(), "multi-gpu-accelerate-cls.py", "--device", "cpu"],
}
# Warm (tests/warm.py): what these prove is the strategy's arithmetic, not its launcher's (test_native.py,
# test_deepspeed.py, test_accelerate.py and test_resume.py launch them). Horovod needs horovodrun's own.
LAUNCHED = {"horovod"}
NEEDS = {"horovod": "horovod", "deepspeed-zero1": "deepspeed", "deepspeed-zero3": "deepspeed",
         "accelerate": "accelerate"}


@pytest.mark.parametrize("strategy", list(LAUNCH))
def test_three_processes_end_with_the_single_device_weights(tmp_path, single_33, strategy):
    if strategy in NEEDS:
        require(NEEDS[strategy])
    # OMP_NUM_THREADS=1, as torchrun and accelerate launch set it: the scripts' own policy decides.
    (run if strategy in LAUNCHED else warm.run)([*LAUNCH[strategy](), *THREE, "--output-dir", str(tmp_path)],
                                                env={"OMP_NUM_THREADS": "1"}, timeout=600)
    result = read_result(tmp_path)
    assert result["world_size"] == 3 and result["global_batch_size"] == 33 and result["precision"] == "fp32"
    assert result["compiled"] is (strategy == "ddp")
    if strategy.startswith("deepspeed"):
        assert result["offload"] == ("optimizer" if strategy == "deepspeed-zero1" else "none")
    if strategy == "ddp":
        assert result["compile_dynamic"] == "static" and result["step_shapes"] == 128 // 64  # 64 and 128 tokens
        assert result["compiled_graphs"] == result["step_shapes"]  # a graph per shape
    assert result["dev_samples"] == DEV_SAMPLES and result["samples_trained"] == 332
    assert result["steps"] == read_result(single_33)["steps"] == 11
    assert result["threads_per_process"] == max(1, machine.usable_cores() // 3)
    assert_same_weights(single_33 / "model", tmp_path / "model")
    # Every step's loss over the global batch, as TensorBoard shows it: on one device's line.
    loss, reference = read_curves(tmp_path)["train/loss"], read_curves(single_33)["train/loss"]
    assert loss.keys() == reference.keys() == set(range(1, 12))
    assert list(loss.values()) == pytest.approx(list(reference.values()), rel=1e-5)
    # The model folder holds what predict.py and pipeline() load, as one device's does; nothing else is
    # left (ZeRO-3's shards merged into it and removed).
    assert [p.name for p in sorted((tmp_path / "model").iterdir())] == [
        p.name for p in sorted((single_33 / "model").iterdir())]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["model", "result.json", "tensorboard"]
    # What each process sent per step at 3: within its formula (a ring's share, 2/3 of an all-reduce's
    # payload, is the formula's too).
    sent = assert_sends_what_its_formula_allows(result)
    assert sent["processes"] == 3
    assert sent["ring_bytes"] <= result["collective_formula_bytes"]["ring_bytes"] * 1.01 + 4096


def test_the_cpu_quota_of_a_container_caps_the_cores(tmp_path):
    assert machine.cgroup_cpu_quota(tmp_path) is None
    (tmp_path / "cpu.max").write_text("150000 100000\n")
    assert machine.cgroup_cpu_quota(tmp_path) == 1.5
    (tmp_path / "cpu.max").write_text("max 100000\n")
    assert machine.cgroup_cpu_quota(tmp_path) is None
    (tmp_path / "cpu.max").unlink()
    (tmp_path / "cpu").mkdir()
    (tmp_path / "cpu" / "cpu.cfs_quota_us").write_text("300000\n")
    (tmp_path / "cpu" / "cpu.cfs_period_us").write_text("100000\n")
    assert machine.cgroup_cpu_quota(tmp_path) == 3.0
    (tmp_path / "cpu" / "cpu.cfs_quota_us").write_text("-1\n")
    assert machine.cgroup_cpu_quota(tmp_path) is None
