"""What a report records about where it ran: the machine, the library versions, the commit, the GPUs
and the model the rows train."""
import importlib.util
import platform
import re
import subprocess
from importlib import metadata
from pathlib import Path

from .estimate import real_size_parameters
from .rows import ROOT, relative


# The modules the rows import, each versioned by the distribution that installed it: lightning_fabric comes
# from lightning-fabric (requirements.txt) or from the whole lightning.
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


def library_versions(providers=None):
    """Python's version and each VERSIONED module's, read as the rows import it; `providers` maps a
    module to the distributions that install it (default: importlib.metadata.packages_distributions())."""
    providers = metadata.packages_distributions() if providers is None else providers
    return {"python": platform.python_version(),
            **{module: module_version(module, providers.get(module, [])) for module in VERSIONED}}


def module_version(module, distributions):
    """The version of the distributions that install `module`, each named where its name is not the
    module's (lightning_fabric from lightning: "2.5.0 (lightning)"); "not installed" where no module of
    that name can be imported, whatever distribution metadata is left behind."""
    if not importable(module):
        return "not installed"
    found = []
    for distribution in distributions:
        try:
            version = metadata.version(distribution)
        except metadata.PackageNotFoundError:
            continue
        same = canonical(distribution) == canonical(module)
        found.append(version if same else f"{version} ({distribution})")
    return ", ".join(dict.fromkeys(found)) or "installed, no distribution metadata"


def importable(module):
    return importlib.util.find_spec(module) is not None


def canonical(name):
    """A distribution's name as PyPI compares them (PEP 503): lightning_fabric is lightning-fabric."""
    return re.sub(r"[-_.]+", "-", name).lower()


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
        parameters = real_size_parameters()
        return model, (f"the architecture of {models.HUB_MODEL_ID} (BERT-base, {parameters:,} parameters), "
                       f"{models.RANDOM_WEIGHTS_BANNER}")
    return model, None
