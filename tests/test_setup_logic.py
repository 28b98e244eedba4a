"""The set-up's decisions, without installing anything: where the CUDA toolkit is (scripts/toolchain.py),
what a failed build's log says, and what the set-up scripts print when the machine is not as they need.
The scripts run against a stand-in Python that answers their questions (milliseconds each); a real
set-up with PyPI's CUDA torch is scripts/try-pypi-torch.sh, by hand (several GB)."""
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from conftest import ROOT

sys.path.insert(0, str(ROOT / "scripts"))
import toolchain  # noqa: E402

pytestmark = pytest.mark.quick


def make_toolkit(folder):
    """What FindCUDAToolkit needs of a toolkit: nvcc, the runtime's header, its library."""
    for name in ("bin/nvcc", "include/cuda_runtime.h", "lib64/libcudart.so.13"):
        (folder / name).parent.mkdir(parents=True, exist_ok=True)
        (folder / name).write_text("#!/bin/sh\n" if name == "bin/nvcc" else "", encoding="utf-8")
    (folder / "bin/nvcc").chmod(0o755)
    return folder


def executable(path, text):
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text, encoding="utf-8")
    path.chmod(0o755)
    return path


def test_the_toolkit_is_found_where_cuda_home_says(tmp_path):
    toolkit = make_toolkit(tmp_path / "cuda-13.0")
    home, _ = toolchain.find_cuda_home({"CUDA_HOME": str(toolkit), "PATH": ""}, last_guess=tmp_path / "none")
    assert home == str(toolkit)


def test_an_nvcc_wrapper_is_followed_to_its_toolkit(tmp_path):
    """This machine's case: /usr/local/bin/nvcc is `exec /usr/local/cuda-13.0/bin/nvcc "$@"`, so torch's
    guess (and CMake's) is /usr/local, which holds no toolkit."""
    toolkit = make_toolkit(tmp_path / "cuda-13.0")
    executable(tmp_path / "bin/nvcc", f'#!/bin/sh\nexec {toolkit}/bin/nvcc "$@"\n')
    home, looked = toolchain.find_cuda_home({"PATH": str(tmp_path / "bin")}, torch_home=str(tmp_path),
                                            last_guess=tmp_path / "none")
    assert home == str(toolkit)
    assert looked == [f"torch's CUDA_HOME={tmp_path}"]
    # A symlink to the compiler, as distributions install it, is followed too.
    (tmp_path / "link").mkdir()
    (tmp_path / "link/nvcc").symlink_to(toolkit / "bin/nvcc")
    assert toolchain.find_cuda_home({"PATH": str(tmp_path / "link")}, last_guess=tmp_path / "none")[0] == str(toolkit)


def test_no_toolkit_names_every_place_looked_at(tmp_path):
    executable(tmp_path / "bin/nvcc", "#!/bin/sh\nexec /opt/nowhere/bin/nvcc \"$@\"\n")
    home, looked = toolchain.find_cuda_home({"CUDA_HOME": str(tmp_path / "gone"), "PATH": str(tmp_path / "bin")},
                                            last_guess=tmp_path / "none")
    assert home is None
    assert looked == [f"CUDA_HOME={tmp_path / 'gone'}", f"nvcc on PATH ({tmp_path / 'bin/nvcc'})",
                      str(tmp_path / "none")]


# How pip shows a failed build: its output indented under its own summary (as in a real log of Horovod's
# build against PyPI's CUDA torch, an nvcc wrapper on PATH and no CUDAToolkit_ROOT).
PIP_FAILED = """Processing /tmp/tmp.x/horovod-0.28.1
  error: subprocess-exited-with-error
  × Building wheel for horovod (pyproject.toml) did not run successfully.
  ╰─> [400 lines of output]
      running bdist_wheel
{body}
      RuntimeError: CMake configuration failed
      [end of output]
  ERROR: Failed building wheel for horovod
ERROR: Failed to build one or more wheels
"""


