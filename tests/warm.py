"""Warm launches, for multi-process runs whose launcher is not what a test proves: the ranks are forked
from a process that has imported torch and transformers already (multiprocessing's forkserver), where a
fresh Python spends 5 s of a tiny run's 6 importing them, in each rank and in the launcher too.

`run(command)` takes the command a user types (`torchrun ...`, `accelerate launch ...`, `deepspeed ...`,
`python SCRIPT`) and gives each rank what that launcher gives it: its environment (test_warm.py checks it
against the real launcher's), its argv, the script run as __main__, its own stdout and stderr; like the
launcher, it stops the other ranks when one fails, and a timeout kills them all. The forkserver imports
nothing of this project: each run imports common and support/ under its own environment, as a fresh
process does. `runner_launches()` sends benchmark.py's launches through it. Launchers whose libraries
need their own environment (horovodrun, fabric run) and the spawn scripts, which start their own ranks,
launch as before (conftest.run)."""
import atexit
import contextlib
import multiprocessing
import multiprocessing.connection
import multiprocessing.forkserver
import os
import runpy
import shlex
import signal
import subprocess
import sys
import tempfile
import time
import traceback
from pathlib import Path
from types import SimpleNamespace

ROOT = Path(__file__).resolve().parents[1]
# What every script imports, loaded once in the forkserver (transformers brings Accelerate, which reads its
# environment when used). Not DeepSpeed, which picks its accelerator when imported (DS_ACCELERATOR).
PRELOAD = ["torch", "torch.distributed", "transformers", "transformers.modeling_layers", "transformers.activations",
           "transformers.models.bert.modeling_bert", "sklearn.metrics", "torch.utils.tensorboard"]
# Variables the preloaded libraries read when imported (huggingface_hub's offline mode...): a run that
# sets them differently must start a fresh Python.
READ_AT_IMPORT = ("HF_", "HUGGINGFACE_", "TRANSFORMERS_", "TOKENIZERS_")
# What torchrun sets where unset, with several processes.
TORCHRUN_DEFAULTS = {"OMP_NUM_THREADS": "1"}
# What accelerate launch adds to torchrun's.
ACCELERATE = {"ACCELERATE_DYNAMO_BACKEND": "NO", "ACCELERATE_DYNAMO_MODE": "default",
              "ACCELERATE_DYNAMO_USE_DYNAMIC": "False", "ACCELERATE_DYNAMO_USE_FULLGRAPH": "False",
              "ACCELERATE_DYNAMO_USE_REGIONAL_COMPILATION": "False"}
# What the deepspeed launcher's processes set where unset: importing deepspeed does (torch then asks NVML
# whether CUDA is there).
DEEPSPEED_DEFAULTS = {"PYTORCH_NVML_BASED_CUDA_CHECK": "1"}
# After the first rank fails, the others get SIGTERM and this long to end before SIGKILL (torchrun: 30 s).
GRACE_SECONDS = 30

_server = {}


def torchrun_environment(rank, processes, port):
    """What torchrun gives rank `rank` of `processes` on one machine, beyond what it passes on. Its agent
    hosts the rendezvous store for the ranks (TORCHELASTIC_USE_AGENT_STORE): here rank 0 hosts it, as
    under the legacy launcher."""
    return {"RANK": str(rank), "LOCAL_RANK": str(rank), "WORLD_SIZE": str(processes),
            "LOCAL_WORLD_SIZE": str(processes), "GROUP_RANK": "0", "GROUP_WORLD_SIZE": "1", "ROLE_NAME": "default",
            "ROLE_RANK": str(rank), "ROLE_WORLD_SIZE": str(processes), "MASTER_ADDR": "127.0.0.1",
            "MASTER_PORT": str(port), "TORCHELASTIC_RUN_ID": "none", "TORCHELASTIC_RESTART_COUNT": "0",
            "TORCHELASTIC_MAX_RESTARTS": "0", "TORCHELASTIC_USE_AGENT_STORE": "False",
            "TORCHELASTIC_SIGNALS_TO_HANDLE": "SIGTERM,SIGINT,SIGHUP,SIGQUIT", "TORCH_NCCL_ASYNC_ERROR_HANDLING": "1"}


