"""Several machines, for real: the batch files of slurm/ on a 2-node Slurm cluster that
scripts/cluster.sh builds on this machine (two network namespaces joined by a veth pair, each with
its own hostname), and plain srun of one task per process.

What this cannot show: NCCL or InfiniBand between hosts (there is no GPU and one kernel), nor a
filesystem that is not shared (both nodes see the host's). See docs/several-machines.md.
"""
import json
import os
import re
import signal
import socket
import subprocess
import time
from pathlib import Path

import pytest
import torch

from support import checkpoints, cli, launch, machine
from conftest import (EXACT, DEV_SAMPLES, PYTHON, ROOT, SMALL, assert_same_weights, processes_mentioning,
                      read_result, run, run_here)

SLURM_TASK = {"SLURM_PROCID": "1", "SLURM_NTASKS": "3", "SLURM_LOCALID": "0", "SLURM_NODEID": "1",
              "SLURM_STEP_ID": "0", "SLURM_STEP_TASKS_PER_NODE": "2,1", "SLURM_TASKS_PER_NODE": "2,1",
              "SLURM_STEP_NODELIST": "gpu[07-08]", "SLURM_NODELIST": "gpu[07-08]", "SLURM_JOB_ID": "123456"}


@pytest.fixture
def slurm_task(monkeypatch):
    """A copy of the environment as srun would set it in a task: what launch_environment writes there
    goes with the copy, not into the later tests' jobs."""
    launcher_set = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "LOCAL_SIZE", "MASTER_ADDR", "MASTER_PORT")
    task_environment = {name: value for name, value in os.environ.items() if name not in launcher_set}
    monkeypatch.setattr(os, "environ", {**task_environment, **SLURM_TASK})
    monkeypatch.setattr(launch, "srun_started_this_process", False)


def test_an_srun_task_takes_its_rank_and_rendezvous_from_slurm(slurm_task):
    assert launch.launch_environment("torchrun ...") == (1, 3, 0, 1)  # node 1 of "2,1" runs one task
    assert os.environ["MASTER_ADDR"] == "gpu07"
    assert os.environ["MASTER_PORT"] == str(15000 + 123456 % 10000)
    assert launch.srun_started_this_process


def test_master_addr_and_port_set_by_the_user_win(slurm_task, monkeypatch):
    monkeypatch.setenv("MASTER_ADDR", "10.0.0.9")
    monkeypatch.setenv("MASTER_PORT", "29999")
    launch.launch_environment("torchrun ...")
    assert (os.environ["MASTER_ADDR"], os.environ["MASTER_PORT"]) == ("10.0.0.9", "29999")


def test_horovod_under_srun_takes_its_ranks_from_slurm_with_the_batch_files_rendezvous(slurm_task):
    with pytest.raises(cli.UserError, match="without Horovod's rendezvous: submit slurm/horovod.sbatch"):
        launch.use_slurm_for_horovod()
    os.environ["HOROVOD_GLOO_RENDEZVOUS_ADDR"] = "gpu07"
    launch.use_slurm_for_horovod()
    ranks = [os.environ[f"HOROVOD_{name}"] for name in ("RANK", "SIZE", "LOCAL_RANK", "LOCAL_SIZE", "CROSS_RANK",
                                                         "CROSS_SIZE")]
    assert ranks == ["1", "3", "0", "1", "1", "2"] and launch.srun_started_this_process  # 2 tasks on gpu07, 1 here
    del os.environ["HOROVOD_RANK"]
    os.environ.update(SLURM_PROCID="1", SLURM_LOCALID="1", SLURM_NODEID="0")
    launch.use_slurm_for_horovod()  # the second task of gpu07: alone at local rank 1
    assert (os.environ["HOROVOD_CROSS_RANK"], os.environ["HOROVOD_CROSS_SIZE"]) == ("0", "1")


def test_a_wrong_head_address_is_refused_by_rank_0_before_anyone_waits_on_it(slurm_task):
    """MASTER_ADDR set to an address no interface here holds (TEST-NET-1): srun's rank 0 refuses it before
    any rendezvous. How such a refusal ends a job on two nodes: the port test on the cluster, below."""
    os.environ.update(SLURM_PROCID="0", SLURM_NODEID="0", SLURM_LOCALID="0", MASTER_ADDR="192.0.2.1")
    with pytest.raises(cli.UserError, match=f"^MASTER_ADDR 192.0.2.1 is not an address of {socket.gethostname()}, "
                                            "where rank 0 runs: leave MASTER_ADDR unset"):
        launch.launch_environment("torchrun ...")


