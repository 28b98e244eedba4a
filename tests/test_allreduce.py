"""microbenchmarks/allreduce.py: the sweep and the model-gradient row, with the NCCL tests' bandwidths."""
import json

import pytest

from conftest import BIN, SAMPLES, free_port, run, small_split


def test_allreduce_benchmark(tmp_path):
    from support import models
    output = tmp_path / "allreduce.json"
    run([BIN / "torchrun", "--nproc_per_node", "2", "--master_port", free_port(), "microbenchmarks/allreduce.py",
         "--model", "tiny", "--max-samples", str(SAMPLES), "--dev-ratio", "0.2", "--device", "cpu",
         "--sizes", "4K,1M", "--iters", "3", "--warmup", "1", "--json", str(output)], timeout=120)
    result = json.loads(output.read_text(encoding="utf-8"))
    assert result["world_size"] == 2 and result["backend"] == "gloo"

    # The tiny model of the SMALL split, built here as the training scripts build it.
    train, _ = small_split()
    _, model = models.build_tiny_model([text for text, _ in train], 123, {"num_labels": 6})
    parameters = sum(parameter.numel() for parameter in model.parameters())
    assert result["model_parameters"] == parameters

    rows = result["rows"]
    assert [row["bytes"] for row in rows if not row["model_gradients"]] == [4096, 2**20]
    [model_row] = [row for row in rows if row["model_gradients"]]
    assert model_row["bytes"] == 4 * parameters and model_row["elements"] == parameters
    for row in rows:
        assert row["time_ms"] > 0 and row["algbw"] > 0 and row["busbw"] > 0
        assert row["algbw"] == pytest.approx(row["bytes"] / (row["time_ms"] / 1e3) / 1e9)
        assert row["busbw"] == pytest.approx(row["algbw"] * 2 * (2 - 1) / 2)
