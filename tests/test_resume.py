"""--save-steps / --resume for every strategy: a run that crashed and resumed ends with the weights
of the run that never stopped, with dropout on and across an epoch boundary; a checkpoint resumes
only into a run where its step means the same samples, and only where every process can read it."""
import argparse
import concurrent.futures
import json
import os
import re
import shutil
import subprocess
import sys
from types import SimpleNamespace

import pytest

import common
import warm
from support import checkpoints, models
from support.errors import UserError
from support.options import resolve
from conftest import (BIN, ONE_PROCESS, RESUMABLE, RESUME, ROOT, assert_same_weights, free_port, read_curves,
                      read_result, require, run_here, run_in_process)
from test_bad_input import assert_clean_error

# The resumed run continues from step 8, in epoch 1, and crosses into epoch 2 (conftest's RESUME).
# The uninterrupted run each resumed one must equal: one device at 16 x 2 micro-batches (and each run of
# one process), or 2 processes x 16 (DDP, and every strategy that draws the same dropout masks).
REFERENCE = {"single": "single", "dataparallel": "single", "ddp-amp": "single"}


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory):
    runs = {}

    def get(name):
        if name not in runs:
            output = tmp_path_factory.mktemp(f"uninterrupted-{name}")
            command = [*RESUMABLE[name](), *RESUME, "--output-dir", str(output)]
            (run_here if name in ONE_PROCESS else warm.run)(command)  # DDP's: warm
            runs[name] = output
        return runs[name]
    return get


@pytest.fixture
def crashed_ddp(crashed_run):
    """The folder of the 2-process DDP run that crashed at step 10, its checkpoint step 8's. It took --model
    auto (conftest's FIRST_RUN): rank 0 alone resolved it, and the checkpoint records what it resolved."""
    crashed = crashed_run("ddp")
    meaning = json.loads((crashed.output / "checkpoint" / "meaning.json").read_text(encoding="utf-8"))
    assert meaning["step"] == 8 and meaning["world_size"] == 2 and meaning["global_batch_size"] == 32
    assert meaning["precision"] == "fp32"  # an fp16 checkpoint (a gradient scaler) resumes only into fp16
    assert meaning["model"] == "tiny"
    if not models.LOCAL_MODEL_DIR.is_dir():
        assert crashed.process.stderr.count("using the TINY randomly") == 1
    return crashed.output


@pytest.mark.parametrize("strategy", list(RESUMABLE))
def test_a_resumed_run_with_dropout_ends_like_the_uninterrupted_one(uninterrupted, crashed_run, resumed_run,
                                                                      strategy):
    crashed = crashed_run(strategy)
    assert crashed.process.returncode != 0 and not (crashed.output / "result.json").exists(), (
        crashed.process.stderr[-2000:])
    resumed, output = resumed_run(strategy)
    assert "--resume: continuing from step 8" in resumed.stdout
    result = read_result(output)
    assert result["resumed_from_step"] == 8 and result["steps"] == 22 and result["epochs"] == 2
    # Throughput counts what this launch trained: 14 steps, the last of each epoch short (12 samples).
    assert result["samples_trained"] == 2 * 332 - 8 * 32
    assert result["device"] == "cpu"  # DeepSpeed's too, with DS_ACCELERATOR=cuda exported (RESUME_ENV)
    if strategy == "deepspeed":
        assert (output / "checkpoint" / "latest").read_text() == "step20"
    # The curves are whole: the crashed run wrote its steps up to its checkpoint, the resumed one the rest.
    assert sorted(read_curves(output)["train/loss"]) == list(range(1, 23))
    assert_same_weights(uninterrupted(REFERENCE.get(strategy, "ddp")) / "model", output / "model")


def test_a_checkpoint_resumes_only_where_its_step_means_the_same_samples(tmp_path, crashed_ddp):
    """3 processes, warm: the step would mean other samples. --model tiny is what the checkpoint's --model
    auto resolved to, which is what it compares."""
    shutil.copytree(crashed_ddp, tmp_path, dirs_exist_ok=True)
    process = warm.run([BIN / "torchrun", "--nproc_per_node", "3", "--master_port", free_port(),
                        "multi-gpu-distributed-cls.py", *RESUME, "--batch-size", "16", "--resume",
                        "--output-dir", str(tmp_path)], check=False)
    assert process.returncode != 0
    errors = [line for line in process.stderr.splitlines() if line.startswith("error: ")]
    assert errors == [f"error: --resume: the checkpoint in {tmp_path / 'checkpoint'} was written with world_size 2 "
                      "(now 3), global_batch_size 32 (now 48): here its step would mean other samples, numbers or "
                      "files. Resume with its settings, or remove it"], process.stderr


