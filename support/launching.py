"""Launching a command, for the runner (bench/run.py) and the GPU check (scripts/gpu_plan.py): in a session
of its own, its output in a log, timed, stopped whole at its timeout. The standard library only."""
import contextlib
import functools
import os
import shlex
import signal
import subprocess
import time
from pathlib import Path
from typing import NamedTuple

from .launch import stop_with_the_parent


class CpuTimes(NamedTuple):
    """A moment of the machine, for what the launches between two of them got: the machine's busy CPU
    seconds (/proc/stat; None without it), this process's own and its finished children's (a launch's
    processes, once reaped), and the 1-minute load average."""
    busy: float | None
    runner: float
    children: float
    load: float

    @classmethod
    def now(cls):
        busy = None
        with contextlib.suppress(OSError, ValueError, IndexError):
            # user nice system idle iowait irq softirq steal ...: all but idle and iowait is busy.
            ticks = [int(field) for field in Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:9]]
            busy = (sum(ticks) - ticks[3] - ticks[4]) / os.sysconf("SC_CLK_TCK")
        times = os.times()  # children: those reaped, with the children they reaped
        return cls(busy, times.user + times.system, times.children_user + times.children_system, os.getloadavg()[0])


class Launched(NamedTuple):
    """How a launch ended: its exit status (negative: the signal that killed it; None: stopped at its timeout),
    its wall seconds, the machine before and after it, and the CPU seconds of its processes once reaped."""
    status: int | None
    wall: float
    before: CpuTimes
    after: CpuTimes
    cpu_seconds: float


def launch(command, log_path, timeout, cwd, env=None, shown=None, grace=15):
    """Run `command` (the variables `env` added to ours) in a session of its own, out of reach of signals sent
    to ours, yet ending with this process, even a killed one; its output appended to `log_path` between the
    command (`shown`, else quoted) and how it ended. At `timeout` seconds (None: none), stop its session."""
    before, start = CpuTimes.now(), time.perf_counter()
    with open(log_path, "a", encoding="utf-8") as log:
        print(f"$ {shown or shlex.join(command)}", file=log, flush=True)
        process = subprocess.Popen(command, cwd=cwd, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                   env={**os.environ, "PYTHONUNBUFFERED": "1", **(env or {})}, start_new_session=True,
                                   preexec_fn=functools.partial(stop_with_the_parent, os.getpid()))
        try:
            status = process.wait(timeout=timeout)
        except BaseException as error:  # its timeout, or this process stopping (Ctrl-C): its session ends too
            stop(process, grace)
            if not isinstance(error, subprocess.TimeoutExpired):
                raise
            status = None
        after = CpuTimes.now()
        launched = Launched(status, time.perf_counter() - start, before, after, after.children - before.children)
        ended = f"stopped after {timeout:g} s (its timeout)" if status is None else f"exit status {status}"
        log.write(f"$ # {ended}, {launched.wall:.1f} s wall, {launched.cpu_seconds:.1f} CPU s\n")
    return launched


def printed(log_path):
    """The lines the launches of `log_path` printed: not the launcher's own ($ ...), nor blank ones."""
    text = Path(log_path).read_text(encoding="utf-8", errors="replace")
    return [line for line in text.splitlines() if line.strip() and not line.startswith("$ ")]


def stop(process, grace=15):
    """End the launcher and every process it started (they share its session, which is its process
    group): SIGTERM, `grace` seconds for all of them to end, then SIGKILL to those still running.
    Waiting for the launcher alone would let a process it started outlive it, or be killed mid-way."""
    for sig, seconds in ((signal.SIGTERM, grace), (signal.SIGKILL, 5)):
        try:
            os.killpg(process.pid, sig)
        except ProcessLookupError:
            return
        deadline = time.monotonic() + seconds
        while time.monotonic() < deadline:
            process.poll()  # reaps the launcher
            if not group_runs(process.pid):
                return process.poll()  # reaps it if it ended since: its CPU seconds count
            time.sleep(0.1)


def group_runs(group):
    """Whether a process of `group` still runs: one that exited and waits for a parent to reap it (a
    zombie) does not, though signals still reach it."""
    try:
        os.killpg(group, 0)
    except ProcessLookupError:
        return False
    if not Path("/proc/self/stat").exists():  # no /proc to tell zombies apart
        return True
    for stat in Path("/proc").glob("[0-9]*/stat"):
        with contextlib.suppress(OSError):
            state, _, process_group = stat.read_text().rsplit(")", 1)[1].split()[:3]
            if int(process_group) == group and state != "Z":
                return True
    return False