def test_a_batch_script_without_srun_still_gets_the_launcher_error(slurm_task):
    del os.environ["SLURM_STEP_ID"]  # the batch script itself: srun did not start this process
    with pytest.raises(cli.UserError, match="runs under a launcher"):
        launch.launch_environment("torchrun ...")


@pytest.mark.parametrize("nodelist, first", [("node1", "node1"), ("node[1-2]", "node1"),
                                             ("gpu[07-09,12]-ib,cpu1", "gpu07-ib"), ("cpu1,gpu[1-2]", "cpu1")])
def test_the_first_host_of_a_node_list(nodelist, first):
    assert launch.first_host(nodelist) == first


@pytest.mark.parametrize("variables, expected", [
    ({}, "cpu"), ({"CUDA_VISIBLE_DEVICES": ""}, "cpu"), ({"SLURM_GPUS_ON_NODE": "0"}, "cpu"),
    ({"SLURM_JOB_GPUS": "0,1"}, "SLURM_JOB_GPUS=0,1 gives this process GPUs, but torch sees none"),
    ({"CUDA_VISIBLE_DEVICES": "0"}, "CUDA_VISIBLE_DEVICES=0 gives this process GPUs, but torch sees none"),
])
def test_a_job_given_gpus_that_torch_cannot_see_stops_instead_of_training_on_the_cpu(monkeypatch, variables,
                                                                                       expected):
    for name in [*machine.GPU_VARIABLES, "SLURM_JOB_ID"]:
        monkeypatch.delenv(name, raising=False)
    for name, value in variables.items():
        monkeypatch.setenv(name, value)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert machine.resolve_device("cpu").type == "cpu"
    if expected == "cpu":
        assert machine.resolve_device("auto").type == "cpu"
        return
    with pytest.raises(cli.UserError, match="to train on the CPU, pass --device cpu") as error:
        machine.resolve_device("auto")
    assert str(error.value).startswith(expected)


def test_device_cuda_in_a_slurm_job_without_gpus_says_how_to_ask_for_them(monkeypatch):
    for name in machine.GPU_VARIABLES:
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("SLURM_JOB_ID", "7")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with pytest.raises(cli.UserError, match=r"this Slurm job was given none: ask for them with --gres=gpu:N"):
        machine.resolve_device("cuda")


def test_tasks_per_node_expand():
    assert launch.expand_tasks_per_node("2(x3),1") == [2, 2, 2, 1]


# ----------------------------------------------------------------------------- on the 2-node cluster

CLUSTER = ROOT / "scripts" / "cluster.sh"
STATE_DIR = Path("/tmp/distributed-nlp-test-cluster")  # scripts/cluster.sh's; node-local differs per node
ENDED = STATE_DIR / "ended"  # a file per job that ended, named by its id: slurm.conf's EpilogSlurmctld writes it
INTERFACE = "cluster0"  # the veth end in each node
# 2 nodes x 1 process x batch 16: the global batch 32 of one device. One thread each: the two
# "machines" share this one's cores.
TRAIN = [*SMALL, *EXACT, "--batch-size", "16", "--threads", "1"]
# The strategy and launcher each batch file's result names.
RAN_AS = {"torchrun": ("ddp", "torchrun"), "srun": ("ddp", "srun")}


@pytest.fixture(scope="session")
def cluster():
    """scripts/cluster.sh up for the whole session, and down at the end whatever happened."""
    if os.geteuid() != 0:
        if os.environ.get("CI"):
            pytest.fail("CI must run the several-machines tests: they need root (network namespaces, Slurm)")
        pytest.skip("the 2-node cluster needs root (network namespaces, Slurm daemons): run the tests as root")
    try:
        run(["bash", str(CLUSTER), "up"], timeout=600)
        assert ENDED.is_dir(), "a cluster of an older scripts/cluster.sh is up: scripts/cluster.sh down, then again"
        yield
    finally:
        run(["bash", str(CLUSTER), "down"], timeout=120)