def test_a_checkpoint_one_machine_cannot_read_fails_the_job_in_one_line(tmp_path, crashed_ddp):
    """Two 'machines' of one process each, without a shared --output-dir: only rank 0's has the checkpoint.
    Warm, each rank with what `torchrun --nnodes 2 --node_rank N --nproc_per_node 1` gives it (the
    launcher is not the point: test_several_machines.py starts two machines' launchers)."""
    shutil.copytree(crashed_ddp, tmp_path / "node0")
    port = free_port()

    def machine(node):
        environment = {**warm.torchrun_environment(node, 2, port), "LOCAL_RANK": "0", "LOCAL_WORLD_SIZE": "1",
                       "GROUP_RANK": str(node), "GROUP_WORLD_SIZE": "2"}
        (logs := tmp_path / f"logs{node}").mkdir()
        script = ["multi-gpu-distributed-cls.py", *RESUME, "--batch-size", "16", "--threads", "1", "--resume",
                  "--output-dir", str(tmp_path / f"node{node}")]
        ranks, _ = warm.start_and_wait([(script, environment)], dict(os.environ), logs, timeout=300)
        return ranks[0]
    with concurrent.futures.ThreadPoolExecutor(2) as machines:
        (code0, _, stderr0), (code1, _, stderr1) = machines.map(machine, (0, 1))
    assert code0 != 0 and code1 != 0
    assert "error: --resume: rank 0 found a checkpoint" in stderr0
    assert "--output-dir must be on a filesystem every machine shares" in stderr0
    assert "error: --resume" not in stderr1  # rank 0 speaks for all


