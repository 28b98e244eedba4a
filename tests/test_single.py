"""single-gpu-cls.py end to end on a few hundred samples, and predict.py on what it saved."""
import pytest
import torch
import transformers

import common
from instruments import flops
from support import models
from support.options import build_parser
from conftest import (DEV_SAMPLES, PYTHON, SMALL, assert_same_weights, load_weights, predict_dev_accuracy,
                      read_curves, read_result, run, run_in_process, small_split)

RESULT_KEYS = {"strategy", "launcher", "world_size", "device", "model", "precision", "batch_size_per_process",
               "global_batch_size", "epochs", "train_seconds", "samples_per_second", "peak_memory_mb",
               "dev_loss", "dev_accuracy", "dev_macro_f1", "dev_samples", "versions"}


@pytest.fixture(scope="module")
def first_run(tmp_path_factory):
    """single-gpu-cls.py as a new user first runs it, with --model auto: without model_hub/'s real
    model and without the hub (HF_HUB_OFFLINE=1) it falls back to the tiny model. (Where model_hub/
    holds the real model, --model tiny.)"""
    output = tmp_path_factory.mktemp("single")
    model = "tiny" if models.LOCAL_MODEL_DIR.is_dir() else "auto"
    options = [arg for arg in SMALL if arg not in ("--model", "tiny")]
    process = run([PYTHON, "single-gpu-cls.py", *options, "--model", model, "--output-dir", str(output)],
                  env={"HF_HUB_OFFLINE": "1"})
    return process, output


@pytest.mark.quick
def test_single_device_trains_evaluates_saves_and_predicts(first_run):
    process, output = first_run
    assert "【train】 epoch：1/1 step：5/11 loss：" in process.stdout + process.stderr
    assert "耗时：" in process.stdout and "samples/s" in process.stdout

    result = read_result(output)
    assert RESULT_KEYS <= result.keys()
    assert result["strategy"] == "single-device" and result["launcher"] == "python"
    assert result["world_size"] == 1 and result["global_batch_size"] == 32 and result["model"] == "tiny"
    assert result["dev_samples"] == DEV_SAMPLES and result["steps"] == 11  # 10 batches of 32 and one of 12
    assert result["samples_trained"] == 332 and result["train_seconds"] > 0 and result["peak_memory_mb"] > 0
    assert result["versions"]["torch"] == torch.__version__
    # The pace against the limit (measure.Throughput): the first step apart, then the steady steps; the
    # work counted from the shapes the loop computed, recounted here from the sampler's batches.
    assert result["first_step_seconds"] > 0 and result["steady_step_seconds"] > 0
    assert result["steady_samples_per_second"] > 0 and result["real_tokens_per_second"] > 0
    assert "first step " in process.stdout and "TFLOP/s" in process.stdout
    train, _ = small_split()
    tokenizer, initial = models.build_tiny_model([t for t, _ in train], 123, {"num_labels": 6})
    lengths = [len(ids) for ids in tokenizer([t for t, _ in train], truncation=True, max_length=128)["input_ids"]]
    sampler = common.GlobalBatchSampler(lengths, 32, seed=123)
    sampler.set_epoch(1)
    batches = [[lengths[i] for i in batch] for batch in sampler.global_batches()]
    assert result["computed_sequences"] == 332 and result["real_tokens"] == sum(lengths)
    assert result["real_sequences"] == 332 and result["real_attended_pairs"] == sum(n * n for n in lengths)
    assert result["pad_to_multiple_of"] == 1  # a CPU's default: each batch to its longest text
    assert result["step_shapes"] == len({(len(batch), max(batch)) for batch in batches})
    assert result["computed_tokens"] == sum(len(batch) * max(batch) for batch in batches)
    assert result["attended_pairs"] == sum(len(batch) * max(batch) ** 2 for batch in batches)
    assert result["model_flops"] == flops.training_flops(initial.config, result["computed_tokens"],
                                                         result["computed_sequences"], result["attended_pairs"])
    assert result["compute_precision"] == "fp32" and result["compiled"] is False
    assert result["mfu"] is None and "matmul_peak.py" in result["mfu_note"]  # a CPU has no published peak

    # The reported accuracy is the saved model's: predict.py on the dev texts scores the same.
    assert abs(predict_dev_accuracy(output) - result["dev_accuracy"]) < 1e-9

    # The checkpoint is portable: no DDP "module." prefixes, no temporary folders left behind.
    weights = load_weights(output / "model")
    assert not any(key.startswith("module.") for key in weights)
    assert sorted(p.name for p in output.iterdir()) == ["dev.txt", "model", "result.json", "tensorboard"]
    # ...and it really trained: the weights moved away from the seed's initialisation.
    assert not torch.allclose(initial.classifier.weight, weights["classifier.weight"])

    # predict.py's label and probability are what transformers' own pipeline finds in the folder, and
    # it joins word-segmented text as training does.
    texts = ["今天天气真好", "气死我了", "气死 我 了"]
    predicted = run_in_process(["predict.py", "--checkpoint", str(output / "model"), *texts])
    assert predicted.returncode == 0, predicted.stderr
    lines = predicted.stdout.strip().splitlines()
    expected = transformers.pipeline("text-classification", model=str(output / "model"), device="cpu")(texts[:2])
    assert len(lines) == 3
    for line, text, truth in zip(lines, texts, expected):
        label, probability, echoed = line.split("\t")
        assert (label, echoed) == (truth["label"], text)
        assert abs(float(probability) - truth["score"]) < 1e-4
    assert lines[2].split("\t")[:2] == lines[1].split("\t")[:2]


