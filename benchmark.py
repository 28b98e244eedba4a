"""Run every strategy with its own launcher on the same model and data, and compare them in one table.

    python benchmark.py                                  # one row per strategy: a process per GPU, or 2 on CPU
    python benchmark.py --only single,ddp,deepspeed --repeat 3     # interleaved repeats and a noise floor
    python benchmark.py --only single,deepspeed-zero2,deepspeed-zero3   # variants side by side (--list)
    python benchmark.py --only single,ddp,horovod --nprocs 1,2,4   # a scaling sweep
    python benchmark.py --strategy-args deepspeed="--zero-stage 3"  # options for one strategy only
    python benchmark.py --variant zero3-adam-cpu=deepspeed:"--zero-stage 3 --offload optimizer"
    python benchmark.py --precision bf16                 # mixed precision wherever a strategy offers it
    python benchmark.py --grad-accum 4 --batch-size 8    # gradient accumulation, each library its own way
    python benchmark.py --profile 5                      # where a step's time goes, phase by phase
    python benchmark.py --max-samples 2000 --lr 5e-4     # options it does not know go to every script
    python benchmark.py --real-size                      # the real model's architecture, a few steps per row
    sbatch slurm/benchmark.sbatch --nnodes 1,2           # on a Slurm cluster: each row across the job's nodes

Each strategy trains with the same model, data, seed, learning rate, epochs and batch per device
(per process; DataParallel's one process gets it times its GPUs), so the global batch grows with
the devices (weak scaling), unless --global-batch asks for the same global batch for all (strong
scaling). Every row trains in fp32 except ddp-amp, whose point is mixed precision, unless
--precision asks for another for every strategy that offers one. Each process takes an equal
share of the machine's cores (the scripts' thread policy), whatever its launcher sets.

A row is a variant: a strategy plus options (`--list` shows the built-in ones; the default rows are
the strategies themselves). With --repeat N the launches go round-robin over the rows, so a slow
minute of a shared machine does not land on one row, and the table states the noise floor. Every
launch writes its result.json under <output-dir>/<row>/ and its output to <output-dir>/<row>.log;
the runner writes the comparison as benchmark.md, benchmark.json and benchmark.png in <output-dir>.
Every row also reports the model state each process holds (weights, gradients, optimizer state,
counted from its tensors) beside the ZeRO formula's prediction; --profile adds each step's time by
phase (data loading, forward, backward, optimizer step, exposed communication).

A row whose script or dependency is missing, or whose launch fails or times out, is listed with its
reason and the others still run. A row whose optional library is not installed (Horovod's build can
fail) is listed as not run; the exit status is 0 when every other row succeeded and some row ran.
"""
import argparse
import contextlib
import datetime
import importlib.util
import itertools
import json
import os
import platform
import re
import shlex
import shutil
import signal
import statistics
import subprocess
import sys
import time
from dataclasses import dataclass
from importlib import metadata
from pathlib import Path
from typing import Callable

from tqdm import tqdm

import benchmark_report
from support import cli, files, flops
from support.spawn_setup import free_port

ROOT = cli.ROOT
# The launchers come from the same environment as this Python, so every strategy runs the same libraries.
BIN = Path(sys.executable).parent
VERSIONED = ["torch", "transformers", "accelerate", "deepspeed", "horovod", "lightning_fabric"]
SCRIPT_DEFAULTS = cli.build_parser(__file__, "")
SCRIPT_BATCH_SIZE = SCRIPT_DEFAULTS.get_default("batch_size")
SCRIPT_MAX_SAMPLES = SCRIPT_DEFAULTS.get_default("max_samples")
SCRIPT_DEV_RATIO = SCRIPT_DEFAULTS.get_default("dev_ratio")


# ----------------------------------------------------------------------------- the strategies

def relative(path):
    """`path` relative to the repository root when it lies inside it: shorter, copy-pastable commands."""
    path = Path(os.path.abspath(ROOT / path))  # abspath, not resolve: keep .venv/bin/python a venv path
    return str(path.relative_to(ROOT)) if path.is_relative_to(ROOT) else str(path)


def python():
    return relative(sys.executable)


def executable(name):
    """A launcher beside this Python, as in a venv; else the one on the PATH (a system Python's)."""
    beside = BIN / name
    return relative(beside) if beside.exists() else shutil.which(name) or relative(beside)


# Each function returns the command up to and including the script; --output-dir and the shared
# options follow it. `n` is --nprocs, `gpus` the number of GPUs torch sees.

def launch_single(script, n, gpus):
    return [python(), script]


def launch_dataparallel(script, n, gpus):
    # One process drives all the GPUs; on CPU there is nothing to split over and it runs alone.
    gpu_ids = ["--gpu-ids", ",".join(str(i) for i in range(n))] if gpus else []
    return [python(), script, *gpu_ids]


def launch_torchrun(script, n, gpus):
    return [executable("torchrun"), "--nproc_per_node", str(n), "--master_port", free_port(), script]


def launch_spawn(script, n, gpus):
    # The script starts its own processes with torch.multiprocessing and picks a free port itself.
    return [python(), script, "--nprocs", str(n)]


def launch_horovodrun(script, n, gpus):
    # --gloo: scripts/build-horovod.sh builds Horovod with Gloo as its only controller (no MPI).
    return [executable("horovodrun"), "-np", str(n), "-H", f"localhost:{n}", "--gloo", python(), script]


def launch_deepspeed(script, n, gpus):
    # Without GPUs DeepSpeed picks its CPU accelerator; --num_gpus then counts CPU processes.
    return [executable("deepspeed"), "--num_gpus", str(n), "--master_port", free_port(), script]


def launch_accelerate(script, n, gpus):
    # `accelerate launch` starts several processes only with --multi_gpu, on CPU too (--cpu starts one);
    # the script itself asks for CPU training when there is no GPU (see its docstring).
    several = ["--multi_gpu"] if n > 1 else []
    return [executable("accelerate"), "launch", "--num_processes", str(n), *several,
            "--main_process_port", free_port(), script]


def launch_fabric(script, n, gpus):
    # fabric run is torchrun underneath; it passes the accelerator and device count to Fabric(). It reads
    # its own options after the script too (its --precision is not the script's): `--` ends them.
    return [executable("fabric"), "run", "--accelerator", "cuda" if gpus else "cpu", "--devices", str(n),
            "--main-port", free_port(), script, "--"]


@dataclass(frozen=True)
class Entry:
    """A strategy: its script and how it is launched."""
    name: str
    script: str
    launcher: str
    launch: Callable[[str, int, int], list]
    needs: str | None = None       # a Python module the strategy cannot run without
    splits_batch: bool = False     # one process splits its --batch-size over its GPUs (DataParallel)
    mixed_precision: bool = False  # the script takes --precision
    distributed: bool = True       # runs --nprocs processes (single and DataParallel run one)
    profiles: bool = True          # takes --profile (transformers.Trainer runs its own loop: it does not)