class Job:
    """A batch job on the cluster. `sbatch --wait` polls at growing intervals, up to several seconds,
    which every test would wait out; scontrol twice a second would start ~700 processes in this file.
    Slurm itself marks the end (ENDED), which this polls: scontrol is asked only then."""

    def __init__(self, job_id, log):
        self.id, self.log, self.returncode = job_id, log, None

    def poll(self):
        """None while the job runs, then its exit code (non-zero too when Slurm ended it)."""
        if self.returncode is None and (ENDED / self.id).exists():
            shown = slurm("scontrol", "--oneliner", "show", "job", self.id)
            fields = dict(field.split("=", 1) for field in shown.split() if "=" in field)
            if fields["JobState"] not in ("PENDING", "CONFIGURING", "RUNNING", "COMPLETING", "SUSPENDED"):
                exit_status, signal_number = map(int, fields["ExitCode"].split(":"))
                self.returncode = exit_status or signal_number or int(fields["JobState"] != "COMPLETED")
        return self.returncode

    def wait(self, timeout=600):
        deadline = time.monotonic() + timeout
        while self.poll() is None:
            assert time.monotonic() < deadline, f"job {self.id} still runs after {timeout} s"
            time.sleep(0.1)
        return self.returncode


def slurm(*command, env=None):
    return subprocess.run(["bash", str(CLUSTER), "exec", *command], cwd=ROOT, env=env, capture_output=True, text=True,
                          check=True, timeout=60).stdout


def submit(batch_file, output_dir, *script_args, env=None, log=None, wait=True):
    """sbatch a file of slurm/ on the cluster, 1 process per node; with `wait`, return (exit code, log)."""
    log = log or Path(output_dir).with_suffix(".log")
    # The CPU cluster's one setting (DEVICE); the interface is left to slurm/preflight.sh to find.
    job_env = {**{name: value for name, value in os.environ.items() if not name.endswith("_SOCKET_IFNAME")},
               "OUTPUT_DIR": str(output_dir), "GPUS_PER_NODE": "1", "DEVICE": "cpu", **(env or {})}
    job_id = slurm("sbatch", "--parsable", "--output", str(log),
                   f"slurm/{batch_file}.sbatch", *script_args, env=job_env).strip().split(";")[0]
    job = Job(job_id, log)
    if not wait:
        return job, log
    job.wait()
    return job.returncode, log.read_text(encoding="utf-8", errors="replace")


def error_lines(log):
    return [line for line in log.splitlines() if line.startswith("error:")]


# benchmark.py's rows across the 2 nodes at the global batch 32 of its single row (an uneven last batch:
# 332 samples), in fp32, DeepSpeed at ZeRO-3: its weights sharded across the two hosts (ZeRO-2 at 2
# processes: the accumulating run and the Trainer's through TrainingArguments). A row per launcher, each
# run by its batch file: ddp-amp (spawn.sbatch, as ddp-spawn), fsdp and hf-trainer (torchrun.sbatch, as
# ddp) are left out, their arithmetic at 2 processes test_grad_accum.py's and test_hf_trainer.py's.
# srun.sbatch and torchrun.sbatch alone also end on one device's weights, in the interruption tests below.
# The matrix-product peak is given, not measured after the rows: the report's MFU is test_benchmark.py's.
BENCHMARK = ["--global-batch", "32", "--precision", "fp32", "--strategy-args", "deepspeed=--zero-stage 3",
             *SMALL, *EXACT, "--threads", "1"]
# The strategy and launcher each row's result names; DataParallel's one process cannot span nodes.
ROWS = {"single": ("single-device", "python"), "ddp": ("ddp", "torchrun"), "ddp-spawn": ("ddp", "spawn"),
        "horovod": ("horovod", "srun"), "deepspeed": ("deepspeed", "deepspeed"),
        "accelerate": ("accelerate", "accelerate launch"), "fabric": ("fabric", "fabric run")}


