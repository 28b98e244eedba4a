"""How a launcher (or Slurm's srun) told this process its place in the job: its rank, the world size,
its local rank and the processes on its machine; and how the job stops. Imports nothing heavy, as options.py."""
import ctypes
import multiprocessing
import os
import re
import signal
import socket
import sys
from pathlib import Path

from .errors import UserError


# Each launcher's rank and world size: torchrun's (and the launchers built on it), Horovod's, Open MPI's,
# Slurm's srun.
RANK_VARIABLES = (("RANK", "WORLD_SIZE"), ("HOROVOD_RANK", "HOROVOD_SIZE"),
                  ("OMPI_COMM_WORLD_RANK", "OMPI_COMM_WORLD_SIZE"), ("SLURM_PROCID", "SLURM_NTASKS"))
# What a launch variable must be, the one rule every reader of them follows (launch_variable): a whole
# number, a rank or index 0 or more, a size 1 or more, a port 1-65535. Anything else is refused in one
# line before any work, not met as a traceback inside torch, or a rendezvous on a port that cannot be.
LAUNCH_VARIABLES = {
    **dict.fromkeys(["RANK", "LOCAL_RANK", "GROUP_RANK", "HOROVOD_RANK", "HOROVOD_LOCAL_RANK", "OMPI_COMM_WORLD_RANK",
                     "OMPI_COMM_WORLD_LOCAL_RANK", "SLURM_PROCID", "SLURM_LOCALID", "SLURM_NODEID", "CROSS_RANK"],
                    (0, None)),
    **dict.fromkeys(["WORLD_SIZE", "LOCAL_WORLD_SIZE", "LOCAL_SIZE", "HOROVOD_SIZE", "HOROVOD_LOCAL_SIZE",
                     "OMPI_COMM_WORLD_SIZE", "SLURM_NTASKS"], (1, None)),
    "MASTER_PORT": (1, 65535),
}
# The scripts that always run alone: one process (single, DataParallel), the spawn scripts' parent (the
# processes it starts run in the group), predict.py, the runner and its one-process microbenchmarks. A
# RANK around them, left by a shell or a job script, names no group: they are rank 0 (in_a_group).
ALONE = {"single-gpu-cls.py", "multi-gpu-dataparallel-cls.py", "multi-gpu-distributed-mp-cls.py",
         "multi-gpu-distributed-mp-amp-cls.py", "predict.py", "benchmark.py", "matmul_peak.py", "pipeline.py"}


def launch_variable(name, default=None):
    """The launch variable `name` (LAUNCH_VARIABLES) as a number, `default` where it is unset."""
    value = os.environ.get(name)
    if value is None:
        return default
    least, most = LAUNCH_VARIABLES[name]
    try:
        number = int(value)
    except ValueError:
        number = None
    if number is None or number < least or (most is not None and number > most):
        kind = {0: "0 or more", 1: "1 or more"}[least] if most is None else f"{least}-{most}"
        raise UserError(f"{name}={value!r}: a launch variable must be a whole number, {kind}: fix what sets it "
                        "(the launcher, the job script or the shell)", only_this_rank=True)
    return number


def in_a_group():
    """Whether this process may be one of a group a launcher started: any script but those that run ALONE,
    and a process the spawn scripts start (multiprocessing's child)."""
    return Path(sys.argv[0]).name not in ALONE or multiprocessing.parent_process() is not None


def check_launch_variables():
    """Every launch variable set here, by launch_variable's rule: before any work of a script that runs in
    a group (a script alone reads none of them)."""
    for name in LAUNCH_VARIABLES:
        launch_variable(name)


def current_rank():
    """This process's rank: rank 0 speaks for all and writes --output-dir. A process alone in its world
    is rank 0 whatever rank its environment names: no other process would speak or write for it; so is
    a script that always runs alone (in_a_group)."""
    if not in_a_group():
        return 0
    for rank, size in RANK_VARIABLES:
        if rank in os.environ:
            return launch_variable(rank) if launch_variable(size, 1) > 1 else 0
    return 0