STRATEGIES = {entry.name: entry for entry in [
    Entry("single", "single-gpu-cls.py", "python", launch_single, distributed=False),
    Entry("dataparallel", "multi-gpu-dataparallel-cls.py", "python", launch_dataparallel, splits_batch=True,
          distributed=False),
    Entry("ddp", "multi-gpu-distributed-cls.py", "torchrun", launch_torchrun),
    Entry("ddp-spawn", "multi-gpu-distributed-mp-cls.py", "python (mp.spawn)", launch_spawn),
    Entry("ddp-amp", "multi-gpu-distributed-mp-amp-cls.py", "python (mp.spawn)", launch_spawn, mixed_precision=True),
    Entry("horovod", "multi-gpu-horovod-cls.py", "horovodrun", launch_horovodrun, needs="horovod"),
    Entry("deepspeed", "multi-gpu-deepspeed-cls.py", "deepspeed", launch_deepspeed, needs="deepspeed",
          mixed_precision=True),
    Entry("accelerate", "multi-gpu-accelerate-cls.py", "accelerate launch", launch_accelerate, needs="accelerate",
          mixed_precision=True),
    Entry("fsdp", "multi-gpu-fsdp-cls.py", "torchrun", launch_torchrun, mixed_precision=True),
    Entry("hf-trainer", "multi-gpu-transformers-cls.py", "torchrun", launch_torchrun, needs="accelerate",
          mixed_precision=True, profiles=False),
    Entry("fabric", "multi-gpu-fabric-cls.py", "fabric run", launch_fabric, needs="lightning_fabric",
          mixed_precision=True),
]}


@dataclass(frozen=True)
class Variant:
    """A row of the table: a strategy and the options that make it this variant."""
    name: str
    strategy: str
    options: tuple = ()
    about: str = ""
    needs_gpu: bool = False


# nn.DataParallel replicates the module at every forward, which torch.compile does not support.
CANNOT_COMPILE = {"dataparallel"}
# The default rows are the strategies as their scripts run by default; the others run when named in --only.
DEFAULT_ROWS = [Variant(name, name, about="the script's defaults") for name in STRATEGIES]
BUILT_IN_VARIANTS = DEFAULT_ROWS + [
    *[Variant(f"deepspeed-zero{stage}", "deepspeed", ("--zero-stage", str(stage)), about)
      for stage, about in enumerate(["stage 0: nothing partitioned (plain data parallelism)",
                                     "stage 1: optimizer state partitioned",
                                     "stage 2: + gradients partitioned (the script's default)",
                                     "stage 3: + weights partitioned"])],
    Variant("deepspeed-zero2-offload", "deepspeed", ("--zero-stage", "2", "--offload", "optimizer"),
            "stage 2, optimizer state and update on the CPU"),
    Variant("deepspeed-zero3-offload", "deepspeed", ("--zero-stage", "3", "--offload", "optimizer+param"),
            "stage 3, optimizer state and weights in CPU memory"),
    Variant("deepspeed-bf16", "deepspeed", ("--precision", "bf16"), "stage 2 with bf16 weights, fp32 master copy"),
    Variant("ddp-amp-bf16", "ddp-amp", ("--precision", "bf16"), "autocast to bf16"),
    Variant("ddp-amp-fp16", "ddp-amp", ("--precision", "fp16"), "autocast to fp16 with a gradient scaler",
            needs_gpu=True),
    Variant("accelerate-bf16", "accelerate", ("--precision", "bf16"), "Accelerate's bf16 autocast"),
    Variant("horovod-fp16-allreduce", "horovod", ("--fp16-allreduce",), "gradients sent as fp16"),
    Variant("fsdp-no-reshard", "fsdp", ("--no-reshard-after-forward",),
            "FSDP2 keeping the gathered weights from forward to backward (one all-gather fewer)"),
    Variant("fsdp-bf16", "fsdp", ("--precision", "bf16"), "FSDP2 gathering the weights in bf16, fp32 shards"),
    Variant("fsdp-offload", "fsdp", ("--offload",), "FSDP2 with the shards and the optimizer step on the CPU",
            needs_gpu=True),
    Variant("ddp-tf32", "ddp", ("--tf32",), "fp32 with its matrix products on TF32 tensor cores", needs_gpu=True),
    *[Variant(f"{name}+compile", name, ("--compile",), "the model compiled with torch.compile")
      for name in STRATEGIES if name not in CANNOT_COMPILE],
    Variant("ddp-amp-bf16+compile", "ddp-amp", ("--precision", "bf16", "--compile"), "autocast to bf16, compiled"),
    Variant("ddp+compile-static", "ddp", ("--compile", "--compile-dynamic", "static", "--pad-to-multiple-of", "16"),
            "compiled with static shapes: a graph per padded length (multiples of 16)"),
    Variant("ddp+compile-dynamic", "ddp", ("--compile", "--compile-dynamic", "dynamic"),
            "compiled with dynamic shapes: one graph for every length"),
    *[Variant(f"{name}+cudagraphs", strategy, (*options, "--compile-mode", "reduce-overhead"),
              f"{about}, compiled and replayed as CUDA graphs", needs_gpu=True)
      for name, strategy, options, about in [("single", "single", (), "one device"), ("ddp", "ddp", (), "DDP"),
                                              ("ddp-amp-bf16", "ddp-amp", ("--precision", "bf16"), "bf16 autocast")]],
    Variant("ddp-longest", "ddp", ("--pad-to-multiple-of", "1"),
            "each batch padded to its own longest text: a new shape almost every step"),
    Variant("ddp-amp-bf16-longest", "ddp-amp", ("--precision", "bf16", "--pad-to-multiple-of", "1"),
            "bf16 autocast, each batch padded to its own longest text"),
]


# --real-size: every default row and every ZeRO stage at 2 processes, the sharded rows also at 4 (to show
# the 1/N), with the real model's architecture (--model base-shape) for a few steps each.
REAL_SIZE_EXTRA_ROWS = ["deepspeed-zero1", "deepspeed-zero3"]
REAL_SIZE_SHARDED_ROWS = {"deepspeed", "deepspeed-zero1", "deepspeed-zero3", "fsdp"}
REAL_SIZE_COUNTS, REAL_SIZE_SHARDED_COUNTS = [2], [2, 4]
# 4 steps: the model state is counted before step 2, --profile's 2 steps follow 2 warm-up steps. Batch 8
# keeps a BERT-base step to seconds on a CPU core; 1,000 samples leave 80 dev samples to evaluate.
REAL_SIZE_DEFAULTS = {"max_steps": 4, "profile": 2, "batch_size": 8, "max_samples": 1000}
# One launch's resident memory per process, from a 2-process DDP run of base-shape (2.66 GB peak on rank 0):
# the whole model state (16 bytes a parameter in fp32 with Adam, the unsharded rows' bound), 4 more for
# DDP's gradient buckets or a gathered copy of the weights, and 1 GiB of libraries and activations at batch 8.
BYTES_PER_PARAMETER, BYTES_BEYOND_PARAMETERS = 20, 2**30
# A launch's cost besides its steps: launcher, imports, building BERT-base, evaluating, saving its 400 MB.
# Measured on 2 quiet cores (docs/results/amd-epyc-2-cores-base-shape): 12 s (one device) to 38 s (ZeRO-3,
# 4 processes), 18 s the median; on 2 loaded cores up to 173 s. With 30 s that run's 17 launches were
# estimated at 13 minutes; they took 9.
LAUNCH_SECONDS = 30


def library_missing(entry):
    return bool(entry.needs) and importlib.util.find_spec(entry.needs) is None


