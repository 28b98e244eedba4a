"""What each strategy sends (instruments/traffic.py): the byte checks catch a strategy that sends more
than its formula allows. Every strategy's own check folds into the launch that already runs it: 2
processes in test_grad_accum.py, test_anatomy.py, test_fsdp.py, test_horovod.py and test_deepspeed.py,
3 in test_equivalence.py (conftest.assert_sends_what_its_formula_allows)."""
import pytest

import warm
from conftest import BIN, EXACT, SMALL, assert_sends_what_its_formula_allows, free_port, read_result

import hooks


def test_a_wasteful_accumulation_and_a_stray_broadcast_are_caught(tmp_path):
    """DDP at 2 processes (a world of one records nothing: it sends nothing), 2 micro-batches per step:
    with no_sync() dropped it all-reduces after each micro-batch, twice the formula's bytes, and a
    broadcast after each step is a kind the formula does not allow. Warm (tests/warm.py): torchrun is
    test_native.py's."""
    warm.run([BIN / "torchrun", "--nproc_per_node", "2", "--master_port", free_port(), "multi-gpu-distributed-cls.py",
              *SMALL, *EXACT, "--batch-size", "8", "--grad-accum", "2", "--max-steps", "3", "--no-save-model",
              "--output-dir", str(tmp_path)], env={hooks.WASTE_ENV: "sync,broadcast"})
    result = read_result(tmp_path)
    sent, allowed = result["collective_bytes"]["kinds"], result["collective_formula_bytes"]["kinds"]
    assert sent["all-reduce"]["bytes"] == 2 * allowed["all-reduce"] == 2 * 4 * result["parameters"]
    with pytest.raises(AssertionError, match="all-reduce: "):
        assert_sends_what_its_formula_allows(result)
    del sent["all-reduce"]
    assert sent["broadcast"]["bytes"] > allowed["broadcast"] + 1024
    with pytest.raises(AssertionError, match="broadcast: "):
        assert_sends_what_its_formula_allows(result)