def launch_environment(how_to_launch):
    """(rank, world size, local rank, processes on this machine) as the launcher set them, or as Slurm
    set them for a plain `srun` of one task per process, or one line saying what is missing."""
    if "RANK" not in os.environ and started_by_srun():
        use_slurm_task_environment()
    if "RANK" not in os.environ or "WORLD_SIZE" not in os.environ:
        raise UserError(f"this script runs under a launcher: {how_to_launch}, or one srun task per process "
                        "(see the README)")
    local = {"LOCAL_RANK": os.environ.get("LOCAL_RANK"),
             "LOCAL_WORLD_SIZE": os.environ.get("LOCAL_WORLD_SIZE") or os.environ.get("LOCAL_SIZE")}
    missing = [name for name, value in local.items() if value is None]
    if missing:
        raise UserError(f"the launcher set RANK and WORLD_SIZE but not {' and '.join(missing)}: set them too "
                        "(this process's index on its machine, and the processes there), as torchrun does")
    rank, size = launch_variable("RANK"), launch_variable("WORLD_SIZE")
    index = launch_variable("LOCAL_RANK")
    processes = launch_variable("LOCAL_WORLD_SIZE" if "LOCAL_WORLD_SIZE" in os.environ else "LOCAL_SIZE")
    if not (0 <= rank < size and 0 <= index < processes):  # else it waits for a rank that never comes
        raise UserError(f"the launcher set RANK={rank}, WORLD_SIZE={size}, LOCAL_RANK={index}, LOCAL_WORLD_SIZE="
                        f"{processes}: each rank must be 0 or more and below its size", only_this_rank=True)
    if rank == 0 and "CROSS_RANK" in os.environ:  # DeepSpeed's launch.py: rank 0 hosts the rendezvous
        refuse_a_port_in_use(launch_variable("MASTER_PORT"), "--master_port", "give the deepspeed command a free one")
    return rank, size, index, processes


def local_rank():
    """This process's index on its machine as its launcher set it (0 alone): its GPU, before a library
    has joined the processes."""
    return launch_variable("LOCAL_RANK", 0)


def world_size():
    """The job's processes as the launcher set them (1 alone)."""
    return launch_variable("WORLD_SIZE", 1)


def local_world_size(default):
    """The processes on this machine as the launcher set them, else `default`."""
    return launch_variable("LOCAL_WORLD_SIZE", default)


def launched():
    """Whether a launcher (torchrun, the legacy or deepspeed launcher) or srun's tasks started this
    process, rather than plain python."""
    return "RANK" in os.environ or "WORLD_SIZE" in os.environ or started_by_srun()


def launch_environment_or_alone(how_to_launch):
    """launch_environment's answer when launched(), else that of one process alone."""
    return launch_environment(how_to_launch) if launched() else (0, 1, 0, 1)


def accelerate_launcher():
    """Which launcher started an Accelerate script: accelerate launch sets ACCELERATE_MIXED_PRECISION
    in every process it starts (its default "no" too); torchrun sets WORLD_SIZE."""
    if "ACCELERATE_MIXED_PRECISION" in os.environ:
        return "accelerate launch"
    return "torchrun" if "WORLD_SIZE" in os.environ else "python"


def fabric_launcher():
    """Which launcher started a Fabric script: fabric run marks its processes with LT_CLI_USED=1;
    torchrun sets TORCHELASTIC_RUN_ID (torch.distributed.is_torchelastic_launched)."""
    if os.environ.get("LT_CLI_USED") == "1":
        return "fabric run"
    return "torchrun" if os.environ.get("TORCHELASTIC_RUN_ID") is not None else "python"


# ----------------------------------------------------------------------------- stopping

# What a scheduler or a launcher sends to stop a job: SIGTERM (preemption, `kill`, a launcher passing
# it on), SIGUSR1 (a notice before the time limit). A training process's main thread decides what they do.
# The rule: a process stops once. A job often gets several (the whole group's, then its launcher's
# passing it on, then its parent's death): the first stops it, the later ones are noted and cut
# nothing short, neither a checkpoint being written nor the clean-up after it (the DataLoader's workers
# told to end, the process group left, the folder's lock released).
STOP_SIGNALS = (signal.SIGTERM, signal.SIGUSR1)
PR_SET_PDEATHSIG = 1  # prctl(2): the signal this process gets when its parent ends
LIBC = ctypes.CDLL(None, use_errno=True) if sys.platform.startswith("linux") else None  # loaded before any fork


