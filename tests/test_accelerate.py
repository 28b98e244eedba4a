"""multi-gpu-accelerate-cls.py: 2 CPU processes over gloo, under accelerate launch and (warm) torchrun's environment;
its checkpoints are Accelerate's save_state, swapped in whole. The accelerate launch runs are conftest's:
the resumed one (test_resume.py checks that it takes DDP's shuffled global batches, epoch after epoch,
and ends on the weights of DDP's uninterrupted run) and the accumulating one."""
import importlib.util
import json
import math

import pytest
import torch
import transformers

import common
import warm
from support import checkpoints
from conftest import (BIN, DEV_SAMPLES, EXACT, ROOT, SMALL, assert_same_weights, load_weights,
                      predict_dev_accuracy, read_result, require, run_in_process)

SCRIPT = "multi-gpu-accelerate-cls.py"
EQUIVALENCE = [*EXACT, "--batch-size", "16"]


@pytest.fixture(autouse=True)
def accelerate_installed():
    require("accelerate")


def assert_accelerate_result(result, launcher, global_batch):
    assert result["strategy"] == "accelerate" and result["launcher"] == launcher
    assert result["world_size"] == 2 and result["global_batch_size"] == global_batch
    assert result["dev_samples"] == DEV_SAMPLES  # each dev sample counted once, not once per process
    assert result["versions"]["accelerate"]


def test_accelerate_launch_shards_the_data_and_logs_once(resumed_run):
    """conftest's resumed Accelerate run: accelerate launch --multi_gpu, 2 processes x 16, shuffling,
    length grouping and dropout on (the defaults), from the step-8 checkpoint of the run that crashed
    to the end of epoch 2, a checkpoint every 4 steps (test_resume.py checks its weights)."""
    process, output = resumed_run("accelerate")
    assert "accelerate: MULTI_CPU, 2 process(es)" in process.stdout
    result = read_result(output)
    assert_accelerate_result(result, "accelerate launch", global_batch=32)
    # 2 epochs of 332 samples in global batches of 32 (10 full, 1 of 12): 22 steps. Unsharded, 42.
    assert result["steps"] == 22 and result["precision"] == "fp32" and result["samples_trained"] == 2 * 332 - 8 * 32
    assert process.stdout.count("【train】 epoch：2/2 step：22/22 loss：") == 1  # only rank 0 logs
    # The step-20 checkpoint: save_state's files (each process its random states) beside the suite's
    # state; no staging folder left.
    assert sorted(p.name for p in output.iterdir()) == ["checkpoint", "model", "result.json", "tensorboard"]
    assert sorted(p.name for p in (output / "checkpoint").iterdir()) == [
        "meaning.json", "model.safetensors", "optimizer.bin", "random_states_0.pkl", "random_states_1.pkl",
        "training_state.pt"]
    assert json.loads((output / "checkpoint" / "meaning.json").read_text(encoding="utf-8"))["step"] == 20
    # The inner model, without DDP's "module.": predict.py scores the reported accuracy, transformers'
    # own pipeline loads it.
    assert not any(key.startswith("module.") for key in load_weights(output / "model"))
    assert abs(predict_dev_accuracy(output) - result["dev_accuracy"]) < 1e-9
    classify = transformers.pipeline("text-classification", model=str(output / "model"), device="cpu")
    assert classify("今天天气真好")[0]["label"] in common.LABELS


def test_config_file_launch_equals_one_device_at_the_same_global_batch(accumulating_run, single_reference):
    """accelerate launch --config_file configs/accelerate/multi-gpu.yaml, 2 processes x 8 x 2 micro-batches
    with averaged gradients (conftest's accumulating run), take the same steps as 1 process x 32."""
    _, output = accumulating_run("accelerate")
    result = read_result(output)
    assert_accelerate_result(result, "accelerate launch", global_batch=32)
    assert result["steps"] == read_result(single_reference)["steps"] == 11
    assert_same_weights(single_reference / "model", output / "model")


