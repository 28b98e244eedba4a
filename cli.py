"""The command line and the launch: the options every script shares, how a launcher (or Slurm's srun)
told this process its place in the job, and how a script's failures reach the user.

Imports nothing heavy (no torch, no transformers): what only plans runs, as the benchmark runner does,
reads the options at once.
"""
import argparse
import os
import re
import signal
import socket
import sys
import traceback
from pathlib import Path

ROOT = Path(__file__).resolve().parent
# Models with random weights learn from scratch (a higher rate); BERT-base's depth needs a lower one than tiny's.
DEFAULT_LR = {"tiny": 1e-3, "base-shape": 1e-4, "pretrained": 3e-5}
PRECISIONS = ["fp32", "bf16", "fp16"]


class UserError(Exception):
    """A problem the user can fix (bad data, missing model, wrong launch): reported in one line.

    Most are found by every process alike, and rank 0 speaks for all; one that only some processes
    meet (`only_this_rank=True`) is reported by each of them.
    """

    def __init__(self, message, only_this_rank=False):
        super().__init__(message)
        self.only_this_rank = only_this_rank


def run(main):
    """Run `main()`, turning failures into one clear line on stderr and a non-zero exit."""
    import torch.distributed as dist  # for its rendezvous errors; every script has imported torch already
    rank = current_rank()
    # SIGTERM (a scheduler or launcher stopping the job) unwinds like Ctrl-C: cleanup code runs.
    signal.signal(signal.SIGTERM, signal.default_int_handler)
    try:
        main()
    except UserError as error:
        if rank == 0 or error.only_this_rank:
            print(f"error: {error}", file=sys.stderr)
        sys.exit(2)
    except KeyboardInterrupt:
        print(f"rank {rank}: interrupted", file=sys.stderr)
        sys.exit(130)
    except (dist.DistNetworkError, dist.DistStoreError) as error:
        # The rendezvous never came together within --dist-timeout: a wrong address, a blocked port, or
        # a process (a node) that never started. Where is in the message; a traceback would add nothing.
        print(f"error: rank {rank} could not reach the process group at {os.environ.get('MASTER_ADDR')}:"
              f"{os.environ.get('MASTER_PORT')} within --dist-timeout: {str(error).splitlines()[0]}", file=sys.stderr)
        sys.exit(1)
    except Exception as error:
        traceback.print_exc()
        print(f"error: rank {rank} failed: {type(error).__name__}: {error}", file=sys.stderr)
        sys.exit(1)


def current_rank():
    for name in ("RANK", "HOROVOD_RANK", "OMPI_COMM_WORLD_RANK", "SLURM_PROCID"):
        if name in os.environ:
            return int(os.environ[name])
    return 0


# ----------------------------------------------------------------------------- command line

class HelpFormatter(argparse.ArgumentDefaultsHelpFormatter, argparse.RawDescriptionHelpFormatter):
    """Show each option's default and keep the script's docstring as written."""


