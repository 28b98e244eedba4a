"""Helpers shared by the tests: run a script the way a user would, read what it wrote."""
import collections
import contextlib
import gc
import importlib.util
import io
import json
import os
import pickle
import resource
import runpy
import shutil
import signal
import subprocess
import sys
import sysconfig
import time
import traceback
from pathlib import Path

import filelock
import pytest

ROOT = Path(__file__).resolve().parents[1]
PYTHON = sys.executable


def launcher_dir():
    """Where this Python's launchers (torchrun, accelerate, deepspeed, ...) are: beside it in a venv,
    elsewhere for a system Python (/usr/local/bin, ~/.local/bin for a user install)."""
    candidates = [Path(PYTHON).parent, Path(sysconfig.get_path("scripts")),
                  Path(sysconfig.get_path("scripts", f"{os.name}_user"))]
    return next((path for path in candidates if (path / "torchrun").exists()), candidates[0])


BIN = launcher_dir()
# A few hundred samples that divide by nothing in sight, as real data does: 332 train (10 batches
# of 32 and a short one of 12; 10 of 33 and one of 2, which 3 processes cannot share evenly) and
# 83 dev (uneven over 2 or 3 processes). Sizes that divide evenly hide the bugs that matter.
SAMPLES, DEV_SAMPLES = 415, 83
# --device cpu: the regular suite always runs on the CPU, over gloo, GPUs or not. With --device auto a
# machine with fewer GPUs than a test's 2 or 3 processes fails ("local rank 1 has no GPU"), and one with
# enough would test NCCL instead of the path the tests check. tests/test_gpu.py runs on the GPUs.
SMALL = ["--model", "tiny", "--max-samples", str(SAMPLES), "--dev-ratio", "0.2", "--log-steps", "5",
         "--device", "cpu"]
# benchmark.py has no --device: it reads the GPUs torch sees to pick --nprocs, DataParallel's --gpu-ids
# and fabric run's --accelerator. Hiding them keeps the runner and every script it starts on the CPU.
CPU_ONLY = {"CUDA_VISIBLE_DEVICES": ""}
# Equivalence runs: shuffling and dropout off, so that only the strategy can make a difference.
EXACT = ["--no-shuffle", "--dropout", "0"]

sys.path.insert(0, str(ROOT))
# Every run a test starts plugs in the tests' hooks (measure.EXTRA_CALLBACKS_ENV), each inert until a
# test sets its own variable.
os.environ["SUITE_CALLBACKS"] = str(ROOT / "tests" / "hooks.py")
# Two test workers share the cores (test.sh): a waiting OpenMP thread of a launch sleeps instead of
# spinning on a core the other worker's launch needs. Results do not depend on it.
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
# Likewise Horovod's background thread, which otherwise negotiates every millisecond: every 20 ms
# here. It delays each step's all-reduces by up to that, and changes no result.
os.environ.setdefault("HOROVOD_CYCLE_TIME", "20")

from support.launch import STOP_SIGNALS  # noqa: E402
from support.spawn_setup import free_port  # noqa: E402  (a launch never meets the rendezvous of an earlier one)
import warm  # noqa: E402


def require(module):
    """Skip when an optional dependency is missing, except in CI, where it must be installed."""
    if importlib.util.find_spec(module) is None:
        if os.environ.get("CI"):
            pytest.fail(f"{module} is not installed, but CI must run its tests (see scripts/setup-env.sh)")
        pytest.skip(f"{module} is not installed (scripts/setup-env.sh installs it)")


def run(command, timeout=600, env=None, check=True):
    """Run a command from the repository root; on failure or timeout show its output in the test report.
    A launch that times out is killed with every process it started (its own session)."""
    problem = None
    with subprocess.Popen(command, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                          env={**os.environ, **(env or {})}, start_new_session=True) as launched:
        try:
            stdout, stderr = launched.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            os.killpg(launched.pid, signal.SIGKILL)
            problem = f"still ran after {timeout} s"
            try:
                stdout, stderr = launched.communicate(timeout=30)
            except subprocess.TimeoutExpired:  # a process outside the session holds the pipes
                stdout, stderr = "", ""
    process = subprocess.CompletedProcess(command, launched.returncode, stdout, stderr)
    if problem or (check and process.returncode != 0):
        pytest.fail(f"{' '.join(map(str, command))} {problem or f'exited {process.returncode}'}\n"
                    f"--- stdout\n{stdout[-4000:]}\n--- stderr\n{stderr[-4000:]}")
    return process


