"""Saving: the portable model folder every script writes at the end, and the training checkpoints of
--save-steps that --resume continues from, with what their step means and every process's random
states, so that a resumed run takes the steps the uninterrupted one would have taken."""
import contextlib
import json
import random
import shutil
import signal
import sys
from pathlib import Path

import numpy as np
import torch

from . import launch
from .callbacks import Callback
from .errors import StoppedAfterSaving, UserError, describe, first_cause
from .files import existing_parent, removed_on_failure, replace_dir, staged_dir, staged_name, write_json

# A training checkpoint: the state, and what its step means, readable by a person.
CHECKPOINT_FILE, MEANING_FILE = "training_state.pt", "meaning.json"


def save_model(model, tokenizer, path, state_dict=None):
    """Write a portable model folder (safetensors, config, tokenizer) atomically: build it next to
    `path`, then swap it in, so an interrupted run never leaves a half-written checkpoint. A sharded
    model passes its gathered `state_dict`."""
    with staged_dir(path) as staging:
        model.save_pretrained(staging, state_dict=state_dict)
        tokenizer.save_pretrained(staging)


# ----------------------------------------------------------------------------- the Trainer's checkpoints

# What a step means, by meaning.json's key: its value in the run, and the options it comes from. A checkpoint
# resumes only where all of it is equal, so a resume refuses changing these options (REFUSED_ON_RESUME):
# a step would mean other samples or tokens (the processes, however launched), other numbers (the precision:
# an fp16 run's checkpoint holds a gradient scaler, DeepSpeed's 16-bit weights), or other files (the strategy's
# checkpoint_layout(): DeepSpeed's ZeRO stage and offload, Fabric's strategy; FSDP's --offload, untested).
STEP_MEANING = {
    "world_size": (lambda run: run.strategy.world_size, ["--nprocs", "--nnodes"]),
    "batch_size_per_process": (lambda run: run.args.batch_size, ["--batch-size"]),
    "global_batch_size": (lambda run: run.global_batch_size, []),
    "gradient_accumulation_steps": (lambda run: run.args.grad_accum, ["--grad-accum"]),
    "data": (lambda run: str(Path(run.args.data).resolve()), ["--data"]),
    "max_samples": (lambda run: run.args.max_samples, ["--max-samples"]),
    "dev_ratio": (lambda run: run.args.dev_ratio, ["--dev-ratio"]),
    "seed": (lambda run: run.args.seed, ["--seed"]),
    "shuffle": (lambda run: not run.args.no_shuffle, ["--no-shuffle"]),
    "group_by_length": (lambda run: run.args.group_by_length, ["--group-by-length"]),
    "max_seq_len": (lambda run: run.args.max_seq_len, ["--max-seq-len"]),
    "model": (lambda run: run.model_name, ["--model"]),
    "precision": (lambda run: run.strategy.precision, ["--precision"]),
}
LAYOUT_OPTIONS = ["--zero-stage", "--offload", "--fabric-strategy"]  # those of strategy.checkpoint_layout()'s keys
# A resume refuses changing the options a step's meaning comes from, and applies every other from the resumed
# step on (docs/running.md's table; test_resume.py checks both against the scripts). The learning rate is
# constant (no schedule to restore), so a new --lr is the user's choice for the steps to come, as after a loss
# spike; --lr and --weight-decay go into the restored optimizer, and a change is named. --deepspeed-config: what
# it sets of the refused ones is compared as those. What a resume restores is no option: the weights, the
# optimizer's moments, the step, every process's random states, a gradient scaler's scale.
REFUSED_ON_RESUME = [option for _, options in STEP_MEANING.values() for option in options] + LAYOUT_OPTIONS
# The optimizer's settings that come from applied options, by parameter group: a resume puts them back
# into the optimizer it restored.
OPTIMIZER_OPTIONS = {"lr": "--lr", "weight_decay": "--weight-decay"}


def meaning(trainer):
    """What a step of this run means (STEP_MEANING), and the script that wrote it (its files are its strategy's)."""
    return {"script": script_name(), **{key: value(trainer) for key, (value, _) in STEP_MEANING.items()},
            **trainer.strategy.checkpoint_layout()}