def test_the_benchmark_job_runs_a_row_per_launcher_across_the_nodes_on_the_single_device_weights(cluster, tmp_path):
    output, peaks = tmp_path / "benchmark", tmp_path / "peaks.json"
    peaks.write_text(json.dumps({"device": "cpu", "peaks": {"fp32": {"tflops": 0.2}}}), encoding="utf-8")
    exit_code, log = submit("benchmark", output, *BENCHMARK, "--only", ",".join([*ROWS, "dataparallel"]),
                            "--matmul-peaks", str(peaks))
    assert exit_code == 0, log[-4000:]
    report = json.loads((output / "benchmark.json").read_text(encoding="utf-8"))
    rows = {row["row"]: row for row in report["rows"]}
    assert rows.keys() == {*ROWS, "dataparallel"} and (output / "benchmark.md").is_file()
    assert rows["dataparallel"]["status"] == "not run" and "cannot run across nodes" in rows["dataparallel"]["reason"]
    for name, ran_as in ROWS.items():
        row_output, row_log = output / name, (output / f"{name}.log").read_text(encoding="utf-8")
        assert rows[name]["status"] == "ok", row_log[-4000:]
        result = read_result(row_output)
        processes = 1 if name == "single" else 2
        assert (result["world_size"], result["global_batch_size"], result["dev_samples"]) == (processes, 32, DEV_SAMPLES)
        assert (result["strategy"], result["launcher"]) == ran_as
        assert_same_weights(output / "single" / "model", row_output / "model")
        # node2's process is a local rank 0 too: global rank 0 alone reports and saves. --threads 1 wins
        # over the thread policy, which would give each node's one process all its cores.
        assert row_log.count("耗时：") == 1 and result["threads_per_process"] == 1
        left = sorted(path.name for path in row_output.iterdir() if not path.name.startswith("hostfile-"))
        assert left == ["model", "result.json", "tensorboard"]  # ZeRO-3's shards too merged into model/, removed
        if name != "single":  # its batch file's log: the interface of node1's address
            assert f"network: {INTERFACE} (NET_INTERFACE overrides it)" in row_log
    assert "launcher: srun, one task per process" in (output / "horovod.log").read_text(encoding="utf-8")
    deepspeed = read_result(output / "deepspeed")
    assert (deepspeed["zero_stage"], deepspeed["precision"]) == (3, "fp32")


def rank_process(output_dir, rank):
    """The training process of `rank` (RANK under torchrun, SLURM_PROCID under srun), found by its output
    folder."""
    for process in processes_mentioning(str(output_dir)):
        try:
            environment = process.environ()
            if environment.get("RANK", environment.get("SLURM_PROCID")) == str(rank) and "python" in process.name():
                return process
        except Exception:
            continue
    return None


# 22 steps; with --save-steps the batch files add --save-on-signal and --resume.
TWO_EPOCHS = ["--epochs", "2", "--dist-timeout", "60"]


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory):
    output = tmp_path_factory.mktemp("uninterrupted")
    run_here([PYTHON, "single-gpu-cls.py", *SMALL, *EXACT, "--epochs", "2", "--threads", "1",
              "--output-dir", str(output)])
    return output


def test_a_node_lost_mid_run_ends_the_job_and_the_same_job_resubmitted_resumes_by_itself(cluster, uninterrupted,
                                                                                           tmp_path):
    # A checkpoint every 4 steps: node2's process is killed once the first one is there.
    output, every_4 = tmp_path / "out", [*TWO_EPOCHS, "--save-steps", "4"]
    job, log = submit("srun", output, *TRAIN, *every_4, wait=False)
    started = time.monotonic()
    while not (output / "checkpoint").exists():
        assert job.poll() is None, "the job ended before its first checkpoint"
        time.sleep(0.2)
    victim = rank_process(output, 1)
    assert victim is not None, "node2's process was not found"
    victim.send_signal(signal.SIGKILL)
    job.wait(timeout=60)  # well within --dist-timeout: nothing waits on the lost node
    assert job.returncode != 0
    assert not (output / "result.json").exists(), "the job finished before the node was lost"
    assert rank_process(output, 0) is None, "node1's process outlived the job"
    print(f"node lost: job ended {time.monotonic() - started:.0f} s after submission")

    # The same job again, as a requeue starts it: with --save-steps the batch file resumes by itself.
    exit_code, log_text = submit("srun", output, *TRAIN, *every_4)
    assert exit_code == 0, log_text[-4000:]
    result = read_result(output)
    assert result["resumed_from_step"] >= 4 and (result["strategy"], result["launcher"]) == RAN_AS["srun"]
    assert (result["world_size"], result["global_batch_size"], result["dev_samples"]) == (2, 32, DEV_SAMPLES)
    assert "launcher: srun, one task per process" in log_text and log_text.count("耗时：") == 1
    assert_same_weights(uninterrupted / "model", output / "model")


