"""Distributed runs fail cleanly: interrupted runs stop everywhere, resume, and lose nothing."""
import hashlib
import os
import signal
import subprocess
import time

import psutil
import pytest

from conftest import BIN, PYTHON, ROOT, SMALL, assert_same_weights, read_result, run

EQUIVALENCE = [*SMALL, "--no-shuffle", "--dropout", "0"]


def digest(folder):
    return {p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in sorted(folder.rglob("*")) if p.is_file()}


def processes_mentioning(marker):
    found = []
    for process in psutil.process_iter(["cmdline"]):
        try:
            if any(marker in part for part in process.info["cmdline"] or []):
                found.append(process)
        except psutil.Error:
            continue
    return found


@pytest.mark.parametrize("launch", ["single", "ddp"])
def test_resume_after_a_crash_ends_like_an_uninterrupted_run(tmp_path, single_reference, launch):
    if launch == "single":
        command = [PYTHON, "single-gpu-cls.py", *EQUIVALENCE]
    else:
        command = [str(BIN / "torchrun"), "--standalone", "--nproc_per_node", "2", "multi-gpu-distributed-cls.py",
                   *EQUIVALENCE, "--batch-size", "16"]
    command += ["--output-dir", str(tmp_path), "--save-steps", "4"]
    crashed = run(command, env={"SUITE_FAIL_AT": "0:6"}, check=False, timeout=300)
    assert crashed.returncode != 0 and (tmp_path / "checkpoint").is_dir()
    assert not (tmp_path / "result.json").exists()

    resumed = run([*command, "--resume"], timeout=300)
    assert "continuing from step 4" in resumed.stdout
    assert read_result(tmp_path)["resumed_from_step"] == 4
    assert_same_weights(single_reference / "model", tmp_path / "model")


def start_long_ddp_run(output_dir):
    command = [str(BIN / "torchrun"), "--standalone", "--nproc_per_node", "2", "multi-gpu-distributed-cls.py",
               "--model", "tiny", "--max-samples", "8000", "--log-steps", "2", "--no-group-by-length",
               "--output-dir", str(output_dir)]
    return subprocess.Popen(command, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            env={**os.environ, "PYTHONUNBUFFERED": "1"}, start_new_session=True)


@pytest.mark.parametrize("how", ["sigterm-to-launcher", "ctrl-c-to-group"])
def test_interrupting_a_run_stops_every_process_and_keeps_the_previous_results(tmp_path, how):
    run([PYTHON, "single-gpu-cls.py", *SMALL, "--output-dir", str(tmp_path)])
    before = digest(tmp_path)

    launcher = start_long_ddp_run(tmp_path)
    try:
        for line in launcher.stdout:
            if "【train】" in line:
                break
        else:
            pytest.fail("the run ended before training started")
        if how == "sigterm-to-launcher":
            launcher.send_signal(signal.SIGTERM)
        else:
            os.killpg(launcher.pid, signal.SIGINT)
        launcher.communicate(timeout=60)
    finally:
        if launcher.poll() is None:
            os.killpg(launcher.pid, signal.SIGKILL)
    assert launcher.returncode != 0

    deadline = time.monotonic() + 10
    while processes_mentioning(str(tmp_path)) and time.monotonic() < deadline:
        time.sleep(0.5)
    assert processes_mentioning(str(tmp_path)) == [], "orphan processes left running"
    assert digest(tmp_path) == before, "the earlier model or result file changed"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["model", "result.json"]


def test_ddp_script_started_without_its_launcher_says_how_to_launch_it():
    process = run([PYTHON, "multi-gpu-distributed-cls.py", *SMALL], check=False, timeout=120)
    assert process.returncode == 2
    assert process.stderr.strip().splitlines()[-1].startswith("error: this script runs under a launcher: torchrun")
