"""tests/warm.py, the warm launch the other files use for runs whose launcher is not the point: each rank
gets what torchrun, accelerate launch and the deepspeed launcher give it, a failing rank ends the job, a
hang its timeout."""
import json
import os
import time

import pytest

import warm
from conftest import BIN, PYTHON, free_port, require, run

# A rank that writes its environment and argv to a file, and then does what SUITE_WARM_RANK_<rank> says.
SCRIPT = """
import json, os, signal, sys, time
rank = os.environ.get("RANK", "0")
with open(os.path.join(os.path.dirname(os.path.abspath(__file__)), f"rank-{rank}.json"), "w") as file:
    json.dump({"environment": dict(os.environ), "argv": sys.argv, "pid": os.getpid()}, file)
action = os.environ.get(f"SUITE_WARM_RANK_{rank}", "")
if action == "stuck":  # as a rank stuck in C++ code is to SIGTERM
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
if action in ("sleep", "stuck"):
    time.sleep(600)
if action == "fail":
    raise RuntimeError("rank failed on purpose")
if action == "exit":
    sys.exit(3)
"""
# What differs by nature: torchrun's agent hosts the rendezvous store (warm: rank 0, as the legacy launcher's
# ranks do), and each writes its ranks' error files in a folder of its own.
DIFFERS = {"TORCHELASTIC_USE_AGENT_STORE", "TORCHELASTIC_ERROR_FILE", "_"}


def ranks_seen(folder, processes):
    seen = [json.loads((folder / f"rank-{rank}.json").read_text()) for rank in range(processes)]
    for rank in seen:
        for name in DIFFERS:
            rank["environment"].pop(name, None)
        del rank["pid"]
    return seen


@pytest.mark.parametrize("launcher", ["torchrun", "accelerate", "deepspeed"])
def test_each_rank_gets_what_its_launcher_gives_it(tmp_path, launcher):
    """torchrun and deepspeed as the runner launches them (bench/rows.py), accelerate launch with a config file."""
    if launcher in ("accelerate", "deepspeed"):
        require(launcher)
    folders = {kind: tmp_path / kind for kind in ("launched", "warm")}
    for folder in folders.values():
        folder.mkdir()
        (folder / "rank.py").write_text(SCRIPT)
    commands = {"torchrun": lambda folder: [BIN / "torchrun", "--nproc_per_node", "2", "--master_port", port,
                                            folder / "rank.py", "--an-option", "1"],
                "accelerate": lambda folder: [BIN / "accelerate", "launch", "--config_file",
                                              "configs/accelerate/multi-gpu.yaml", "--main_process_port", port,
                                              folder / "rank.py", "--an-option", "1"],
                "deepspeed": lambda folder: [BIN / "deepspeed", "--num_gpus", "2", "--master_port", port,
                                             folder / "rank.py", "--an-option", "1"]}
    port = free_port()
    run(commands[launcher](folders["launched"]))
    warm.run(commands[launcher](folders["warm"]))
    launched, warmed = ranks_seen(folders["launched"], 2), ranks_seen(folders["warm"], 2)
    for rank in (0, 1):
        local_rank = [f"--local_rank={rank}"] if launcher == "deepspeed" else []
        assert warmed[rank]["argv"][1:] == launched[rank]["argv"][1:] == [*local_rank, "--an-option", "1"]
        assert warmed[rank]["environment"] == launched[rank]["environment"]


@pytest.fixture
def rank_script(tmp_path):
    """The script in tmp_path, run once warm first: the times below exclude the forkserver's imports."""
    (tmp_path / "rank.py").write_text(SCRIPT)
    warm.run([PYTHON, tmp_path / "rank.py"])
    return tmp_path / "rank.py"


def test_a_failing_rank_stops_the_others_and_names_itself(tmp_path, rank_script):
    started = time.monotonic()
    process = warm.run([BIN / "torchrun", "--nproc_per_node", "3", tmp_path / "rank.py"], check=False,
                       env={"SUITE_WARM_RANK_0": "sleep", "SUITE_WARM_RANK_1": "sleep", "SUITE_WARM_RANK_2": "fail"})
    assert time.monotonic() - started < warm.GRACE_SECONDS
    assert process.returncode == 1
    assert [code for code, _, _ in process.ranks] == [-15, -15, 1]  # the others, asleep, stopped by SIGTERM
    assert "RuntimeError: rank failed on purpose" in process.stderr and process.ranks[0][2] == ""
    with pytest.raises(pytest.fail.Exception, match="rank 1 exited 3"):
        warm.run([BIN / "torchrun", "--nproc_per_node", "2", tmp_path / "rank.py"], env={"SUITE_WARM_RANK_1": "exit"})


def test_a_hang_is_killed_at_the_timeout(tmp_path, rank_script):
    started = time.monotonic()
    with pytest.raises(pytest.fail.Exception, match="still ran after 3 s"):
        warm.run([BIN / "torchrun", "--nproc_per_node", "2", tmp_path / "rank.py"], timeout=3,
                 env={"SUITE_WARM_RANK_0": "sleep", "SUITE_WARM_RANK_1": "sleep"})
    assert time.monotonic() - started < 30
    pids = [json.loads((tmp_path / f"rank-{rank}.json").read_text())["pid"] for rank in (0, 1)]
    assert not any(os.path.exists(f"/proc/{pid}") for pid in pids)


def test_a_rank_that_outlives_the_grace_after_a_failure_fails_the_run_and_is_named(tmp_path, rank_script, monkeypatch):
    """check=False accepts a failing rank, never one that had to be killed: that is a hang at exit."""
    monkeypatch.setattr(warm, "GRACE_SECONDS", 1)
    with pytest.raises(pytest.fail.Exception, match=r"rank 1 exited 3; ranks \[0\] still ran 1 s after SIGTERM"):
        warm.run([BIN / "torchrun", "--nproc_per_node", "2", tmp_path / "rank.py"], check=False,
                 env={"SUITE_WARM_RANK_0": "stuck", "SUITE_WARM_RANK_1": "exit"})


def test_what_it_cannot_give_is_refused():
    with pytest.raises(ValueError, match="does not emulate horovodrun"):
        warm.run([BIN / "horovodrun", "-np", "2", "python", "script.py"])
    with pytest.raises(ValueError, match="the launcher option --nnodes"):
        warm.run([BIN / "torchrun", "--nnodes", "2", "script.py"])
    with pytest.raises(ValueError, match="does not emulate python"):
        warm.run([PYTHON, "-m", "torch.distributed.launch", "script.py"])
    with pytest.raises(ValueError, match="read when the preloaded libraries are imported"):
        warm.run([BIN / "torchrun", "script.py"], env={"HF_HUB_OFFLINE": "1"})
