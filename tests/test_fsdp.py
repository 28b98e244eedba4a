"""multi-gpu-fsdp-cls.py: FSDP2 on 2 CPU processes over gloo. The 3-process equivalence, resume and
failing-rank checks are in test_equivalence.py, test_resume.py and test_reliability.py."""
import pytest
import transformers

import warm
from conftest import (BIN, DEV_SAMPLES, SMALL, assert_same_weights, assert_sends_what_its_formula_allows, free_port,
                      load_weights,
                      predict_dev_accuracy, read_result, run_in_process, untrained_dev_loss)

SCRIPT = "multi-gpu-fsdp-cls.py"


def torchrun(*options):
    """Warm (tests/warm.py): the failing-rank and resume runs launch torchrun (test_reliability.py, test_resume.py)."""
    return warm.run([BIN / "torchrun", "--nproc_per_node", "2", "--master_port", free_port(), SCRIPT, *SMALL,
                     "--batch-size", "16", *options], timeout=600)


def test_bf16_with_checkpoints_learns_and_saves_a_portable_model(tmp_path):
    """Shuffling and dropout on, weights gathered in bf16, a sharded checkpoint every 4 steps."""
    torchrun("--precision", "bf16", "--save-steps", "4", "--output-dir", str(tmp_path))
    result = read_result(tmp_path)
    assert result["strategy"] == "fsdp2" and result["world_size"] == 2 and result["global_batch_size"] == 32
    assert result["precision"] == "bf16" and result["reshard_after_forward"] is True
    assert result["dev_samples"] == DEV_SAMPLES and result["samples_trained"] == 332
    assert result["dev_loss"] < untrained_dev_loss() - 0.03
    # Each process holds half of the fp32 weights, gradients and Adam moments (4 + 4 + 8 bytes each).
    whole = sum(tensor.numel() * 4 for tensor in load_weights(tmp_path / "model").values())
    held = result["model_state_bytes"]
    assert whole / 2 <= held["parameters"] < whole / 2 * 1.01 and held["gradients"] == held["parameters"]
    assert 0 <= held["optimizer_state"] - 2 * held["parameters"] < 1024  # and Adam's step counts
    # Each step gathers the weights in bf16 for forward and again for backward (2 x 2 bytes a weight),
    # and reduce-scatters the fp32 gradients once.
    sent = assert_sends_what_its_formula_allows(result)["kinds"]
    assert sent["all-gather"]["bytes"] == pytest.approx(2 * 2 * result["parameters"], rel=0.01)
    assert sent["reduce-scatter"]["bytes"] == pytest.approx(4 * result["parameters"], rel=0.01)
    # The gathered full state dict is an ordinary model folder: predict.py scores the reported
    # accuracy, transformers' own pipeline loads it.
    assert abs(predict_dev_accuracy(tmp_path) - result["dev_accuracy"]) < 1e-9
    classify = transformers.pipeline("text-classification", model=str(tmp_path / "model"), device="cpu")
    assert classify("今天天气真好")[0]["label"] in transformers.AutoConfig.from_pretrained(
        tmp_path / "model").id2label.values()
    # Each process wrote its own shard of the step-8 checkpoint; no staging folder is left.
    assert sorted(p.name for p in tmp_path.iterdir()) == ["checkpoint", "dev.txt", "model", "result.json",
                                                          "tensorboard"]
    shards = sorted(p.name for p in (tmp_path / "checkpoint").iterdir())
    assert shards == [".metadata", "__0_0.distcp", "__1_0.distcp", "meaning.json", "training_state.pt"]


def test_weights_kept_from_forward_to_backward_end_with_the_single_device_weights(profiled_benchmark,
                                                                                  single_reference):
    """--no-reshard-after-forward, 2 processes x 8 x 2 micro-batches: the profiled runner run's FSDP2 row."""
    output, _ = profiled_benchmark
    output = output / "fsdp"
    result = read_result(output)
    assert result["reshard_after_forward"] is False and result["steps"] == 11
    assert_same_weights(single_reference / "model", output / "model")


def test_what_a_cpu_cannot_run_is_refused_in_one_line(tmp_path):
    env = {"RANK": "0", "WORLD_SIZE": "1", "LOCAL_RANK": "0", "LOCAL_WORLD_SIZE": "1"}
    for options, message in ((["--offload"], "error: --offload moves the shards from GPU to CPU memory"),
                             (["--precision", "fp16"], "error: --precision fp16 needs a GPU")):
        process = run_in_process([SCRIPT, *SMALL, *options, "--output-dir", str(tmp_path)], env=env)
        assert process.returncode == 2
        assert process.stderr.strip().splitlines() == [process.stderr.strip().splitlines()[-1]]
        assert process.stderr.strip().startswith(message), process.stderr
