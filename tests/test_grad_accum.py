"""--grad-accum in every strategy, each the way its library does it: 2 processes x 8 x 2 micro-batches
(one device: 16 x 2) end with the weights of one device at 32. The 332 training samples end each
epoch with a short step of 12: one micro-batch instead of two, the loss still the mean over its 12.
The runs are conftest's ACCUMULATING, shared with each strategy's own file. (A resumed run skips
the micro-batches of the steps it has taken: test_resume.py's single and DataParallel runs.)"""
import pytest

from conftest import ACCUMULATING, assert_same_weights, read_result


def assert_steps_like_one_device_at_32(output, single_reference):
    result = read_result(output)
    assert result["global_batch_size"] == 32 and result["steps"] == 11 and result["samples_trained"] == 332
    assert_same_weights(single_reference / "model", output / "model")
    return result


@pytest.mark.parametrize("strategy", list(ACCUMULATING))
def test_accumulating_ends_with_the_single_device_weights(accumulating_run, single_reference, strategy):
    _, output = accumulating_run(strategy)
    assert read_result(output)["gradient_accumulation_steps"] == 2
    assert_steps_like_one_device_at_32(output, single_reference)


def test_ddp_all_reduces_once_per_optimizer_step_whatever_the_accumulation(ddp_run, single_reference):
    """no_sync(): 4 micro-batches of 4 per process run as many all-reduces as 1 batch of 16 (one per
    gradient bucket and step), not 4 times as many; the last step has 2 micro-batches (12 samples)."""
    counts = {accumulation: assert_steps_like_one_device_at_32(ddp_run(accumulation)[1], single_reference)[
        "gradient_allreduces"] for accumulation in (1, 4)}
    assert counts[4] == counts[1] >= 11
