"""Distributed runs fail cleanly: interrupted runs stop everywhere, resume, and lose nothing."""
import contextlib
import errno
import hashlib
import itertools
import os
import re
import shutil
import signal
import socket
import subprocess
from types import SimpleNamespace

import pytest

from support import checkpoints, cli, launch
from support.launch import STOP_SIGNALS
import warm
from conftest import (BIN, EXACT, PYTHON, ROOT, SMALL, assert_no_process_left, assert_same_weights, free_port, require,
                      run_in_process)


def digest(folder):
    return {p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in sorted(folder.rglob("*")) if p.is_file()}


# Every launcher, at the global batch 32 of single_reference, shuffling and dropout off.
LAUNCH = {
    "python": lambda: [PYTHON, "single-gpu-cls.py", "--batch-size", "32"],
    "python dataparallel": lambda: [PYTHON, "multi-gpu-dataparallel-cls.py", "--gpu-ids", "0,1", "--batch-size", "32"],
    "python spawn": lambda: [PYTHON, "multi-gpu-distributed-mp-cls.py", "--nprocs", "2", "--batch-size", "16"],
    "torchrun": lambda: [BIN / "torchrun", "--nproc_per_node", "2", "--master_port", free_port(),
                         "multi-gpu-distributed-cls.py", "--batch-size", "16"],
    "torch.distributed.launch": lambda: [PYTHON, "-m", "torch.distributed.launch", "--nproc_per_node", "2",
                                         "--master_port", free_port(), "multi-gpu-distributed-cls.py",
                                         "--batch-size", "16"],
    "horovodrun": lambda: [BIN / "horovodrun", "-np", "2", "-H", "localhost:2", "--gloo", "--start-timeout", "120",
                           PYTHON, "multi-gpu-horovod-cls.py", "--batch-size", "16"],
    "deepspeed": lambda: [BIN / "deepspeed", "--num_gpus", "2", "--master_port", free_port(),
                          "multi-gpu-deepspeed-cls.py", "--zero-stage", "2", "--batch-size", "16"],
    "accelerate launch": lambda: [BIN / "accelerate", "launch", "--multi_gpu", "--num_processes", "2",
                                  "--main_process_port", free_port(), "multi-gpu-accelerate-cls.py",
                                  "--batch-size", "16"],
    "fabric run": lambda: [BIN / "fabric", "run", "--accelerator", "cpu", "--devices", "2", "--main-port", free_port(),
                           "multi-gpu-fabric-cls.py", "--batch-size", "16"],
}
NEEDS = {"horovodrun": "horovod", "deepspeed": "deepspeed", "accelerate launch": "accelerate", "fabric run": "click"}
# (launcher, signal, sent to the launcher alone or to its whole process group, the launcher's exit
# status, whether the checkpoint is resumed): docs/running.md's table. Torch's elastic launcher
# (torchrun, the legacy launch, accelerate launch, fabric run) passes SIGTERM on and dies of SIGUSR1,
# deepspeed's command of both: their ranks stop with them. DataLoader workers (WORKERS' group cases:
# one process alone, one launched) leave both to their process. A signal's checkpoint is saved as
# --save-steps' are: it is resumed once per kind of save (whole under the legacy launcher, DeepSpeed's
# under its command, collective under fabric run), warm under torchrun (under_torchrun); test_resume.py
# resumes the others' strategies (single, spawn, torchrun, horovodrun, accelerate launch).
SIGNALLED = [("python", "SIGTERM", "group", 75, False), ("python dataparallel", "SIGUSR1", "launcher", 75, False),
             ("python spawn", "SIGUSR1", "launcher", 75, False), ("python spawn", "SIGTERM", "group", 75, False),
             ("torchrun", "SIGTERM", "launcher", 1, False), ("torchrun", "SIGUSR1", "launcher", -10, False),
             ("torch.distributed.launch", "SIGTERM", "group", 1, False),
             ("torch.distributed.launch", "SIGUSR1", "launcher", -10, True),
             ("horovodrun", "SIGTERM", "launcher", 1, False),  # its ranks run in a session of their own: no group
             ("deepspeed", "SIGTERM", "launcher", -15, True), ("deepspeed", "SIGUSR1", "group", -10, False),
             ("accelerate launch", "SIGUSR1", "launcher", -10, False),
             ("accelerate launch", "SIGTERM", "group", 1, False),
             ("fabric run", "SIGTERM", "launcher", 1, True)]