def why_not_ready(entry, launcher):
    """The reason `entry` cannot be launched at all with the file `launcher`, or None."""
    if not (ROOT / entry.script).is_file():
        return f"script {entry.script} not found"
    if library_missing(entry):
        return f"needs the Python module {entry.needs}, which is not installed (scripts/setup-env.sh installs it)"
    if not (ROOT / launcher).exists():
        return f"launcher {launcher} not found"
    return None


# ----------------------------------------------------------------------------- across nodes

# In a Slurm job of several nodes (slurm/benchmark.sbatch), each distributed row runs the batch file of
# slurm/ that runs its launcher across nodes, as if submitted alone: the same checks, the same launch
# line. The second field: the batch file starts one Slurm task per process (srun is the launcher), not
# one per node (a launcher that starts its node's processes).
BATCH_FILES = {"torchrun": ("slurm/torchrun.sbatch", False), "python (mp.spawn)": ("slurm/spawn.sbatch", False),
               "horovodrun": ("slurm/horovod.sbatch", True), "deepspeed": ("slurm/deepspeed.sbatch", False),
               "accelerate launch": ("slurm/accelerate.sbatch", False), "fabric run": ("slurm/fabric.sbatch", False)}
# One process on one machine: no launcher spans nodes. (single runs too, on the job's first node: the
# reference every row's speed-up is measured against.)
CANNOT_SPAN_NODES = {"dataparallel": "nn.DataParallel is one process driving the GPUs of one machine: it cannot "
                                     "run across nodes"}


def job_hosts(nnodes_option):
    """This Slurm job's nodes, the first (where the batch script runs) first."""
    if "SLURM_JOB_NODELIST" not in os.environ:
        raise cli.UserError(f"--nnodes {nnodes_option} runs each row across the nodes of a Slurm job: submit "
                            "slurm/benchmark.sbatch")
    listed = subprocess.run(["scontrol", "show", "hostnames", os.environ["SLURM_JOB_NODELIST"]], capture_output=True,
                            text=True, check=True)
    return listed.stdout.split()


