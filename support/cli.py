"""The command line: the options every script shares, the output folder one run claims, and how a
script's failures reach the user (the launch environment is launch.py's).

Imports nothing heavy (no torch, no transformers): what only plans runs, as the benchmark runner does,
reads the options at once.

--help lists the options in named groups: the strategy's own first (what a script adds with
`parser.add_argument`), then model, data and output; training; checkpoints; speed; measurement. A new shared
option goes in its group's add_*_args function below, whose `parser` is that group: `parser.add_argument`
there lands in it. Its default is shown once: given as a value, --help appends it; where it depends on the
run (None), the help says it in words, "(default: ...)".
"""
import argparse
import contextlib
import fcntl
import gc
import json
import math
import os
import signal
import stat
import sys
import textwrap
import time
import traceback
from pathlib import Path

from . import launch
from .errors import UserError, describe, first_cause
from .files import RECORD_FILE, clear_dead_staging, existing_parent, holder_line, no_link
from .launch import current_rank

ROOT = Path(__file__).resolve().parents[1]
# Models with random weights learn from scratch (a higher rate); BERT-base's depth needs a lower one than tiny's.
DEFAULT_LR = {"tiny": 1e-3, "base-shape": 1e-4, "pretrained": 3e-5}
PRECISIONS = ["fp32", "bf16", "fp16"]
# torch.compile's modes; reduce-overhead records CUDA graphs.
COMPILE_MODES = ["default", "reduce-overhead", "max-autotune", "max-autotune-no-cudagraphs"]
# Room for [CLS], one token of text and [SEP]: a shorter --max-seq-len truncates nothing, silently.
MIN_SEQ_LEN = 3
# A training sample and a dev sample.
MIN_SAMPLES = 2


def run(main):
    """Run `main()`, turning failures into one clear line on stderr and a non-zero exit; in a script that
    runs in a group (launch.in_a_group), after checking its launch variables."""
    import torch.distributed as dist  # for its rendezvous errors; every script has imported torch already
    # SIGTERM and SIGUSR1 (a scheduler or launcher stopping the job) unwind like Ctrl-C, once: cleanup code
    # runs (--save-on-signal's handler takes over while training). A launched process stops with its launcher.
    for number in launch.STOP_SIGNALS:
        signal.signal(number, launch.stop_once)
    if launch.launched():
        launch.stop_with_the_parent()
    try:
        if launch.in_a_group():
            launch.check_launch_variables()
        main()
    except SystemExit:  # the script's own exit status stands
        raise
    except UserError as error:
        if error.only_this_rank or current_rank() == 0:  # rank 0 speaks for all
            report(f"error: {error}")
        sys.exit(2)
    except KeyboardInterrupt:
        print(f"rank {current_rank()}: interrupted", file=sys.stderr)
        sys.exit(130)
    except (dist.DistNetworkError, dist.DistStoreError) as error:
        # The rendezvous never came together within --dist-timeout: a wrong address, a blocked port, or
        # a process (a node) that never started. Where is in the message; a traceback would add nothing.
        report(f"error: rank {current_rank()} could not reach the process group at {os.environ.get('MASTER_ADDR')}:"
               f"{os.environ.get('MASTER_PORT')} within --dist-timeout: {str(error).splitlines()[0]}")
        sys.exit(1)
    except BaseException as error:  # torch.distributed.checkpoint's errors derive from BaseException, not Exception
        traceback.print_exc()
        report(f"error: rank {current_rank()} failed: {describe(first_cause(error))}")
        sys.exit(1)
    finally:
        release_output_dir()
        # A destroyed gloo group can linger in a reference cycle until the interpreter shuts down, and
        # freeing it then aborts the process about one run in five ("terminate called without an
        # active exception"): free it now.
        gc.collect()


def report(line):
    """The failure's one line on stderr, and for torchrun (and the launchers built on it) in the error
    file it names: its closing summary then repeats the line instead of a link to its docs."""
    print(line, file=sys.stderr)
    if os.environ.get("TORCHELASTIC_ERROR_FILE"):
        with contextlib.suppress(OSError), open(os.environ["TORCHELASTIC_ERROR_FILE"], "w", encoding="utf-8") as file:
            json.dump({"message": line, "timestamp": int(time.time())}, file)