WORKERS = {"python", "torch.distributed.launch"}


def under_torchrun(command):
    """A LAUNCH command's script and options under torchrun, 2 processes: every resumed script runs under it
    (the DeepSpeed and Fabric scripts too), and warm.run emulates it."""
    script = next(index for index, part in enumerate(command) if str(part).endswith("-cls.py"))
    return [BIN / "torchrun", "--nproc_per_node", "2", *command[script:]]


PR_SET_CHILD_SUBREAPER = 36  # prctl(2)


@contextlib.contextmanager
def adopting_orphans():
    """While the block runs, this process adopts the orphans of what it starts (Linux's child subreaper):
    the ranks of a launcher that died of a signal, which finish on their own. Reaped (reap), their CPU
    seconds count in the cost table (conftest), as their launcher's would have."""
    launch.LIBC.prctl(PR_SET_CHILD_SUBREAPER, 1)
    try:
        yield
    finally:
        launch.LIBC.prctl(PR_SET_CHILD_SUBREAPER, 0)


def reap(processes):
    """Reap those of `processes` (psutil's) that ended as this process's adopted orphans."""
    for process in processes:
        with contextlib.suppress(ChildProcessError):  # reaped by their own parent
            os.waitpid(process.pid, os.WNOHANG)


@pytest.mark.parametrize("launch, signal_name, to, status, resumed", SIGNALLED)
def test_a_signal_saves_the_step_stops_every_process_and_resumes_to_the_single_device_weights(
        tmp_path, single_reference, launch, signal_name, to, status, resumed):
    """--save-on-signal, the signal sent once rank 0 trains slowly (tests/hooks.py), after step 3 of 11:
    every process stops at the next step boundary with its checkpoint, the launcher with its status, no
    process is left, the results of an earlier run in the folder are untouched; resumed, the run ends
    with single_reference's weights."""
    import hooks
    import psutil
    if launch in NEEDS:
        require(NEEDS[launch])
    for name in ("model", "result.json"):  # the results of an earlier run in the same folder
        (shutil.copytree if name == "model" else shutil.copy)(single_reference / name, tmp_path / name)
    command = [*LAUNCH[launch](), *SMALL, *EXACT, "--save-on-signal", "--output-dir", str(tmp_path)]
    workers = ["--num-workers", "2"] if to == "group" and launch in WORKERS else []
    with adopting_orphans():
        launcher = subprocess.Popen([*command, *workers], cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                    text=True, start_new_session=True,
                                    env={**os.environ, "PYTHONUNBUFFERED": "1", hooks.SLOW_AFTER_ENV: "3"})
        try:
            output = "".join(itertools.takewhile(lambda line: "slow from step 3" not in line, launcher.stdout))
            job = psutil.Process(launcher.pid).children(recursive=True)
            if to == "launcher":
                launcher.send_signal(getattr(signal, signal_name))
            else:
                os.killpg(launcher.pid, getattr(signal, signal_name))
            output += launcher.communicate(timeout=120)[0]
        finally:
            if launcher.poll() is None:
                os.killpg(launcher.pid, signal.SIGKILL)
        assert_no_process_left(str(tmp_path))
        reap(job)
    assert digest(tmp_path / "model") == digest(single_reference / "model"), "the earlier model changed"
    assert (tmp_path / "result.json").read_bytes() == (single_reference / "result.json").read_bytes()
    stopped = re.findall(r"error: stopped by SIG\w+ after step (\d+): checkpoint saved in", output)
    assert len(stopped) == 1 and 3 <= int(stopped[0]) < 11, output  # rank 0's one line
    step = int(stopped[0])
    assert [checkpoints.meaning_in(path.parent)["step"] for path in (tmp_path / "checkpoint").rglob(
        checkpoints.MEANING_FILE)] == [step]  # whole or sharded (DeepSpeed's, in a folder of its step)
    assert "failed" not in output and "killed by signal" not in output
    assert launcher.returncode == status, output
    if resumed:  # warm: the kind of checkpoint the signal saved is the point, not the resume's launcher
        process = warm.run([*under_torchrun(command), "--resume"])
        assert f"--resume: continuing from step {step}" in process.stdout
        assert_same_weights(single_reference / "model", tmp_path / "model")


