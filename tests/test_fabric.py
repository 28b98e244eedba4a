"""multi-gpu-fabric-cls.py: Lightning Fabric on CPU processes over gloo. Under fabric run it learns,
counts each dev sample once, saves a portable model and checkpoints, and (DDP, 2 processes x 8 x 2
micro-batches) ends with the single-device weights at 32; under torchrun FSDP2 on 3 processes ends with
those at 33; a failing rank ends the job; what a CPU cannot run is refused in one line."""
import time

import pytest
import torch
import transformers

import common
import warm
from support import cli, machine
from support.options import build_parser, resolve
import hooks
from support import models
from conftest import (BIN, DEV_SAMPLES, EXACT, SMALL, assert_no_process_left, assert_same_weights,
                      free_port, load_weights, predict_dev_accuracy, read_result, require, run, run_in_process,
                      small_split, untrained_dev_loss)

SCRIPT = "multi-gpu-fabric-cls.py"


@pytest.fixture(autouse=True)
def fabric_installed():
    require("lightning_fabric")


def torchrun(processes, *options, env=None, check=True, launch=warm.run):
    """Warm (tests/warm.py) but where torchrun is the point: a failing rank ends the job. OMP_NUM_THREADS=1,
    as torchrun sets it: the script's own thread policy decides."""
    return launch([BIN / "torchrun", "--nproc_per_node", str(processes), "--master_port", free_port(), SCRIPT, *SMALL,
                   *options], env={"OMP_NUM_THREADS": "1", **(env or {})}, check=check, timeout=600)


def test_fabric_run_learns_counts_each_dev_sample_once_and_ends_with_the_single_device_weights(
        tmp_path, single_reference):
    """fabric run, DDP on 2 processes x 8 x 2 micro-batches (fabric.no_backward_sync holds the first
    one's all-reduce back) against one device x 32, a checkpoint every 4 steps."""
    require("click")  # fabric run's command line, which lightning-fabric does not declare
    process = run([BIN / "fabric", "run", "--accelerator", "cpu", "--devices", "2", "--main-port", free_port(),
                   SCRIPT, *SMALL, *EXACT, "--batch-size", "8", "--grad-accum", "2", "--save-steps", "4",
                   "--output-dir", str(tmp_path)], env={hooks.COUNT_ALLREDUCES_ENV: "1"}, timeout=600)
    assert "fabric: DDPStrategy, 2 process(es), cpu, precision 32-true" in process.stdout
    result = read_result(tmp_path)
    assert result["strategy"] == "fabric" and result["launcher"] == "fabric run" and result["fabric_strategy"] == "ddp"
    assert result["world_size"] == 2 and result["global_batch_size"] == 32 and result["precision"] == "fp32"
    assert result["dev_samples"] == DEV_SAMPLES  # each dev sample counted once, not once per process
    assert result["samples_trained"] == 332 and result["steps"] == 11 and result["versions"]["lightning_fabric"]
    assert process.stdout.count("【train】 epoch：1/1 step：11/11 loss：") == 1  # only rank 0 logs
    assert result["gradient_allreduces"] >= 11  # counted on the DDP inside Fabric's wrapper
    assert result["dev_loss"] < untrained_dev_loss() - 0.03
    assert_same_weights(single_reference / "model", tmp_path / "model")
    # The inner model is saved, without Fabric's or DDP's wrapper names: predict.py scores the
    # reported accuracy, transformers' own pipeline loads it.
    assert not any(key.startswith(("module.", "_forward_module.", "_original_module."))
                   for key in load_weights(tmp_path / "model"))
    assert abs(predict_dev_accuracy(tmp_path) - result["dev_accuracy"]) < 1e-9
    classify = transformers.pipeline("text-classification", model=str(tmp_path / "model"), device="cpu")
    assert classify("今天天气真好")[0]["label"] in transformers.AutoConfig.from_pretrained(
        tmp_path / "model").id2label.values()
    # The step-8 checkpoint: fabric.save's file (rank 0 under DDP) beside the suite's state; no staging left.
    assert sorted(p.name for p in tmp_path.iterdir()) == ["checkpoint", "dev.txt", "model", "result.json",
                                                          "tensorboard"]
    assert sorted(p.name for p in (tmp_path / "checkpoint").iterdir()) == ["fabric", "meaning.json",
                                                                          "training_state.pt"]