@pytest.mark.parametrize("body, cause", [
    ("""      CMake Error at /usr/share/cmake-3.25/Modules/FindPackageHandleStandardArgs.cmake:230 (message):
        Could NOT find CUDAToolkit (missing: CUDAToolkit_INCLUDE_DIR CUDA_CUDART) (found
        version "13.0.88")
      Call Stack (most recent call first):""",
     "CMake Error at /usr/share/cmake-3.25/Modules/FindPackageHandleStandardArgs.cmake:230 (message): "
     "Could NOT find CUDAToolkit (missing: CUDAToolkit_INCLUDE_DIR CUDA_CUDART) (found"),
    ("""      In file included from /x/torch/include/c10/util/Exception.h:5,
      /x/torch/include/c10/macros/Macros.h:5:2: error: #error C++17 or later compatible compiler is required
      make[2]: *** [CMakeFiles/x.dir/build.make:76: x.o] Error 1
      collect2: error: ld returned 1 exit status""",
     "/x/torch/include/c10/macros/Macros.h:5:2: error: #error C++17 or later compatible compiler is required"),
    ("""      /usr/bin/ld: cannot find -lnccl: No such file or directory
      collect2: error: ld returned 1 exit status""",
     "/usr/bin/ld: cannot find -lnccl: No such file or directory"),
    ("      building 'horovod' ...", "RuntimeError: CMake configuration failed"),
])
def test_a_failed_build_is_told_by_its_cause(body, cause):
    assert toolchain.build_error(PIP_FAILED.format(body=body)) == cause


def test_a_failed_install_is_told_by_pips_error():
    log = ("Collecting torch==9.9\n  WARNING: Retrying (Retry(total=4...)) after connection broken\n"
           "ERROR: Could not find a version that satisfies the requirement torch==9.9 (from versions: none)\n"
           "ERROR: No matching distribution found for torch==9.9\n")
    assert toolchain.build_error(log) == (
        "ERROR: Could not find a version that satisfies the requirement torch==9.9 (from versions: none)")


# ----------------------------------------------------------------------------- the scripts' messages

def stand_in_python(folder, answers):
    """A `python` answering the scripts' questions: each (fragment of its arguments, output, exit status)
    in turn; anything else exits 3. Every call is appended to calls.txt."""
    cases = "\n".join(f"  *{fragment!r}*) {f'echo {output!r}; ' if output else ''}exit {status};;"
                      for fragment, output, status in answers)
    return executable(folder / "python", f'#!/bin/sh\necho "$*" >> {folder}/calls.txt\ncase "$*" in\n{cases}\n'
                                         f"  *) exit 3;;\nesac\n")


def run_script(script, *args, env=None):
    return subprocess.run(["bash", str(ROOT / "scripts" / script), *map(str, args)], capture_output=True,
                          text=True, timeout=60, env={**os.environ, **(env or {})})


def test_horovod_with_a_cuda_torch_and_no_toolkit_says_the_two_ways_out_in_one_line(tmp_path):
    python = stand_in_python(tmp_path, [
        ("torch.__version__", "2.13.0", 0), ("sys.version_info", "cp312", 0),
        ("torch.version.cuda is None", "", 0),  # a CUDA build
        ("cuda-home", "no CUDA toolkit in nvcc on PATH (/usr/local/bin/nvcc), /usr/local/cuda", 1)])
    process = run_script("build-horovod.sh", python, env={"HOROVOD_WHEEL_CACHE": str(tmp_path / "cache")})
    assert process.returncode == 1
    lines = process.stderr.splitlines()
    assert len(lines) == 1, process.stderr
    assert "no CUDA toolkit in nvcc on PATH (/usr/local/bin/nvcc)" in lines[0]
    assert "set CUDA_HOME" in lines[0] and "torch's CPU build" in lines[0]


def test_deepspeeds_cpu_ops_are_installed_for_a_cuda_torch_without_a_gpu(tmp_path):
    """PyPI's torch on a machine without a GPU: DeepSpeed runs on its CPU accelerator, so its CPU ops are
    installed (here from a wheel already built), and one line says so."""
    cache = tmp_path / "cache"
    cache.mkdir()
    for python_tag in ("cp312", "cp313"):  # the folder is shared by the Pythons of one torch
        (cache / f"deepspeed-0.19.8-{python_tag}-{python_tag}-linux_x86_64.whl").touch()
    python = stand_in_python(tmp_path, [
        ("importlib.metadata", "0.19.8", 0), ("device_count", "0", 0),
        ("torch.version.cuda is not None", "", 1),  # a CUDA build, in case the script asks
        ("torch.__version__", "2.13.0", 0), ("sys.version_info", "cp312", 0),
        ("pip install", "", 0), ("installed_ops", "", 0)])
    process = run_script("build-deepspeed-ops.sh", python, env={"DEEPSPEED_WHEEL_CACHE": str(cache)})
    assert process.returncode == 0, process.stderr
    pip = next(line for line in (tmp_path / "calls.txt").read_text().splitlines() if "pip install" in line)
    assert "deepspeed-0.19.8-cp312-cp312-linux_x86_64.whl" in pip and "cp313" not in pip
    assert process.stdout == ("DeepSpeed 0.19.8: CPU ops cpu_adam and shm_comm prebuilt for the CPU "
                              "(torch sees no GPU)\n")