def test_a_signal_after_the_last_step_lets_the_run_finish_its_evaluation_and_model():
    """The final evaluation and save keep --save-on-signal's handler: a signal then is said, not fatal."""
    logged, fatal, callback = [], [], checkpoints.SaveOnSignal()
    trainer = SimpleNamespace(log=logged.append)
    # Before training, cli.run's handlers, which end the run: here they note it.
    handlers = {number: signal.signal(number, lambda number, frame: fatal.append(number)) for number in STOP_SIGNALS}
    try:
        callback.on_train_begin(trainer, 0)
        callback.on_train_end(trainer)
        os.kill(os.getpid(), signal.SIGUSR1)  # during the final evaluation
        callback.on_result(trainer, {})
    finally:
        for number, handler in handlers.items():
            signal.signal(number, handler)
    assert fatal == [] and logged == ["SIGUSR1 came after the last step: the run finishes before it stops"]


def test_a_second_stop_signal_cuts_no_clean_up_short():
    """launch.py's rule: a process stops once. A rank often gets a stop signal twice (the group's, then
    its launcher's passing it on, or its parent's death): the second, during the clean-up the first
    started, changes nothing. It used to raise there: a spawn rank with --num-workers 1 and SIGTERM sent
    to the group never told its DataLoader worker to end, waited for it, and was killed 30 s later."""
    cleaned = []

    def main():
        try:
            signal.raise_signal(signal.SIGTERM)  # the group's: the run stops (KeyboardInterrupt)
        finally:
            signal.raise_signal(signal.SIGTERM)  # the launcher's, passing it on, during the clean-up
            cleaned.append("the DataLoader's workers ended, the group left, the folder's lock released")
    handlers = {number: signal.getsignal(number) for number in STOP_SIGNALS}
    try:
        with pytest.raises(SystemExit) as exit:
            cli.run(main)
    finally:
        for number, handler in handlers.items():
            signal.signal(number, handler)
    assert exit.value.code == 130 and len(cleaned) == 1


def test_a_stop_signal_once_the_run_has_ended_leaves_its_exit_status_as_it_is():
    """A rank whose peer failed first gets its launcher's SIGTERM while it leaves. In its exit functions (where
    the group's handle frees the group, joining gloo's threads) it raised KeyboardInterrupt: a traceback after
    the refusal's one line, and another exit status (seen in 2 of 50 warm 3-process refusals)."""
    handlers = {number: signal.getsignal(number) for number in STOP_SIGNALS}

    def main():
        raise cli.UserError("refused")
    try:
        with pytest.raises(SystemExit) as exit:
            cli.run(main)
        try:
            signal.raise_signal(signal.SIGTERM)  # as the exit functions run
        except KeyboardInterrupt:
            pytest.fail("the stop signal unwound a process that had ended")
    finally:
        for number, handler in handlers.items():
            signal.signal(number, handler)
    assert exit.value.code == cli.UserError("").status


def test_a_rank_that_outlives_the_stop_is_named_when_killed(capsys):
    """The spawn script's parent gives its ranks 30 s after SIGTERM, as torchrun does; one it then kills
    hung, and the parent says so."""
    from support import spawn_setup
    killed = []
    hung = SimpleNamespace(terminate=lambda: None, join=lambda timeout: None, is_alive=lambda: not killed,
                           kill=lambda: killed.append(True))
    spawn_setup.stop([SimpleNamespace(terminate=lambda: None, join=lambda timeout: None, is_alive=lambda: False),
                      hung], first_rank=2)
    assert killed == [True]
    assert capsys.readouterr().err == ("error: rank 3 still ran 30 s after SIGTERM: killed by signal SIGKILL, its "
                                       "clean-up undone\n")