def run_in_process(command, env=None):
    """Run `python SCRIPT ARGS...` in this interpreter, for checks that end before any training (a bad
    option or input, a wrong launch) and one-process runs whose launcher is not the point: a new Python
    would spend its 5 s importing torch and transformers first. Returns what `run(..., check=False)`
    would: the exit status and the two streams, with an uncaught exception's traceback on stderr as the
    interpreter prints it."""
    script, *args = map(str, command)
    stdout, stderr = io.StringIO(), io.StringIO()
    saved = dict(os.environ), sys.argv, os.getcwd(), {number: signal.getsignal(number) for number in STOP_SIGNALS}
    torch = sys.modules.get("torch")
    threads = torch.get_num_threads() if torch else None
    os.environ.update(env or {})
    sys.argv = [str(ROOT / script), *args]
    os.chdir(ROOT)
    returncode = 0
    try:
        with contextlib.redirect_stdout(stdout), contextlib.redirect_stderr(stderr):
            try:
                runpy.run_path(str(ROOT / script), run_name="__main__")
            except SystemExit as exit:
                returncode = exit.code if isinstance(exit.code, int) else int(exit.code is not None)
                if isinstance(exit.code, str):
                    print(exit.code, file=sys.stderr)
            except BaseException:
                traceback.print_exc()
                returncode = 1
    finally:
        environment, sys.argv, cwd, handlers = saved
        os.environ.clear()
        os.environ.update(environment)
        os.chdir(cwd)
        for number, handler in handlers.items():  # cli.run installs its own
            signal.signal(number, handler)
        gc.unfreeze()  # cli.run froze what it found (gc.freeze): this interpreter goes on and collects it
        if threads:
            sys.modules["torch"].set_num_threads(threads)
    return subprocess.CompletedProcess(command, returncode, stdout.getvalue(), stderr.getvalue())


def run_here(command, env=None):
    """run(command) for `python SCRIPT ARGS...` in this interpreter (run_in_process): the test fails on
    a non-zero exit and shows the end of stderr."""
    process = run_in_process(command[1:], env)
    if process.returncode != 0:
        pytest.fail(f"{' '.join(map(str, command))} exited {process.returncode}\n--- stderr\n{process.stderr[-4000:]}")
    return process


def read_result(output_dir):
    return json.loads((Path(output_dir) / "result.json").read_text(encoding="utf-8"))