@pytest.mark.parametrize("damaged", [checkpoints.CHECKPOINT_FILE, checkpoints.MEANING_FILE])
def test_a_truncated_checkpoint_is_named_in_one_line(tmp_path, crashed_run, damaged):
    """The single run's step-8 checkpoint cut in half, resumed in this interpreter: it fails before training.
    (A sharded one fails in the same place, checkpoints.readable, whichever library reads it.)"""
    shutil.copytree(crashed_run("single").output / "checkpoint", tmp_path / "checkpoint")
    path = tmp_path / "checkpoint" / damaged
    path.write_bytes(path.read_bytes()[:path.stat().st_size // 2])
    process = run_in_process([*RESUMABLE["single"]()[1:], *RESUME, "--resume", "--output-dir", str(tmp_path)])
    assert_clean_error(process, f"--resume: the checkpoint in {tmp_path / 'checkpoint'} cannot be read")


def test_a_checkpoint_whose_meaning_json_disagrees_with_its_training_state_is_refused(tmp_path, crashed_run):
    """meaning.json edited to batch 8 and resumed at --batch-size 8: the training state recorded 16. In
    this interpreter, refused before training."""
    shutil.copytree(crashed_run("single").output / "checkpoint", tmp_path / "checkpoint")
    meaning_file = tmp_path / "checkpoint" / checkpoints.MEANING_FILE
    edited = {**json.loads(meaning_file.read_text(encoding="utf-8")), "batch_size_per_process": 8,
              "global_batch_size": 16}
    meaning_file.write_text(json.dumps(edited), encoding="utf-8")
    process = run_in_process([*RESUMABLE["single"]()[1:], *RESUME, "--resume", "--batch-size", "8", "--max-steps", "9",
                              "--output-dir", str(tmp_path)])
    assert_clean_error(process, f"--resume: the checkpoint in {tmp_path / 'checkpoint'} is damaged: "
                                "batch_size_per_process 8 in its meaning.json, 16 in its training state; "
                                "global_batch_size 16 in its meaning.json, 32 in its training state")


def test_a_checkpoint_resumes_only_into_the_script_that_wrote_it(tmp_path, crashed_run, monkeypatch):
    """Another script's checkpoint is named and refused before any training by every strategy's resume
    (checkpoints.choose): DeepSpeed would not find one device's and train from step 0 beside it, FSDP2
    would blame --offload, one device would call DeepSpeed's incomplete. In this interpreter, for one
    process of each."""
    import runpy
    import torch
    require("deepspeed")
    shutil.copytree(crashed_run("single").output / "checkpoint", tmp_path / "single" / "checkpoint")
    step8 = tmp_path / "deepspeed" / "checkpoint" / "step8"
    step8.mkdir(parents=True)
    (step8 / checkpoints.MEANING_FILE).write_text(json.dumps({"step": 8, "script": "multi-gpu-deepspeed-cls.py"}))
    (step8.parent / "latest").write_text("step8", encoding="utf-8")

    def alone(strategy_class):
        class OneProcess(strategy_class):  # no process group: the collectives of one process
            broadcast_object, reduce_mean = common.Strategy.broadcast_object, common.Strategy.reduce_mean
        return OneProcess
    deepspeed = alone(runpy.run_path(str(ROOT / "multi-gpu-deepspeed-cls.py"))["DeepSpeed"])
    fsdp = alone(runpy.run_path(str(ROOT / "multi-gpu-fsdp-cls.py"))["FSDP2"])
    resuming = {"multi-gpu-deepspeed-cls.py": (deepspeed("cpu", 0, 1, 1, "fp32", {"zero_optimization": {"stage": 2}}),
                                               "single"),
                "multi-gpu-fsdp-cls.py": (fsdp(torch.device("cpu"), 0, 1, 1, "fp32", True, False), "single"),
                "single-gpu-cls.py": (common.Strategy(torch.device("cpu")), "deepspeed")}
    writers = {"single": "single-gpu-cls.py", "deepspeed": "multi-gpu-deepspeed-cls.py"}
    for script, (strategy, writer) in resuming.items():
        monkeypatch.setattr(sys, "argv", [script])
        folder = tmp_path / writer / "checkpoint" / ("step8" if writer == "deepspeed" else "")
        trainer = SimpleNamespace(args=SimpleNamespace(resume=True), output_dir=tmp_path / writer, strategy=strategy,
                                  log=print)
        with pytest.raises(UserError) as refused:
            checkpoints.resume(trainer)
        assert str(refused.value) == (
            f"--resume: the checkpoint in {folder} was written by {writers[writer]}, not {script}: "
            f"another strategy's checkpoint does not resume here: resume it with {writers[writer]}, or remove it")


def script_parsers(monkeypatch):
    """The parser of every script that resumes (the Hugging Face one refuses --resume: transformers_setup),
    caught where it parses, in this interpreter."""
    parsers = []

    def caught(parser, *args, **kwargs):
        parsers.append(parser)
        sys.exit(0)
    monkeypatch.setattr(argparse.ArgumentParser, "parse_args", caught)
    for script in sorted(ROOT.glob("*-cls.py")):
        if script.name != "multi-gpu-transformers-cls.py":
            assert run_in_process([script.name]).returncode == 0
    monkeypatch.undo()
    return parsers


def another(value):
    """A value of the same kind that differs from `value`."""
    return not value if isinstance(value, bool) else 1 if value is None else value + type(value)("1")


def test_every_option_is_restored_applied_or_refused_as_running_md_says(monkeypatch):
    """checkpoints.REFUSED_ON_RESUME names options of the scripts that resume; meaning() (what a resume
    must keep) changes with each refused option it reads from the command line and with no applied one;
    docs/running.md's table says the same."""
    parsers = script_parsers(monkeypatch)
    options = {action.option_strings[0] for parser in parsers for action in parser._actions
               if action.option_strings and action.dest != "help"}
    refused = set(checkpoints.REFUSED_ON_RESUME)
    assert refused <= options
    # Compared as the run resolves them: the model's name, the processes, the strategy's precision and layout.
    resolved = {"--model", "--nprocs", "--nnodes", "--precision", "--zero-stage", "--offload", "--fabric-strategy"}
    assert resolved <= refused

    def run_with(args):
        return SimpleNamespace(args=args, strategy=common.Strategy("cpu"), global_batch_size=32, model_name="tiny")
    for parser in parsers:
        args = resolve(parser.parse_args([]))  # as a run reads them
        for action in parser._actions:
            if action.option_strings and action.dest != "help" and action.option_strings[0] not in resolved:
                changed = argparse.Namespace(**{**vars(args), action.dest: another(getattr(args, action.dest))})
                differs = checkpoints.meaning(run_with(changed)) != checkpoints.meaning(run_with(args))
                assert differs == (action.option_strings[0] in refused), action.option_strings[0]
    page = (ROOT / "docs" / "running.md").read_text(encoding="utf-8")
    table = {line.split("|")[1].strip(): set(re.findall(r"`(--[a-z0-9-]+)`", line))
             for line in page.splitlines() if line.startswith("| ")}
    assert table["refuses changing"] == refused
    assert table["applies"] and table["applies"] <= options - refused


def test_a_resume_applies_a_new_learning_rate_and_names_it(tmp_path, crashed_run):
    """The single run's step-8 checkpoint resumed for one step at --lr 0.5 --weight-decay 0.1, in this
    interpreter: the step trains at 0.5 (the optimizer's rate, as the curves record it), not the
    checkpoint's 0.001."""
    shutil.copytree(crashed_run("single").output / "checkpoint", tmp_path / "checkpoint")
    process = run_in_process([*RESUMABLE["single"]()[1:], *RESUME, "--resume", "--max-steps", "9", "--lr", "0.5",
                              "--weight-decay", "0.1", "--output-dir", str(tmp_path)])
    assert process.returncode == 0, process.stderr[-2000:]
    assert read_curves(tmp_path)["train/learning_rate"] == {9: 0.5}
    assert (f"--resume: continuing from step 8 ({tmp_path / 'checkpoint'}); --lr 0.5 (the checkpoint's 0.001); "
            "--weight-decay 0.1 (the checkpoint's 0.01)") in process.stdout
    assert read_result(tmp_path)["learning_rate"] == 0.5


def test_a_damaged_checkpoint_is_refused_and_a_killed_save_is_finished_or_cleared(tmp_path, crashed_run):
    """The single run's checkpoint without its training state: refused, never taken for no checkpoint.
    A save killed between its two renames (checkpoint/ moved aside, the new one staged whole) is finished
    by the next run, which resumes from it; a killed save's half-written staging is removed, saying so.
    In this interpreter, to step 8."""
    saved = crashed_run("single").output / "checkpoint"
    shutil.copytree(saved, tmp_path / "checkpoint")
    (tmp_path / "checkpoint" / checkpoints.CHECKPOINT_FILE).unlink()
    command = [*RESUMABLE["single"]()[1:], *RESUME, "--resume", "--max-steps", "8", "--output-dir", str(tmp_path)]
    process = run_in_process(command)
    assert_clean_error(process, f"--resume: {tmp_path / 'checkpoint'} holds an incomplete checkpoint and there is "
                                "no complete one: remove it to start from step 0")
    finished = subprocess.Popen(["true"])
    finished.wait()
    dead = finished.pid  # names a process that no longer runs
    (tmp_path / "checkpoint").rename(tmp_path / f".checkpoint.old-{dead}")
    shutil.copytree(saved, tmp_path / f".checkpoint.tmp-{dead}")
    dead_run_recorded(tmp_path, dead, f".checkpoint.old-{dead}", f".checkpoint.tmp-{dead}")
    process = run_in_process(command)
    assert process.returncode == 0, process.stderr[-2000:]
    assert (f"what saves killed mid-write left: finished the interrupted save of checkpoint; removed "
            f".checkpoint.old-{dead}") in process.stdout
    assert f"--resume: continuing from step 8 ({tmp_path / 'checkpoint'})" in process.stdout
    assert read_result(tmp_path)["resumed_from_step"] == 8
    shutil.rmtree(tmp_path / "checkpoint")
    (tmp_path / f".checkpoint.tmp-{dead}").mkdir()  # killed while writing its first checkpoint
    dead_run_recorded(tmp_path, dead, f".checkpoint.tmp-{dead}")
    process = run_in_process(command)
    assert process.returncode == 0, process.stderr[-2000:]
    assert f"left: removed .checkpoint.tmp-{dead}" in process.stdout
    assert f"--resume: no checkpoint in {tmp_path / 'checkpoint'}, starting from step 0" in process.stdout


def dead_run_recorded(folder, pid, *staging):
    """The .lock a run of `pid` killed mid-save left in `folder`: what it staged there (files.record_staging)."""
    (folder / ".lock").write_text("\n".join([f"the run of pid {pid} on somehost", *staging, ""]), encoding="utf-8")