def test_ddp_script_started_without_its_launcher_says_how_to_launch_it():
    process = run_in_process(["multi-gpu-distributed-cls.py", *SMALL])
    assert process.returncode == 2
    assert process.stderr.strip().splitlines()[-1].startswith("error: this script runs under a launcher: torchrun")


@pytest.mark.parametrize("strategy", ["horovod", "accelerate", "fsdp", "deepspeed"])
def test_a_failing_rank_ends_the_whole_job_and_is_named(crashed_run, strategy):
    """conftest's crashed runs, each under its own launcher (DeepSpeed's too): rank 1 failed at step
    10. DDP under torchrun and spawn have the same test in test_native.py."""
    crashed = crashed_run(strategy)
    assert crashed.process.returncode != 0
    assert crashed.seconds < 240
    assert "error: rank 1 failed: RuntimeError: failure injected by SUITE_FAIL_AT at step 10" in (
        crashed.process.stdout + crashed.process.stderr)
    assert crashed.orphans == [], "orphan processes left running"
    assert not (crashed.output / "result.json").exists()


def test_extra_callbacks_come_only_from_the_file_suite_callbacks_names(monkeypatch, tmp_path):
    """A plain run has none; the tests' hooks are such a file, and the injected failure names its rank
    and step; a file that is not there is one line."""
    import hooks
    from instruments import measure
    monkeypatch.delenv(measure.EXTRA_CALLBACKS_ENV)
    assert measure.extra_callbacks() == []
    monkeypatch.setenv(measure.EXTRA_CALLBACKS_ENV, hooks.__file__)
    monkeypatch.setenv(hooks.FAIL_AT_ENV, "1:3")
    failure, = measure.extra_callbacks()
    failure.on_step_end(SimpleNamespace(strategy=SimpleNamespace(rank=0)), 3, loss=None)
    failure.on_step_end(SimpleNamespace(strategy=SimpleNamespace(rank=1)), 2, loss=None)
    with pytest.raises(RuntimeError, match="^failure injected by SUITE_FAIL_AT at step 3$"):
        failure.on_step_end(SimpleNamespace(strategy=SimpleNamespace(rank=1)), 3, loss=None)
    monkeypatch.setenv(measure.EXTRA_CALLBACKS_ENV, str(tmp_path / "nowhere.py"))
    with pytest.raises(cli.UserError, match="nowhere.py: no such file"):
        measure.extra_callbacks()


@pytest.mark.parametrize("script", ["multi-gpu-distributed-mp-cls.py", "multi-gpu-distributed-mp-amp-cls.py"])
def test_spawn_refuses_a_master_port_in_use(script):
    with socket.socket() as taken:
        taken.bind(("", 0))
        taken.listen()
        port = taken.getsockname()[1]
        process = run_in_process([script, *SMALL, "--master-port", str(port)])
    assert process.returncode == 2
    assert process.stderr.strip().splitlines()[-1] == (
        f"error: --master-port {port} is already in use on {socket.gethostname()} (rank 0's machine): name another, "
        "or leave it out to get a free one")


def test_a_port_the_previous_run_just_closed_is_free_to_the_next(tmp_path):
    """A resume right after its run, on the same --master_port: the old run's closed connections wait
    in TIME_WAIT, which the rendezvous binds through (SO_REUSEADDR), so the check must too."""
    with socket.socket() as listener:
        listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as torch's TCPStore listens
        listener.bind(("127.0.0.1", 0))
        listener.listen()
        port = listener.getsockname()[1]
        with socket.create_connection(("127.0.0.1", port)), listener.accept()[0]:
            pass  # the rendezvous' side closes first: its end of the connection waits in TIME_WAIT
    with socket.socket() as plain, pytest.raises(OSError):
        plain.bind(("", port))  # the condition the check met
    launch.refuse_a_port_in_use(port, "--master_port", "give the deepspeed command a free one")


