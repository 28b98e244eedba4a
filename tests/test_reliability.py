"""Distributed runs fail cleanly: interrupted runs stop everywhere, resume, and lose nothing."""
import hashlib
import os
import signal
import socket
import subprocess
import time

import pytest

from conftest import BIN, PYTHON, ROOT, SMALL, assert_no_process_left, require, run


def digest(folder):
    return {p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in sorted(folder.rglob("*")) if p.is_file()}


def free_port():
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


LAUNCH = {
    "torchrun": lambda: [str(BIN / "torchrun"), "--standalone", "--nproc_per_node", "2",
                         "multi-gpu-distributed-cls.py"],
    "spawn": lambda: [PYTHON, "multi-gpu-distributed-mp-cls.py", "--nprocs", "2"],
    "horovod": lambda: [str(BIN / "horovodrun"), "-np", "2", "-H", "localhost:2", "--gloo", "--start-timeout", "120",
                        PYTHON, "multi-gpu-horovod-cls.py"],
    "deepspeed": lambda: [str(BIN / "deepspeed"), "--num_gpus", "2", "--master_port", str(free_port()),
                          "multi-gpu-deepspeed-cls.py"],
    "accelerate": lambda: [str(BIN / "accelerate"), "launch", "--multi_gpu", "--num_processes", "2",
                           "--main_process_port", str(free_port()), "multi-gpu-accelerate-cls.py"],
    "fsdp": lambda: [str(BIN / "torchrun"), "--nproc_per_node", "2", "--master_port", str(free_port()),
                     "multi-gpu-fsdp-cls.py"],
}


def start_long_run(launch, output_dir):
    command = [*LAUNCH[launch](), "--model", "tiny", "--max-samples", "8000", "--log-steps", "2",
               "--no-group-by-length", "--device", "cpu", "--output-dir", str(output_dir)]
    return subprocess.Popen(command, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            env={**os.environ, "PYTHONUNBUFFERED": "1"}, start_new_session=True)


@pytest.mark.parametrize("launch, how", [("torchrun", "sigterm-to-launcher"), ("torchrun", "ctrl-c-to-group"),
                                         ("spawn", "sigterm-to-launcher")])
def test_interrupting_a_run_stops_every_process_and_keeps_the_previous_results(tmp_path, launch, how):
    run([PYTHON, "single-gpu-cls.py", *SMALL, "--output-dir", str(tmp_path)])
    before = digest(tmp_path)

    launcher = start_long_run(launch, tmp_path)
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
    assert_no_process_left(str(tmp_path))
    assert digest(tmp_path) == before, "the earlier model or result file changed"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["model", "result.json"]


def test_ddp_script_started_without_its_launcher_says_how_to_launch_it():
    process = run([PYTHON, "multi-gpu-distributed-cls.py", *SMALL], check=False, timeout=120)
    assert process.returncode == 2
    assert process.stderr.strip().splitlines()[-1].startswith("error: this script runs under a launcher: torchrun")


@pytest.mark.parametrize("launch, module", [("horovod", "horovod"), ("deepspeed", "deepspeed"),
                                            ("accelerate", "accelerate"), ("fsdp", "torch")])
def test_a_failing_rank_ends_the_whole_job_and_is_named(tmp_path, launch, module):
    """DDP under torchrun and spawn have the same test in test_native.py."""
    require(module)
    started = time.monotonic()
    process = run([*LAUNCH[launch](), *SMALL, "--output-dir", str(tmp_path)], env={"SUITE_FAIL_AT": "1:3"},
                  check=False, timeout=300)
    assert process.returncode != 0
    assert time.monotonic() - started < 240
    assert "error: rank 1 failed: RuntimeError: failure injected by SUITE_FAIL_AT at step 3" in (
        process.stdout + process.stderr)
    assert_no_process_left(str(tmp_path))
    assert not (tmp_path / "result.json").exists()


def test_the_injected_failure_is_the_tests_and_names_its_rank_and_step(monkeypatch):
    """tests/hooks.py is no part of a user's run: loaded only when a test's variable is set."""
    import measure
    monkeypatch.delenv("SUITE_FAIL_AT", raising=False)
    monkeypatch.delenv("SUITE_COUNT_ALLREDUCES", raising=False)
    assert measure.load_test_hooks() is None
    monkeypatch.setenv("SUITE_FAIL_AT", "1:3")
    hooks = measure.load_test_hooks()
    hooks.fail_if_asked(0, 3)
    hooks.fail_if_asked(1, 2)
    with pytest.raises(RuntimeError, match="^failure injected by SUITE_FAIL_AT at step 3$"):
        hooks.fail_if_asked(1, 3)


@pytest.mark.parametrize("script", ["multi-gpu-distributed-mp-cls.py", "multi-gpu-distributed-mp-amp-cls.py"])
def test_spawn_refuses_a_master_port_in_use(script):
    with socket.socket() as taken:
        taken.bind(("", 0))
        taken.listen()
        port = taken.getsockname()[1]
        process = run([PYTHON, script, *SMALL, "--master-port", str(port)], check=False, timeout=120)
    assert process.returncode == 2
    assert process.stderr.strip().splitlines()[-1] == (
        f"error: --master-port {port} is in use on this machine: name another, or leave it out to get a free one")
