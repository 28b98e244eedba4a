"""What each strategy sends (support/traffic.py): the byte checks catch a strategy that sends more
than its formula allows. Every strategy's own check folds into the launch that already runs it: 2
processes in test_grad_accum.py, test_anatomy.py, test_fsdp.py, test_horovod.py and test_deepspeed.py,
3 in test_equivalence.py (conftest.assert_sends_what_its_formula_allows)."""
import pytest

from conftest import EXACT, SMALL, assert_sends_what_its_formula_allows, free_port, read_result, run_in_process

import hooks


def test_a_wasteful_accumulation_and_a_stray_broadcast_are_caught(tmp_path):
    """DDP in this process (one rank: a world of one still runs its collectives), 2 micro-batches per
    step: with no_sync() dropped it all-reduces after each micro-batch, twice the formula's bytes, and a
    broadcast after each step is a kind the formula does not allow."""
    env = {"RANK": "0", "WORLD_SIZE": "1", "LOCAL_RANK": "0", "LOCAL_WORLD_SIZE": "1", "MASTER_ADDR": "127.0.0.1",
           "MASTER_PORT": free_port(), hooks.WASTE_ENV: "sync,broadcast"}
    process = run_in_process(["multi-gpu-distributed-cls.py", *SMALL, *EXACT, "--batch-size", "8", "--grad-accum", "2",
                              "--max-steps", "3", "--output-dir", str(tmp_path)], env=env)
    assert process.returncode == 0, process.stderr
    result = read_result(tmp_path)
    sent, allowed = result["collective_bytes"]["kinds"], result["collective_formula_bytes"]["kinds"]
    assert sent["all-reduce"]["bytes"] == 2 * allowed["all-reduce"] == 2 * 4 * result["parameters"]
    with pytest.raises(AssertionError, match="all-reduce: "):
        assert_sends_what_its_formula_allows(result)
    del sent["all-reduce"]
    assert sent["broadcast"]["bytes"] > allowed["broadcast"] + 1024
    with pytest.raises(AssertionError, match="broadcast: "):
        assert_sends_what_its_formula_allows(result)