def test_bf16_under_torchrun_trains_like_fp32(tmp_path, single_reference):
    """Warm (tests/warm.py): torchrun's environment, which names the launcher (test_warm.py checks it)."""
    warm.run([BIN / "torchrun", "--standalone", "--nproc_per_node", "2", SCRIPT, *SMALL, *EQUIVALENCE,
              "--precision", "bf16", "--output-dir", str(tmp_path)], timeout=600)
    result = read_result(tmp_path)
    assert_accelerate_result(result, "torchrun", global_batch=32)
    assert result["precision"] == "bf16"
    # bf16 really ran: the weights are not the fp32 run's to float tolerance...
    with pytest.raises(AssertionError, match="largest weight difference"):
        assert_same_weights(single_reference / "model", tmp_path / "model")
    # ...yet it learned as much: the untrained model's dev loss is ln 6 (uniform over 6 labels).
    assert result["dev_loss"] < math.log(6) - 0.03
    assert abs(result["dev_loss"] - read_result(single_reference)["dev_loss"]) < 0.01


def test_fp16_on_cpu_is_refused_rather_than_run_in_fp32(tmp_path):
    process = run_in_process([SCRIPT, *SMALL, "--precision", "fp16", "--output-dir", str(tmp_path)])
    assert process.returncode == 2
    assert process.stderr.strip().splitlines()[-1].startswith("error: --precision fp16 needs a GPU")


def test_an_interrupted_save_keeps_the_previous_checkpoint_which_load_state_restores(tmp_path, monkeypatch):
    """In this process, alone: save_state writes in place, so a save that fails halfway must leave the
    last complete checkpoint whole, and load_state bring back its weights and optimizer moments."""
    from accelerate import Accelerator
    from accelerate.state import AcceleratorState
    spec = importlib.util.spec_from_file_location("accelerate_script", ROOT / SCRIPT)
    script = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(script)
    accelerator = Accelerator(cpu=True)
    try:
        strategy = script.Accelerate(accelerator, "python", "fp32")
        layer = torch.nn.Linear(4, 2)
        model, optimizer = accelerator.prepare(layer, torch.optim.AdamW(layer.parameters(), lr=0.1))

        def train_step():
            strategy.backward(model(torch.ones(3, 4)).square().sum())
            strategy.step(model, optimizer)

        def checkpoint(step):
            state = {"step": step, "meaning": {"world_size": 1}, "random_states": [checkpoints.random_states()],
                     "strategy_state": strategy.extra_state()}
            strategy.save_state(model, optimizer, tmp_path / "checkpoint", state)

        train_step()
        checkpoint(1)
        saved = {name: tensor.clone() for name, tensor in model.state_dict().items()}
        assert sorted(p.name for p in (tmp_path / "checkpoint").iterdir()) == [
            "meaning.json", "model.safetensors", "optimizer.bin", "random_states_0.pkl", "training_state.pt"]
        train_step()

        def fails_halfway(output_dir):
            output_dir.mkdir()
            (output_dir / "model.safetensors").write_bytes(b"half a file")
            raise OSError("disk full")

        monkeypatch.setattr(accelerator, "save_state", fails_halfway)
        with pytest.raises(OSError, match="disk full"):
            checkpoint(2)
        assert strategy.checkpoint_meaning(tmp_path / "checkpoint")["step"] == 1
        assert strategy.load_state(model, optimizer, tmp_path / "checkpoint")["step"] == 1
        assert all(torch.equal(tensor, saved[name]) for name, tensor in model.state_dict().items())
        assert optimizer.state_dict()["state"][0]["step"].item() == 1
        # The next save clears what the failed one left in the staging folder.
        monkeypatch.undo()
        checkpoint(2)
        assert strategy.checkpoint_meaning(tmp_path / "checkpoint")["step"] == 2
        assert sorted(p.name for p in tmp_path.iterdir()) == ["checkpoint"]
    finally:
        accelerator.end_training()
        AcceleratorState._reset_state(reset_partial_state=True)