def stop_with_the_parent(parent=None):
    """This process gets SIGTERM when its parent (pid `parent`, else its parent now) ends, as if the
    parent had passed one on: a launcher killed by a signal it does not handle (torchrun and SIGUSR1),
    or the runner killed outright, would otherwise leave its processes training on as orphans. Also a
    Popen preexec_fn, given the parent's pid from before the fork. Linux only: prctl's signal comes when
    the thread that started this process ends, and every launcher here starts its ranks from its main
    thread."""
    if LIBC is None:
        return
    parent = parent or os.getppid()
    LIBC.prctl(PR_SET_PDEATHSIG, signal.SIGTERM)
    if os.getppid() != parent:  # it ended before the call: nothing would send the signal
        os.kill(os.getpid(), signal.SIGTERM)


def stop_once(number, frame):
    """The stop signals' handler outside --save-on-signal's training: the first unwinds the process as
    Ctrl-C does (KeyboardInterrupt: the clean-up code runs); later ones are ignored, as the rule says."""
    for each in STOP_SIGNALS:
        signal.signal(each, stopping_already)
    raise KeyboardInterrupt


def stopping_already(number, frame):
    """A stop signal after the first changes nothing. (A handler of Python's, unlike SIG_IGN, does not
    pass to a program the process starts.)"""


def ignore_stop_signals(worker_id=None):
    """A DataLoader worker's worker_init_fn: the stop signals sent to the whole process group are the
    training process's to handle; a worker they killed would end it with a traceback instead."""
    for number in STOP_SIGNALS:
        signal.signal(number, signal.SIG_IGN)


# ----------------------------------------------------------------------------- Slurm, no launcher

# What srun sets in every task it starts. SLURM_STEP_ID is missing from the batch script itself, which
# also has SLURM_PROCID 0 and the job's SLURM_NTASKS: a script started there without srun is one
# process, not rank 0 of a group that would wait for the others until --dist-timeout.
SLURM_TASK_VARIABLES = ("SLURM_PROCID", "SLURM_NTASKS", "SLURM_LOCALID", "SLURM_NODEID", "SLURM_STEP_ID")
# The rendezvous port when MASTER_PORT is unset: one per job id, so that two jobs sharing a first node
# do not meet each other's rendezvous (two steps of one job at once need a MASTER_PORT each).
SLURM_PORT_BASE, SLURM_PORT_SPAN = 15000, 10000
# Set when srun, not a launcher, started this process: result.json names srun as its launcher.
srun_started_this_process = False


def started_by_srun():
    return all(name in os.environ for name in SLURM_TASK_VARIABLES)


def use_slurm_task_environment():
    """Set what torchrun would have set (RANK, WORLD_SIZE, LOCAL_RANK, LOCAL_WORLD_SIZE, MASTER_ADDR,
    MASTER_PORT) from srun's SLURM_* variables. The rendezvous is the step's first node, where srun
    starts rank 0; MASTER_ADDR and MASTER_PORT, when set, win."""
    global srun_started_this_process
    srun_started_this_process, env = True, os.environ
    node_id = int(env["SLURM_NODEID"])
    tasks_per_node = expand_tasks_per_node(env.get("SLURM_STEP_TASKS_PER_NODE") or env["SLURM_TASKS_PER_NODE"])
    env.update(RANK=env["SLURM_PROCID"], WORLD_SIZE=env["SLURM_NTASKS"], LOCAL_RANK=env["SLURM_LOCALID"],
               LOCAL_WORLD_SIZE=str(tasks_per_node[node_id]))
    env.setdefault("MASTER_ADDR", first_host(env.get("SLURM_STEP_NODELIST") or env["SLURM_NODELIST"]))
    env.setdefault("MASTER_PORT", str(SLURM_PORT_BASE + int(env.get("SLURM_JOB_ID", 0)) % SLURM_PORT_SPAN))
    if env["RANK"] == "0":
        check_rendezvous_host(env["MASTER_ADDR"], int(env["MASTER_PORT"]))
        print(f"launcher: srun, one task per process: rank, world size and local rank from SLURM_PROCID, "
              f"SLURM_NTASKS and SLURM_LOCALID; rendezvous {env['MASTER_ADDR']}:{env['MASTER_PORT']} "
              f"(the first node; MASTER_ADDR and MASTER_PORT override it)", flush=True)


