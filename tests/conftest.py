"""Helpers shared by the tests: run a script the way a user would, read what it wrote."""
import importlib.util
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest

ROOT = Path(__file__).resolve().parents[1]
PYTHON = sys.executable
BIN = Path(PYTHON).parent
# A few hundred samples: 320 train (10 steps of 32), 80 dev. Enough to exercise every path.
SMALL = ["--model", "tiny", "--max-samples", "400", "--dev-ratio", "0.2", "--log-steps", "5"]

sys.path.insert(0, str(ROOT))


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
    """The models in two checkpoint folders are equal to float tolerance, tensor by tensor."""
    a, b = load_weights(a_dir), load_weights(b_dir)
    assert a.keys() == b.keys()
    worst = max((a[k].float() - b[k].float()).abs().max().item() for k in a)
    assert worst < atol, f"largest weight difference {worst:g} exceeds {atol:g}"


def predict_dev_accuracy(output_dir):
    """Run predict.py on the SMALL dev texts with the model in `output_dir`; return its accuracy."""
    import common
    _, dev = common.split_records(common.load_records(ROOT / "data" / "train.json"), 400, 0.2, 123)
    texts_file = Path(output_dir) / "dev.txt"
    texts_file.write_text("\n".join(text for text, _ in dev), encoding="utf-8")
    lines = run([PYTHON, "predict.py", "--checkpoint", str(Path(output_dir) / "model"), "--file", str(texts_file)]
                ).stdout.strip().splitlines()
    assert len(lines) == len(dev)
    return sum(line.split("\t")[0] == common.LABELS[label] for line, (_, label) in zip(lines, dev)) / len(dev)


def processes_mentioning(marker):
    """The running processes whose command line mentions `marker` (a test's own output folder)."""
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


@pytest.fixture(scope="session")
def single_reference(tmp_path_factory):
    """single-gpu-cls.py at batch 32, shuffling and dropout off: what distributed runs must equal."""
    output = tmp_path_factory.mktemp("single-reference")
    run([PYTHON, "single-gpu-cls.py", *SMALL, "--no-shuffle", "--dropout", "0", "--output-dir", str(output)])
    return output