def script_name():
    """The file name of the script this process runs, as result.json's command names it."""
    return Path(sys.argv[0]).name


def check_free_space(trainer):
    """Before any training: room on --output-dir's disk for the model and, with --save-steps, one
    checkpoint (the weights and AdamW's two moments), in fp32. A full disk is otherwise found at the
    first save, after the training before it."""
    parameters = sum(getattr(p, "ds_numel", p.numel())  # ZeRO-3 keeps only a shard's numel
                     for p in trainer.strategy.unwrap(trainer.model).parameters())
    needed = parameters * 4 * ((3 if trainer.args.save_steps else 0) + trainer.args.save_model)
    disk = existing_parent(trainer.output_dir)
    free = shutil.disk_usage(disk).free
    if needed > free:
        raise UserError(f"no space left on {disk}: the model{' and a checkpoint' if trainer.args.save_steps else ''} "
                        f"need about {needed / 2**20:.1f} MiB, {free / 2**20:.1f} MiB is free: free some space or "
                        "choose another --output-dir")


def save(trainer, step):
    """Write the training checkpoint of `step` into <output-dir>/checkpoint, the strategy's way."""
    strategy = trainer.strategy
    trainer.notify("on_save", step)  # what the curves hold so far goes to disk with it
    state = {"step": step, "meaning": meaning(trainer),
             "random_states": strategy.gather_objects(random_states(strategy.gpus_in_use())),
             "strategy_state": strategy.extra_state()}
    strategy.save_state(trainer.model, trainer.optimizer, trainer.output_dir / "checkpoint", state)


def resume(trainer):
    """With --resume, restore the checkpoint in --output-dir (choose()) and return its step, else 0;
    the applied settings are this command line's. Rank 0 chooses; every process must be able to read
    what it chose. What a resume checks, and refuses in one line before any training: the script that
    wrote the checkpoint is this one (choose), its meaning.json is this run's meaning() in every
    refused setting, the training state it loads records the same (check_agrees), and every process
    reads the folder rank 0 chose."""
    checkpoint, strategy = trainer.output_dir / "checkpoint", trainer.strategy
    if not trainer.args.resume:
        return 0
    with readable(checkpoint):
        mine = choose(strategy, checkpoint)
    folder, saved, note, refusal = strategy.broadcast_object(mine)
    if refusal:
        raise UserError(refusal)
    if folder is None:
        trainer.log(f"--resume: no checkpoint in {checkpoint}{note or ''}, starting from step 0")
        return 0
    if strategy.reduce_mean(torch.tensor(float(mine[0] == folder), device=strategy.device)).item() < 1:
        raise UserError(f"--resume: rank 0 found a checkpoint in {folder} that another process cannot "
                        "read: --output-dir must be on a filesystem every machine shares")
    differences = [f"{key} {saved.get(key)!r} (now {value!r})" for key, value in meaning(trainer).items()
                   if saved.get(key) != value]
    if differences:
        raise UserError(f"--resume: the checkpoint in {folder} was written with " + ", ".join(differences)
                        + ": here its step would mean other samples, numbers or files. Resume with its settings, "
                        "or remove it")
    chosen = [{key: group[key] for key in OPTIMIZER_OPTIONS} for group in trainer.optimizer.param_groups]
    with readable(folder):
        state = strategy.load_state(trainer.model, trainer.optimizer, folder)
    check_agrees(folder, saved, state)
    set_random_states(state["random_states"][strategy.rank])
    strategy.load_extra_state(state["strategy_state"])
    changes = apply_optimizer_settings(trainer.optimizer, chosen)
    trainer.log(f"--resume: continuing from step {state['step']} ({folder})"
                + "".join(f"; {part}" for part in [note, *changes] if part))
    return state["step"]


