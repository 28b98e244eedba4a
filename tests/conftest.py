"""Helpers shared by the tests: run a script the way a user would, read what it wrote."""
import importlib.util
import json
import os
import subprocess
import sys
import sysconfig
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PYTHON = sys.executable


def launcher_dir():
    """Where this Python's launchers (torchrun, accelerate, deepspeed, ...) are: beside it in a venv,
    elsewhere for a system Python (/usr/local/bin, ~/.local/bin for a user install)."""
    candidates = [Path(PYTHON).parent, Path(sysconfig.get_path("scripts")),
                  Path(sysconfig.get_path("scripts", f"{os.name}_user"))]
    return next((path for path in candidates if (path / "torchrun").exists()), candidates[0])


BIN = launcher_dir()
# A few hundred samples that divide by nothing in sight, as real data does: 332 train (10 batches
# of 32 and a short one of 12; 10 of 33 and one of 2, which 3 processes cannot share evenly) and
# 83 dev (uneven over 2 or 3 processes). Sizes that divide evenly hide the bugs that matter.
SAMPLES, DEV_SAMPLES = 415, 83
# --device cpu: the regular suite always runs on the CPU, over gloo, GPUs or not. With --device auto a
# machine with fewer GPUs than a test's 2 or 3 processes fails ("local rank 1 has no GPU"), and one with
# enough would test NCCL instead of the path the tests check. tests/test_gpu.py runs on the GPUs.
SMALL = ["--model", "tiny", "--max-samples", str(SAMPLES), "--dev-ratio", "0.2", "--log-steps", "5",
         "--device", "cpu"]
# benchmark.py has no --device: it reads the GPUs torch sees to pick --nprocs, DataParallel's --gpu-ids
# and fabric run's --accelerator. Hiding them keeps the runner and every script it starts on the CPU.
CPU_ONLY = {"CUDA_VISIBLE_DEVICES": ""}
# Equivalence runs: shuffling and dropout off, so that only the strategy can make a difference.
EXACT = ["--no-shuffle", "--dropout", "0"]

sys.path.insert(0, str(ROOT))


def free_port():
    """A port nothing listens on, so a launch never meets the rendezvous of an earlier one."""
    import socket
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return str(probe.getsockname()[1])


def require(module):
    """Skip when an optional dependency is missing, except in CI, where it must be installed."""
    if importlib.util.find_spec(module) is None:
        if os.environ.get("CI"):
            pytest.fail(f"{module} is not installed, but CI must run its tests (see scripts/setup-env.sh)")
        pytest.skip(f"{module} is not installed (scripts/setup-env.sh installs it)")


def run(command, timeout=600, env=None, check=True):
    """Run a command from the repository root; on failure show its output in the test report."""
    process = subprocess.run(command, cwd=ROOT, capture_output=True, text=True, timeout=timeout,
                             env={**os.environ, **(env or {})})
    if check and process.returncode != 0:
        pytest.fail(f"{' '.join(map(str, command))} exited {process.returncode}\n"
                    f"--- stdout\n{process.stdout[-4000:]}\n--- stderr\n{process.stderr[-4000:]}")
    return process


def read_result(output_dir):
    return json.loads((Path(output_dir) / "result.json").read_text(encoding="utf-8"))


def load_weights(model_dir):
    from safetensors.torch import load_file
    return load_file(str(Path(model_dir) / "model.safetensors"))


def assert_same_weights(a_dir, b_dir, atol=1e-4):
    """The models in two checkpoint folders are equal to float tolerance, tensor by tensor. (A sample
    trained twice or weighed wrongly moves them by about 1e-3 here.)"""
    a, b = load_weights(a_dir), load_weights(b_dir)
    assert a.keys() == b.keys()
    worst = max((a[k].float() - b[k].float()).abs().max().item() for k in a)
    assert worst < atol, f"largest weight difference {worst:g} exceeds {atol:g}"


def small_split():
    """The SMALL run's (train, dev) records."""
    import common
    return common.split_records(common.load_records(ROOT / "data" / "train.json"), SAMPLES, 0.2, 123)