# ----------------------------------------------------------------------------- command line

class HelpFormatter(argparse.RawDescriptionHelpFormatter):
    """Keep the script's docstring as written, and show each default once: "(default: ...)" after the help,
    unless the help says it (an option whose default depends on the run: "default: ..." in its words) or
    there is nothing to say (a flag, off unless given)."""

    def __init__(self, prog):
        super().__init__(prog, max_help_position=32)

    def _split_lines(self, text, width):  # "--batch-size" stays whole at the end of a line
        return textwrap.wrap(" ".join(text.split()), width, break_on_hyphens=False)

    def _get_help_string(self, action):  # the hook argparse's own ArgumentDefaultsHelpFormatter overrides
        text = action.help or ""
        nothing_to_show = action.default is None or action.default is False or action.default == argparse.SUPPRESS
        if nothing_to_show or "default" in text:
            return text
        return f"{text} (default: %(default)s)".lstrip()


class Parser(argparse.ArgumentParser):
    """A script's command line in named groups. What the script adds with `parser.add_argument` is its
    strategy's own (what it takes beyond single-gpu-cls.py) and is listed first; the shared options follow,
    each in its group: model, data and output; training; checkpoints; speed; measurement."""

    def __init__(self, **kwargs):
        super().__init__(add_help=False, formatter_class=HelpFormatter, **kwargs)
        self.strategy = self.add_argument_group("this strategy's options (beyond single-gpu-cls.py's)")

    def add_argument(self, *args, **kwargs):
        return self.strategy.add_argument(*args, **kwargs)


def build_parser(script_file, description):
    """The options every script accepts. A script adds its own with `parser.add_argument` (its strategy's
    group, listed first); a new shared option goes in the add_*_args function of its group below, where
    `parser.add_argument` adds to that group."""
    summary, about = split_docstring(description)
    parser = Parser(usage="%(prog)s [options]", description=summary, epilog=about)
    add_data_args(parser.add_argument_group("model, data and output"), Path(script_file).stem)
    add_training_args(parser.add_argument_group("training"))
    add_checkpoint_args(parser.add_argument_group("checkpoints"))
    add_speed_args(parser.add_argument_group("speed"))
    add_measurement_args(parser.add_argument_group("measurement"))
    parser.add_argument_group("help").add_argument("-h", "--help", action="help", help="show this help and exit")
    return parser


def split_docstring(docstring):
    """The script's summary above the options, so that a first run's options fit the first screen; its launch
    lines and the rest of its docstring below them, the last lines --help leaves on the terminal."""
    summary, _, rest = (docstring or "").strip("\n").partition("\n")
    return summary, f"how to launch it, and what it shows:\n{rest}" if rest.strip() else None


def add_data_args(parser, stem):
    """What the run reads (first the model, then the data) and where it writes."""
    parser.add_argument("--model", default="auto",
                        help="auto (local weights, else the hub, else tiny), tiny (fast), base-shape (BERT-base, "
                             "random weights), a folder or a hub id")
    parser.add_argument("--data", metavar="FILE", help="JSON list of [text, label] (default: data/train.json)",
                        default=str(ROOT / "data" / "train.json"))
    parser.add_argument("--output-dir", metavar="DIR", default=str(ROOT / "output" / stem),
                        help=f"for model/, result.json, checkpoints (default: output/{stem})")
    parser.add_argument("--max-samples", type=int, default=10000, metavar="N", help="use the first N records")
    parser.add_argument("--dev-ratio", type=float, default=0.08, metavar="R", help="share held out for dev")
    parser.add_argument("--max-seq-len", type=int, default=128, metavar="N", help="longer texts are truncated")


