"""What a report records about where it ran: the machine, the library versions, the commit, the GPUs
and the model the rows train."""
import platform
import subprocess
from importlib import metadata
from pathlib import Path

from support import files

from .estimate import bert_parameters
from .rows import ROOT, python, relative


VERSIONED = ["torch", "transformers", "accelerate", "deepspeed", "horovod", "lightning_fabric"]


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


def choose_model(choice, gpus):
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