def test_fsdp2_on_three_processes_ends_with_the_single_device_weights(tmp_path, single_33):
    """Fabric's ModelParallelStrategy (FSDP2) under torchrun, 3 x 11 against one device x 33: the last
    global batch (2 samples) and the 83 dev samples cannot be shared evenly by 3. Fabric's 3-process
    run of test_equivalence.py's kind (its DDP: the fabric run test above, at 2)."""
    torchrun(3, *EXACT, "--fabric-strategy", "fsdp2", "--batch-size", "11", "--output-dir", str(tmp_path))
    result = read_result(tmp_path)
    assert result["launcher"] == "torchrun" and result["fabric_strategy"] == "fsdp2" and result["precision"] == "fp32"
    assert result["world_size"] == 3 and result["global_batch_size"] == 33
    assert result["dev_samples"] == DEV_SAMPLES and result["samples_trained"] == 332 and result["steps"] == 11
    assert result["threads_per_process"] == max(1, machine.usable_cores() // 3)
    assert result["model_state_formula_bytes"]["zero_stage"] == 3  # the weights really are sharded
    assert_same_weights(single_33 / "model", tmp_path / "model")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["model", "result.json", "tensorboard"]


def test_a_failing_rank_ends_the_whole_job_and_is_named(tmp_path):
    started = time.monotonic()
    process = torchrun(2, "--output-dir", str(tmp_path), env={"SUITE_FAIL_AT": "1:2"}, check=False, launch=run)
    assert process.returncode != 0
    assert time.monotonic() - started < 240
    assert "error: rank 1 failed: RuntimeError: failure injected by SUITE_FAIL_AT at step 2" in (
        process.stdout + process.stderr)
    assert_no_process_left(str(tmp_path))
    assert not (tmp_path / "result.json").exists()


def test_what_a_cpu_cannot_run_is_refused_in_one_line(tmp_path, monkeypatch):
    process = run_in_process([SCRIPT, *SMALL, "--fabric-strategy", "deepspeed", "--output-dir", str(tmp_path)])
    assert process.returncode == 2
    assert process.stderr.strip().splitlines() == [
        "error: --fabric-strategy deepspeed needs CUDA GPUs (Fabric's DeepSpeedStrategy refuses the CPU); on CPU, "
        "multi-gpu-deepspeed-cls.py runs DeepSpeed over gloo"]
    # The same check reads what fabric run passes in LT_* variables: fp16 on CPU is refused, where
    # Fabric itself would train in bf16 after a warning.
    from libraries import fabric_setup  # here: lightning_fabric is checked for first (fabric_installed)
    parser = build_parser(SCRIPT, "")
    fabric_setup.add_fabric_args(parser)
    refusals = [([], {"LT_PRECISION": "16-mixed"}, "--precision fp16 needs a GPU"),
                (["--precision", "fp16"], {}, "--precision fp16 needs a GPU"),
                ([], {"LT_PRECISION": "64-true"}, "fabric run --precision 64-true: this script trains in"),
                (["--precision", "bf16"], {"LT_PRECISION": "32-true"}, "--precision bf16 and fabric run --precision"),
                ([], {"LT_STRATEGY": "fsdp"}, "fabric run --strategy fsdp: leave it out"),
                ([], {"LT_ACCELERATOR": "mps"}, "fabric run --accelerator mps: this script trains on cpu or cuda")]
    for options, env, message in refusals:
        with monkeypatch.context() as patch:
            for name, value in env.items():
                patch.setenv(name, value)
            with pytest.raises(cli.UserError, match="^" + message.replace("+", r"\+")):
                fabric_setup.resolve_launch(parser.parse_args(["--device", "cpu", *options]))
    with monkeypatch.context() as patch:  # agreeing ones are taken
        patch.setenv("LT_PRECISION", "bf16-mixed")
        patch.setenv("LT_ACCELERATOR", "cpu")
        assert fabric_setup.resolve_launch(parser.parse_args([])) == (torch.device("cpu"), "bf16")


def test_fabric_leaves_the_epoch_of_the_suites_sampler_to_the_trainer():
    """Fabric's loader wrapper calls set_epoch(times iterated) on the samplers it finds (loader.sampler,
    loader.batch_sampler.sampler); the suite's GlobalBatchSampler is the batch sampler itself, so the
    Trainer's set_epoch(epoch) stands, and every process and a resumed run shuffle as DDP does."""
    from lightning_fabric import Fabric
    train, _ = small_split()
    tokenizer, _ = models.build_tiny_model([text for text, _ in train], 123, {"num_labels": 6})
    dataset = common.EncodedDataset(train, tokenizer, 128)
    args = resolve(build_parser(SCRIPT, "").parse_args(["--batch-size", "16"]))
    loader = Fabric(accelerator="cpu", devices=1).setup_dataloaders(
        common.make_loader(dataset, args, tokenizer, common.train_sampler(dataset, args, 2, 1)),
        use_distributed_sampler=False)
    loader.batch_sampler.set_epoch(3)
    first = next(iter(loader))
    assert loader.batch_sampler.epoch == 3
    loader.batch_sampler.set_epoch(1)
    assert next(iter(loader))["index"].tolist() != first["index"].tolist()
    assert loader.batch_sampler.epoch == 1
