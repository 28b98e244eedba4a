"""The step and memory anatomy, through the runner: one row per sharding stage, each profiled (the
runner's run is conftest's `profiled_benchmark`, which test_benchmark.py reads too).

Every row's model state (counted from each process's tensors) must match what the ZeRO formula
predicts for it, and --profile must split a step into phases that add up to it, with DDP's
all-reduce seen and, where it runs under backward, overlapped."""
import json
from types import SimpleNamespace

import pytest
import torch

from conftest import assert_sends_what_its_formula_allows, read_result
from instruments import measure

MODEL_STATE = ("parameters", "gradients", "optimizer_state")


def test_each_process_holds_what_the_zero_formula_predicts(profiled_benchmark):
    _, rows = profiled_benchmark
    held = {name: row["model_state_bytes"] for name, row in rows.items()}
    for name, row in rows.items():
        formula = row["model_state_formula_bytes"]
        for part in MODEL_STATE:  # up to the libraries' padding and Adam's step counters
            assert formula[part] <= held[name][part] <= formula[part] * 1.03 + 4096, (name, part)
    assert held["ddp"] == held["single"]  # DDP holds everything, as one device does
    totals = {name: state["total"] for name, state in held.items()}
    # DeepSpeed's ZeRO-1 reduces the gradients into partitions at the end of backward: at the step
    # it holds what ZeRO-2 holds (docs/anatomy.md).
    assert totals["ddp"] > totals["deepspeed-zero1"] >= totals["deepspeed-zero2"] > totals["zero3-sharded-all"]
    # FSDP2's formula is ZeRO-3's without the fp32 master copy DeepSpeed keeps beside fp32 weights.
    assert held["fsdp"]["parameters"] == pytest.approx(held["zero3-sharded-all"]["parameters"], rel=0.01)
    assert held["fsdp"]["optimizer_state"] < held["zero3-sharded-all"]["optimizer_state"]
    assert rows["fsdp"]["model_state_formula_bytes"]["zero_stage"] == 3


def test_each_row_sends_what_its_formula_allows(profiled_benchmark):
    """2 processes x 2 micro-batches, read from --profile's records: DDP one all-reduce of the gradients
    per step; ZeRO-1 that and a gather of the updated weights; ZeRO-2 an all-reduce per micro-batch;
    ZeRO-3 a reduce-scatter per micro-batch and gathers; FSDP2 keeping its weights from forward to
    backward one gather per micro-batch and one reduce-scatter per step."""
    output, rows = profiled_benchmark
    assert rows["single"]["collective_bytes"] is None
    sent = {name: assert_sends_what_its_formula_allows(row) for name, row in rows.items() if name != "single"}
    fp32_gradients = 4 * read_result(output / "ddp")["parameters"]
    assert sent["ddp"]["kinds"]["all-reduce"]["bytes"] == fp32_gradients
    assert sent["deepspeed-zero2"]["kinds"]["all-reduce"]["bytes"] == pytest.approx(2 * fp32_gradients, abs=1024)
    assert sent["fsdp"]["kinds"]["all-gather"]["bytes"] == pytest.approx(2 * fp32_gradients, rel=0.01)
    assert sent["fsdp"]["kinds"]["reduce-scatter"]["bytes"] == pytest.approx(fp32_gradients, rel=0.01)
    # The anatomy shows the same bytes, a ring's worth per process.
    assert rows["ddp"]["profile"]["ring_bytes_per_step"] == sent["ddp"]["ring_bytes"]