def test_a_job_signalled_before_preemption_saves_its_step_and_resumes_from_it(cluster, uninterrupted, tmp_path):
    """Slurm's SIGTERM (preemption, or --signal before the time limit) reaches torchrun and its workers:
    they agree on a step, save it and stop; the job run again continues from that step. There, a
    worker killed: torchrun restarts them all (--max-restarts), and they continue from it again."""
    output, rarely = tmp_path / "out", [*TWO_EPOCHS, "--save-steps", "100"]  # no checkpoint but the signal's
    job, log = submit("torchrun", output, *TRAIN, *rarely, wait=False)
    while "step：5/22" not in (log.read_text(errors="replace") if log.exists() else ""):
        assert job.poll() is None, "the job ended before step 5"
        time.sleep(0.1)
    slurm("scancel", "--signal=TERM", job.id)
    assert job.wait(timeout=60) != 0
    text = log.read_text(errors="replace")
    # At a line's start, or after rank 0's progress bar: a step slower than its 1 s refresh redraws it
    # just before (the bar's line is not ended first).
    stopped = re.findall(r"^(?:\s*\d+%\|.*\])?error: stopped by SIGTERM after step (\d+): ", text, re.MULTILINE)
    assert stopped and not (output / "result.json").exists(), text[-4000:]
    step = int(stopped[0])
    assert 5 <= step < 22 and checkpoints.read_meaning(output / "checkpoint")["step"] == step

    job, log = submit("torchrun", output, *TRAIN, *rarely, wait=False)
    resumed, victim = f"--resume: continuing from step {step} ", None
    while resumed not in (log.read_text(errors="replace") if log.exists() else ""):
        assert job.poll() is None, "the job ended before it resumed"
        victim = victim or rank_process(output, 1)
        time.sleep(0.1)
    first_rank_0 = rank_process(output, 0)
    (victim or rank_process(output, 1)).send_signal(signal.SIGKILL)  # node2's, training from that step
    # node1's restarted worker held back 3 s, as on a busy node: node2's reaches the rendezvous first,
    # which must not find the previous attempt's addresses there.
    while (restarted := rank_process(output, 0)) in (None, first_rank_0):
        assert job.poll() is None, "the job ended without restarting its workers"
        time.sleep(0.1)
    restarted.suspend()
    time.sleep(3)
    restarted.resume()
    exit_code, log_text = job.wait(), log.read_text(errors="replace")
    assert exit_code == 0 and log_text.count(resumed) == 2, log_text[-4000:]  # before the kill and after
    result = read_result(output)
    assert result["resumed_from_step"] == step and (result["strategy"], result["launcher"]) == RAN_AS["torchrun"]
    assert result["threads_per_process"] == 1 and log_text.count("耗时：") == 1
    assert f"network: {INTERFACE} (NET_INTERFACE overrides it)" in log_text
    assert_same_weights(uninterrupted / "model", output / "model")


def test_an_output_folder_one_node_cannot_see_fails_the_job_in_one_line_before_training(cluster, tmp_path):
    exit_code, log = submit("srun", STATE_DIR / "node-local" / tmp_path.name, *TRAIN, log=tmp_path / "job.log")
    assert exit_code != 0
    assert error_lines(log) == [line for line in error_lines(log) if "not on a filesystem every node shares" in line]
    assert len(error_lines(log)) == 1 and "【train】" not in log, log[-4000:]


def test_an_interface_a_node_lacks_fails_the_job_in_one_line_before_training(cluster, tmp_path):
    exit_code, log = submit("srun", tmp_path / "out", *TRAIN, env={"NET_INTERFACE": "ib9"})
    assert exit_code != 0
    assert error_lines(log) == ["error: network interface ib9 is missing on a node of this job: set NET_INTERFACE "
                                "to the one every node has (ip -br addr lists them)"], log[-4000:]
    assert "【train】" not in log


def test_a_batch_file_without_the_venv_says_so_before_asking_slurm_anything(tmp_path):
    """A .venv made on one node's disk, or not yet made: the batch file stops in one line."""
    process = run(["bash", "-c", f"cd {tmp_path} && source {ROOT / 'slurm' / 'preflight.sh'}"],
                  env={"SLURM_JOB_ID": "7"}, check=False)
    assert process.returncode == 2
    assert process.stderr.strip() == (f"error: no .venv in {tmp_path}: make it once on the shared filesystem "
                                      "(./test.sh --quick sets it up)")


