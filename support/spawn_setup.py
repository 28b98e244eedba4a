"""The helpers of the spawn scripts (multi-gpu-distributed-mp-cls.py and its AMP variant) that are not
the lesson: torchrun's options and checks, a free rendezvous port, noting the first rank to fail, and
stopping the processes as torchrun would. free_port also serves benchmark.py, which imports this module without
torch: torch is imported where it is used."""
import socket
import sys
import time

from .errors import StoppedAfterSaving, UserError
from .launch import refuse_a_port_in_use

# Seconds the other processes get to stop on their own after a failure before they are killed; and
# after a SIGTERM, torchrun's 30: time for --save-on-signal's checkpoint.
SHUTDOWN_GRACE_SECONDS, STOP_GRACE_SECONDS = 10, 30


def add_launch_args(parser):
    """The options torchrun took, now the script's own."""
    parser.add_argument("--nprocs", type=int, metavar="N",
                        help="processes here (default: 1 per GPU, 2 on CPU)")
    parser.add_argument("--nnodes", type=int, default=1, metavar="N", help="machines taking part")
    parser.add_argument("--node-rank", type=int, default=0, metavar="I", help="this machine's index: 0 .. nnodes - 1")
    parser.add_argument("--master-addr", metavar="HOST",
                        help="the --node-rank 0 machine (default: 127.0.0.1)")
    parser.add_argument("--master-port", type=int, metavar="PORT", help="rendezvous port (default: a free one)")


def launch_defaults(args, gpus):
    """The launch options' defaults, which depend on the machine (its `gpus`): options.resolve's part for them."""
    if args.nnodes > 1 and (args.master_addr is None or args.master_port is None):
        raise UserError("with --nnodes > 1 every machine needs the same --master-addr (the address "
                        "of the --node-rank 0 machine) and --master-port")
    return {"nprocs": (gpus or 2) if args.nprocs is None else args.nprocs,
            "master_addr": args.master_addr or "127.0.0.1",
            "master_port": free_port() if args.master_port is None else args.master_port}


def check_launch(args, gpus):
    """Refuse launches that cannot meet, before any process starts."""
    if args.nprocs < 1 or args.nnodes < 1:
        raise UserError("--nprocs and --nnodes must be at least 1")
    if gpus and args.nprocs > gpus and args.backend != "gloo":
        raise UserError(f"--nprocs {args.nprocs} asks for more processes than this machine's {gpus} GPUs; "
                        "--backend gloo lets them share the GPUs")
    if not 0 <= args.node_rank < args.nnodes:
        raise UserError(f"--node-rank must be between 0 and {args.nnodes - 1}, got {args.node_rank}")
    if args.node_rank == 0:
        refuse_a_port_in_use(int(args.master_port), "--master-port",
                             "name another, or leave it out to get a free one")


def free_port():
    """A port nothing listens on, picked by the system, as the text a command line or MASTER_PORT takes.
    A fixed default (torchrun's 29500) makes a second job on the same machine, or a launch that
    follows an earlier one too closely, fail to start."""
    with socket.socket() as probe:
        probe.bind(("", 0))
        return str(probe.getsockname()[1])


def wait_for(processes, first_failure, args):
    """Wait for the processes of `mp.start_processes(..., join=False)`. If one fails, the others get a
    grace period, then are stopped, and the job ends naming the first rank that failed; if the job is
    interrupted (Ctrl-C, or SIGTERM or SIGUSR1 from a scheduler), they are stopped before the script
    exits, with their status where they stopped after saving (--save-on-signal: they said so)."""
    import torch.multiprocessing as mp
    try:
        while not processes.join(grace_period=SHUTDOWN_GRACE_SECONDS):
            pass
    except KeyboardInterrupt:
        stop(processes.processes, args.node_rank * args.nprocs)
        if StoppedAfterSaving.status in [process.exitcode for process in processes.processes]:
            raise SystemExit(StoppedAfterSaving.status) from None
        raise
    except mp.ProcessExitedException as error:
        if error.exit_code in (UserError.status, StoppedAfterSaving.status):  # the process has said why
            raise SystemExit(error.exit_code) from None
        rank = first_failure.value if first_failure.value >= 0 else args.node_rank * args.nprocs + error.error_index
        cause = f"killed by {error.signal_name}" if error.signal_name else f"exit code {error.exit_code}"
        raise SystemExit(f"error: rank {rank} failed ({cause}); the other processes were stopped") from None


def noting_the_first_failure(first_failure, rank, train):
    """`train`, noting `rank` in `first_failure` (for wait_for) if it fails first: in cli.run, before it leaves."""
    def train_noting_failure():
        try:
            train()
        except Exception:
            with first_failure.get_lock():
                if first_failure.value < 0:
                    first_failure.value = rank
            raise
    return train_noting_failure


def stop(processes, first_rank):
    """End the processes (ranks first_rank, first_rank + 1, ...) as torchrun would: SIGTERM (they clean up
    as on Ctrl-C), then SIGKILL, which says so: a rank still running then hung instead of stopping."""
    for process in processes:
        process.terminate()
    deadline = time.monotonic() + STOP_GRACE_SECONDS
    for index, process in enumerate(processes):
        process.join(max(0.0, deadline - time.monotonic()))
        if process.is_alive():
            process.kill()
            print(f"error: rank {first_rank + index} still ran {STOP_GRACE_SECONDS} s after SIGTERM: killed by signal "
                  "SIGKILL, its clean-up undone", file=sys.stderr, flush=True)