def use_slurm_for_horovod():
    """Horovod's rank variables from srun's, for one srun task per process (slurm/horovod.sbatch runs
    the gloo rendezvous horovodrun would run): what horovodrun sets in each process it starts."""
    env = os.environ
    if "HOROVOD_RANK" in env or not started_by_srun():
        return
    if "HOROVOD_GLOO_RENDEZVOUS_ADDR" not in env:
        raise UserError("srun started this script without Horovod's rendezvous: submit slurm/horovod.sbatch, "
                        "which runs one, or start it with horovodrun")
    global srun_started_this_process
    srun_started_this_process = True
    node, local_rank = int(env["SLURM_NODEID"]), int(env["SLURM_LOCALID"])
    tasks_per_node = expand_tasks_per_node(env.get("SLURM_STEP_TASKS_PER_NODE") or env["SLURM_TASKS_PER_NODE"])
    # The "cross" group: the processes of this local rank, one on each node that has one.
    peers = [index for index, tasks in enumerate(tasks_per_node) if tasks > local_rank]
    env.update(HOROVOD_RANK=env["SLURM_PROCID"], HOROVOD_SIZE=env["SLURM_NTASKS"],
               HOROVOD_LOCAL_RANK=str(local_rank), HOROVOD_LOCAL_SIZE=str(tasks_per_node[node]),
               HOROVOD_CROSS_RANK=str(peers.index(node)), HOROVOD_CROSS_SIZE=str(len(peers)),
               HOROVOD_HOSTNAME=env.get("SLURMD_NODENAME") or socket.gethostname(),
               HOROVOD_CONTROLLER="gloo", HOROVOD_CPU_OPERATIONS="gloo")
    if env["HOROVOD_RANK"] == "0":
        print(f"launcher: srun, one task per process: Horovod's ranks from SLURM_PROCID, SLURM_NTASKS and "
              f"SLURM_LOCALID; rendezvous {env['HOROVOD_GLOO_RENDEZVOUS_ADDR']}:"
              f"{env.get('HOROVOD_GLOO_RENDEZVOUS_PORT')}", flush=True)


def expand_tasks_per_node(value):
    """Slurm's compressed tasks per node, one count per node: '2(x3),1' -> [2, 2, 2, 1]."""
    counts = []
    for part in value.split(","):
        count, _, repeat = part.partition("(x")
        counts += [int(count)] * int(repeat.rstrip(")") or 1)
    return counts


def first_host(nodelist):
    """The first host of a Slurm node list, as `scontrol show hostnames` would list it first:
    'gpu[07-09,12]-ib,cpu1' -> 'gpu07-ib'. Zero padding is kept: it is part of the name."""
    prefix, ranges, suffix = re.match(r"([^,\[]*)(?:\[([^\]]*)\])?([^,]*)", nodelist).groups()
    return prefix + (ranges.split(",")[0].split("-")[0] if ranges else "") + suffix


def check_rendezvous_host(address, port):
    """On rank 0, before anyone waits on it: the rendezvous address is this machine's, and its port free.
    Otherwise the other processes would wait --dist-timeout seconds for a rendezvous that never comes."""
    with socket.socket() as probe:
        try:
            probe.bind((socket.gethostbyname(address), 0))
        except OSError:
            raise UserError(f"MASTER_ADDR {address} is not an address of {socket.gethostname()}, where rank 0 "
                            "runs: leave MASTER_ADDR unset (the job's first node) or name this node") from None
    refuse_a_port_in_use(port, "MASTER_PORT", "set MASTER_PORT to a free port")


def refuse_a_port_in_use(port, option, remedy):
    """Where rank 0 hosts the rendezvous (not under torchrun, whose agent does): a port another program
    holds would keep the other processes waiting --dist-timeout seconds, then blaming the timeout."""
    with socket.socket() as probe:
        # As the rendezvous binds: the previous run's closed connections (TIME_WAIT) do not hold the port.
        probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            probe.bind(("", port))
        except OSError:
            raise UserError(f"{option} {port} is already in use on {socket.gethostname()} (rank 0's machine): "
                            f"{remedy}") from None