@contextlib.contextmanager
def mounted_tmpfs(folder, *options):
    """A small disk of its own at `folder` (the tests run as root), unmounted however the block ends."""
    if os.geteuid() != 0:
        pytest.fail("the disk tests mount a tmpfs: run the suite as root (as CI and test.sh do)")
    subprocess.run(["mount", "-t", "tmpfs", "-o", ",".join(["size=256k", *options]), "tmpfs", str(folder)],
                   check=True)
    try:
        yield folder
    finally:  # lazily where a file is still open in it: no mount outlives the test
        if subprocess.run(["umount", str(folder)]).returncode != 0:
            subprocess.run(["umount", "--lazy", str(folder)], check=True)


def test_a_disk_without_room_for_the_model_and_a_checkpoint_is_refused_before_training(tmp_path):
    from test_bad_input import assert_clean_error
    with mounted_tmpfs(tmp_path):
        process = run_in_process(["single-gpu-cls.py", *SMALL, "--save-steps", "4", "--output-dir", str(tmp_path)])
        assert_clean_error(process, f"no space left on {tmp_path}: the model and a checkpoint need about")
        assert "【train】" not in process.stdout


def test_a_full_disk_during_a_sharded_checkpoint_is_named_and_keeps_the_previous_one(tmp_path):
    """torch.distributed.checkpoint, as FSDP2 saves, in one process: its errors derive from
    BaseException, and the full disk is found in another thread's write."""
    import torch
    import torch.distributed.checkpoint as dcp
    from support import checkpoints
    from support import cli, launch
    with mounted_tmpfs(tmp_path):
        state = {"step": 1, "meaning": {}}
        with checkpoints.staged_checkpoint(tmp_path / "checkpoint", state, True, lambda: None) as staging:
            dcp.save({"weights": torch.zeros(1000)}, checkpoint_id=staging)
        before = digest(tmp_path)
        with pytest.raises(cli.UserError, match=f"^no space left on {tmp_path}: "):
            with checkpoints.staged_checkpoint(tmp_path / "checkpoint", state, True, lambda: None) as staging:
                dcp.save({"weights": torch.zeros(100_000)}, checkpoint_id=staging)
        assert digest(tmp_path) == before  # the staging removed, the previous checkpoint whole
        assert checkpoints.read_meaning(tmp_path / "checkpoint")["step"] == 1


def test_a_full_disk_during_a_whole_checkpoint_is_named_and_keeps_the_previous_one(tmp_path):
    """torch.save's own error on a full disk ("unexpected pos ...") names neither."""
    import torch
    from support import checkpoints
    from support import cli
    with mounted_tmpfs(tmp_path):
        checkpoints.save_whole(tmp_path / "checkpoint", {"step": 1, "meaning": {}, "weights": torch.zeros(1000)})
        before = digest(tmp_path)
        with pytest.raises(cli.UserError, match=f"^no space left on {tmp_path}: "):
            checkpoints.save_whole(tmp_path / "checkpoint", {"step": 2, "meaning": {}, "weights": torch.zeros(100_000)})
        assert digest(tmp_path) == before


def test_a_full_disk_during_a_deepspeed_step_removes_its_folder_and_latest_names_the_previous_one(tmp_path):
    """DeepSpeed writes `latest` last; its step folder is the part a failed save leaves (in one process:
    each rank's shard is a torch.save)."""
    import torch
    from support import cli
    from libraries import deepspeed_setup
    with mounted_tmpfs(tmp_path):
        (tmp_path / "latest").write_text("step4", encoding="utf-8")
        with pytest.raises(cli.UserError, match=f"^no space left on {tmp_path}: "):
            with deepspeed_setup.step_folder(tmp_path / "step8", {"step": 8, "meaning": {}}, True):
                torch.save(torch.zeros(100_000), tmp_path / "step8" / "zero_pp_rank_0_mp_rank_00_optim_states.pt")
        assert sorted(p.name for p in tmp_path.iterdir()) == ["latest"]


