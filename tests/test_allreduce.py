"""microbenchmarks/allreduce.py: the sweep and the model-gradient row, with the NCCL tests' bandwidths."""
import json

import pytest

from conftest import ROOT, SAMPLES


def test_allreduce_benchmark(profiled_benchmark):
    """The all-reduce the profiled run measured for its projection of the bytes sent (bench/traffic.py):
    microbenchmarks/allreduce.py under torch.distributed.run, 2 processes, sizes 4K and 16M."""
    import common
    from support import models
    output, _ = profiled_benchmark
    result = json.loads((output / "allreduce-2.json").read_text(encoding="utf-8"))
    assert result["world_size"] == 2 and result["backend"] == "gloo"

    # The tiny model of the split the runner named (--max-samples, the default --dev-ratio 0.08), built
    # here as the training scripts build it.
    train, _ = common.split_records(common.load_records(ROOT / "data" / "train.json"), SAMPLES, 0.08, 123)
    _, model = models.build_tiny_model([text for text, _ in train], 123, {"num_labels": 6})
    parameters = sum(parameter.numel() for parameter in model.parameters())
    assert result["model_parameters"] == parameters

    rows = result["rows"]
    assert [row["bytes"] for row in rows if not row["model_gradients"]] == [4096, 16 * 2**20]
    [model_row] = [row for row in rows if row["model_gradients"]]
    assert model_row["bytes"] == 4 * parameters and model_row["elements"] == parameters
    for row in rows:
        assert row["time_ms"] > 0 and row["algbw"] > 0 and row["busbw"] > 0
        assert row["algbw"] == pytest.approx(row["bytes"] / (row["time_ms"] / 1e3) / 1e9)
        assert row["busbw"] == pytest.approx(row["algbw"] * 2 * (2 - 1) / 2)