def launch_across_nodes(entry, nnodes, nprocs, run_dir, hosts):
    """The batch file that runs `entry` over the first `nnodes` nodes of this job, and its environment:
    the job's shape as sbatch would have set it for a job of those nodes alone (srun takes its node and
    task counts from these variables), the script, a new free port (this node hosts the rendezvous),
    and no restart of failed workers (torchrun.sbatch's): a row fails as it would on one machine,
    rather than timing two attempts."""
    batch_file, task_per_process = BATCH_FILES[entry.launcher]
    tasks = nnodes * (nprocs if task_per_process else 1)
    return ["bash", batch_file], {
        "SCRIPT": entry.script, "GPUS_PER_NODE": str(nprocs), "OUTPUT_DIR": relative(run_dir),
        "MASTER_PORT": free_port(), "MAX_RESTARTS": "0", "SLURM_JOB_NODELIST": ",".join(hosts[:nnodes]),
        "SLURM_NNODES": str(nnodes), "SLURM_JOB_NUM_NODES": str(nnodes),
        "SLURM_NTASKS": str(tasks), "SLURM_NPROCS": str(tasks), "SLURM_NTASKS_PER_NODE": str(tasks // nnodes)}


# ----------------------------------------------------------------------------- command line

def parse_args(argv, gpus):
    """The command line; `gpus` (gpu_count()) sets the default --nprocs."""
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter,
                                     epilog="Any other option goes to every script as it is (--lr, --seed, "
                                            "--dev-ratio, ...): `python single-gpu-cls.py --help` lists them.")
    parser.add_argument("--only", help="comma-separated rows to run: strategies or variants (default: one row per "
                                       f"strategy, {','.join(STRATEGIES)}; --list shows the variants)")
    parser.add_argument("--skip", help="comma-separated rows to leave out")
    parser.add_argument("--list", action="store_true", help="list the strategies and variants, then exit")
    parser.add_argument("--variant", action="append", default=[], metavar='NAME=STRATEGY:"OPTIONS"',
                        help="define a row of your own, e.g. zero3-cpu-adam=deepspeed:\"--zero-stage 3 --offload "
                             "optimizer\"; it runs with the default rows, or when named in --only (repeatable)")
    parser.add_argument("--strategy-args", action="append", default=[], metavar='STRATEGY="OPTIONS"',
                        help="options for every row of one strategy only, e.g. deepspeed=\"--zero-stage 3\" "
                             "(repeatable)")
    parser.add_argument("--nprocs", default=str(gpus or 2),
                        help="processes (GPUs) per distributed row; a list like 1,2,4 runs a scaling sweep "
                             "(default: all GPUs, or 2 without GPU: %(default)s here)")
    parser.add_argument("--nnodes",
                        help="in a Slurm job (slurm/benchmark.sbatch): nodes per distributed row, each row run by its "
                             "batch file of slurm/ with --nprocs processes on each node; a list like 1,2 sweeps "
                             "(default: this machine alone)")
    parser.add_argument("--model",
                        help="as the scripts' --model, resolved once here and passed to all (default: auto on a "
                             "machine with GPUs; tiny without, where the real model would take hours)")
    parser.add_argument("--max-samples", type=int, help="passed to every script (default: the scripts' 10000)")
    parser.add_argument("--epochs", type=int, help="passed to every script (default: the scripts' 1)")
    parser.add_argument("--max-steps", type=int, metavar="N",
                        help="every script stops after N optimizer steps, then evaluates (default: the whole epochs)")
    parser.add_argument("--real-size", action="store_true",
                        help="the real model's architecture (--model base-shape, random weights): every default row "
                             "and ZeRO-1/3 at 2 processes, the sharded rows also at 4, with --max-steps "
                             f"{REAL_SIZE_DEFAULTS['max_steps']} --profile {REAL_SIZE_DEFAULTS['profile']} "
                             f"--batch-size {REAL_SIZE_DEFAULTS['batch_size']} --max-samples "
                             f"{REAL_SIZE_DEFAULTS['max_samples']} unless given; estimates its duration first")
    parser.add_argument("--repeat", type=int, default=1,
                        help="launches per row, interleaved round-robin over the rows; the table shows the median "
                             "run, the min-max spread and the noise floor (default: 1)")
    parser.add_argument("--batch-size",
                        help="per device, for every row (default: the scripts' 32); DataParallel's one process "
                             "gets it times its GPUs; a list like 32,128,512 runs a batch sweep (rows named -b128)")
    parser.add_argument("--grad-accum", type=int, metavar="N",
                        help="micro-batches per optimizer step, for every row (default: the scripts' 1): the "
                             "global batch is the batch per device x devices x N")
    parser.add_argument("--global-batch", type=int,
                        help="the same global batch for every row and process count (strong scaling): per-device "
                             "batch = N / devices")
    parser.add_argument("--precision", choices=cli.PRECISIONS,
                        help="for every strategy that offers mixed precision (ddp-amp, deepspeed, accelerate, fsdp, hf-trainer, "
                             "fabric); the "
                             "others stay in fp32 (default: the scripts' own: fp32, and for ddp-amp fp16 on GPUs, "
                             "bf16 on CPU)")
    parser.add_argument("--profile", type=int, metavar="STEPS",
                        help="every script records STEPS steps with torch.profiler: the anatomy table and chart "
                             "panel show each step's time by phase (train s then includes the profiler's cost; "
                             "hf-trainer runs transformers' own loop and is not profiled)")
    parser.add_argument("--timeout", type=float, default=1800,
                        help="seconds one launch may take before it is killed (default: %(default)g)")
    parser.add_argument("--output-dir", default=str(ROOT / "output" / "benchmark"),
                        help="where the table, chart, logs and each run's files go (default: output/benchmark)")
    parser.add_argument("--publish", nargs="?", const="", metavar="SUFFIX",
                        help="also copy the tables, JSON and chart to docs/results/<machine>[-<model>][-SUFFIX]/ "
                             "(a SUFFIX keeps the run beside another of the same machine and model)")
    args, passthrough = parser.parse_known_args(argv)
    args = check_args(args, passthrough, parser.get_default("nprocs"))
    if gpus and max(args.counts) > gpus and "cpu" not in passthrough:  # one GPU per process: say so before any launch
        raise cli.UserError(f"--nprocs {args.nprocs}: this machine has {gpus} GPU(s) and each process takes one; "
                            "hide them to run CPU processes: CUDA_VISIBLE_DEVICES= ./run.sh --device cpu")
    if args.node_counts:
        args.hosts = job_hosts(args.nnodes)
        if max(args.node_counts) > len(args.hosts):
            raise cli.UserError(f"--nnodes {args.nnodes}: this Slurm job has {len(args.hosts)} node(s); ask sbatch "
                                "for more with --nodes")
    return args


def split_assignment(value, separator):
    name, found, rest = value.partition(separator)
    if not found or not name.strip():
        return None, None
    return name.strip(), rest


def parse_variant(value):
    """NAME=STRATEGY:"OPTIONS" -> a Variant."""
    name, rest = split_assignment(value, "=")
    strategy, options = split_assignment(rest or "", ":") if name else (None, None)
    if not strategy:
        raise cli.UserError(f'--variant {value!r}: write NAME=STRATEGY:"OPTIONS", e.g. '
                            'zero3-cpu-adam=deepspeed:"--zero-stage 3 --offload optimizer"')
    if strategy not in STRATEGIES:
        raise cli.UserError(f"--variant {name}: unknown strategy {strategy}; choose from {','.join(STRATEGIES)}")
    return Variant(name, strategy, tuple(shlex.split(options)), "from the command line")


def parse_strategy_args(values):
    """STRATEGY="OPTIONS" (repeatable) -> {strategy: [options]}."""
    chosen = {}
    for value in values:
        strategy, options = split_assignment(value, "=")
        if strategy not in STRATEGIES:
            raise cli.UserError(f"--strategy-args {value!r}: write STRATEGY=\"OPTIONS\" with a strategy from "
                                f"{','.join(STRATEGIES)}")
        chosen[strategy] = chosen.get(strategy, []) + shlex.split(options)
    return chosen


def parse_counts(value, option="--nprocs", what="process count"):
    try:
        counts = [int(part) for part in value.split(",") if part.strip()]
    except ValueError:
        counts = []
    if not counts or any(count < 1 for count in counts) or len(set(counts)) != len(counts):
        raise cli.UserError(f"{option} takes {what}s of at least 1, like 2 or 1,2,4; got {value!r}")
    return sorted(counts)


def names(option, value, known):
    chosen = [name.strip() for name in value.split(",") if name.strip()]
    if not chosen:
        raise cli.UserError(f"{option} names no row; choose from {','.join(known)} (--list describes them)")
    unknown = [name for name in chosen if name not in known]
    if unknown:
        raise cli.UserError(f"{option}: unknown row {', '.join(unknown)}; choose from {','.join(known)} "
                            "(--list describes them)")
    return chosen


def check_args(args, passthrough, default_nprocs):
    if args.real_size:
        apply_real_size(args, default_nprocs)
    args.batch_sizes = parse_counts(str(args.batch_size), "--batch-size", "batch size") if args.batch_size else [None]
    args.batch_size = args.batch_sizes[-1]  # the largest: what the estimates size
    for name in ("repeat", "max_samples", "epochs", "max_steps", "global_batch", "profile"):
        value = getattr(args, name)
        if value is not None and value < 1:
            raise cli.UserError(f"--{name.replace('_', '-')} must be at least 1, got {value}")
    if args.timeout <= 0:
        raise cli.UserError(f"--timeout must be positive, got {args.timeout:g}")
    if args.publish and not re.fullmatch(r"[a-z0-9]+(-[a-z0-9]+)*", args.publish):
        raise cli.UserError(f"--publish {args.publish}: a suffix of lower-case letters, digits and dashes, e.g. compile")
    args.counts = parse_counts(args.nprocs)
    args.node_counts = parse_counts(args.nnodes, "--nnodes", "node count") if args.nnodes else None
    own = [parse_variant(value) for value in args.variant]
    args.variants = {variant.name: variant for variant in BUILT_IN_VARIANTS + own}
    args.strategy_options = parse_strategy_args(args.strategy_args)
    defaults = [v.name for v in DEFAULT_ROWS + own] + (REAL_SIZE_EXTRA_ROWS if args.real_size else [])
    chosen = names("--only", args.only, args.variants) if args.only is not None else defaults
    skip = names("--skip", args.skip, args.variants) if args.skip is not None else []
    args.rows = [args.variants[name] for name in dict.fromkeys(chosen) if name not in skip]
    if not args.rows and not args.list:
        raise cli.UserError("--only and --skip leave no row to run")
    if args.global_batch:
        if args.batch_size:
            raise cli.UserError("--global-batch sets each script's --batch-size: pass one or the other")
        micro = args.grad_accum or 1
        uneven = [count for count in world_sizes(args) if args.global_batch % (count * micro)]
        if uneven:
            raise cli.UserError(f"--global-batch {args.global_batch} does not split evenly over "
                                f"{' and '.join(map(str, uneven))} processes (--nprocs {args.nprocs}"
                                + (f" x --nnodes {args.nnodes})" if args.node_counts else ")")
                                + (f" x {micro} micro-batches" if micro > 1 else ""))
    args.passthrough = passthrough
    args.output_dir = Path(args.output_dir).resolve()
    return args


def world_sizes(args):
    """The process counts of the distributed rows: --nprocs on each of --nnodes nodes."""
    return sorted({nnodes * nprocs for nnodes in args.node_counts or [1] for nprocs in args.counts})


def apply_real_size(args, default_nprocs):
    """--real-size: base-shape at 2 processes (the plan adds 4 for the sharded rows), and the plan's
    defaults where the command line gives none."""
    if args.model not in (None, "base-shape"):
        raise cli.UserError(f"--real-size trains --model base-shape, not {args.model}: leave --model out")
    if args.nprocs != default_nprocs:
        raise cli.UserError("--real-size runs 2 processes per row, and 4 for the sharded ones: leave --nprocs out")
    args.model, args.nprocs = "base-shape", ",".join(map(str, REAL_SIZE_COUNTS))
    for name, value in REAL_SIZE_DEFAULTS.items():
        if getattr(args, name) is None:
            setattr(args, name, value)


def list_rows(variants):
    print("Strategies and variants (a variant is a strategy plus options; --only picks rows, --variant adds one):")
    width = max(len(name) for name in variants)
    options_width = max(len(" ".join(variant.options)) for variant in variants.values())
    for variant in variants.values():
        options = " ".join(variant.options) or "-"
        default = " [default row]" if variant in DEFAULT_ROWS else ""
        gpu = " [GPU only]" if variant.needs_gpu else ""
        print(f"  {variant.name:<{width}}  {variant.strategy:<12}  {options:<{options_width}}  "
              f"{variant.about}{default}{gpu}")


# ----------------------------------------------------------------------------- the plan

def devices(entry, nprocs, gpus):
    """How many model replicas share each global batch."""
    if entry.name == "single" or (entry.splits_batch and not gpus):
        return 1
    return nprocs


def batch_options(args, entry, gpus, nprocs, batch_size):
    """--batch-size for the script, so that every device gets the same share of a batch."""
    replicas = devices(entry, nprocs, gpus)
    per_device = args.global_batch // (replicas * (args.grad_accum or 1)) if args.global_batch else batch_size
    if entry.splits_batch and replicas > 1:
        return ["--batch-size", str((per_device or SCRIPT_BATCH_SIZE) * replicas)]
    return ["--batch-size", str(per_device)] if per_device else []


def script_options(args, variant, run_dir, model, gpus, nprocs, batch_size):
    """What a script gets after the launcher's part: the options every row shares, then this
    strategy's and this variant's own; `batch_size` per device (None: the script's)."""
    entry = STRATEGIES[variant.strategy]
    options = ["--output-dir", relative(run_dir), "--model", model]
    if args.max_samples:
        options += ["--max-samples", str(args.max_samples)]
    if args.epochs:
        options += ["--epochs", str(args.epochs)]
    if args.max_steps:
        options += ["--max-steps", str(args.max_steps)]
    if args.precision and entry.mixed_precision:
        options += ["--precision", args.precision]
    if args.grad_accum:
        options += ["--grad-accum", str(args.grad_accum)]
    if args.profile and entry.profiles:
        options += ["--profile", str(args.profile)]
    return (options + batch_options(args, entry, gpus, nprocs, batch_size) + args.passthrough
            + args.strategy_options.get(entry.name, []) + list(variant.options))


def plan(args, gpus):
    """The cells to run: each row at each batch size, node and process count (rows that depend on
    neither count, once per batch size)."""
    cells = []
    for variant in args.rows:
        entry = STRATEGIES[variant.strategy]
        counts = args.counts if entry.distributed else [1 if entry.name == "single" else args.counts[-1]]
        if args.real_size and variant.name in REAL_SIZE_SHARDED_ROWS:
            counts = REAL_SIZE_SHARDED_COUNTS
        node_counts = args.node_counts if args.node_counts and entry.distributed else [1]
        for batch_size, nnodes, nprocs in itertools.product(args.batch_sizes, node_counts, counts):
            name = (variant.name + (f"-b{batch_size}" if len(args.batch_sizes) > 1 else "")
                    + (f"-nodes{nnodes}" if len(node_counts) > 1 else "")
                    + (f"-n{nprocs}" if entry.distributed and len(counts) > 1 else ""))
            cells.append({"row": name, "variant": variant.name, "strategy": entry.name, "script": entry.script,
                          "launcher": entry.launcher, "nnodes": nnodes, "nprocs": nprocs, "batch_size": batch_size,
                          "options": list(variant.options), "log": relative(args.output_dir / f"{name}.log"),
                          "status": "pending", "reason": None, "runs": []})
    return cells


def not_runnable(variant, gpus):
    if variant.needs_gpu and not gpus:
        return f"{variant.name} needs a GPU ({variant.about})"
    return None


# ----------------------------------------------------------------------------- a real-size plan

def bert_parameters(config, labels):
    """BertForSequenceClassification's parameter count from its config's shapes, without building it."""
    hidden, inner = config["hidden_size"], config["intermediate_size"]
    embeddings = hidden * (config["vocab_size"] + config["max_position_embeddings"] + config["type_vocab_size"])
    layer_norm = 2 * hidden
    layer = 4 * (hidden * hidden + hidden) + (hidden * inner + inner) + (inner * hidden + hidden) + 2 * layer_norm
    pooler, classifier = hidden * hidden + hidden, hidden * labels + labels
    return embeddings + layer_norm + config["num_hidden_layers"] * layer + pooler + classifier


def available_memory_bytes():
    """Memory the kernel can give new processes now (MemAvailable): other jobs' memory is not ours."""
    for line in Path("/proc/meminfo").read_text().splitlines():
        if line.startswith("MemAvailable:"):
            return int(line.split()[1]) * 1024
    raise cli.UserError("cannot read MemAvailable from /proc/meminfo: the memory check needs Linux")


def processes(cell):
    """The processes a cell's launch starts (DataParallel's and single's one, whatever --nprocs)."""
    return cell["nprocs"] if STRATEGIES[cell["strategy"]].distributed else 1


def check_memory(cells, parameters, available):
    """Refuse, before any model is built, a plan whose largest launch would not fit in `available` bytes."""
    largest = max(cells, key=processes)
    needed = processes(largest) * (BYTES_PER_PARAMETER * parameters + BYTES_BEYOND_PARAMETERS)
    if needed > available:
        raise cli.UserError(f"this plan needs about {needed / 2**30:.1f} GiB for {largest['row']} "
                            f"({processes(largest)} processes of {parameters / 1e6:.1f} M parameters) but "
                            f"{available / 2**30:.1f} GiB is available: run fewer processes (--only) or free memory")
    return needed


def time_one_step(args):
    """Seconds of a steady base-shape training step here on one thread, at the plan's batch: the first
    step (Adam creates its state) is not timed, the second is. One thread, as each process of a
    2-process row gets on 2 cores; timing on all cores would also time how the threads of a loaded
    machine wait for each other."""
    import torch
    import common
    from support import models
    batch_size = args.batch_size or SCRIPT_BATCH_SIZE
    texts = [text for text, _ in common.load_records(ROOT / "data" / "train.json")[:batch_size]]
    tokenizer, model = models.build_base_shape_model(texts, 0, {"num_labels": len(common.LABELS)})
    batch = tokenizer(texts, padding=True, truncation=True, max_length=128, return_tensors="pt")
    labels = torch.zeros(len(texts), dtype=torch.long)
    optimizer = models.make_optimizer(model, 1e-4, 0.01)
    seconds, threads = [], torch.get_num_threads()
    torch.set_num_threads(1)
    for _ in range(2):
        start = time.perf_counter()
        model(**batch, labels=labels).loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        seconds.append(time.perf_counter() - start)
    torch.set_num_threads(threads)
    return seconds[-1]


def estimate_seconds(cells, step_seconds, args):
    """The plan's duration from a step timed on one thread: each launch's fixed cost, then its steps
    and its evaluation. N processes, each with its own batch, share the machine's cores: a step takes
    N / cores times the one-thread step. The dev batches are split over the processes, each a forward
    pass, about a third of a step."""
    from support import machine
    cores = machine.usable_cores()
    batch_size = args.batch_size or SCRIPT_BATCH_SIZE
    dev_batches = round((args.max_samples or SCRIPT_MAX_SAMPLES) * SCRIPT_DEV_RATIO) / batch_size
    evaluation = step_seconds * dev_batches / 3 / cores
    return sum(LAUNCH_SECONDS + step_seconds * processes(cell) / cores * args.max_steps + evaluation
               for cell in cells) * args.repeat


def announce_real_size(args, cells):
    """Check the plan's memory, time a step, and say what the plan will take before it starts."""
    import common
    from support import models
    parameters = bert_parameters(models.base_shape_config(), len(common.LABELS))
    needed = check_memory(cells, parameters, available_memory_bytes())
    print(f"real size: {parameters:,} parameters; the largest launch needs about {needed / 2**30:.1f} GiB",
          flush=True)
    step_seconds = time_one_step(args)
    minutes = estimate_seconds(cells, step_seconds, args) / 60
    print(f"real size: a base-shape step took {step_seconds:.1f} s here (one thread, batch "
          f"{args.batch_size}): {len(cells) * args.repeat} launches, about {minutes:.0f} minutes in all", flush=True)


# The committed tiny-model run on 2 cores: how long each row's launch took, for a plan's estimate.
REFERENCE_RUN = ROOT / "docs" / "results" / "amd-epyc-2-cores" / "benchmark.json"


def expected_duration(args, cells, model, gpus):
    """One line, before the first launch: the plan's launches and how long they should take here.
    The tiny model: as long as the committed run's rows took on 2 cores, for its data and epochs. A
    real-size model on a CPU: its steps, timed here on one BERT-base step (hours, usually)."""
    launches = len(cells) * args.repeat
    if gpus:
        return f"plan: {launches} launch(es) on {gpus} GPU(s); no estimate for GPUs yet"
    if model == "tiny":
        reference = json.loads(REFERENCE_RUN.read_text(encoding="utf-8"))
        walls = {row["row"]: row["wall_seconds"] for row in reference["rows"] if row["status"] == "ok"}
        typical = statistics.median(walls.values())
        minutes = sum(walls.get(cell["variant"], typical) for cell in cells) * args.repeat / 60
        other = "" if args.max_samples is None and args.epochs is None else "; more or less with other data or epochs"
        return (f"plan: {launches} launch(es), about {minutes:.0f} minutes on 2 cores as in "
                f"{relative(REFERENCE_RUN.parent)} (the default data, 1 epoch{other})")
    if args.real_size:
        return None  # announce_real_size times a step and says it
    step_seconds = time_one_step(args)
    if args.max_steps:
        seconds = estimate_seconds(cells, step_seconds, args)
    else:
        # The processes of a launch share its batches and the machine's cores: whatever their number,
        # a launch costs the epoch's batches at one step each, over the cores.
        batches = (args.max_samples or SCRIPT_MAX_SAMPLES) * (1 - SCRIPT_DEV_RATIO) * (args.epochs or 1) / (
            args.batch_size or SCRIPT_BATCH_SIZE)
        from support import machine
        seconds = (LAUNCH_SECONDS + step_seconds * batches / machine.usable_cores()) * launches
    hours = seconds / 3600
    return (f"plan: {launches} launch(es) of a BERT-base-sized model on the CPU, about {hours:.1f} hours (a step "
            f"took {step_seconds:.1f} s here); --model tiny compares the strategies in minutes")


# ----------------------------------------------------------------------------- running

class Progress:
    """In a terminal, one updating line: the launch running and the time left for the whole
    benchmark. Otherwise (CI, a log file), one plain line per finished launch."""

    def __init__(self, total):
        self.interactive = sys.stdout.isatty()
        self.bar = tqdm(total=total, unit="launch", dynamic_ncols=True) if self.interactive else None
        self.total, self.done = total, 0

    def start(self, label):
        if self.bar:
            self.bar.set_description(label)

    def finish(self, label, message):
        self.done += 1
        if self.bar:
            self.bar.update()
            if not message.startswith("ok"):
                self.bar.write(f"{label}: {message}")
        else:
            print(f"[{self.done}/{self.total}] {label}: {message}", flush=True)

    def close(self):
        if self.bar:
            self.bar.close()


def run_all(args, cells, model, gpus, after_each):
    """Launch every cell --repeat times, round-robin: repeat 1 of every cell, then repeat 2, ...;
    `after_each()` runs after every launch (to keep the report up to date)."""
    progress = Progress(len(cells) * args.repeat)
    for cell in cells:
        (args.output_dir / f"{cell['row']}.log").unlink(missing_ok=True)
    try:
        for repeat in range(1, args.repeat + 1):
            for cell in cells:
                label = f"{cell['row']} run {repeat}/{args.repeat}"
                if cell["status"] in ("failed", "skipped", "not run"):
                    progress.finish(label, f"not run: {cell['status']}")
                    continue
                progress.start(label)
                progress.finish(label, launch_cell(args, cell, model, gpus))
                after_each()
    finally:
        progress.close()


def launch_cell(args, cell, model, gpus):
    """One launch of `cell`; its run is added to the cell, or the cell is marked failed or skipped."""
    variant, entry = args.variants[cell["variant"]], STRATEGIES[cell["strategy"]]
    run_dir, log_path = args.output_dir / cell["row"], args.output_dir / f"{cell['row']}.log"
    # Each launch gets a new free port.
    if args.node_counts and entry.launcher in BATCH_FILES:
        launcher, env = launch_across_nodes(entry, cell["nnodes"], cell["nprocs"], run_dir, args.hosts)
        launcher_file = launcher[1]  # bash's batch file
    else:
        launcher, env = entry.launch(entry.script, cell["nprocs"], gpus), {}
        launcher_file = launcher[0]
    command = launcher + script_options(args, variant, run_dir, model, gpus, cell["nnodes"] * cell["nprocs"],
                                        cell["batch_size"])
    cell["command"] = shlex.join([f"{name}={value}" for name, value in env.items()] + command)
    reason = (why_not_ready(entry, launcher_file) or not_runnable(variant, gpus)
              or (args.node_counts and CANNOT_SPAN_NODES.get(entry.name)))
    if reason:
        log_path.write_text(f"$ {cell['command']}\nnot launched: {reason}\n", encoding="utf-8")
        # An optional library left out is the set-up's news (its warning said why), not this run's failure;
        # nor is a row that cannot span nodes.
        cannot = library_missing(entry) or (args.node_counts and entry.name in CANNOT_SPAN_NODES)
        status = "not run" if cannot and (ROOT / entry.script).is_file() else "skipped"
        cell.update(status=status, reason=reason)
        return f"{status}: {reason}"
    result, wall, reason = launch_once(command, env, cell["command"], run_dir, log_path, args.timeout)
    if reason:
        cell.update(status="failed", reason=reason, wall_seconds=round(wall, 2))
        return f"FAILED after {wall:.0f} s: {reason} (log: {relative(log_path)})"
    if args.repeat > 1:
        files.write_json(run_dir / f"result-{len(cell['runs']) + 1}.json", result)
    cell["runs"].append({**result, "wall_seconds": round(wall, 2), "launch_command": cell["command"]})
    cell["status"] = "ok"
    return (f"ok, {result['train_seconds']:.1f} s training, {wall:.1f} s wall, "
            f"dev accuracy {result['dev_accuracy']:.4f}")


def stop(process):
    """End the launcher and every process it started (they share its session, which is its process
    group): waiting for the launcher alone would let a process it started outlive this one."""
    for sig, grace in ((signal.SIGTERM, 15), (signal.SIGKILL, 5)):
        try:
            os.killpg(process.pid, sig)
        except ProcessLookupError:
            return
        deadline = time.monotonic() + grace
        while time.monotonic() < deadline:
            process.poll()  # reaps the launcher
            if not group_runs(process.pid):
                return
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


def failure_reason(log_path):
    """The first `error:` line a process printed (the cause; later ones are usually peers that lost
    their connection), else the last line that mentions an error, else the last line."""
    lines = [line.strip() for line in log_path.read_text(encoding="utf-8", errors="replace").splitlines()]
    lines = [line for line in lines if line and not line.startswith("$ ")]
    for line in lines:
        position = line.find("error: ")
        if position == 0 or (position > 0 and line[position - 1] in " :>]"):
            return line[position:]
    for line in reversed(lines):
        if "error" in line.lower() or "exception" in line.lower():
            return line
    return lines[-1] if lines else "no output"


def launch_once(command, env, shown, run_dir, log_path, timeout):
    """Run one launch (`command` with the variables `env`, `shown` as a shell line) to its end; returns
    (result dict or None, wall seconds, reason of a failure)."""
    result_file = run_dir / "result.json"
    result_file.unlink(missing_ok=True)  # a failed launch must never report an earlier run's result
    env = {**os.environ, "PYTHONUNBUFFERED": "1", **env}
    started = time.time()
    start = time.perf_counter()
    with open(log_path, "a", encoding="utf-8") as log:
        log.write(f"$ {shown}\n")
        log.flush()
        process = subprocess.Popen(command, cwd=ROOT, stdout=log, stderr=subprocess.STDOUT, env=env,
                                   stdin=subprocess.DEVNULL, start_new_session=True)
        try:
            code = process.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            stop(process)
            code = None
        except BaseException:
            stop(process)
            raise
    wall = time.perf_counter() - start
    with open(log_path, "a", encoding="utf-8") as log:
        log.write(f"$ # exit status {code}, {wall:.1f} s wall\n")
    if code is None:
        return None, wall, f"timed out after {timeout:g} s (--timeout)"
    if code != 0:
        return None, wall, f"exit status {code}: {failure_reason(log_path)}"
    if not result_file.is_file() or result_file.stat().st_mtime < started:
        return None, wall, f"exit status 0 but no fresh {relative(result_file)}"
    return json.loads(result_file.read_text(encoding="utf-8")), wall, None


# ----------------------------------------------------------------------------- the figures

# What each row's result.json says of its pace against the limit (measure.Throughput).
THROUGHPUT_FIELDS = ("compiled", "compiled_graphs", "cuda_graphs", "step_shapes", "pad_to_multiple_of",
                     "compute_precision", "devices", "first_step_seconds",
                     "steady_step_seconds", "steady_samples_per_second", "real_tokens_per_second",
                     "computed_tokens_per_second", "model_flops_per_second", "steady_model_flops_per_second", "mfu",
                     "mfu_real", "real_flops_share", "peak_tflops", "peak_source", "mfu_note")


def summarize(cell):
    """The cell's median run by training time (the lower middle one for an even count) and the spread."""
    runs = cell["runs"]
    if cell["status"] != "ok":
        return cell
    median_seconds = statistics.median_low(run["train_seconds"] for run in runs)
    chosen = next(run for run in runs if run["train_seconds"] == median_seconds)
    seconds = [run["train_seconds"] for run in runs]
    return {
        **cell,
        "command": chosen["launch_command"],
        "launcher": chosen["launcher"],
        "processes": chosen["world_size"],
        "device": chosen["device"],
        "threads_per_process": chosen["threads_per_process"],
        "precision": chosen["precision"],
        "precision_native": chosen["precision_native"],
        "zero_stage": chosen.get("zero_stage"),
        "model": chosen["model"],
        "global_batch": chosen["global_batch_size"],
        "gradient_accumulation": chosen.get("gradient_accumulation_steps", 1),
        "batch_per_process": chosen["batch_size_per_process"],
        "train_samples": chosen["train_samples"],
        "epochs": chosen["epochs"],
        "train_seconds": chosen["train_seconds"],
        "samples_per_second": chosen["samples_per_second"],
        "tokens_per_sample": chosen["tokens_per_sample"],
        "padded_tokens_per_sample": chosen["padded_tokens_per_sample"],
        "peak_memory_mb": chosen["peak_memory_mb"],
        "dev_accuracy": chosen["dev_accuracy"],
        "dev_macro_f1": chosen["dev_macro_f1"],
        "dev_samples": chosen["dev_samples"],
        "wall_seconds": chosen["wall_seconds"],
        "train_seconds_min": min(seconds),
        "train_seconds_max": max(seconds),
        "relative_spread": round((max(seconds) - min(seconds)) / median_seconds, 4) if len(runs) > 1 else None,
        "wall_seconds_min": min(run["wall_seconds"] for run in runs),
        "wall_seconds_max": max(run["wall_seconds"] for run in runs),
        "model_state_bytes": chosen.get("model_state_bytes"),
        "model_state_formula_bytes": chosen.get("model_state_formula_bytes"),
        "profile": chosen.get("profile"),
        **{key: chosen.get(key) for key in THROUGHPUT_FIELDS},
    }


def add_figures(report):
    """Speed-ups over single, scaling against each row's own 1-process run, the noise floor and
    which speed-ups it cannot tell apart."""
    rows = [row for row in report["rows"] if row["status"] == "ok"]
    single = next((row for row in rows if row["strategy"] == "single"), None)
    for row in rows:
        row["speedup"] = round(row["samples_per_second"] / single["samples_per_second"], 3) if single else None
        one = next((other for other in rows if other["variant"] == row["variant"] and other["processes"] == 1
                    and STRATEGIES[other["strategy"]].distributed), None)
        if one and STRATEGIES[row["strategy"]].distributed:
            row["speedup_vs_1_process"] = round(row["samples_per_second"] / one["samples_per_second"], 3)
            row["scaling_efficiency"] = round(row["speedup_vs_1_process"] / row["processes"], 3)
    spreads = [row["relative_spread"] for row in rows if row["relative_spread"] is not None]
    report["noise_floor"] = max(spreads) if spreads else None
    floor = report["noise_floor"]
    for row in rows:
        # Rows whose speed-ups differ by less than the noise floor: their order is not significant.
        row["indistinguishable_from"] = [
            other["row"] for other in rows
            if other is not row and floor is not None and row["speedup"] is not None
            and abs(row["speedup"] - other["speedup"]) / max(row["speedup"], other["speedup"]) < floor]


def measure_matmul_peaks(rows):
    """This machine's achievable matrix-product rate for each device and precision the rows computed in
    (microbenchmarks/matmul_peak.py, on all the cores or the first GPU), and each row's MFU against it."""
    from microbenchmarks import matmul_peak  # imports torch: for the run, not for the planning
    peaks = {}
    for row in rows:
        if row["status"] != "ok" or row.get("compute_precision") is None:
            continue
        device = "cuda" if row["device"].startswith("cuda") else "cpu"
        key = f"{device} {row['compute_precision']}"
        if key not in peaks:
            try:
                peaks[key] = {"tflops": round(matmul_peak.measure(device, row["compute_precision"]), 4)}
            except (cli.UserError, RuntimeError) as error:
                peaks[key] = {"error": str(error).splitlines()[0] if str(error) else type(error).__name__}
        flop_per_second = row.get("steady_model_flops_per_second")
        mfu = flops.mfu(flop_per_second and flop_per_second / row["devices"], peaks[key].get("tflops"))
        if mfu is not None:
            row["mfu_measured"] = round(mfu, 4)
            row["mfu_measured_real"] = round(mfu * row["real_flops_share"], 4)
    return peaks


# ----------------------------------------------------------------------------- the machine and the code

def cpu_model():
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def describe_machine():
    import torch
    from support import machine
    gpus = [torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())]
    counted = ", ".join(f"{gpus.count(name)} x {name}" for name in dict.fromkeys(gpus)) or "no GPU"
    cores = machine.usable_cores()
    native = [p for p in ("bf16", "fp16") if machine.computes_natively(p, torch.device("cpu"))]
    cpu = f"{cpu_model()} ({', '.join(native) + ' native' if native else 'no native bf16/fp16'})"
    return {"cpu": cpu_model(), "cores": cores, "cpu_native_16bit": native, "gpus": gpus,
            "summary": f"{cpu}, {cores} usable cores, {counted}"}