def test_an_error_deriving_from_base_exception_still_ends_in_one_error_line(capsys):
    """torch.distributed.checkpoint's CheckpointException is not an Exception."""
    from torch.distributed.checkpoint.api import CheckpointException
    from support import cli

    def main():
        raise CheckpointException("load failed", {0: (OSError(errno.EIO, "I/O error"), None)})
    with pytest.raises(SystemExit) as exit:
        cli.run(main)
    assert exit.value.code == 1
    assert capsys.readouterr().err.strip().splitlines()[-1] == (
        "error: rank 0 failed: OSError: [Errno 5] I/O error")


def test_a_failed_run_leaves_its_group_to_be_freed_by_the_groups_handle_at_exit_not_by_the_model(monkeypatch):
    """A failure's traceback holds the model; freed with it, the DDP reducer freed the gloo group holding
    the GIL, while a gloo thread waited for the GIL to free the last collective's tensor: a hang, once in
    seven warm 3-process refusals on 2 busy cores. The group's own handle frees it without the GIL: cli.run
    keeps it until the exit functions run. (One process, in this interpreter.)"""
    import atexit
    import gc
    import weakref
    import torch
    import torch.distributed as dist
    import torch._dynamo  # noqa: F401  as the scripts' transformers does: without it, DDP holds the group longer
    exit_functions, handlers = [], {number: signal.getsignal(number) for number in STOP_SIGNALS}
    monkeypatch.setattr(atexit, "register", exit_functions.append)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{free_port()}", rank=0, world_size=1)
    group = weakref.ref(dist.group.WORLD)

    def main():
        model = torch.nn.parallel.DistributedDataParallel(torch.nn.Linear(2, 2))
        dist.all_reduce(torch.ones(1))
        raise cli.UserError(f"refused beside {model}")
    try:
        cli.run(main)
    except SystemExit as exit:
        assert exit.code != 0
    finally:
        gc.unfreeze()  # cli.run froze what it found, and installed its handlers
        for number, handler in handlers.items():
            signal.signal(number, handler)
    gc.collect()  # the traceback, the model and its reducer are gone
    assert not dist.is_initialized() and group() is not None
    for function in exit_functions:
        function()
    assert group() is None


def test_the_next_run_in_a_folder_clears_the_staging_of_dead_runs(tmp_path):
    """What saves killed mid-write (SIGKILL) left beside their targets, 316 MB a checkpoint at base-shape,
    goes with the next run into the folder; the staging of a process still running stays. A folder set
    aside by a save killed before its new one was ready is put back. Only what the dead run recorded goes
    (files.record_staging): names alike that no run of the suite wrote stay."""
    from test_bad_input import assert_clean_error
    from test_resume import dead_run_recorded
    finished = subprocess.Popen(["true"])
    finished.wait()  # its pid names a process that no longer runs
    dead = [f".checkpoint.tmp-{finished.pid}", f".model.old-{finished.pid}", ".checkpoint.staging"]
    for name in dead:
        (tmp_path / name).mkdir()
        (tmp_path / name / "training_state.pt").write_bytes(b"half a checkpoint")
    (tmp_path / f".result.json.tmp-{finished.pid}").write_text("{", encoding="utf-8")
    (tmp_path / ".model.tmp-1").mkdir()  # pid 1, init: always running
    someone_elses = [".notes.txt.old-999999", ".draft.md.tmp-999998", ".photos.staging", ".model.old-999997"]
    for name in someone_elses:
        (tmp_path / name).mkdir() if name.endswith("staging") else (tmp_path / name).write_text(name, encoding="utf-8")
    dead_run_recorded(tmp_path, finished.pid, *dead, ".model.tmp-1", f".result.json.tmp-{finished.pid}")
    process = run_in_process(["single-gpu-cls.py", *SMALL, "--output-dir", tmp_path, "--data", "no-such-file.json"])
    assert_clean_error(process, "data file not found")
    assert sorted(path.name for path in tmp_path.iterdir()) == sorted([".model.tmp-1", "model", *someone_elses])
    assert (tmp_path / "model" / "training_state.pt").read_bytes() == b"half a checkpoint"