def add_training_args(parser):
    """Where and how long the model trains, and the step's arithmetic."""
    parser.add_argument("--device", choices=["auto", "cpu", "cuda"], default="auto", help="auto: GPUs if any")
    parser.add_argument("--epochs", type=int, default=1, metavar="N", help="passes over the training set")
    parser.add_argument("--max-steps", type=int, default=0, metavar="N",
                        help="stop after N optimizer steps, then evaluate (default: 0, all of --epochs)")
    parser.add_argument("--batch-size", type=int, default=32, metavar="N", help="per process and micro-batch")
    parser.add_argument("--grad-accum", type=int, default=1, metavar="N",
                        help="micro-batches per optimizer step (gradient accumulation): the global batch is "
                             "--batch-size x processes x N")
    parser.add_argument("--lr", type=float, default=None,
                        help=f"learning rate (default: {DEFAULT_LR['tiny']} for tiny, {DEFAULT_LR['base-shape']} "
                             f"for base-shape, {DEFAULT_LR['pretrained']} otherwise)")
    parser.add_argument("--weight-decay", type=float, default=0.01, metavar="W", help="AdamW's weight decay")
    parser.add_argument("--dropout", type=float, default=None, metavar="P",
                        help="override the model's dropout probabilities")
    parser.add_argument("--seed", type=int, default=123, help="for the random weights, shuffling and dropout")
    parser.add_argument("--no-shuffle", action="store_true", help="keep the training order fixed")


def add_checkpoint_args(parser):
    """Saving the training state in --output-dir, and continuing from it."""
    parser.add_argument("--save-model", action=argparse.BooleanOptionalAction, default=True,
                        help="save the trained model to <output-dir>/model (--no-save-model: only result.json, as "
                             "a benchmark needs; 390 MB at base-shape)")
    parser.add_argument("--save-steps", type=int, default=0, metavar="N",
                        help="save a training checkpoint (for --resume) every N steps (default: 0, never)")
    parser.add_argument("--resume", action="store_true",
                        help="continue from the training checkpoint in --output-dir, if there is one")
    parser.add_argument("--save-on-signal", action="store_true",
                        help="on SIGTERM or SIGUSR1 (a scheduler's notice before preemption or the time limit), "
                             "every process finishes its step, a checkpoint is saved, and the run stops")


def add_speed_args(parser):
    """What makes a step faster or smaller without changing what it computes: compiling, padding, TF32,
    batching by length, recomputing activations, threads and loader workers."""
    parser.add_argument("--compile", action="store_true",
                        help="compile the model with torch.compile: its first steps pay the compilation "
                             "(first_step_seconds in result.json), later ones run fused kernels")
    parser.add_argument("--compile-mode", choices=COMPILE_MODES,
                        help="torch.compile's mode (implies --compile): reduce-overhead replays each step's kernels "
                             "as CUDA graphs (GPUs; single, DDP and AMP)")
    parser.add_argument("--compile-dynamic", choices=["auto", "static", "dynamic"], default="auto",
                        help="static: a graph per step shape (dynamic=False); dynamic: one graph for every length "
                             "(dynamic=True); auto: static when --pad-to-multiple-of makes the shapes repeat")
    parser.add_argument("--pad-to-multiple-of", type=int, metavar="N",
                        help="pad each batch to its longest text rounded up to a multiple of N tokens, and fill a "
                             "short batch with repeats of weight 0: a handful of step shapes (default: 16 on a "
                             "GPU, 1 on a CPU: each batch to its longest text)")
    parser.add_argument("--tf32", action="store_true",
                        help="fp32 matrix products on TF32 tensor cores (NVIDIA GPUs from Ampere on): 10 "
                             "mantissa bits in the products, fp32 everywhere else; without it IEEE fp32")
    parser.add_argument("--group-by-length", action=argparse.BooleanOptionalAction, default=True,
                        help="batch texts of similar length together: 2x faster here, same accuracy "
                             "(microbenchmarks/pipeline.py)")
    parser.add_argument("--gradient-checkpointing", action="store_true",
                        help="keep only each layer's input in forward and recompute the rest in backward: less "
                             "activation memory for about one more forward pass of compute")
    parser.add_argument("--threads", type=int, metavar="N",
                        help="torch threads per process (default: the cores this process may use, shared "
                             "equally by the processes on this machine, whatever the launcher set)")
    parser.add_argument("--num-workers", type=int, default=0, metavar="N", help="DataLoader worker processes")


def add_measurement_args(parser):
    """What the run reports while it trains: the loss, dev accuracy, a profile."""
    parser.add_argument("--log-steps", type=int, default=50, metavar="N", help="print the training loss every N steps")
    parser.add_argument("--eval-steps", type=int, default=0, metavar="N",
                        help="evaluate every N steps (default: 0, only at the end)")
    parser.add_argument("--profile", type=int, default=0, metavar="STEPS",
                        help="record STEPS training steps with torch.profiler after 2 warm-up steps: "
                             "<output-dir>/trace.json and milliseconds per phase in result.json (slower)")