def deepspeed_environment(rank, processes, port):
    """What the deepspeed launcher (its launch.py, on one machine) gives rank `rank` of `processes`: its
    accelerator's devices, CPU's and CUDA's alike, in CUDA_VISIBLE_DEVICES, one per process."""
    return {"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port), "WORLD_SIZE": str(processes), "CROSS_RANK": "0",
            "CROSS_SIZE": "1", "LOCAL_SIZE": str(processes), "RANK": str(rank), "LOCAL_RANK": str(rank),
            "CUDA_VISIBLE_DEVICES": ",".join(map(str, range(processes)))}


def options(arguments, known, flags=()):
    """The launcher options at the front of `arguments` ({name: value}, flags True) and the rest (the
    script and its arguments). An option this module does not emulate is refused: launch that run."""
    found, rest = {}, list(map(str, arguments))
    while rest and rest[0].startswith("--"):
        option = rest.pop(0)
        name = option.replace("-", "_")
        if name in flags:
            found[name] = True
        elif name in known:
            found[name] = rest.pop(0)
        else:
            raise ValueError(f"warm.run does not emulate the launcher option {option}: launch it (conftest.run)")
    return found, rest


def plan(command):
    """(what the launcher sets where unset, each rank's (argv, launcher environment)) for `command`."""
    program, *arguments = map(str, command)
    name = Path(program).name
    if name.startswith("python") and arguments[:2] == ["-m", "torch.distributed.run"]:  # what torchrun runs
        name, arguments = "torchrun", arguments[2:]
    if name.startswith("python") and not arguments[0].startswith("-"):
        return {}, [(arguments, {})]
    if name == "deepspeed":
        return deepspeed_plan(arguments)
    if name == "torchrun":
        found, rest = options(arguments, {"__nproc_per_node", "__master_port"}, {"__standalone"})
        extra = {}
    elif name == "accelerate" and arguments[:1] == ["launch"]:
        found, rest = options(arguments[1:], {"__num_processes", "__main_process_port", "__config_file"},
                              {"__multi_gpu"})
        if "__config_file" in found:
            import yaml
            config = yaml.safe_load((ROOT / found["__config_file"]).read_text(encoding="utf-8"))
            assert config["distributed_type"] == "MULTI_GPU" and config["num_machines"] == 1, config
            found.setdefault("__num_processes", config["num_processes"])
        else:
            assert found.get("__multi_gpu"), "accelerate launch without --multi_gpu starts one process"
        found = {"__nproc_per_node": found["__num_processes"], "__master_port": found.get("__main_process_port")}
        extra = {**ACCELERATE, "ACCELERATE_MIXED_PRECISION": "no"}
    else:
        raise ValueError(f"warm.run does not emulate {name}: launch it (conftest.run)")
    processes = int(found.get("__nproc_per_node", 1))
    port = found.get("__master_port") or free_port()
    return TORCHRUN_DEFAULTS if processes > 1 else {}, [
        (rest, {**torchrun_environment(rank, processes, port), **extra}) for rank in range(processes)]


def deepspeed_plan(arguments):
    """plan() for `deepspeed --num_gpus N [--master_port P] SCRIPT ...`: its launch.py passes each rank
    --local_rank before the script's own arguments."""
    found, (script, *rest) = options(arguments, {"__num_gpus", "__master_port"})
    assert "__num_gpus" in found, "deepspeed without --num_gpus starts a process per device it finds"
    processes, port = int(found["__num_gpus"]), found.get("__master_port") or free_port()
    return DEEPSPEED_DEFAULTS, [([script, f"--local_rank={rank}", *rest], deepspeed_environment(rank, processes, port))
                                for rank in range(processes)]


