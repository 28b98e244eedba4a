"""--grad-accum in every strategy, each the way its library does it: 2 processes x 8 x 2 micro-batches
(one device: 16 x 2) end with the weights of one device at 32. The 332 training samples end each
epoch with a short step of 12: one micro-batch instead of two, the loss still the mean over its 12.
The runs are conftest's ACCUMULATING, shared with each strategy's own file, and the rows of the
profiled runner run (one device, DDP, DeepSpeed's stages, FSDP2). (A resumed run skips the
micro-batches of the steps it has taken: test_resume.py's single and DataParallel runs.)"""
import pytest

from conftest import ACCUMULATING, PROFILED_ROWS, assert_same_weights, assert_sends_what_its_formula_allows, read_result


def assert_steps_like_one_device_at_32(output, single_reference):
    result = read_result(output)
    assert result["global_batch_size"] == 32 and result["steps"] == 11 and result["samples_trained"] == 332
    assert_same_weights(single_reference / "model", output / "model")
    return result


@pytest.mark.parametrize("strategy", list(ACCUMULATING))
def test_accumulating_ends_with_the_single_device_weights(accumulating_run, single_reference, strategy):
    _, output = accumulating_run(strategy)
    assert read_result(output)["gradient_accumulation_steps"] == 2
    result = assert_steps_like_one_device_at_32(output, single_reference)
    sent = result["collective_bytes"]
    if strategy == "dataparallel":  # one process: its copies between devices are no collectives
        assert sent["payload_bytes"] is None and "one process" in sent["note"]
    else:  # one exchange of the gradients per step (DDP's no_sync(), Horovod's synchronize()), not per micro-batch
        assert assert_sends_what_its_formula_allows(result) == sent
        assert sent["kinds"]["all-reduce"]["bytes"] == pytest.approx(4 * result["parameters"], abs=1024)


@pytest.mark.parametrize("row", PROFILED_ROWS)
def test_the_runners_accumulating_rows_end_with_the_single_device_weights(profiled_benchmark, single_reference, row):
    """Last in this file (as the test after): the runner's run is long, and another file may be launching it."""
    output, rows = profiled_benchmark
    assert rows[row]["status"] == "ok"
    assert read_result(output / row)["gradient_accumulation_steps"] == 2
    assert_steps_like_one_device_at_32(output / row, single_reference)
    # The chart's loss panel: every row on one device's line, step by step (the median run's curve).
    assert rows[row]["train_loss_curve"]["loss"] == pytest.approx(
        read_result(single_reference)["train_loss_curve"]["loss"], rel=1e-5)


def test_ddp_all_reduces_once_per_optimizer_step_whatever_the_accumulation(ddp_run, single_reference,
                                                                           profiled_benchmark):
    """no_sync(): 4 micro-batches of 4 per process (the legacy launcher's run) run as many all-reduces
    as 2 of 8 (the runner's DDP row): one per gradient bucket and step, not one per micro-batch. The
    last step's 12 samples are 2 micro-batches in the first run, 1 in the second."""
    output, _ = profiled_benchmark
    results = {accumulation: assert_steps_like_one_device_at_32(folder, single_reference)
               for accumulation, folder in ((4, ddp_run(4)[1]), (2, output / "ddp"))}
    counts = {accumulation: result["gradient_allreduces"] for accumulation, result in results.items()}
    assert counts[4] == counts[2] >= 11
    # The bytes too: each step's gradients once, whatever the micro-batches (4 bytes per parameter).
    for result in results.values():
        assert assert_sends_what_its_formula_allows(result)["kinds"]["all-reduce"]["bytes"] == 4 * result["parameters"]