def add_distributed_args(parser, backend=False, local_rank=False):
    """Options of the scripts that run several processes; `backend` for the DDP scripts, whose gloo
    all-reduce works on GPU tensors too; `local_rank` for those the legacy torch.distributed.launch
    or the deepspeed launcher start, which pass --local-rank (older releases --local_rank). Both also
    set LOCAL_RANK, which is what the scripts read: the flag only tells which launcher ran."""
    parser.add_argument("--dist-timeout", type=float, default=300,
                        metavar="SECONDS", help="how long a collective waits")
    if local_rank:
        parser.add_argument("--local-rank", "--local_rank", type=int, help=argparse.SUPPRESS)
    if backend:
        parser.add_argument("--backend", choices=["auto", "nccl", "gloo"], default="auto",
                            help="auto: nccl on GPUs, gloo on CPUs; gloo lets processes share a GPU")


def add_precision_arg(parser, default="fp32", default_help=None):
    """The one precision option of every script that can train in mixed precision."""
    parser.add_argument("--precision", choices=PRECISIONS, default=default,
                        help="fp32, or mixed precision: bf16, or fp16 (GPUs only)"
                             + (f" (default: {default_help})" if default_help else ""))


def check_args(args):
    """Every value checked before any work (a traceback deep in torch otherwise, or a silent nonsense
    run), then --output-dir claimed for this run."""
    if args.max_samples < MIN_SAMPLES:
        raise UserError(f"--max-samples must be at least {MIN_SAMPLES}, got {args.max_samples}")
    for name in ("save_steps", "profile", "max_steps"):
        if getattr(args, name) < 0:
            raise UserError(f"--{name.replace('_', '-')} must be 0 or more, got {getattr(args, name)}")
    if not 0 < args.dev_ratio < 1:
        raise UserError(f"--dev-ratio must be between 0 and 1, got {args.dev_ratio}")
    if args.lr is not None and not 0 < args.lr < math.inf:
        raise UserError(f"--lr must be a positive number, got {args.lr:g}")
    if not 0 <= args.weight_decay < math.inf:
        raise UserError(f"--weight-decay must be a number, 0 or more, got {args.weight_decay:g}")
    if args.dropout is not None and not 0 <= args.dropout < 1:
        raise UserError(f"--dropout must be at least 0 and below 1, got {args.dropout:g}")
    if not 0 < getattr(args, "dist_timeout", 1) < math.inf:
        raise UserError(f"--dist-timeout must be a positive number of seconds, got {args.dist_timeout:g}")
    if not 0 <= args.seed < 2**32:
        raise UserError(f"--seed must be between 0 and 2**32 - 1 (numpy's range), got {args.seed}")
    for name in ("num_workers", "eval_steps"):
        if getattr(args, name) < 0:
            raise UserError(f"--{name.replace('_', '-')} must be 0 or more, got {getattr(args, name)}")
    check_max_seq_len(args.max_seq_len)
    check_output_dir(args.output_dir)
    if args.threads is not None and args.threads < 1:
        raise UserError(f"--threads must be at least 1, got {args.threads}")
    if args.pad_to_multiple_of is not None and args.pad_to_multiple_of < 1:
        raise UserError(f"--pad-to-multiple-of must be at least 1, got {args.pad_to_multiple_of}")
    args.compile = args.compile or args.compile_mode is not None
    for name in ("epochs", "batch_size", "grad_accum", "log_steps"):
        if getattr(args, name) < 1:
            raise UserError(f"--{name.replace('_', '-')} must be at least 1, got {getattr(args, name)}")
    writes = getattr(args, "estimate_memory", None) is None  # DeepSpeed's estimate only prints a table
    if writes and current_rank() == 0 and getattr(args, "node_rank", 0) == 0:  # the process that writes the results
        claim_output_dir(Path(args.output_dir))
    return args