def choose(strategy, checkpoint):
    """(folder, its meaning, note, refusal): refused where another script wrote it (foreign_checkpoint);
    else the checkpoint the last save made, else the newest complete one, the note saying why. Without a
    complete one: refused where the last save's folder is there, damaged (a folder with a checkpoint's
    files is never taken for an empty one); else none (folder None), the note naming what an interrupted
    save left, which holds nothing to resume from."""
    foreign = foreign_checkpoint(checkpoint)
    if foreign:
        return None, None, None, foreign
    expected, *others = strategy.checkpoint_folders(checkpoint)
    saved = strategy.checkpoint_meaning(expected)
    if saved is not None:
        return expected, saved, None, None
    complete = [(found["step"], folder, found) for folder in others
                if (found := strategy.checkpoint_meaning(folder)) is not None]
    if complete:
        _, folder, saved = max(complete, key=lambda candidate: candidate[0])
        return folder, saved, f"{expected} is missing or incomplete: this is the newest complete checkpoint", None
    if expected.is_dir() and any(expected.iterdir()):
        return None, None, None, (f"--resume: {expected} holds an incomplete checkpoint and there is no complete "
                                  "one: remove it to start from step 0")
    left = [str(folder) for folder in others if folder.is_dir() and any(folder.iterdir())]
    return None, None, f" (only what an interrupted save left: {', '.join(left)})" if left else None, None


def foreign_checkpoint(checkpoint):
    """One line refusing the checkpoint in `checkpoint` when a script other than this one wrote it, as a
    meaning.json there or in a step folder below says (any strategy's layout); else None. Another
    strategy's files are not this one's: it would not find them (and start from step 0 beside them) or
    would misread them, blaming a setting."""
    mine = script_name()
    for found in sorted([checkpoint / MEANING_FILE, *checkpoint.glob(f"*/{MEANING_FILE}")]):
        try:
            writer = json.loads(found.read_text(encoding="utf-8"))
        except (OSError, ValueError):  # no meaning.json, or a damaged one: the strategy's choice says so
            continue
        writer = writer.get("script") if isinstance(writer, dict) else None
        if writer != mine:
            by = f"by {writer}" if writer else "by another script (its meaning.json names none)"
            return (f"--resume: the checkpoint in {found.parent} was written {by}, not {mine}: another strategy's "
                    f"checkpoint does not resume here: resume it with {writer or 'the script that wrote it'}, "
                    "or remove it")
    return None


def check_agrees(folder, saved, state):
    """meaning.json is what a person reads, and can edit; the training state holds what the run recorded.
    A checkpoint whose two disagree is damaged: refused, whichever of them was changed."""
    recorded = {"step": state.get("step"), **(state.get("meaning") or {})}
    differences = [f"{key} {saved.get(key)!r} in its {MEANING_FILE}, {recorded.get(key)!r} in its training state"
                   for key in sorted(set(saved) | set(recorded)) if saved.get(key) != recorded.get(key)]
    if differences:
        raise UserError(f"--resume: the checkpoint in {folder} is damaged: " + "; ".join(differences)
                        + ": a resume trusts only what it checks: remove it to start from step 0")


def apply_optimizer_settings(optimizer, chosen):
    """Put this command line's settings (`chosen`: OPTIMIZER_OPTIONS' values per parameter group, read
    before the restore) back into the restored optimizer; returns each change, as "--lr 0.5 (the
    checkpoint's 0.001)"."""
    changes = []
    for group, settings in zip(optimizer.param_groups, chosen):
        for key, value in settings.items():
            change = f"{OPTIMIZER_OPTIONS[key]} {value:g} (the checkpoint's {group[key]:g})"
            if group[key] != value and change not in changes:
                changes.append(change)
            group[key] = value
    return changes


@contextlib.contextmanager
def readable(checkpoint):
    """A checkpoint that cannot be read (truncated, corrupt) is named in one line, not in the traceback
    of whichever library reads its kind of files."""
    try:
        yield
    except (UserError, KeyboardInterrupt, SystemExit):
        raise
    except BaseException as error:  # torch.distributed.checkpoint's errors derive from BaseException
        raise UserError(f"--resume: the checkpoint in {checkpoint} cannot be read ({describe(first_cause(error))}): "
                        "remove it to start from step 0", only_this_rank=True) from None