def free_port():
    from support import spawn_setup  # here: the forkserver imports nothing of this project
    return spawn_setup.free_port()


def server():
    """The forkserver's context, started with PRELOAD on first use."""
    if not _server:
        context = multiprocessing.get_context("forkserver")
        context.set_forkserver_preload(PRELOAD)
        _server["context"] = context
    return _server["context"]


def cpu_seconds():
    """The CPU seconds of the forkserver and of every rank it has reaped (conftest's cost table adds them:
    they are no children of the tests' process until the forkserver ends)."""
    pid = getattr(multiprocessing.forkserver._forkserver, "_forkserver_pid", None)
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except (OSError, TypeError):
        return 0.0
    return sum(int(value) for value in fields[11:15]) / os.sysconf("SC_CLK_TCK")


def rank_main(arguments, environment, log):
    """One rank, in a process forked from the forkserver: a fresh process of the launcher's as far as the
    script can tell, in its own session so that a timeout kills what it starts too."""
    os.setsid()
    for descriptor, suffix in ((1, "out"), (2, "err")):
        opened = os.open(f"{log}.{suffix}", os.O_WRONLY | os.O_CREAT | os.O_TRUNC)
        os.dup2(opened, descriptor)
        os.close(opened)
    sys.stdout = open(1, "w", encoding="utf-8", buffering=1, closefd=False)
    sys.stderr = open(2, "w", encoding="utf-8", buffering=1, closefd=False)
    multiprocessing.process._parent_process = None  # no multiprocessing parent (launch.in_a_group)
    os.environ.clear()
    os.environ.update(environment)
    os.chdir(ROOT)
    sys.argv = arguments
    sys.path.insert(0, str(ROOT))
    code = 0
    try:
        runpy.run_path(str(ROOT / arguments[0]), run_name="__main__")
    except SystemExit as exit:
        code = exit.code if isinstance(exit.code, int) else int(exit.code is not None)
        if exit.code is not None and not isinstance(exit.code, int):
            print(exit.code, file=sys.stderr)
    except BaseException:
        traceback.print_exc()
        code = 1
    atexit._run_exitfuncs()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code & 0xFF)


def stop(processes, number):
    """Signal each rank still running, and what it started (its session: rank_main)."""
    for process in processes:
        if process.exitcode is None:
            try:
                os.killpg(process.pid, number)
            except ProcessLookupError:  # not yet in a session of its own, or gone
                with contextlib.suppress(ProcessLookupError):
                    os.kill(process.pid, number)


def wait(processes, timeout):
    """Wait for every rank; once one fails, stop the others as torchrun does. Returns what went wrong (None,
    "rank N exited C", "still ran after T s", "rank N exited C; ranks [M] still ran G s after SIGTERM") and the
    rank that failed first (None)."""
    deadline, problem, first = time.monotonic() + timeout, None, None
    waiting = {process.sentinel: process for process in processes}
    while waiting:
        ready = multiprocessing.connection.wait(list(waiting), timeout=max(0.0, deadline - time.monotonic()))
        if not ready:
            stop(processes, signal.SIGKILL)
            running = sorted(processes.index(process) for process in waiting.values())
            problem = (f"still ran after {timeout} s" if first is None
                       else f"{problem}; ranks {running} still ran {GRACE_SECONDS} s after SIGTERM")
            deadline = time.monotonic() + 30
            continue
        for sentinel in ready:
            process = waiting.pop(sentinel)
            process.join()
            if process.exitcode != 0 and first is None:
                first = processes.index(process)
                problem = problem or f"rank {first} exited {process.exitcode}"
                stop(processes, signal.SIGTERM)
                deadline = min(deadline, time.monotonic() + GRACE_SECONDS)
    return problem, first