def test_every_step_is_written_for_tensorboard_and_read_back(single_33):
    """tensorboard --logdir reads each optimizer step's loss, learning rate and seconds from the event
    files (no MFU without a published peak: a CPU); result.json holds the same losses for the runner's
    chart. The last step's loss is the last one the loop logged (--log-steps 5: step 11 alone), and the
    steps' seconds add up to the training loop's."""
    curves, result = read_curves(single_33), read_result(single_33)
    assert set(curves) == {"train/loss", "train/learning_rate", "train/step_seconds"}
    assert all(curve.keys() == set(range(1, 12)) for curve in curves.values())
    assert list(curves["train/learning_rate"].values()) == pytest.approx([result["learning_rate"]] * 11)
    assert curves["train/loss"][11] == pytest.approx(result["final_train_loss"], rel=1e-6)
    assert result["train_loss_curve"] == {"first_step": 1, "loss": pytest.approx(list(curves["train/loss"].values()),
                                                                                 rel=1e-5)}
    # result.json rounds the loop's seconds to the millisecond
    assert 0.9 * result["train_seconds"] < sum(curves["train/step_seconds"].values()) <= result["train_seconds"] + 5e-4
    assert result["tensorboard"] == str(single_33 / "tensorboard")


def test_auto_falls_back_to_the_tiny_model_with_a_banner(first_run):
    if models.LOCAL_MODEL_DIR.is_dir():
        pytest.skip(f"{models.LOCAL_MODEL_DIR} exists, so --model auto would use it")
    process, output = first_run
    assert process.stderr.count("using the TINY randomly") == 1
    assert read_result(output)["model"] == "tiny"


def test_gradient_checkpointing_is_switched_on_and_trains_the_same_weights(profiled_benchmark, single_reference):
    """Recomputing the activations in backward saves memory, not results: the profiled runner run's
    one-device row (16 x 2 micro-batches, --gradient-checkpointing) ends with the weights of the
    reference at batch 32, and the model really checkpoints."""
    args = build_parser("single-gpu-cls.py", "").parse_args(["--model", "tiny", "--gradient-checkpointing"])
    train, _ = small_split()
    _, model, _, _ = models.load_model(args, [text for text, _ in train], "tiny", common.LABELS)
    assert model.is_activation_checkpointing
    output, rows = profiled_benchmark
    assert rows["single"]["command"].endswith(" --gradient-checkpointing")
    assert_same_weights(single_reference / "model", output / "single" / "model")