def test_the_projection_is_a_model_of_each_rows_bytes_and_compute(profiled_benchmark):
    """At 8 and 64 GPUs over the published links, and against this machine's all-reduce (measured by
    the runner at 2 processes) for the steps profiled here."""
    output, rows = profiled_benchmark
    assert json.loads((output / "benchmark.json").read_text())["interconnect"]["2"]["busbw"] > 0
    assert rows["single"].get("projection") is None
    for name, row in rows.items():
        if name == "single":
            continue
        projection = row["projection"]
        assert [link["gpus"] for link in projection["published"]] == [8, 64, 64]
        for link in projection["published"]:
            assert link["overlapped_s"] <= link["serial_s"], name
            assert 0 < link["efficiency_serial"] <= link["efficiency_overlapped"] <= 1, name
        here = projection["here"]
        assert here["measured_s"] == pytest.approx(row["profile"]["step_ms"] / 1000), name
        assert here["serial_s"] == pytest.approx(here["compute_s"] + here["communication_s"]), name
        assert here["communication_s"] > 0 and here["error_serial"] == pytest.approx(
            here["serial_s"] / here["measured_s"] - 1), name
    table = (output / "benchmark.md").read_text(encoding="utf-8")
    assert "Projection (a model, not a measurement)" in table and "The model against this machine" in table
    assert "Bytes sent per step:" in table


def test_profile_splits_each_step_into_phases_and_communication(profiled_benchmark):
    output, rows = profiled_benchmark
    for name, row in rows.items():
        profile = row["profile"]
        assert profile["steps"] == 3
        trace = json.loads((output / name / "trace.json").read_text())
        assert any(event.get("name") == "backward" for event in trace["traceEvents"]), name
        phases = profile["phases_ms"]
        assert set(phases) == {"data loading", "forward", "backward", "optimizer step", "exposed communication"}
        assert min(phases.values()) >= 0 and phases["forward"] > 0 and phases["backward"] > 0
        assert sum(phases.values()) == pytest.approx(profile["step_ms"], rel=0.10), name
        assert profile["communication_ms"] == pytest.approx(
            phases["exposed communication"] + profile["overlapped_communication_ms"], abs=0.01)
    assert rows["single"]["profile"]["collectives"] == {} and rows["single"]["profile"]["communication_ms"] == 0
    ddp = rows["ddp"]["profile"]
    assert ddp["communication_ms"] > 0 and ddp["collectives"]["gloo:all_reduce"]["during"] == "backward"
    assert ddp["collectives"]["gloo:all_reduce"]["calls_per_step"] >= 1
    # ZeRO-1 and 2 gather the updated weights after the step; ZeRO-3 and FSDP2 gather them for compute.
    assert rows["deepspeed-zero2"]["profile"]["collectives"]["gloo:all_gather"]["during"] == "optimizer step"
    assert rows["fsdp"]["profile"]["collectives"]["gloo:all_gather"]["during"] in ("forward", "backward")
    assert read_result(output / "ddp")["profile"] == ddp


def test_the_tables_and_the_chart_show_the_anatomy(profiled_benchmark):
    output, rows = profiled_benchmark
    table = (output / "benchmark.md").read_text(encoding="utf-8")
    assert "Model state per process:" in table and "Step anatomy:" in table
    fsdp = rows["fsdp"]["model_state_bytes"]
    assert f"| fsdp | 2 | {fsdp['parameters'] / 2**20:.2f} | {fsdp['gradients'] / 2**20:.2f} |" in table
    chart = (output / "benchmark.png").read_bytes()
    assert chart.startswith(b"\x89PNG") and len(chart) > 10_000


def test_a_one_step_run_counts_the_optimizer_state_its_step_created():
    """The count before the second step never comes in a run of one: its Adam moments (created in
    the step) are counted after it, with the gradients counted before it (zero_grad frees them)."""
    model = torch.nn.Linear(256, 256)
    optimizer = torch.optim.AdamW(model.parameters())
    count = measure.ModelStateCount()
    count.on_train_begin(SimpleNamespace(strategy=SimpleNamespace(), model=model, optimizer=optimizer), 0)
    model(torch.ones(2, 256)).sum().backward()
    count.on_phase_begin(None, "optimizer step")
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    count.on_train_end(None)
    weights = sum(p.untyped_storage().nbytes() for p in model.parameters())
    assert count.bytes["parameters"] == count.bytes["gradients"] == weights
    assert count.bytes["optimizer_state"] >= 2 * weights  # the two moments, and each weight's step count
    assert count.bytes_by_device == {"cpu": count.bytes["total"]}