def check_max_seq_len(max_seq_len, max_positions=None):
    """--max-seq-len: room for one token of text and, once the model is known, within its positions (a
    longer batch fails deep in its embeddings)."""
    if max_seq_len < MIN_SEQ_LEN:
        raise UserError(f"--max-seq-len must be at least {MIN_SEQ_LEN} ([CLS], a token, [SEP]), got {max_seq_len}")
    if max_positions is not None and max_seq_len > max_positions:
        raise UserError(f"--max-seq-len {max_seq_len} exceeds the model's {max_positions} positions")


def split_sizes(max_samples, dev_ratio, records):
    """(train, dev) samples of the first --max-samples of `records` with --dev-ratio held out for dev,
    or one line saying why there are none: the scripts' rule, which the runner checks before any launch."""
    if max_samples > records:
        raise UserError(f"--max-samples {max_samples} asks for more records than the data has ({records})")
    dev = round(max_samples * dev_ratio)
    if not 0 < dev < max_samples:
        raise UserError(f"--max-samples {max_samples} with --dev-ratio {dev_ratio:g} leaves an empty "
                        f"{'dev' if dev == 0 else 'train'} set")
    return max_samples - dev, dev


# ----------------------------------------------------------------------------- the run's folder

# What a run may touch (docs/running.md): only inside --output-dir, following no link there: the folder
# may be a link the user made, but a link in it (a model/ or .lock pointing elsewhere, or to itself) is
# refused, not written through. There, only the entries below, each of its kind (another is refused before
# any work, not moved aside or failed on after the training), and the staging its saves record
# (files.record_staging). The run writing the folder holds an OS lock on this file in it: a second run
# into the folder is refused, and a run that crashed leaves no stale lock (the OS drops it with the process).
LOCK_FILE = RECORD_FILE
RUN_ENTRIES = {"model": "folder", "checkpoint": "folder", "tensorboard": "folder", "result.json": "file",
               "trace.json": "file", LOCK_FILE: "file"}
# What a run replaces whole at each save, with everything in it: no other run's folder may lie there.
REPLACED = [name for name, kind in RUN_ENTRIES.items() if kind == "folder"]
output_lock = None  # (the open lock file, whether this run created the folder) while this process holds it


def check_output_dir(name):
    """In every process, before any work: --output-dir names a folder a run can make or use, else one
    line now rather than a traceback at the first write, after the training."""
    if not name:  # Path("") is the current folder, whose model/ and result.json would be replaced unasked
        raise UserError("--output-dir is empty: name a folder ('.' for the current one)")
    check_name_lengths(name)
    try:
        is_folder = stat.S_ISDIR(os.stat(name).st_mode)
    except FileNotFoundError:  # the run makes it, unless on the way is a link to what does not exist
        for link in (path for path in (Path(name), *Path(name).parents) if os.path.islink(path)):
            if not os.path.exists(link):
                raise UserError(f"--output-dir {name}: {link} is a link to {os.readlink(link)}, which does not "
                                "exist") from None
        return
    except OSError as error:  # a loop of links, a file on the way, no permission
        raise UserError(f"--output-dir {name} cannot be used: {error.strerror}") from None
    if not is_folder:
        raise UserError(f"--output-dir {name} is a file, not a folder")


def check_name_lengths(name):
    """Each name in the folder's path fits its filesystem, and the whole path leaves room below it for the
    run's files (a name of the longest kind): else mkdir, or the first save after the training, fails."""
    folder = existing_parent(name)
    longest = max(Path(name).parts, key=lambda part: len(os.fsencode(part)))
    name_max, path_max = os.pathconf(folder, "PC_NAME_MAX"), os.pathconf(folder, "PC_PATH_MAX")
    if len(os.fsencode(longest)) > name_max:
        raise UserError(f"--output-dir {name}: the name {longest[:16]}... is {len(os.fsencode(longest))} bytes, "
                        f"its filesystem holds at most {name_max}")
    length = len(os.fsencode(os.path.abspath(name)))
    if length + name_max >= path_max:
        raise UserError(f"--output-dir {name[:40]}... is {length} bytes long, too long for the run's files below "
                        f"it: paths on its filesystem hold at most {path_max - 1} bytes")