def read_curves(output_dir):
    """The scalars a run wrote for TensorBoard (instruments/curves.py), read back as TensorBoard reads them:
    {tag: {step: value}}."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
    events = EventAccumulator(str(Path(output_dir) / "tensorboard"), size_guidance={"scalars": 0})
    events.Reload()
    return {tag: {event.step: event.value for event in events.Scalars(tag)} for tag in events.Tags()["scalars"]}


def load_weights(model_dir):
    from safetensors.torch import load_file
    return load_file(str(Path(model_dir) / "model.safetensors"))


def assert_same_weights(a_dir, b_dir, atol=1e-4):
    """The models in two checkpoint folders are equal to float tolerance, tensor by tensor. (A sample
    trained twice or weighed wrongly moves them by about 1e-3 here.)"""
    a, b = load_weights(a_dir), load_weights(b_dir)
    assert a.keys() == b.keys()
    worst = max((a[k].float() - b[k].float()).abs().max().item() for k in a)
    assert worst < atol, f"largest weight difference {worst:g} exceeds {atol:g}"


# What a kind of collective beyond a strategy's formula may carry per step: a few scalars (DeepSpeed's
# overflow flag, the loss a logging step averages) and DDP's broadcast of its bucket order on the first
# synchronised step.
STRAY_BYTES = 1024


def assert_sends_what_its_formula_allows(result):
    """Each kind of collective the run sent per step (result.json's collective_bytes, instruments/traffic.py)
    carries at most what its strategy's formula allows (up to 1% of shard padding and STRAY_BYTES), and
    every kind the formula names ran, in full."""
    measured, allowed = result["collective_bytes"]["kinds"], result["collective_formula_bytes"]["kinds"]
    for kind, totals in measured.items():
        limit = allowed.get(kind, 0) * 1.01 + STRAY_BYTES
        assert totals["bytes"] <= limit, f"{kind}: {totals['bytes']:,} bytes per step, the formula allows {limit:,.0f}"
    for kind, size in allowed.items():
        assert kind in measured and measured[kind]["bytes"] >= size, f"{kind}: {measured.get(kind)}, {size:,}"
    return result["collective_bytes"]


def small_split():
    """The SMALL run's (train, dev) records."""
    import common
    return common.split_records(common.load_records(ROOT / "data" / "train.json"), SAMPLES, 0.2, 123)


def untrained_dev_loss():
    """The dev loss of the tiny model before any step, on the SMALL split."""
    import torch
    import torch.nn.functional as F

    from support import models
    train, dev = small_split()
    tokenizer, model = models.build_tiny_model([text for text, _ in train], 123, {"num_labels": 6})
    encoded = tokenizer([text for text, _ in dev], padding=True, truncation=True, max_length=128, return_tensors="pt")
    with torch.no_grad():
        logits = model.eval()(**encoded).logits
    return F.cross_entropy(logits, torch.tensor([label for _, label in dev])).item()


def predict_dev_accuracy(output_dir):
    """Run predict.py on the SMALL dev texts with the model in `output_dir`; return its accuracy. In this
    interpreter: test_single.py launches predict.py as a user does."""
    import common
    _, dev = small_split()
    texts_file = Path(output_dir) / "dev.txt"
    texts_file.write_text("\n".join(text for text, _ in dev), encoding="utf-8")
    process = run_in_process(["predict.py", "--checkpoint", str(Path(output_dir) / "model"), "--file", str(texts_file)])
    assert process.returncode == 0, process.stderr
    lines = process.stdout.strip().splitlines()
    assert len(lines) == len(dev)
    return sum(line.split("\t")[0] == common.LABELS[label] for line, (_, label) in zip(lines, dev)) / len(dev)


def processes_mentioning(marker):
    """The running processes whose command line mentions `marker` (a test's own output folder)."""
    import psutil  # here, not at the top: tests/test_gpu.py must load where psutil is missing
    found = []
    for process in psutil.process_iter(["cmdline"]):
        try:
            if any(marker in part for part in process.info["cmdline"] or []):
                found.append(process)
        except psutil.Error:
            continue
    return found


def assert_no_process_left(marker):
    """No process of the job is left running (allowing a few seconds to exit)."""
    deadline = time.monotonic() + 10
    while processes_mentioning(marker) and time.monotonic() < deadline:
        time.sleep(0.5)
    assert processes_mentioning(marker) == [], "orphan processes left running"


def once_per_session(tmp_path_factory, name, launch):
    """What launch(folder) returns, launched the first time a test asks for `name` in this session. Under
    pytest-xdist (test.sh runs 2 workers) the workers share it: the first to ask launches, the others
    wait on its lock and read what it returned."""
    base = tmp_path_factory.getbasetemp()
    folder = (base.parent if os.environ.get("PYTEST_XDIST_WORKER") else base) / f"shared-{name}"
    with filelock.FileLock(f"{folder}.lock"):
        returned = folder / "returned.pickle"
        if not returned.exists():
            shutil.rmtree(folder, ignore_errors=True)  # what a failed launch left
            folder.mkdir()
            returned.write_bytes(pickle.dumps(launch(folder)))
        return pickle.loads(returned.read_bytes())


def single_run(tmp_path_factory, batch_size, *options):
    def launch(output):  # warm: test_single.py's run is the one `python single-gpu-cls.py` launches
        warm.run([PYTHON, "single-gpu-cls.py", *SMALL, *EXACT, "--batch-size", str(batch_size), *options,
                  "--output-dir", str(output)])
        return output
    return once_per_session(tmp_path_factory, f"single-reference-{batch_size}", launch)


@pytest.fixture(scope="session")
def single_reference(tmp_path_factory):
    """single-gpu-cls.py at batch 32, shuffling and dropout off: what 2 processes x 16 must equal."""
    return single_run(tmp_path_factory, 32)


@pytest.fixture(scope="session")
def single_33(tmp_path_factory):
    """single-gpu-cls.py at batch 33: what 3 processes x 11 must equal (the last global batch, 2
    samples, cannot be shared by 3). With --max-steps beyond its 11 steps, which must change nothing
    (test_base_shape.py)."""
    return single_run(tmp_path_factory, 33, "--max-steps", "1000")


@pytest.fixture(scope="session")
def ddp_run(tmp_path_factory):
    """ddp_run(accumulation) -> (its process, its output folder): DDP, 2 processes at the global batch
    32 (16 x 1, or 4 x 4 micro-batches), shuffling and dropout off, its gradient all-reduces counted
    (tests/hooks.py). The first under torchrun (the quick tier's DDP check), the second under the legacy
    python -m torch.distributed.launch, padded as on a GPU (--pad-to-multiple-of 16: test_native.py);
    test_grad_accum.py reads the all-reduces of both."""
    launchers = {1: [BIN / "torchrun"], 4: [PYTHON, "-m", "torch.distributed.launch"]}
    padding = {1: [], 4: ["--pad-to-multiple-of", "16"]}

    def get(accumulation):
        def launch(output):
            import hooks
            return run([*launchers[accumulation], "--nproc_per_node", "2", "--master_port", free_port(),
                        "multi-gpu-distributed-cls.py", *SMALL, *EXACT, *padding[accumulation],
                        "--grad-accum", str(accumulation),
                        "--batch-size", str(16 // accumulation), "--output-dir", str(output)],
                       env={hooks.COUNT_ALLREDUCES_ENV: "1"}), output
        return once_per_session(tmp_path_factory, f"ddp-{accumulation}", launch)
    return get


# Each strategy at 2 processes x 8 x 2 micro-batches (one device: 16 x 2), shuffling and dropout off:
# the global batch 32 of single_reference. test_grad_accum.py checks every one against it; the
# strategy's own file reads the same run for what it checks at 2 processes (its launcher, its result,
# rank 0 alone reporting), and Accelerate's takes its config file. One device, DeepSpeed's ZeRO-2 (and
# its other stages) and FSDP2 with the weights kept from forward to backward are the profiled runner's
# rows (profiled_benchmark), which run the same way.
ACCUMULATING = {
    "dataparallel": lambda: [PYTHON, "multi-gpu-dataparallel-cls.py", "--batch-size", "16"],
    "ddp-spawn": lambda: [PYTHON, "multi-gpu-distributed-mp-cls.py", "--nprocs", "2", "--batch-size", "8"],
    # Compiled too: test_compile.py reads it (torch.compile under DDP's no_sync and a short last step, each
    # graph traced once: tests/hooks.py counts the traces).
    "ddp-amp": lambda: [PYTHON, "multi-gpu-distributed-mp-amp-cls.py", "--nprocs", "2", "--batch-size", "8",
                        "--precision", "fp32", "--compile"],
    "horovod": lambda: [BIN / "horovodrun", "-np", "2", "-H", "localhost:2", "--gloo", "--start-timeout", "120",
                        PYTHON, "multi-gpu-horovod-cls.py", "--batch-size", "8"],
    "accelerate": lambda: [BIN / "accelerate", "launch", "--config_file", "configs/accelerate/multi-gpu.yaml",
                           "--main_process_port", free_port(), "multi-gpu-accelerate-cls.py", "--device", "cpu",
                           "--batch-size", "8"],
}
NEEDS = {"horovod": "horovod", "deepspeed": "deepspeed", "accelerate": "accelerate"}


@pytest.fixture(scope="session")
def accumulating_run(tmp_path_factory):
    """accumulating_run(strategy) -> (its process, its output folder): launched once a session."""
    def get(strategy):
        if strategy in NEEDS:
            require(NEEDS[strategy])

        def launch(output):
            import hooks
            command = [*ACCUMULATING[strategy](), *SMALL, *EXACT, "--grad-accum", "2", "--output-dir", str(output)]
            env = {hooks.COUNT_TRACES_ENV: "1"} if "--compile" in command else {}
            # DataParallel's warm (tests/warm.py): its crashed run launches `python` (test_native.py).
            return (warm.run if strategy == "dataparallel" else run)(command, env=env), output
        return once_per_session(tmp_path_factory, f"accumulating-{strategy}", launch)
    return get

# Each strategy's run of test_resume.py: dropout on (the model's 0.1), so the random states must come
# back too; 11 steps per epoch, 22 in all; a checkpoint every 4 steps. A failure injected at step 10
# (in rank 1 where there are 2 processes) ends the job after the step-8 checkpoint: test_resume.py
# resumes a copy of each, the failing-rank tests of test_native.py and test_reliability.py read how
# the job ended. One process takes its global batch of 32 in 2 micro-batches of 16, so that a resume
# must also skip the micro-batches of the steps already taken.
RESUME = [*SMALL, "--epochs", "2", "--save-steps", "4"]
RESUMABLE = {
    "single": lambda: [PYTHON, "single-gpu-cls.py", "--batch-size", "16", "--grad-accum", "2"],
    # --gpu-ids without a GPU: one CPU process (test_native.py)
    "dataparallel": lambda: [PYTHON, "multi-gpu-dataparallel-cls.py", "--gpu-ids", "0,1", "--batch-size", "16",
                             "--grad-accum", "2"],
    "ddp": lambda: [BIN / "torchrun", "--nproc_per_node", "2", "--master_port", free_port(),
                    "multi-gpu-distributed-cls.py", "--batch-size", "16"],
    "ddp-spawn": lambda: [PYTHON, "multi-gpu-distributed-mp-cls.py", "--nprocs", "2", "--batch-size", "16"],
    # In fp32: on a CPU the AMP script's bf16 has no gradient scaler to save (fp16, with one, needs a
    # GPU: tests/test_gpu.py), and emulated bf16 would only make the three runs several times slower.
    # One process x 16 x 2 micro-batches, as one device: what the script adds to the spawn one is its
    # strategy's state, which needs no second process (spawn's resume runs their shared worker at 2).
    "ddp-amp": lambda: [PYTHON, "multi-gpu-distributed-mp-amp-cls.py", "--nprocs", "1", "--batch-size", "16",
                        "--grad-accum", "2", "--precision", "fp32"],
    "horovod": lambda: [BIN / "horovodrun", "-np", "2", "-H", "localhost:2", "--gloo", "--start-timeout", "120",
                        PYTHON, "multi-gpu-horovod-cls.py", "--batch-size", "16"],
    "fsdp": lambda: [BIN / "torchrun", "--nproc_per_node", "2", "--master_port", free_port(), "multi-gpu-fsdp-cls.py",
                     "--batch-size", "16"],
    # Under torchrun, which sets what the deepspeed launcher would, so that an exported
    # DS_ACCELERATOR=cuda (RESUME_ENV) reaches the script: --device cpu must win over it. (The run
    # that crashes takes the deepspeed launcher: CRASHING.)
    "deepspeed": lambda: [BIN / "torchrun", "--nproc_per_node", "2", "--master_port", free_port(),
                          "multi-gpu-deepspeed-cls.py", "--zero-stage", "2", "--device", "cpu", "--batch-size", "16"],
    "accelerate": lambda: [BIN / "accelerate", "launch", "--multi_gpu", "--num_processes", "2",
                           "--main_process_port", free_port(), "multi-gpu-accelerate-cls.py", "--device", "cpu",
                           "--batch-size", "16"],
}
RESUME_ENV = {"deepspeed": {"DS_ACCELERATOR": "cuda"}}
# `python SCRIPT`, one process: resumed (and single's uninterrupted run, test_resume.py) in the tests'
# interpreter, which has imported torch already. Their crashed runs, whose ends other files read, launch.
ONE_PROCESS = ("single", "dataparallel")
ONE_RANK = (*ONE_PROCESS, "ddp-amp")  # their failure is injected in rank 0
# DDP's crash takes --model auto, as a first run does: without model_hub/'s model and the hub, rank 0 alone
# resolves it, to the tiny model (test_resume.py). Where model_hub/ holds the real model, --model tiny.
FIRST_RUN = {"ddp": (["--model", "auto"], {"HF_HUB_OFFLINE": "1"})}
# DeepSpeed's run crashes under its own launcher (test_reliability.py reads how it ends the job), and
# its checkpoint resumes under torchrun.
CRASHING = {"deepspeed": lambda: [BIN / "deepspeed", "--num_gpus", "2", "--master_port", free_port(),
                                  "multi-gpu-deepspeed-cls.py", "--zero-stage", "2", "--device", "cpu",
                                  "--batch-size", "16"]}
# Warm (tests/warm.py), their launchers proven elsewhere: the resumes under torchrun and accelerate launch
# (whose crashed runs, launched, test_native.py and test_reliability.py read), single's crash. The spawn
# scripts' resumes and the AMP script's crash start their parent warm, which spawns its ranks as always
# (spawn's crash, launched, test_native.py reads).
WARM_RESUMES = ("ddp", "fsdp", "deepspeed", "accelerate", "ddp-spawn", "ddp-amp")
WARM_CRASHES = ("single", "ddp-amp")
CrashedRun = collections.namedtuple("CrashedRun", "process seconds orphans output")


@pytest.fixture(scope="session")
def crashed_run(tmp_path_factory):
    """crashed_run(strategy) -> CrashedRun: how its RESUMABLE run (CRASHING's, where it has one) ended:
    the process, the seconds it took, the pids still running 10 s after, and the folder it left.
    Tests work on copies."""
    def get(strategy):
        if strategy in NEEDS:
            require(NEEDS[strategy])

        def launch(output):
            from support import models
            failing_rank = 0 if strategy in ONE_RANK else 1
            options, env = ([], {}) if models.LOCAL_MODEL_DIR.is_dir() else FIRST_RUN.get(strategy, ([], {}))
            started = time.monotonic()
            process = (warm.run if strategy in WARM_CRASHES else run)(
                [*CRASHING.get(strategy, RESUMABLE[strategy])(), *RESUME, *options, "--output-dir", str(output)],
                check=False, env={**env, "SUITE_FAIL_AT": f"{failing_rank}:10"})
            seconds = time.monotonic() - started
            deadline = time.monotonic() + 10
            while processes_mentioning(str(output)) and time.monotonic() < deadline:
                time.sleep(0.5)
            orphans = [left.pid for left in processes_mentioning(str(output))]
            return CrashedRun(process, seconds, orphans, output)
        return once_per_session(tmp_path_factory, f"crashed-{strategy}", launch)
    return get


@pytest.fixture(scope="session")
def resumed_run(tmp_path_factory, crashed_run):
    """resumed_run(strategy) -> (its process, its output folder): a copy of the crashed run's folder,
    resumed with --resume from its step-8 checkpoint to the end of epoch 2. test_resume.py compares it
    with the uninterrupted run; test_accelerate.py reads Accelerate's for what its launcher leaves."""
    def get(strategy):
        crashed = crashed_run(strategy)

        def launch(folder):
            output = folder / "output"  # what the run wrote, apart from once_per_session's file
            shutil.copytree(crashed.output, output, ignore=shutil.ignore_patterns("returned.pickle"))
            command = [*RESUMABLE[strategy](), *RESUME, "--output-dir", str(output), "--resume"]
            if strategy in ONE_PROCESS:
                return run_here(command), output
            return (warm.run if strategy in WARM_RESUMES else run)(command, env=RESUME_ENV.get(strategy, {})), output
        return once_per_session(tmp_path_factory, f"resumed-{strategy}", launch)
    return get

# The rows of the step and memory anatomy, one per sharding stage, each profiled for 3 steps. DeepSpeed's
# ZeRO-3 keeps weights under 1e5 elements whole in every process: most of the tiny model's. Without that
# threshold (zero3-sharded-all, a variant of one's own) it shards every weight, as FSDP2 does.
PROFILED_ROWS = ["single", "ddp", "deepspeed-zero1", "deepspeed-zero2", "zero3-sharded-all", "fsdp"]


@pytest.fixture(scope="session")
def profiled_benchmark(tmp_path_factory):
    """benchmark.py over PROFILED_ROWS at 2 processes x 8 x 2 micro-batches (one device: 16 x 2),
    shuffling and dropout off, with an option for DeepSpeed's rows alone, FSDP2's weights kept from
    forward to backward and one device's activations recomputed in backward (--gradient-checkpointing):
    (output folder, {row: benchmark.json row}). test_anatomy.py reads the anatomy, test_benchmark.py
    how variants and per-strategy options reach their rows, test_grad_accum.py each row's weights,
    single_reference's as every accumulating run's (ACCUMULATING: the others), and DDP's gradient
    all-reduces, counted (tests/hooks.py); test_single.py that checkpointing trains the same weights.
    Warm: benchmark.py in this interpreter, its launches through tests/warm.py, which gives each rank what
    its launcher would (test_warm.py); the runner's real launches: test_benchmark.py's failing row."""
    require("deepspeed")

    def launch(output):
        import hooks
        config = output / "zero3.json"
        config.write_text(json.dumps({"zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": 0}}))
        command = [PYTHON, "benchmark.py", "--only", ",".join(PROFILED_ROWS), "--nprocs", "2", "--global-batch", "32",
                   "--grad-accum", "2", "--profile", "3",
                   "--variant", f"zero3-sharded-all=deepspeed:--zero-stage 3 --deepspeed-config {config}",
                   "--strategy-args", "deepspeed=--offload none", "--strategy-args", "fsdp=--no-reshard-after-forward",
                   "--strategy-args", "single=--gradient-checkpointing",
                   "--model", "tiny", "--max-samples", str(SAMPLES), "--dev-ratio", "0.2", "--device", "cpu", *EXACT,
                   "--output-dir", str(output)]
        with warm.runner_launches():
            run_here(command, env={**CPU_ONLY, hooks.COUNT_ALLREDUCES_ENV: "1"})
        return output, {row["row"]: row for row in json.loads((output / "benchmark.json").read_text())["rows"]}
    return once_per_session(tmp_path_factory, "profiled-benchmark", launch)

# What the suite costs, by file: seconds, the processes its tests launch (counted by Python's audit
# hook for subprocess.Popen, so nothing is replaced) and the CPU seconds they and the test spent (the
# launched processes' once they ended; a Slurm job's run under slurmd, not here). Each test report
# carries its own, so that under pytest-xdist the controller adds up what every worker ran. Printed at
# the end of every run; the README gives the whole suite's duration on 2 cores.
_launches = [None]
_cpu_at = [0.0]


def _count_launches(event, _args):
    if event == "subprocess.Popen" and _launches[0] is not None:
        _launches[0] += 1


sys.addaudithook(_count_launches)


def _cpu_seconds():
    used = resource.getrusage(resource.RUSAGE_SELF), resource.getrusage(resource.RUSAGE_CHILDREN)
    return sum(usage.ru_utime + usage.ru_stime for usage in used) + warm.cpu_seconds()  # warm's ranks too


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_protocol(item, nextitem):
    _launches[0], _cpu_at[0] = 0, _cpu_seconds()
    yield
    _launches[0] = None


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    report = (yield).get_result()
    now = _cpu_seconds()
    report.user_properties += [("launches", _launches[0]), ("cpu_seconds", now - _cpu_at[0])]
    _launches[0], _cpu_at[0] = 0, now


_cost = {}


def pytest_runtest_logreport(report):
    cost = _cost.setdefault(report.nodeid.split("::")[0], [0.0, 0.0, 0, 0])
    spent = dict(report.user_properties)
    cost[0] += report.duration
    cost[1] += spent.get("cpu_seconds", 0.0)
    cost[2] += report.when == "setup"
    cost[3] += spent.get("launches", 0)


def pytest_terminal_summary(terminalreporter):
    if not _cost or os.environ.get("PYTEST_XDIST_WORKER"):
        return
    write = terminalreporter.write_line
    terminalreporter.section("cost by file: seconds (setup, call, teardown), CPU seconds, tests, launched processes")
    for name, (seconds, cpu, tests, launches) in sorted(_cost.items(), key=lambda item: -item[1][1]):
        write(f"{seconds:8.1f} s {cpu:8.1f} cpu s {tests:4d} tests {launches:4d} launches  {name}")
    seconds, cpu, tests, launches = (sum(column) for column in zip(*_cost.values()))
    write(f"{seconds:8.1f} s {cpu:8.1f} cpu s {tests:4d} tests {launches:4d} launches  total")