def library_versions():
    versions = {"python": platform.python_version()}
    for package in VERSIONED:
        try:
            versions[package] = metadata.version(package)
        except metadata.PackageNotFoundError:
            versions[package] = "not installed"
    return versions


def git_state():
    """The commit this code is at and whether the tree differs from it: where a result came from."""
    def git(*arguments):
        try:
            done = subprocess.run(["git", *arguments], cwd=ROOT, capture_output=True, text=True, timeout=30)
        except (OSError, subprocess.TimeoutExpired):
            return None
        return done.stdout.strip() if done.returncode == 0 else None
    commit = git("rev-parse", "HEAD")
    status = git("status", "--porcelain", "--untracked-files=no")
    return {"commit": commit, "modified": bool(status) if status is not None else None}


def gpu_count():
    """The GPUs torch sees (CUDA_VISIBLE_DEVICES= hides them): a process per GPU, DataParallel's
    --gpu-ids and fabric run's --accelerator follow from it. torch is imported here, for the run,
    not for the planning."""
    import torch
    return torch.cuda.device_count()


def resolve_model(choice, gpus):
    """The model every strategy trains, resolved once, here, and said. Without --model: auto with
    GPUs; without them the tiny model, since eleven rows of the real BERT on a CPU take hours."""
    import common
    from support import models
    model = models.resolve_model(choice or ("auto" if gpus else "tiny"))
    if model == "tiny":
        note = ("the offline tiny BERT (2 layers, hidden 128, random weights): "
                "the figures compare strategies, not models")
        if choice is None and not gpus:
            note += "; chosen because this machine has no GPU (--model auto or a model folder trains the real one)"
        elif choice in (None, "auto"):
            note += f"; chosen because {relative(models.LOCAL_MODEL_DIR)} is absent and the hub is unreachable"
        return model, note
    if model == "base-shape":
        parameters = bert_parameters(models.base_shape_config(), len(common.LABELS))
        return model, (f"the architecture of {models.HUB_MODEL_ID} (BERT-base, {parameters:,} parameters), "
                       f"{models.RANDOM_WEIGHTS_BANNER}")
    return model, None