def run(command, timeout=600, env=None, check=True):
    """conftest.run(command, ...) for a torchrun, accelerate launch, deepspeed or `python SCRIPT` command, warm.
    Returns a CompletedProcess: the exit status of the rank that failed first (else 0), the ranks' stdout and
    stderr joined in rank order; `.ranks` holds each rank's (exit status, stdout, stderr)."""
    defaults, ranks = plan(command)
    changed = [name for name in env or {} if name.startswith(READ_AT_IMPORT)]
    if changed:
        raise ValueError(f"{changed} are read when the preloaded libraries are imported: launch it (conftest.run)")
    with tempfile.TemporaryDirectory(prefix="warm-") as folder:
        ended, (problem, first) = start_and_wait(ranks, {**defaults, **os.environ, **(env or {})}, Path(folder),
                                                 timeout)
    completed = subprocess.CompletedProcess(list(map(str, command)), 0 if first is None else ended[first][0],
                                            "".join(out for _, out, _ in ended), "".join(err for _, _, err in ended))
    completed.ranks = ended
    if problem and (check or "still ran" in problem):
        import pytest
        pytest.fail(f"warm: {' '.join(completed.args)} {problem}\n--- stdout\n{completed.stdout[-4000:]}\n"
                    f"--- stderr\n{completed.stderr[-4000:]}")
    return completed


def start_and_wait(ranks, inherited, logs, timeout):
    """Each rank's (exit status, stdout, stderr), and wait's answer; `inherited`: the environment the
    launcher passes on."""
    processes = []
    for rank, (arguments, variables) in enumerate(ranks):
        environment = {**inherited, **variables}
        if "TORCHELASTIC_RUN_ID" in variables:  # torchrun's
            environment["TORCHELASTIC_ERROR_FILE"] = str(logs / f"error-{rank}.json")
        processes.append(server().Process(target=rank_main, args=(arguments, environment, str(logs / str(rank)))))
        processes[-1].start()
    problem = wait(processes, timeout)
    return [(process.exitcode, *(read(logs / f"{rank}.{suffix}") for suffix in ("out", "err")))
            for rank, process in enumerate(processes)], problem


def launch(command, log_path, timeout, cwd, env=None, shown=None):
    """support.launching.launch, warm (runner_launches): the log gets the command, each rank's stdout and
    stderr in rank order, and how it ended; the ranks' CPU seconds count as the runner's children's."""
    from support import launching
    assert Path(cwd) == ROOT, cwd
    before, started, spent = launching.CpuTimes.now(), time.perf_counter(), cpu_seconds()
    completed = run(command, timeout, {"PYTHONUNBUFFERED": "1", **(env or {})}, check=False)
    spent, wall, now = cpu_seconds() - spent, time.perf_counter() - started, launching.CpuTimes.now()
    with open(log_path, "a", encoding="utf-8") as log:
        log.write(f"$ {shown or shlex.join(map(str, command))}\n{completed.stdout}{completed.stderr}"
                  f"$ # exit status {completed.returncode}, {wall:.1f} s wall, {spent:.1f} CPU s (warm)\n")
    return launching.Launched(completed.returncode, wall, before, now._replace(children=now.children + spent), spent)


def measured_like_subprocess(command, cwd, timeout, **_):
    """subprocess.run(command, cwd=ROOT, capture_output=True, text=True, timeout=...), warm: how bench/traffic.py
    runs microbenchmarks/allreduce.py."""
    assert Path(cwd) == ROOT, cwd
    return run(command, timeout, check=False)


@contextlib.contextmanager
def runner_launches():
    """While benchmark.py runs in the tests' interpreter (conftest.run_in_process): its rows' launches and
    the all-reduce it measures, warm. A launch that does not end in its timeout fails the test."""
    import pytest

    from bench import traffic
    from support import launching
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(launching, "launch", launch)
        patch.setattr(traffic, "subprocess", SimpleNamespace(run=measured_like_subprocess))
        yield


def read(path):
    """What a rank wrote there; nothing where it failed before opening it."""
    return path.read_text(encoding="utf-8", errors="replace") if path.exists() else ""
