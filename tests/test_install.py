"""The set-up is complete: every library the strategies need imports, and every launcher starts its
script. Part of the quick tier (./test.sh --quick), a few minutes' check of a new install."""
import importlib.util
import json
from pathlib import Path

import pytest

from conftest import BIN, PYTHON, free_port, require, run

pytestmark = pytest.mark.quick

# The module each strategy's library is imported as, Horovod's PyTorch part included (its build), and
# torch's TensorBoard writer (instruments/curves.py), which needs the tensorboard package.
LIBRARIES = ["torch", "transformers", "sklearn", "safetensors", "matplotlib", "accelerate", "deepspeed",
             "lightning_fabric", "horovod.torch", "torch.utils.tensorboard"]


IMPORT_EACH = """import importlib, json, sys
failures = {}
for module in sys.argv[1:]:
    try:
        importlib.import_module(module)
    except Exception as error:
        failures[module] = f"{type(error).__name__}: {error}"
print(json.dumps(failures))"""


@pytest.fixture(scope="module")
def import_failures():
    """{module: its import error} for the LIBRARIES that fail, all tried in one fresh interpreter."""
    process = run([PYTHON, "-c", IMPORT_EACH, *LIBRARIES], timeout=300)
    return json.loads(process.stdout.strip().splitlines()[-1])


@pytest.mark.parametrize("module", LIBRARIES)
def test_library_imports(module, import_failures):
    require(module.split(".")[0])
    assert module not in import_failures, f"import {module} failed: {import_failures.get(module)}"


def test_deepspeeds_cpu_ops_come_built_where_torch_sees_no_gpu():
    """scripts/build-deepspeed-ops.sh: without its wheel every fresh environment's first DeepSpeed run
    compiles them (a minute or two), whichever torch build is installed (PyPI's is the CUDA one). Where
    torch sees a GPU, DeepSpeed keeps its own just-in-time build of the GPU ops."""
    require("deepspeed")
    import torch
    if torch.cuda.device_count():
        pytest.skip("torch sees a GPU: DeepSpeed compiles its GPU ops on first use")
    # Read from the file the wheel wrote, without importing deepspeed (which probes for an accelerator).
    package = Path(importlib.util.find_spec("deepspeed").submodule_search_locations[0])
    metadata = package / "git_version_info_installed.py"
    assert metadata.is_file(), "deepspeed was installed without any prebuilt op (scripts/build-deepspeed-ops.sh)"
    installed = {}
    exec(metadata.read_text(encoding="utf-8"), installed)
    assert installed["installed_ops"]["cpu_adam"] and installed["installed_ops"]["deepspeed_shm_comm"], (
        "DeepSpeed's CPU ops are not prebuilt: run scripts/build-deepspeed-ops.sh .venv/bin/python")


# Each launcher, one process, the script's --help: the launcher finds the interpreter and the script
# and passes the script its options. The quick tier's alone: in the whole suite each launcher trains
# its script (torchrun, torch.distributed.launch and spawn: test_native.py; deepspeed:
# test_reliability.py; horovodrun, accelerate launch and fabric run: their own files).
LAUNCHES = {
    "torchrun": (None, lambda: [BIN / "torchrun", "--nproc_per_node", "1", "--master_port", free_port(),
                                "multi-gpu-distributed-cls.py"]),
    "torch.distributed.launch": (None, lambda: [PYTHON, "-m", "torch.distributed.launch", "--nproc_per_node", "1",
                                                "--master_port", free_port(), "multi-gpu-distributed-cls.py"]),
    "spawn": (None, lambda: [PYTHON, "multi-gpu-distributed-mp-cls.py"]),
    "deepspeed": ("deepspeed", lambda: [BIN / "deepspeed", "--num_gpus", "1", "--master_port", free_port(),
                                        "multi-gpu-deepspeed-cls.py"]),
    "horovodrun": ("horovod", lambda: [BIN / "horovodrun", "-np", "1", "-H", "localhost:1", "--gloo", PYTHON,
                                       "multi-gpu-horovod-cls.py"]),
    "accelerate launch": ("accelerate", lambda: [BIN / "accelerate", "launch", "--num_processes", "1",
                                                 "--main_process_port", free_port(), "multi-gpu-accelerate-cls.py"]),
    # fabric run's own --help would answer an option after the script, unless -- ends its options.
    "fabric run": ("lightning_fabric", lambda: [BIN / "fabric", "run", "--accelerator", "cpu", "--devices", "1",
                                                "--main-port", free_port(), "multi-gpu-fabric-cls.py", "--"]),
}


@pytest.mark.quick_only
@pytest.mark.parametrize("launcher", LAUNCHES)
def test_launcher_starts_its_script(launcher):
    library, command = LAUNCHES[launcher]
    if library:
        require(library)
    process = run([*command(), "--help"], env={"CUDA_VISIBLE_DEVICES": ""}, timeout=300)
    assert "usage:" in process.stdout and "--output-dir" in process.stdout, process.stdout[-2000:]


def test_every_launcher_is_beside_the_interpreter():
    """The runner and the README start the launchers from the environment's bin folder."""
    wanted = {"torchrun": None, "deepspeed": "deepspeed", "horovodrun": "horovod", "accelerate": "accelerate",
              "fabric": "lightning_fabric"}
    missing = [name for name, library in wanted.items()
               if (library is None or importlib.util.find_spec(library)) and not (BIN / name).exists()]
    assert not missing, f"not in {BIN}: {', '.join(missing)}"