def untrained_dev_loss():
    """The dev loss of the tiny model before any step, on the SMALL split."""
    import torch
    import torch.nn.functional as F

    import models
    train, dev = small_split()
    tokenizer, model = models.build_tiny_model([text for text, _ in train], 123, {"num_labels": 6})
    encoded = tokenizer([text for text, _ in dev], padding=True, truncation=True, max_length=128, return_tensors="pt")
    with torch.no_grad():
        logits = model.eval()(**encoded).logits
    return F.cross_entropy(logits, torch.tensor([label for _, label in dev])).item()


def predict_dev_accuracy(output_dir):
    """Run predict.py on the SMALL dev texts with the model in `output_dir`; return its accuracy."""
    import common
    _, dev = small_split()
    texts_file = Path(output_dir) / "dev.txt"
    texts_file.write_text("\n".join(text for text, _ in dev), encoding="utf-8")
    lines = run([PYTHON, "predict.py", "--checkpoint", str(Path(output_dir) / "model"), "--file", str(texts_file)]
                ).stdout.strip().splitlines()
    assert len(lines) == len(dev)
    return sum(line.split("\t")[0] == common.LABELS[label] for line, (_, label) in zip(lines, dev)) / len(dev)


def processes_mentioning(marker):
    """The running processes whose command line mentions `marker` (a test's own output folder)."""
    import psutil  # here, not at the top: tests/test_gpu.py must load where psutil is missing
    found = []
    for process in psutil.process_iter(["cmdline"]):
        try:
            if any(marker in part for part in process.info["cmdline"] or []):
                found.append(process)
        except psutil.Error:
            continue
    return found


def assert_no_process_left(marker):
    """No process of the job is left running (allowing a few seconds to exit)."""
    deadline = time.monotonic() + 10
    while processes_mentioning(marker) and time.monotonic() < deadline:
        time.sleep(0.5)
    assert processes_mentioning(marker) == [], "orphan processes left running"


def single_run(tmp_path_factory, batch_size):
    output = tmp_path_factory.mktemp(f"single-reference-{batch_size}")
    run([PYTHON, "single-gpu-cls.py", *SMALL, *EXACT, "--batch-size", str(batch_size), "--output-dir", str(output)])
    return output


@pytest.fixture(scope="session")
def single_reference(tmp_path_factory):
    """single-gpu-cls.py at batch 32, shuffling and dropout off: what 2 processes x 16 must equal."""
    return single_run(tmp_path_factory, 32)


@pytest.fixture(scope="session")
def single_33(tmp_path_factory):
    """single-gpu-cls.py at batch 33: what 3 processes x 11 must equal (the last global batch, 2
    samples, cannot be shared by 3)."""
    return single_run(tmp_path_factory, 33)


# What the suite costs, by file: seconds and the processes its tests launch (counted by Python's audit
# hook for subprocess.Popen, so nothing is replaced). Printed at the end of every run; docs/tests.md
# keeps the figures of a whole run on 2 cores.
_cost = {}
_current_file = [None]


def _count_launches(event, _args):
    if event == "subprocess.Popen" and _current_file[0] is not None:
        _cost.setdefault(_current_file[0], [0.0, 0, 0])[2] += 1


sys.addaudithook(_count_launches)


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_protocol(item, nextitem):
    _current_file[0] = item.nodeid.split("::")[0]
    started = time.monotonic()
    yield
    cost = _cost.setdefault(_current_file[0], [0.0, 0, 0])
    cost[0] += time.monotonic() - started
    cost[1] += 1
    _current_file[0] = None


def pytest_terminal_summary(terminalreporter):
    if not _cost:
        return
    write = terminalreporter.write_line
    terminalreporter.section("cost by file: seconds (setup, call and teardown), tests, launched processes")
    for name, (seconds, tests, launches) in sorted(_cost.items(), key=lambda item: -item[1][0]):
        write(f"{seconds:8.1f} s {tests:4d} tests {launches:4d} launches  {name}")
    write(f"{sum(c[0] for c in _cost.values()):8.1f} s {sum(c[1] for c in _cost.values()):4d} tests "
          f"{sum(c[2] for c in _cost.values()):4d} launches  total")