def test_deepspeed_on_a_gpu_machine_says_what_it_leaves(tmp_path):
    python = stand_in_python(tmp_path, [("importlib.metadata", "0.19.8", 0), ("device_count", "2", 0)])
    process = run_script("build-deepspeed-ops.sh", python)
    assert process.returncode == 0 and process.stderr == ""
    assert process.stdout.startswith("DeepSpeed 0.19.8: no op prebuilt, torch sees 2 GPU(s)")


@pytest.fixture
def bare_checkout(tmp_path):
    """The set-up scripts and requirements, without a .venv (setup-env.sh works in its checkout)."""
    (tmp_path / "repo/scripts").mkdir(parents=True)
    for name in ("requirements.txt", *(f"scripts/{path.name}" for path in (ROOT / "scripts").iterdir())):
        (tmp_path / "repo" / name).write_bytes((ROOT / name).read_bytes())
    return tmp_path / "repo"


def test_a_python_that_cannot_run_is_named_in_one_line(bare_checkout, tmp_path):
    """pyenv's shim for a version that is not selected: it exits 127 after several lines of advice."""
    shim = executable(tmp_path / "shims/python3.12", "#!/bin/sh\necho 'pyenv: python3.12: command not found' >&2\n"
                      "echo >&2\necho 'The `python3.12` command exists in these Python versions:' >&2\nexit 127\n")
    for python, why in [(shim, "pyenv: python3.12: command not found"), (tmp_path / "no/python3", "not found")]:
        process = subprocess.run(["bash", "scripts/setup-env.sh"], cwd=bare_checkout, capture_output=True, text=True,
                                 timeout=60, env={**os.environ, "PYTHON": str(python)})
        assert process.returncode == 1
        assert process.stderr.splitlines() == [
            f"error: the Python to make .venv from, {python}, cannot be run: {why} (PYTHON=... names a Python "
            "3.11, 3.12 or 3.13 that runs, e.g. PYTHON=/usr/bin/python3.12)"]
        assert not (bare_checkout / ".venv").exists()


# A Python whose venv is itself, whose pip only notes the index it was given, and whose probe of torch's
# CPU index succeeds when REACHABLE=0. The builds it cannot answer fail, as optional builds may.
SETUP_PYTHON = """#!/bin/sh
echo "$* index=${PIP_EXTRA_INDEX_URL:-}" >> calls.txt
case "$*" in
  *sys.version_info*) echo 3.12;;
  "-m venv .venv") mkdir -p .venv/bin && cp "$0" .venv/bin/python;;
  *urlopen*) exit "$REACHABLE";;
  *"pip install"*) ;;
  *torch.version.cuda*) echo "torch 2.13.0: the build pip chose";;
  *) exit 3;;
esac
"""


@pytest.mark.parametrize("reachable, torch_build", [(True, ""), (False, ""), (True, "pypi")])
def test_without_an_nvidia_driver_the_set_up_takes_torchs_cpu_build(bare_checkout, tmp_path, reachable, torch_build):
    python = executable(tmp_path / "python3.12", SETUP_PYTHON)
    env = {key: value for key, value in os.environ.items() if key not in ("PIP_INDEX_URL", "PIP_EXTRA_INDEX_URL")}
    process = subprocess.run(["bash", "scripts/setup-env.sh"], cwd=bare_checkout, capture_output=True, text=True,
                             timeout=60, env={**env, "PYTHON": str(python), "REACHABLE": "0" if reachable else "1",
                                              "TORCH_BUILD": torch_build})
    assert process.returncode == 0, process.stderr
    pip = next(line for line in (bare_checkout / "calls.txt").read_text().splitlines() if "pip install" in line)
    cpu_index = "https://download.pytorch.org/whl/cpu"
    driver = Path("/proc/driver/nvidia/version").exists() or shutil.which("nvidia-smi")
    if driver or torch_build == "pypi":
        assert pip.endswith("index=") and "NVIDIA" not in process.stdout
    elif reachable:
        assert pip.endswith(f"index={cpu_index}")
        assert f"No NVIDIA driver here: torch's CPU build comes from {cpu_index}" in process.stdout
    else:
        assert pip.endswith("index=")
        assert (f"No NVIDIA driver here, but {cpu_index} cannot be reached: torch comes from pip's own index"
                in process.stdout)
    assert "torch 2.13.0: the build pip chose" in process.stdout
