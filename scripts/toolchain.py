"""What the set-up needs to know of the machine and of its failed builds (scripts/setup-env.sh, build-*.sh):

    python scripts/toolchain.py cuda-home        the CUDA toolkit's folder, or exit 1 saying where it looked
                                                 (both on stdout: importing torch may log on stderr)
    python scripts/toolchain.py build-error LOG  the line of a pip log that gives a failure's cause

The toolkit is looked for where torch looks (torch.utils.cpp_extension: CUDA_HOME or CUDA_PATH, else the
folder above `nvcc` on PATH, else /usr/local/cuda), with two differences: an `nvcc` that is a symlink or a
wrapper script is followed to the real compiler (torch and CMake take the wrapper's parent, where no
toolkit is), and a folder counts only if it holds a toolkit, so a wrong guess does not hide a right one.
"""
import os
import re
import shutil
import sys
from pathlib import Path

# A wrapper names the real compiler by its absolute path (`exec /usr/local/cuda-13.0/bin/nvcc "$@"`).
NVCC_IN_SCRIPT = re.compile(r"(/[^\s'\"`;|&()]*/nvcc)\b")


def real_nvcc(nvcc, hops=5):
    """`nvcc` with symlinks resolved and wrapper scripts followed to the compiler they run."""
    nvcc = Path(nvcc).resolve()
    for _ in range(hops):
        with open(nvcc, "rb") as file:
            if file.read(2) != b"#!":
                return nvcc
            text = file.read(65536).decode("utf-8", "replace")
        target = next((Path(found).resolve() for found in NVCC_IN_SCRIPT.findall(text)
                       if Path(found).is_file() and Path(found).resolve() != nvcc), None)
        if target is None:
            return nvcc
        nvcc = target
    return nvcc


def is_toolkit(folder):
    """What CMake's FindCUDAToolkit needs: the compiler, the runtime's header and its library."""
    folder = Path(folder)
    libraries = [folder / "lib64", folder / "lib", *folder.glob("targets/*/lib")]
    return ((folder / "bin" / "nvcc").is_file() and (folder / "include" / "cuda_runtime.h").is_file()
            and any(any(library.glob("libcudart.so*")) for library in libraries))


def candidates(environ, torch_home, last_guess):
    """(where, folder) in torch's order of guesses."""
    for name in ("CUDA_HOME", "CUDA_PATH"):
        if environ.get(name):
            yield f"{name}={environ[name]}", environ[name]
    if torch_home:
        yield f"torch's CUDA_HOME={torch_home}", torch_home
    nvcc = shutil.which("nvcc", path=environ.get("PATH", ""))
    if nvcc:
        yield f"nvcc on PATH ({nvcc})", real_nvcc(nvcc).parent.parent
    yield str(last_guess), last_guess


def find_cuda_home(environ, torch_home=None, last_guess="/usr/local/cuda"):
    """(the toolkit's folder or None, the places looked at)."""
    looked = []
    for where, folder in candidates(environ, torch_home, last_guess):
        if is_toolkit(folder):
            return str(Path(folder).resolve()), looked
        looked.append(where)
    return None, looked


# In a pip log, from the most telling: CMake's own error, a compiler's, the linker's, pip's (a version or a
# download), a Python exception; pip's summary lines say only that a build failed.
CAUSES = [re.compile(pattern) for pattern in (
    r"^\s*CMake Error",
    r"(?<!collect2: )\b(fatal )?error: ",
    r"\bld(\.\w+)?: (cannot find|.*undefined reference)",
    r"^ERROR: ",
    r"^\s*\w*(Error|Exception): ",
)]
PIP_SUMMARY = re.compile(r"subprocess-exited-with-error|Failed building wheel|Failed to build|"
                         r"metadata-generation-failed")


def indent(line):
    return len(line) - len(line.lstrip())


def build_error(text):
    """One line: the first of the most telling kind, joined to the line after it where that continues it
    (CMake's message is indented below its `CMake Error at FILE:LINE` line); else the log's last line.
    One line, so that a failed optional build, the script's error and the set-up's warning make three."""
    lines = [line.rstrip() for line in text.splitlines() if line.strip() and not PIP_SUMMARY.search(line)]
    for pattern in CAUSES:
        for index, line in enumerate(lines):
            if pattern.search(line):
                cause = line.strip()
                if pattern is CAUSES[0] and index + 1 < len(lines) and indent(lines[index + 1]) > indent(line):
                    cause += " " + lines[index + 1].strip()
                return cause[:400]
    return (lines or ["(empty log)"])[-1].strip()[:400]


def main(argv):
    if argv[:1] == ["cuda-home"]:
        try:
            from torch.utils.cpp_extension import CUDA_HOME as torch_home
        except ImportError:
            torch_home = None
        home, looked = find_cuda_home(os.environ, torch_home)
        if home is None:
            print(f"no CUDA toolkit in {', '.join(looked)}")
            return 1
        print(home)
        return 0
    if len(argv) == 2 and argv[0] == "build-error":
        print(build_error(Path(argv[1]).read_text(encoding="utf-8", errors="replace")))
        return 0
    print(__doc__, file=sys.stderr)
    return 2


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
