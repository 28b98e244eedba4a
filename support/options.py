"""The options every script shares: the parser in named groups; resolve, the one step that decides every
default depending on the machine or on another option; and the checks. Imports nothing heavy (torch only
inside resolve): what only plans runs, as the benchmark runner does, reads the options at once.
"""
import argparse
import math
import textwrap
from pathlib import Path

from . import folder, spawn_setup
from .errors import UserError
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
    # Repeating shapes on a GPU, where each new one costs a plan or a graph; on a CPU padding is only work.
    parser.add_argument("--pad-to-multiple-of", type=int, metavar="N", default=ByDevice(gpu=16, cpu=1),
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


class ByDevice:
    """A default that depends on where the run trains: `gpu` where torch sees GPUs (and --device allows them),
    else `cpu`. options.resolve picks one; the option's help says both in words."""

    def __init__(self, gpu, cpu):
        self.gpu, self.cpu = gpu, cpu


class Options(argparse.Namespace):
    """The options once resolved: read everywhere, written nowhere, so what a run did is what resolve decided."""

    def __init__(self, **values):
        self.__dict__.update(values)

    def __setattr__(self, name, value=None):
        raise AttributeError(f"--{name.replace('_', '-')} is resolved once, by options.resolve: it cannot change after")

    __delattr__ = __setattr__


def parse(parser):
    """The run's options in three steps: resolved (once; read-only after), checked, and --output-dir claimed
    by the process that writes the results."""
    args = resolve(parser.parse_args())
    check(args)
    writes = getattr(args, "estimate_memory", None) is None  # DeepSpeed's estimate only prints a table
    if writes and current_rank() == 0 and getattr(args, "node_rank", 0) == 0:  # the process that writes the results
        folder.claim_output_dir(Path(args.output_dir))
    return args


def visible_gpus(device):
    """The GPUs a run on --device may use (none with --device cpu), known before any process picks its own."""
    import torch  # here, not above: what only plans runs (the benchmark runner) reads the parser without torch
    return torch.cuda.device_count() if device != "cpu" else 0


def resolve(args):
    """Every default that depends on the machine, the strategy or another option, decided here and only here,
    before any work; the record returned refuses writes."""
    gpus = visible_gpus(args.device)
    values = {name: (value.gpu if gpus else value.cpu) if isinstance(value, ByDevice) else value
              for name, value in vars(args).items()}
    values["compile"] = args.compile or args.compile_mode is not None
    if args.compile_dynamic == "auto":  # static where padding makes the step shapes repeat
        values["compile_dynamic"] = "static" if values["pad_to_multiple_of"] > 1 else "dynamic"
    if "nprocs" in values:  # the spawn scripts' launch options, torchrun's before
        values.update(spawn_setup.launch_defaults(args, gpus))
    return Options(**values)


def check(args):
    """Every resolved value checked before any work: one line naming the problem, not a traceback deep in
    torch or a silent nonsense run."""
    if args.max_samples < MIN_SAMPLES:
        raise UserError(f"--max-samples must be at least {MIN_SAMPLES}, got {args.max_samples}")
    for name in ("save_steps", "profile", "max_steps", "num_workers", "eval_steps"):
        if getattr(args, name) < 0:
            raise UserError(f"--{name.replace('_', '-')} must be 0 or more, got {getattr(args, name)}")
    for name in ("epochs", "batch_size", "grad_accum", "log_steps", "pad_to_multiple_of"):
        if getattr(args, name) < 1:
            raise UserError(f"--{name.replace('_', '-')} must be at least 1, got {getattr(args, name)}")
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
    if args.threads is not None and args.threads < 1:
        raise UserError(f"--threads must be at least 1, got {args.threads}")
    check_max_seq_len(args.max_seq_len)
    folder.check_output_dir(args.output_dir)
    if "nprocs" in vars(args):
        spawn_setup.check_launch(args, visible_gpus(args.device))


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

