"""Facts of the machine a process runs on, and what follows from them: its device, the cores it
may use and the thread policy, whether the hardware computes a precision natively, the memory it
peaked at."""
import os
import resource
from pathlib import Path

import torch

from .errors import UserError

# CPU flags of native 16-bit arithmetic (/proc/cpuinfo); without them torch emulates the type in fp32.
NATIVE_CPU_FLAGS = {"bf16": {"avx512_bf16", "amx_bf16"}, "fp16": {"avx512_fp16", "amx_fp16"}}


# Variables by which a scheduler or the user gives a process GPUs (Slurm's allocation, a device list).
GPU_VARIABLES = ("SLURM_JOB_GPUS", "SLURM_STEP_GPUS", "SLURM_GPUS_ON_NODE", "CUDA_VISIBLE_DEVICES")


def given_gpus():
    """'NAME=VALUE' of the first variable that gives this process GPUs, or None. An empty
    CUDA_VISIBLE_DEVICES (or -1) hides the GPUs: none given. So does the list of local process ids
    that DeepSpeed's launcher writes there even where it saw no GPU (its processes alone have
    CROSS_RANK and LOCAL_SIZE): `deepspeed --num_gpus 2` on a CPU machine."""
    for name in GPU_VARIABLES:
        value = os.environ.get(name, "").strip()
        none = value in ("", "-1", "NoDevFiles") or (name == "SLURM_GPUS_ON_NODE" and value == "0") or (
            name == "CUDA_VISIBLE_DEVICES" and "CROSS_RANK" in os.environ
            and value == ",".join(map(str, range(int(os.environ.get("LOCAL_SIZE") or 0)))))
        if not none:
            return f"{name}={value}"
    return None


def resolve_device(choice, local_rank=0, share_gpus=None):
    """`auto` picks this process's GPU when there is one, else the CPU, unless the environment says
    GPUs were given (a GPU job must not train on the CPU for hours without a word). With `share_gpus`
    (gloo), processes beyond the GPU count take turns on the GPUs there are; None: the script has no
    --backend to offer for it."""
    if choice != "cpu" and not torch.cuda.is_available():
        build = (f"torch {torch.__version__} is a CPU-only build" if torch.version.cuda is None
                 else f"torch is built for CUDA {torch.version.cuda}: is the NVIDIA driver loaded? (nvidia-smi)")
        if choice == "cuda":
            slurm = " (this Slurm job was given none: ask for them with --gres=gpu:N)" if (
                "SLURM_JOB_ID" in os.environ and not given_gpus()) else ""
            raise UserError(f"--device cuda was asked for, but torch sees no CUDA GPU{slurm}; {build}")
        if given_gpus():
            raise UserError(f"{given_gpus()} gives this process GPUs, but torch sees none; {build}; "
                            "to train on the CPU, pass --device cpu")
    if choice == "cpu" or not torch.cuda.is_available():
        return torch.device("cpu")
    gpus = torch.cuda.device_count()
    if local_rank >= gpus and not share_gpus:
        offer = "" if share_gpus is None else ", or share the GPUs over --backend gloo"
        raise UserError(f"local rank {local_rank} has no GPU: this machine has {gpus}; start at most that many "
                        f"processes per machine{offer}", only_this_rank=True)
    return torch.device("cuda", local_rank % gpus)


def check_precision(precision, device):
    """Refuse, in one line, a precision the device cannot train in."""
    if precision == "fp16" and device.type == "cpu":
        raise UserError("--precision fp16 needs a GPU (CPUs emulate fp16, many times slower than fp32); "
                        "on CPU use --precision bf16 or fp32")
    if precision == "bf16" and device.type == "cuda" and torch.cuda.get_device_capability(device)[0] < 8:
        raise UserError(f"--precision bf16 needs a GPU from Ampere on; {torch.cuda.get_device_name(device)} "
                        "has no bf16: use --precision fp16 or fp32")


def use_tf32(enabled, device):
    """--tf32: fp32 matrix products on TF32 tensor cores. Refused off NVIDIA GPUs, where it means nothing."""
    if not enabled:
        return
    if device.type != "cuda" or torch.cuda.get_device_capability(device)[0] < 8:
        where = torch.cuda.get_device_name(device) if device.type == "cuda" else "the CPU"
        raise UserError(f"--tf32 needs an NVIDIA GPU from Ampere on; {where} computes IEEE fp32: leave --tf32 out")
    torch.backends.cuda.matmul.fp32_precision = "tf32"


def use_attention_without_plans(device):
    """16-bit attention off cuDNN. On Hopper and later torch tries cuDNN's attention first, which
    builds an execution plan for every new (batch, length) shape, and a batch padded to its own longest
    text is almost always new: on one H100 the bf16 and fp16 steps took 5x as long as fp32's with it
    (docs/gpu.md). Flash and memory-efficient attention need no plan."""
    if device.type == "cuda":
        torch.backends.cuda.enable_cudnn_sdp(False)


def computes_natively(precision, device):
    """Whether the hardware computes `precision` itself. torch has no query for CPUs: read their flags.
    GPUs: bf16 from Ampere (compute capability 8), fp16 tensor cores from Volta (7)."""
    if precision == "fp32":
        return True
    if device.type == "cuda":
        return torch.cuda.get_device_capability(device)[0] >= (8 if precision == "bf16" else 7)
    return bool(NATIVE_CPU_FLAGS[precision] & cpu_flags())


def cpu_flags():
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("flags"):
                return set(line.split(":", 1)[1].split())
    except OSError:
        pass
    return set()


def usable_cores():
    """The cores this process may run on: its CPU affinity, capped by the container's CPU quota.
    os.cpu_count() counts the whole machine's."""
    cores = len(os.sched_getaffinity(0))
    quota = cgroup_cpu_quota()
    return max(1, min(cores, int(quota))) if quota else cores


def cgroup_cpu_quota(root=Path("/sys/fs/cgroup")):
    """The container's CPU quota in cores (cgroup v2, else v1), or None when there is none."""
    try:
        quota, period = (root / "cpu.max").read_text().split()
        return None if quota == "max" else int(quota) / int(period)
    except (OSError, ValueError):
        pass
    try:
        quota = int((root / "cpu" / "cpu.cfs_quota_us").read_text())
        period = int((root / "cpu" / "cpu.cfs_period_us").read_text())
        return quota / period if quota > 0 else None
    except (OSError, ValueError):
        return None


def set_threads(requested, processes_on_this_machine):
    """The suite's one thread policy: each process gets an equal share of the usable cores (or
    --threads), whatever OMP_NUM_THREADS the launcher set (torchrun sets 1, spawn nothing), so that
    rows differ by strategy, not by thread count. More threads than cores make them wait on each other."""
    threads = requested or max(1, usable_cores() // processes_on_this_machine)
    torch.set_num_threads(threads)
    return threads


def backend_for(device, choice="auto"):
    """NCCL between GPUs, Gloo between CPU processes: the only difference between the two paths."""
    if choice == "nccl" and device.type == "cpu":
        raise UserError("--backend nccl needs GPUs; CPU processes talk over gloo (--backend auto or gloo)")
    if choice != "auto":
        return choice
    return "nccl" if device.type == "cuda" else "gloo"


def synchronize(device):
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def device_description(device):
    if device.type == "cuda":
        return f"cuda ({torch.cuda.get_device_name(device)})"
    return "cpu"


def reset_peak_memory(device):
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)


def peak_memory_mb(device):
    """Peak GPU memory allocated by torch on CUDA; peak resident memory of the process on CPU."""
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device) / 2**20
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
