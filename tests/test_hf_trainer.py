"""multi-gpu-transformers-cls.py: transformers.Trainer with the suite's data, optimizer and loss rule,
on CPU processes over gloo."""
import runpy
import signal
import sys

import pytest
import torch
import transformers

import common
import warm
from support import machine
from support.launch import STOP_SIGNALS
import hooks
from conftest import (BIN, DEV_SAMPLES, EXACT, PYTHON, ROOT, SMALL, assert_no_process_left, assert_same_weights,
                      assert_sends_what_its_formula_allows, free_port, predict_dev_accuracy, read_curves, read_result,
                      require, run)

SCRIPT = "multi-gpu-transformers-cls.py"


def torchrun(processes, *options, env=None, check=True, launch=warm.run):
    """Warm (tests/warm.py) but where torchrun is the point: a failing rank ends the job."""
    return launch([BIN / "torchrun", "--nproc_per_node", str(processes), "--master_port", free_port(), SCRIPT, *SMALL,
                   *options], env=env, check=check, timeout=600)


@pytest.fixture(autouse=True)
def accelerate_installed():
    require("accelerate")  # transformers.Trainer runs on it


def test_three_processes_end_with_the_single_device_weights_and_count_each_dev_sample_once(tmp_path, single_33):
    """3 x 11 against one device x 33: the last global batch (2 samples) leaves one process only a
    repeat of weight 0, and the 83 dev samples do not split over 3. Exact to float rounding: the
    Trainer's defaults (clipping, linear decay, its AdamW, sampler, loss averaging) are all undone.
    Its model folder is an ordinary one. (Shuffled, length-grouped, with dropout: test_base_shape.py's
    --max-steps run.)"""
    process = torchrun(3, *EXACT, "--batch-size", "11", "--output-dir", str(tmp_path), env={"OMP_NUM_THREADS": "1"})
    assert_same_weights(single_33 / "model", tmp_path / "model")
    result, reference = read_result(tmp_path), read_result(single_33)
    # The same fields as every script's result.json, filled the same way, and what the processes sent:
    # DDP's one all-reduce of the gradients per step, within its formula at 3.
    assert result.keys() - {"collective_bytes", "collective_formula_bytes"} == reference.keys()
    assert assert_sends_what_its_formula_allows(result)["kinds"]["all-reduce"]["bytes"] == 4 * result["parameters"]
    assert result["strategy"] == "hf-trainer" and result["launcher"] == "torchrun" and result["world_size"] == 3
    assert result["global_batch_size"] == 33 and result["batch_size_per_process"] == 11
    assert result["steps"] == reference["steps"] == 11 and result["samples_trained"] == 332
    assert result["dev_samples"] == DEV_SAMPLES and result["train_samples"] == 332
    assert result["threads_per_process"] == max(1, machine.usable_cores() // 3)
    assert result["versions"]["accelerate"] and result["resumed_from_step"] == 0
    for key in ("dev_loss", "dev_accuracy", "dev_macro_f1", "final_train_loss", "tokens_per_sample"):
        assert result[key] == pytest.approx(reference[key], rel=1e-5), key
    assert result["model_state_bytes"] == reference["model_state_bytes"]  # stage 0: all of it in each process
    # Each step's loss, kept by the Trainer's callbacks, on one device's line (TensorBoard's events).
    loss, reference_loss = read_curves(tmp_path)["train/loss"], read_curves(single_33)["train/loss"]
    assert loss.keys() == reference_loss.keys() == set(range(1, 12))
    assert list(loss.values()) == pytest.approx(list(reference_loss.values()), rel=1e-5)
    # Rank 0 alone prints, in the suite's form; the Trainer's own log dictionaries are not printed.
    assert process.stdout.count("【train】 epoch：1/1 step：11/11 loss：") == 1
    assert "dev: 83 samples" in process.stdout and "strategy hf-trainer (torchrun, 3 process(es)" in process.stdout
    assert "'loss':" not in process.stdout + process.stderr
    assert sorted(p.name for p in tmp_path.iterdir()) == ["model", "result.json", "tensorboard"]
    # predict.py scores the reported accuracy; transformers' own pipeline loads the folder.
    assert abs(predict_dev_accuracy(tmp_path) - result["dev_accuracy"]) < 1e-9
    classify = transformers.pipeline("text-classification", model=str(tmp_path / "model"), device="cpu")
    assert classify("今天天气真好")[0]["label"] in common.LABELS


def test_one_process_ends_with_the_single_device_weights(tmp_path, single_reference):
    """python, no launcher: the Trainer on one device, 2 micro-batches of 16 per step against one
    batch of 32 (its accumulation, and the short last step of one micro-batch of 12)."""
    warm.run([PYTHON, SCRIPT, *SMALL, *EXACT, "--batch-size", "16", "--grad-accum", "2", "--output-dir", str(tmp_path)])
    result = read_result(tmp_path)
    assert result["launcher"] == "python" and result["world_size"] == 1 and result["steps"] == 11
    assert result["global_batch_size"] == 32 and result["gradient_accumulation_steps"] == 2
    assert_same_weights(single_reference / "model", tmp_path / "model")


def test_a_failing_rank_ends_the_job(tmp_path):
    process = torchrun(2, "--output-dir", str(tmp_path), env={hooks.FAIL_AT_ENV: "1:2"}, check=False, launch=run)
    assert process.returncode != 0
    assert "error: rank 1 failed: RuntimeError: failure injected by SUITE_FAIL_AT at step 2" in process.stderr
    assert_no_process_left(str(tmp_path))
    assert not (tmp_path / "result.json").exists()


def test_deepspeed_through_training_arguments_ends_with_the_single_device_weights(tmp_path, single_reference):
    """TrainingArguments(deepspeed=configs/deepspeed/zero2.json), 2 CPU processes x 16, fp32."""
    require("deepspeed")
    torchrun(2, *EXACT, "--batch-size", "16", "--deepspeed", "configs/deepspeed/zero2.json",
             "--output-dir", str(tmp_path))
    result = read_result(tmp_path)
    assert result["zero_stage"] == 2 and result["versions"]["deepspeed"] and result["dev_samples"] == DEV_SAMPLES
    assert result["deepspeed_config"]["gradient_clipping"] == 0.0  # "auto", filled from max_grad_norm=0
    assert_same_weights(single_reference / "model", tmp_path / "model")
    # Counted where the Trainer's callbacks and the optimizer's step hook see the state: ZeRO-2's
    # gradient partition, not the whole gradients nor ZeRO's fp32 copy beside its reduce buffer.
    held, formula = result["model_state_bytes"], result["model_state_formula_bytes"]
    for part in ("parameters", "gradients", "optimizer_state"):  # up to padding and Adam's step counters
        assert formula[part] <= held[part] <= formula[part] * 1.01 + 4096, (part, held, formula)


def test_what_the_trainer_cannot_do_is_refused_in_one_line(monkeypatch, capsys, tmp_path):
    """Refused before any process group or model: run in this process, it costs no interpreter start."""
    handlers = {number: signal.getsignal(number) for number in STOP_SIGNALS}  # cli.run installs its own
    launched = {"RANK": "0", "WORLD_SIZE": "1", "LOCAL_RANK": "0", "LOCAL_WORLD_SIZE": "1"}
    try:
        for options, message, gpu_machine in (
                (["--fsdp"], "error: --fsdp needs GPUs: with CPU processes Accelerate drops the Trainer's FSDP plugin",
                 False),
                (["--save-on-signal"], "error: --resume, --save-steps and --save-on-signal are not available in "
                 "multi-gpu-transformers-cls.py", False),
                (["--deepspeed", "configs/deepspeed/zero2.json"],
                 "error: --deepspeed with --device cpu on a GPU machine: Accelerate would still put each process",
                 True)):
            if gpu_machine:  # a launched process that torch tells there is a GPU
                monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
                for name, value in launched.items():
                    monkeypatch.setenv(name, value)
            monkeypatch.setattr(sys, "argv", [SCRIPT, *SMALL, *options, "--output-dir", str(tmp_path)])
            with pytest.raises(SystemExit) as exit_:
                runpy.run_path(str(ROOT / SCRIPT), run_name="__main__")
            stderr = capsys.readouterr().err
            assert exit_.value.code == 2
            assert stderr.strip().splitlines() == [stderr.strip().splitlines()[-1]]
            assert stderr.startswith(message), stderr
    finally:
        for number, handler in handlers.items():
            signal.signal(number, handler)
    assert not any(tmp_path.iterdir())
