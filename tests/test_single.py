"""single-gpu-cls.py end to end on a few hundred samples, and predict.py on what it saved."""
import torch

import common
from conftest import PYTHON, ROOT, SMALL, load_weights, predict_dev_accuracy, read_result, run

RESULT_KEYS = {"strategy", "launcher", "world_size", "device", "model", "precision", "batch_size_per_process",
               "global_batch_size", "epochs", "train_seconds", "samples_per_second", "peak_memory_mb",
               "dev_loss", "dev_accuracy", "dev_macro_f1", "dev_samples", "versions"}


def test_single_device_trains_evaluates_saves_and_predicts(tmp_path):
    process = run([PYTHON, "single-gpu-cls.py", *SMALL, "--output-dir", str(tmp_path)])
    assert "【train】 epoch：1/1 step：5/10 loss：" in process.stdout + process.stderr
    assert "耗时：" in process.stdout and "samples/s" in process.stdout

    result = read_result(tmp_path)
    assert RESULT_KEYS <= result.keys()
    assert result["strategy"] == "single-device" and result["launcher"] == "python"
    assert result["world_size"] == 1 and result["global_batch_size"] == 32 and result["model"] == "tiny"
    assert result["dev_samples"] == 80 and result["steps"] == 10
    assert result["train_seconds"] > 0 and result["peak_memory_mb"] > 0
    assert 0 <= result["dev_accuracy"] <= 1 and result["versions"]["torch"] == torch.__version__

    # The checkpoint is portable: no DDP "module." prefixes, no temporary folders left behind.
    weights = load_weights(tmp_path / "model")
    assert not any(key.startswith("module.") for key in weights)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["model", "result.json"]
    # ...and it really trained: the weights moved away from the seed's initialisation.
    train, _ = common.split_records(common.load_records(ROOT / "data" / "train.json"), 400, 0.2, 123)
    _, initial = common.build_tiny_model([t for t, _ in train], 123, {"num_labels": 6})
    assert not torch.allclose(initial.classifier.weight, weights["classifier.weight"])

    texts = ["今天 天气 真好", "气死 我 了"]
    predicted = run([PYTHON, "predict.py", "--checkpoint", str(tmp_path / "model"), *texts]).stdout
    lines = predicted.strip().splitlines()
    assert len(lines) == 2
    for line, text in zip(lines, texts):
        label, probability, echoed = line.split("\t")
        assert label in common.LABELS and 1 / 6 <= float(probability) <= 1 and echoed == text


def test_predict_reads_a_file_and_matches_the_dev_accuracy(tmp_path):
    """predict.py on the dev texts agrees with the accuracy the run reported."""
    run([PYTHON, "single-gpu-cls.py", *SMALL, "--output-dir", str(tmp_path)])
    assert abs(predict_dev_accuracy(tmp_path) - read_result(tmp_path)["dev_accuracy"]) < 1e-9


def test_auto_falls_back_to_the_tiny_model_with_a_banner(tmp_path):
    if common.LOCAL_MODEL_DIR.is_dir():
        import pytest
        pytest.skip(f"{common.LOCAL_MODEL_DIR} exists, so --model auto uses it")
    args = [arg for arg in SMALL if arg not in ("--model", "tiny")]
    process = run([PYTHON, "single-gpu-cls.py", *args, "--model", "auto", "--output-dir", str(tmp_path)],
                  env={"HF_HUB_OFFLINE": "1"})
    assert "using the TINY randomly" in process.stderr
    assert read_result(tmp_path)["model"] == "tiny"