@pytest.mark.parametrize("job_id", [None, "7"])
def test_a_batch_file_run_by_bash_outside_slurm_says_to_sbatch_it_and_makes_nothing(tmp_path, job_id):
    """`bash slurm/x.sbatch` on a login node: one line naming sbatch, no output folder left behind; also
    with a SLURM_JOB_ID left in the environment, which no job of Slurm's here has (Slurm's commands or not)."""
    outside_slurm = {name: value for name, value in os.environ.items() if not name.startswith("SLURM_")}
    for batch_file in sorted((ROOT / "slurm").glob("*.sbatch")):
        output_dir, name = tmp_path / batch_file.stem, f"slurm/{batch_file.name}"
        process = subprocess.run(["bash", name, "--epochs", "1"], cwd=ROOT, capture_output=True, text=True, timeout=60,
                                 env={**outside_slurm, "OUTPUT_DIR": str(output_dir), "DEVICE": "cpu",
                                      **({"SLURM_JOB_ID": job_id} if job_id else {})})
        assert (process.returncode, process.stderr.splitlines()) == (2, [
            f"error: SLURM_JOB_ID is set (7), but no Slurm job of that id runs here (scontrol cannot show it): {name} "
            f"runs as a Slurm job: submit it from the repository root with `sbatch --gres gpu:N {name}`" if job_id else
            f"error: {name} runs as a Slurm job: submit it from the repository root with `sbatch --gres gpu:N {name}` "
            f"(N GPUs per node; on CPU nodes `DEVICE=cpu sbatch {name}`)"]), process.stderr
        assert not output_dir.exists()


def test_a_gpu_job_submitted_without_gpus_says_how_to_ask_for_them_and_makes_nothing(tmp_path):
    """`sbatch slurm/x.sbatch` without --gres on a GPU cluster: one line, before the nodes are asked anything."""
    in_a_job = {name: value for name, value in os.environ.items()
                if not name.startswith("SLURM_") and name not in ("GPUS_PER_NODE", "DEVICE")}
    for command in ("scontrol", "srun"):  # a job's machine has them; this check asks them nothing
        (tmp_path / command).write_text("#!/bin/sh\nexit 1\n", encoding="utf-8")
        (tmp_path / command).chmod(0o755)
    process = subprocess.run(["bash", "slurm/benchmark.sbatch"], cwd=ROOT, capture_output=True, text=True, timeout=60,
                             env={**in_a_job, "SLURM_JOB_ID": "7", "SLURM_SUBMIT_DIR": str(ROOT),
                                  "OUTPUT_DIR": str(tmp_path / "out"), "PATH": f"{tmp_path}:{os.environ['PATH']}"})
    assert (process.returncode, process.stderr.splitlines()) == (2, [
        "error: this job was given no GPUs: submit it with sbatch --gres gpu:N (N GPUs per node; GPUS_PER_NODE=N "
        "where the cluster has no gres), or with DEVICE=cpu on a CPU cluster"]), process.stderr
    assert not (tmp_path / "out").exists()


def test_a_port_already_taken_on_the_head_fails_in_one_line_before_training(cluster, tmp_path):
    """Rank 0 on node1 refuses the port (as it refuses a wrong MASTER_ADDR, checked in this process above),
    and node2's rank, waiting on it, goes with the job."""
    port = str(20000 + os.getpid() % 1000)
    holder = subprocess.Popen(["bash", str(CLUSTER), "exec", PYTHON, "-c",
                               f"import socket, time; s = socket.socket(); s.bind(('', {port})); s.listen(); "
                               "print('listening', flush=True); time.sleep(300)"],
                              cwd=ROOT, stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline().strip() == "listening"
        exit_code, log = submit("srun", tmp_path / "out", *TRAIN, "--dist-timeout", "60", env={"MASTER_PORT": port})
    finally:
        holder.kill()
        holder.wait()
    assert exit_code != 0
    assert len(error_lines(log)) == 1 and f"MASTER_PORT {port} is already in use on node1" in log, log[-4000:]
    assert "【train】" not in log and "Traceback" not in log
