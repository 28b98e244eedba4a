"""The rows the runner can run: each strategy's script and launch line, the built-in variants, why a
row cannot run here, and a row's launch across the nodes of a Slurm job. Imports no torch."""
import importlib.util
import os
import shutil
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

from support import cli
from support.options import ROOT, build_parser
from support.spawn_setup import free_port


# The launchers come from the same environment as this Python, so every strategy runs the same libraries.
BIN = Path(sys.executable).parent
SCRIPT_DEFAULTS = build_parser(__file__, "")
SCRIPT_BATCH_SIZE = SCRIPT_DEFAULTS.get_default("batch_size")
SCRIPT_MAX_SAMPLES = SCRIPT_DEFAULTS.get_default("max_samples")
SCRIPT_DEV_RATIO = SCRIPT_DEFAULTS.get_default("dev_ratio")


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