def claim_output_dir(path):
    """Make --output-dir this run's, before any work: writable, free of links, used by no other run; then
    clear what saves of runs killed mid-write left staged in it."""
    global output_lock
    if output_lock is not None and Path(output_lock[0].name).parent == path:
        return
    created = not path.exists()
    try:
        refuse_a_running_runs_folder(path)
        path.mkdir(parents=True, exist_ok=True)
        check_entries(path)
        lock, record = lock_output_dir(path)
    except OSError as error:  # read-only, not ours, or full: found now, not after the training
        raise UserError(f"--output-dir {path} is not writable: {error.strerror}") from None
    output_lock = lock, created
    cleared = clear_dead_staging(path, record)
    if cleared:
        print(f"note: in {path}, what saves killed mid-write left: {'; '.join(cleared)}", flush=True)


def check_entries(path):
    """The run's entries in `path` are absent or of their kind (RUN_ENTRIES), and no link is there."""
    links = sorted(entry.name for entry in os.scandir(path) if entry.is_symlink())
    if links:
        raise UserError(f"--output-dir {path} holds links ({', '.join(links)}): a run writes only inside its "
                        "folder and follows no link there: remove them, or choose another --output-dir")
    for name, kind in RUN_ENTRIES.items():
        with contextlib.suppress(FileNotFoundError):
            if ("folder" if stat.S_ISDIR(os.lstat(path / name).st_mode) else "file") != kind:
                raise UserError(f"--output-dir {path} holds a {'folder' if kind == 'file' else 'file'} named "
                                f"{name}, where a run writes its {name} {kind}: move it away, or choose another "
                                "--output-dir")


def refuse_a_running_runs_folder(path):
    """`path` is not in what a running run replaces at its next save (its model/, checkpoint/,
    tensorboard/), nor does such a folder of `path` hold a running run."""
    path = Path(os.path.realpath(path))
    for outer in path.parents:
        inner = outer / path.relative_to(outer).parts[0]
        if inner.name in REPLACED and is_held(outer / LOCK_FILE):
            raise UserError(f"--output-dir {path} lies in {inner}, which the run holding {outer} replaces at its "
                            "next save: choose a folder outside it")
    for name in REPLACED:
        held = next((lock.parent for lock in (path / name).rglob(LOCK_FILE) if is_held(lock)), None)
        if held:
            raise UserError(f"--output-dir {path}: the run holding {held} lies in its {name}/, which this run "
                            "would replace: choose another --output-dir, or wait for that run to end")


def is_held(lock_path):
    """Whether a running process holds the lock `lock_path` (a shared lock cannot be had beside it)."""
    try:
        with open(lock_path, encoding="utf-8", opener=no_link) as lock:
            fcntl.flock(lock, fcntl.LOCK_SH | fcntl.LOCK_NB)
    except BlockingIOError:
        return True
    except OSError:  # none there, a link, or no locks on its filesystem
        return False
    return False


def lock_output_dir(path):
    """The lock file of `path`, open and locked by this process, and the record of the run that held it
    before (files.clear_dead_staging); or one line naming the run holding it."""
    lock_path = path / LOCK_FILE
    while True:  # O_NOFOLLOW: a .lock that became a link since check_entries is refused, not written through
        lock = open(lock_path, "a+", encoding="utf-8", opener=no_link)
        try:
            fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            lock.seek(0)
            holder = lock.readline().strip() or "another run"
            lock.close()
            raise UserError(f"--output-dir {path} is in use by {holder}: wait for that run to end, or "
                            "choose another --output-dir") from None
        except OSError as error:
            lock.close()
            raise UserError(f"--output-dir {path} cannot be locked ({error.strerror}): choose a folder on a "
                            "filesystem with file locks") from None
        # The holder before us may have removed the file between our open and our lock: lock anew.
        if lock_path.exists() and os.path.samestat(os.fstat(lock.fileno()), lock_path.stat()):
            break
        lock.close()
    lock.seek(0)
    record = lock.read()
    lock.truncate(0)
    lock.write(holder_line(os.getpid()) + "\n")
    lock.flush()
    return lock, record


def release_output_dir():
    """At the end of the run that claimed --output-dir: the lock file goes, and the folder too if the
    run created it and wrote nothing."""
    global output_lock
    if output_lock is None:
        return
    lock, created = output_lock
    output_lock = None
    folder = Path(lock.name).parent
    Path(lock.name).unlink(missing_ok=True)
    lock.close()
    if created and not any(folder.iterdir()):
        folder.rmdir()