class SaveOnSignal(Callback):
    """--save-on-signal: a scheduler's SIGTERM (preemption) or SIGUSR1 (a warning before the time limit),
    or a launcher's, ends the run at the end of a step, with a checkpoint of that step. The processes may
    get the signal at different steps: after each step they agree whether any did (one small all-reduce,
    made only with this option), so that all save the same step. After the last step the run finishes
    (evaluation, model, result.json) instead: the handler stays to the end. A callback of the Trainer's loop."""

    def __init__(self):
        self.received = None

    def on_train_begin(self, trainer, first_step):
        for number in launch.STOP_SIGNALS:
            signal.signal(number, self.receive)

    def receive(self, number, frame):
        self.received = signal.Signals(number).name

    def on_step_end(self, trainer, step, loss):
        strategy = trainer.strategy
        told = strategy.reduce_mean(torch.tensor(float(self.received is not None), device=strategy.device))
        if told.item() > 0:
            save(trainer, step)
            raise StoppedAfterSaving(f"stopped by {self.received or 'a signal to another process'} after step {step}: "
                            f"checkpoint saved in {trainer.output_dir / 'checkpoint'}; --resume continues from it")

    def on_result(self, trainer, result):
        if self.received:
            trainer.log(f"{self.received} came after the last step: the run finishes before it stops")


# ----------------------------------------------------------------------------- checkpoint files

def save_whole(path, state):
    """One process's checkpoint of the whole training state, in a staged folder swapped in whole: a
    half-written checkpoint is never taken for one."""
    with staged_dir(path) as staging:
        write_training_state(staging, state)


@contextlib.contextmanager
def staged_checkpoint(path, state, is_main, barrier):
    """Yield the staging folder of a training checkpoint that every process writes part of (its
    shards), by a collective save that returns once all of them are written. Rank 0 empties it
    first; after the block it adds `state` and swaps the folder in whole, so an interrupted save
    leaves the previous checkpoint whole, and a failed one removes its staging (rank 0).
    `barrier()` waits for every process."""
    staging = staged_name(path, "staging")  # the same name in every process
    if is_main:
        shutil.rmtree(staging, ignore_errors=True)
    barrier()
    with removed_on_failure(staging, remove=is_main):
        yield staging
        if is_main:
            write_training_state(staging, state)
            replace_dir(staging, path)
    barrier()


def write_training_state(folder, state):
    """The checkpoint's state, and beside it what its step means, readable by a person."""
    torch.save(state, folder / CHECKPOINT_FILE)
    write_json(folder / MEANING_FILE, {"step": state["step"], **state["meaning"]})


def read_meaning(path):
    """The step and settings of the complete checkpoint in `path` (meaning.json is written last), or None
    when there is none."""
    return meaning_in(path) if (Path(path) / CHECKPOINT_FILE).is_file() else None


def meaning_in(folder):
    """The meaning.json in `folder` (any strategy's checkpoint folder), or None when it has none."""
    meaning = Path(folder) / MEANING_FILE
    return json.loads(meaning.read_text(encoding="utf-8")) if meaning.is_file() else None


def read_training_state(path):
    """The state of the checkpoint in `path`, loaded to the CPU. weights_only: a checkpoint someone
    hands you holds tensors and plain values, and loading it runs no code."""
    return torch.load(Path(path) / CHECKPOINT_FILE, map_location="cpu", weights_only=True)


def random_states(gpus=()):
    """This process's random-number states, those of the `gpus` it draws from included, as tensors and
    plain values (loadable with weights_only)."""
    version, internal, gauss = random.getstate()
    kind, keys, position, has_gauss, cached = np.random.get_state()
    return {"python": [version, list(internal), gauss],
            "numpy": [kind, torch.from_numpy(keys.astype(np.int64)), position, has_gauss, cached],
            "torch": torch.get_rng_state(),
            "cuda": {gpu: torch.cuda.get_rng_state(gpu) for gpu in gpus}}


def set_random_states(states):
    version, internal, gauss = states["python"]
    random.setstate((version, tuple(internal), gauss))
    kind, keys, position, has_gauss, cached = states["numpy"]
    np.random.set_state((kind, keys.numpy().astype(np.uint32), position, has_gauss, cached))
    torch.set_rng_state(states["torch"].cpu())
    for gpu, state in states["cuda"].items():
        torch.cuda.set_rng_state(state.cpu(), gpu)