def write_report(report, output_dir, final):
    """The figures, benchmark.json, and benchmark_report's table and chart."""
    add_figures(report)
    files.write_json(output_dir / "benchmark.json", report)
    benchmark_report.write(report, output_dir, final)


# ----------------------------------------------------------------------------- main

def main():
    # A launch runs in its own session, out of reach of signals sent to this one: on SIGTERM, as on
    # Ctrl-C, unwind so that launch_once stops the launch before this process exits.
    signal.signal(signal.SIGTERM, lambda signum, frame: sys.exit(128 + signum))
    gpus = gpu_count()
    args = parse_args(sys.argv[1:], gpus)
    if args.list:
        list_rows(args.variants)
        return
    args.output_dir.mkdir(parents=True, exist_ok=True)
    model, model_note = resolve_model(args.model, gpus)
    cells = plan(args, gpus)
    if args.real_size:
        announce_real_size(args, cells)
    # The distributed rows' process counts (--real-size adds 4 for the sharded rows; --nnodes multiplies).
    counts = ({cell["nnodes"] * cell["nprocs"] for cell in cells if STRATEGIES[cell["strategy"]].distributed}
              or set(args.counts))
    report = {
        "machine": describe_machine(),
        "versions": library_versions(),
        "git": git_state(),
        "model": relative(model) if Path(model).is_dir() else model,
        "model_note": model_note,
        "nprocs": args.nprocs,
        "nnodes": args.nnodes,
        "counts": sorted(counts),
        "max_steps": args.max_steps,
        "repeat": args.repeat,
        "spread": "min-max over the repeats; the row is the run with the median training time",
        "noise_floor": None,
        "global_batch": args.global_batch,
        "batch_sizes": args.batch_sizes,
        "precision": args.precision,
        "strategy_args": args.strategy_options,
        "passthrough": args.passthrough,
        "output_dir": relative(args.output_dir),
        "started": datetime.datetime.now().isoformat(timespec="seconds"),
        "finished": None,
        "all_succeeded": None,
        "rows": cells,
    }
    for line in benchmark_report.header_lines(report)[:4]:
        print(line, flush=True)
    duration = expected_duration(args, cells, model, gpus)
    if duration:
        print(duration, flush=True)

    def after_each():  # what finished so far survives an interruption
        report["rows"] = [summarize(cell) for cell in cells]
        report["finished"] = datetime.datetime.now().isoformat(timespec="seconds")
        write_report(report, args.output_dir, final=False)

    run_all(args, cells, model, gpus, after_each)
    report["rows"] = [summarize(cell) for cell in cells]
    print("measuring the matrix-product peak of each precision the rows computed in (microbenchmarks/matmul_peak.py)",
          flush=True)
    report["matmul_peaks"] = measure_matmul_peaks(report["rows"])
    report["all_succeeded"] = all(row["status"] == "ok" for row in report["rows"])
    write_report(report, args.output_dir, final=True)
    print("\n" + benchmark_report.terminal_report(report))
    print(f"\nwritten: {relative(args.output_dir)}/benchmark.md, benchmark.json, benchmark.png and a log per row")
    if args.publish is not None:
        print(f"published: {benchmark_report.publish(report, args.output_dir, args.publish)}")
    problem = unsuccessful(report["rows"])
    if problem:
        print(problem, file=sys.stderr)
        sys.exit(1)


def unsuccessful(rows):
    """Why the run failed, or None: a row that could run did not succeed, or no row ran at all."""
    failed = [row["row"] for row in rows if row["status"] not in ("ok", "not run")]
    if failed:
        return f"not all rows succeeded: {', '.join(failed)} (the table and their logs say why)"
    if not any(row["status"] == "ok" for row in rows):
        return "no row ran: their libraries are not installed (the table says which)"
    return None


if __name__ == "__main__":
    cli.run(main)