def build_parser(script_file, description):
    """The options every script accepts; scripts add their own with `parser.add_argument`."""
    stem = Path(script_file).stem
    parser = argparse.ArgumentParser(description=description, formatter_class=HelpFormatter)
    parser.add_argument("--model", default="auto",
                        help="'auto' (local weights, else the hub, else tiny), 'tiny', 'base-shape' (the real model's "
                             "architecture, random weights, offline), a folder or a hub id")
    parser.add_argument("--data", default=str(ROOT / "data" / "train.json"), help="JSON list of [text, label]")
    parser.add_argument("--max-samples", type=int, default=10000, help="use the first N records")
    parser.add_argument("--dev-ratio", type=float, default=0.08, help="share of samples held out for dev")
    parser.add_argument("--epochs", type=int, default=1)
    parser.add_argument("--max-steps", type=int, default=0, metavar="N",
                        help="stop after N optimizer steps (at most --epochs' worth), then evaluate on the whole dev "
                             "set as usual; 0 = every step of --epochs")
    parser.add_argument("--batch-size", type=int, default=32, help="per process and micro-batch")
    parser.add_argument("--grad-accum", type=int, default=1, metavar="N",
                        help="micro-batches per optimizer step (gradient accumulation): the global batch is "
                             "--batch-size x processes x N")
    parser.add_argument("--lr", type=float, default=None,
                        help=f"default {DEFAULT_LR['tiny']} for the tiny model, {DEFAULT_LR['base-shape']} for "
                             f"base-shape, {DEFAULT_LR['pretrained']} otherwise")
    parser.add_argument("--weight-decay", type=float, default=0.01)
    parser.add_argument("--max-seq-len", type=int, default=128, help="longer texts are truncated")
    parser.add_argument("--seed", type=int, default=123)
    parser.add_argument("--log-steps", type=int, default=50, help="print the training loss every N steps")
    parser.add_argument("--eval-steps", type=int, default=0, help="evaluate every N steps; 0 = only at the end")
    parser.add_argument("--output-dir", default=str(ROOT / "output" / stem))
    parser.add_argument("--device", choices=["auto", "cpu", "cuda"], default="auto")
    parser.add_argument("--num-workers", type=int, default=0, help="DataLoader worker processes")
    parser.add_argument("--threads", type=int,
                        help="torch threads per process; None = the cores this process may use, shared "
                             "equally by the processes on this machine, whatever the launcher set")
    parser.add_argument("--group-by-length", action=argparse.BooleanOptionalAction, default=True,
                        help="batch texts of similar length together: 2x faster here, same accuracy "
                             "(benchmarks/pipeline.py)")
    parser.add_argument("--no-shuffle", action="store_true", help="keep the training order fixed")
    parser.add_argument("--dropout", type=float, default=None, help="override the model's dropout probabilities")
    parser.add_argument("--gradient-checkpointing", action="store_true",
                        help="keep only each layer's input in forward and recompute the rest in backward: less "
                             "activation memory for about one more forward pass of compute")
    parser.add_argument("--save-steps", type=int, default=0,
                        help="save a training checkpoint (for --resume) every N steps; 0 = never")
    parser.add_argument("--resume", action="store_true",
                        help="continue from the training checkpoint in --output-dir, if there is one")
    parser.add_argument("--compile", action="store_true",
                        help="compile the model with torch.compile: its first steps pay the compilation "
                             "(first_step_seconds in result.json), later ones run fused kernels")
    parser.add_argument("--tf32", action="store_true",
                        help="fp32 matrix products on TF32 tensor cores (NVIDIA GPUs from Ampere on): 10 "
                             "mantissa bits in the products, fp32 everywhere else; default IEEE fp32")
    parser.add_argument("--profile", type=int, default=0, metavar="STEPS",
                        help="record STEPS training steps with torch.profiler after 2 warm-up steps: "
                             "<output-dir>/trace.json and milliseconds per phase in result.json (slower)")
    return parser


def add_distributed_args(parser, backend=False):
    """Options of the scripts that run several processes; `backend` for the DDP scripts, whose gloo
    all-reduce works on GPU tensors too."""
    parser.add_argument("--dist-timeout", type=float, default=300,
                        help="seconds a collective call may wait for the other processes before failing")
    if backend:
        parser.add_argument("--backend", choices=["auto", "nccl", "gloo"], default="auto",
                            help="auto = nccl between GPUs, gloo between CPU processes; gloo also lets more "
                                 "processes than GPUs share them (to try the GPU path on one GPU)")


def add_precision_arg(parser, default="fp32", default_help=None):
    """The one precision option of every script that can train in mixed precision."""
    parser.add_argument("--precision", choices=PRECISIONS, default=default,
                        help="fp32, or mixed precision computing in bf16 or fp16 (fp16: GPUs only)"
                             + (f"; None = {default_help}" if default_help else ""))


def check_args(args):
    if args.max_samples < 2:
        raise UserError(f"--max-samples must be at least 2, got {args.max_samples}")
    for name in ("save_steps", "profile", "max_steps"):
        if getattr(args, name) < 0:
            raise UserError(f"--{name.replace('_', '-')} must be 0 or more, got {getattr(args, name)}")
    if not 0 < args.dev_ratio < 1:
        raise UserError(f"--dev-ratio must be between 0 and 1, got {args.dev_ratio}")
    if args.lr is not None and not args.lr > 0:
        raise UserError(f"--lr must be positive, got {args.lr:g}")
    if args.weight_decay < 0:
        raise UserError(f"--weight-decay must be 0 or more, got {args.weight_decay:g}")
    if Path(args.output_dir).exists() and not Path(args.output_dir).is_dir():
        raise UserError(f"--output-dir {args.output_dir} is a file, not a folder")
    if args.threads is not None and args.threads < 1:
        raise UserError(f"--threads must be at least 1, got {args.threads}")
    for name in ("epochs", "batch_size", "grad_accum", "max_seq_len", "log_steps"):
        if getattr(args, name) < 1:
            raise UserError(f"--{name.replace('_', '-')} must be at least 1, got {getattr(args, name)}")
    return args


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
    return (int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"]), int(local["LOCAL_RANK"]),
            int(local["LOCAL_WORLD_SIZE"]))


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
    with socket.socket() as probe:
        try:
            probe.bind(("", port))
        except OSError:
            raise UserError(f"MASTER_PORT {port} is already in use on {socket.gethostname()} (rank 0's node): "
                            "set MASTER_PORT to a free port") from None
