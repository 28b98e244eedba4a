"""The runner's command line and its plan: which rows to run, at which process counts, with which
options for each script. Imports no torch."""
import argparse
import itertools
import json
import math
import os
import re
import shlex
from pathlib import Path

from support import cli
from support.options import MIN_SAMPLES, PRECISIONS, Options, split_sizes

from .rows import (BUILT_IN_VARIANTS, DEFAULT_ROWS, ROOT, SCRIPT_BATCH_SIZE, SCRIPT_DEFAULTS, SCRIPT_DEV_RATIO,
                   SCRIPT_MAX_SAMPLES, STRATEGIES, Variant, job_hosts, relative)


# --real-size: every default row and every ZeRO stage at 2 processes, the sharded rows also at 4 (to show
# the 1/N), with the real model's architecture (--model base-shape) for a few steps each; on GPUs, the
# counts that fit, a process per GPU (real_size_counts).
REAL_SIZE_EXTRA_ROWS = ["deepspeed-zero1", "deepspeed-zero3"]
REAL_SIZE_SHARDED_ROWS = {"deepspeed", "deepspeed-zero1", "deepspeed-zero3", "fsdp"}
REAL_SIZE_COUNTS, REAL_SIZE_SHARDED_COUNTS = [2], [2, 4]
# 4 steps: the model state is counted before step 2, --profile's 2 steps follow 2 warm-up steps. Batch 8
# keeps a BERT-base step to seconds on a CPU core; 1,000 samples leave 80 dev samples to evaluate.
REAL_SIZE_DEFAULTS = {"max_steps": 4, "profile": 2, "batch_size": 8, "max_samples": 1000}


def parse_args(argv, gpus, description=None):
    """The command line; `gpus` (gpu_count()) sets the default --nprocs; `description`: benchmark.py's."""
    parser = build_parser(gpus, description)
    args, passthrough = parser.parse_known_args(argv)
    args = check_runner_args(args, passthrough, parser.get_default("nprocs"), 0 if "cpu" in passthrough else gpus)
    if gpus and max(args.counts) > gpus and "cpu" not in passthrough:  # one GPU per process: say so before any launch
        raise cli.UserError(f"--nprocs {args.nprocs}: this machine has {gpus} GPU(s) and each process takes one; "
                            "hide them to run CPU processes: CUDA_VISIBLE_DEVICES= ./run.sh --device cpu")
    if args.node_counts:
        args.hosts = job_hosts(args.nnodes)
        if max(args.node_counts) > len(args.hosts):
            raise cli.UserError(f"--nnodes {args.nnodes}: this Slurm job has {len(args.hosts)} node(s); ask sbatch "
                                "for more with --nodes")
    return Options(**vars(args))  # resolved: read-only from here on


def build_parser(gpus, description):
    """Which rows run, where, and where their results go; add_script_options adds what goes to every script."""
    parser = argparse.ArgumentParser(description=description, formatter_class=argparse.RawDescriptionHelpFormatter,
                                     epilog="Any other option goes to every script as it is (--lr, --seed, "
                                            "--dev-ratio, ...): `python single-gpu-cls.py --help` lists them.")
    parser.add_argument("--only", help="comma-separated rows to run: strategies or variants (default: one row per "
                                       f"strategy, {','.join(STRATEGIES)}; --list shows the variants)")
    parser.add_argument("--skip", help="comma-separated rows to leave out")
    parser.add_argument("--list", action="store_true", help="list the strategies and variants, then exit")
    parser.add_argument("--variant", action="append", default=[], metavar='NAME=STRATEGY:"OPTIONS"',
                        help="define a row of your own, e.g. zero3-cpu-adam=deepspeed:\"--zero-stage 3 --offload "
                             "optimizer\"; it runs with the default rows, or when named in --only (repeatable)")
    parser.add_argument("--strategy-args", action="append", default=[], metavar='STRATEGY="OPTIONS"',
                        help="options for every row of one strategy only, e.g. deepspeed=\"--zero-stage 3\" "
                             "(repeatable)")
    parser.add_argument("--nprocs", default=str(gpus or 2),
                        help="processes (GPUs) per distributed row; a list like 1,2,4 runs a scaling sweep "
                             "(default: all GPUs, or 2 without GPU: %(default)s here)")
    parser.add_argument("--nnodes",
                        help="in a Slurm job (slurm/benchmark.sbatch): nodes per distributed row, each row run by its "
                             "batch file of slurm/ with --nprocs processes on each node; a list like 1,2 sweeps "
                             "(default: this machine alone)")
    parser.add_argument("--model",
                        help="as the scripts' --model, resolved once here and passed to all (default: auto on a "
                             "machine with GPUs; tiny without, where the real model would take hours)")
    add_script_options(parser)
    parser.add_argument("--timeout", type=float, default=1800,
                        help="seconds one launch may take before it is killed (default: %(default)g)")
    parser.add_argument("--output-dir", default=str(ROOT / "output" / "benchmark"),
                        help="where the table, chart, logs and each run's files go (default: output/benchmark)")
    parser.add_argument("--matmul-peaks", metavar="FILE",
                        help="the matrix-product peaks measured already (scripts/gpu-check.sh's peaks.json, "
                             "{device, peaks: {precision: {tflops}}}): not measured again after the rows")
    parser.add_argument("--publish", nargs="?", const="", metavar="SUFFIX",
                        help="also copy the tables, JSON and chart to docs/results/<machine>[-<model>][-SUFFIX]/ "
                             "(a SUFFIX keeps the run beside another of the same machine and model)")
    return parser


def add_script_options(parser):
    """The options the runner passes on to every script (and --real-size, which sets several of them)."""
    parser.add_argument("--max-samples", type=int, help="passed to every script (default: the scripts' 10000)")
    parser.add_argument("--epochs", type=int, help="passed to every script (default: the scripts' 1)")
    parser.add_argument("--max-steps", type=int, metavar="N",
                        help="every script stops after N optimizer steps, then evaluates (default: the whole epochs)")
    parser.add_argument("--real-size", action="store_true",
                        help="the real model's architecture (--model base-shape, random weights): every default row "
                             "and ZeRO-1/3 at 2 processes, the sharded rows also at 4 (on GPUs, the counts that fit: "
                             "1 GPU runs all at 1, 2-3 GPUs at 2), with --max-steps "
                             f"{REAL_SIZE_DEFAULTS['max_steps']} --profile {REAL_SIZE_DEFAULTS['profile']} "
                             f"--batch-size {REAL_SIZE_DEFAULTS['batch_size']} --max-samples "
                             f"{REAL_SIZE_DEFAULTS['max_samples']} unless given; estimates its duration first")
    parser.add_argument("--repeat", type=int, default=1,
                        help="launches per row, interleaved round-robin over the rows; the table shows the median "
                             "run, the min-max spread and the noise floor (default: 1)")
    parser.add_argument("--batch-size",
                        help="per device, for every row (default: the scripts' 32); DataParallel's one process "
                             "gets it times its GPUs; a list like 32,128,512 runs a batch sweep (rows named -b128)")
    parser.add_argument("--grad-accum", type=int, metavar="N",
                        help="micro-batches per optimizer step, for every row (default: the scripts' 1): the "
                             "global batch is the batch per device x devices x N")
    parser.add_argument("--global-batch", type=int,
                        help="the same global batch for every row and process count (strong scaling): per-device "
                             "batch = N / devices")
    parser.add_argument("--precision", choices=PRECISIONS,
                        help="for every strategy that offers mixed precision (ddp-amp, deepspeed, accelerate, fsdp, hf-trainer, "
                             "fabric); the "
                             "others stay in fp32 (default: the scripts' own: fp32, and for ddp-amp fp16 on GPUs, "
                             "bf16 on CPU)")
    parser.add_argument("--profile", type=int, metavar="STEPS",
                        help="every script records STEPS steps with torch.profiler: the anatomy table and chart "
                             "panel show each step's time by phase (train s then includes the profiler's cost; "
                             "hf-trainer runs transformers' own loop and is not profiled)")


# The scripts' options that name a file or folder. The runner launches every script in the repository,
# so a relative path is made absolute first, against the folder the runner was started in, as its user
# meant it. --model names a folder only where one is there (else a keyword or a hub id).
PATH_OPTIONS = ("--data", "--deepspeed-config", "--model")
MODEL_KEYWORDS = ("auto", "tiny", "base-shape")


def user_path(option, value):
    """`value` of the path option `option` as an absolute path."""
    if value is None or option == "--model" and (value in MODEL_KEYWORDS or not Path(value).expanduser().exists()):
        return value
    return os.path.abspath(Path(value).expanduser())


def user_paths(options):
    """The options passed on to the scripts, with the value of each PATH_OPTIONS one (`--data X` or
    `--data=X`) made absolute by user_path."""
    resolved = []
    for index, option in enumerate(options):
        name, equals, value = option.partition("=")
        if index and options[index - 1] in PATH_OPTIONS:
            option = user_path(options[index - 1], option)
        elif equals and name in PATH_OPTIONS:
            option = f"{name}={user_path(name, value)}"
        resolved.append(option)
    return resolved


def split_assignment(value, separator):
    name, found, rest = value.partition(separator)
    if not found or not name.strip():
        return None, None
    return name.strip(), rest


def parse_variant(value):
    """NAME=STRATEGY:"OPTIONS" -> a Variant."""
    name, rest = split_assignment(value, "=")
    strategy, options = split_assignment(rest or "", ":") if name else (None, None)
    if not strategy:
        raise cli.UserError(f'--variant {value!r}: write NAME=STRATEGY:"OPTIONS", e.g. '
                            'zero3-cpu-adam=deepspeed:"--zero-stage 3 --offload optimizer"')
    if strategy not in STRATEGIES:
        raise cli.UserError(f"--variant {name}: unknown strategy {strategy}; choose from {','.join(STRATEGIES)}")
    return Variant(name, strategy, tuple(user_paths(shlex.split(options))), "from the command line")


def parse_strategy_args(values):
    """STRATEGY="OPTIONS" (repeatable) -> {strategy: [options]}."""
    chosen = {}
    for value in values:
        strategy, options = split_assignment(value, "=")
        if strategy not in STRATEGIES:
            raise cli.UserError(f"--strategy-args {value!r}: write STRATEGY=\"OPTIONS\" with a strategy from "
                                f"{','.join(STRATEGIES)}")
        chosen[strategy] = chosen.get(strategy, []) + user_paths(shlex.split(options))
    return chosen


def parse_counts(value, option="--nprocs", what="process count"):
    try:
        counts = [int(part) for part in value.split(",") if part.strip()]
    except ValueError:
        counts = []
    if not counts or any(count < 1 for count in counts):
        raise cli.UserError(f"{option} takes {what}s of at least 1, like 2 or 1,2,4; got {value!r}")
    repeated = sorted({count for count in counts if counts.count(count) > 1})
    if repeated:
        raise cli.UserError(f"{option} {value}: {', '.join(map(str, repeated))} given twice; each {what} makes its "
                            "own rows, so name it once (--repeat runs a row several times)")
    return sorted(counts)


def names(option, value, known):
    chosen = [name.strip() for name in value.split(",") if name.strip()]
    if not chosen:
        raise cli.UserError(f"{option} names no row; choose from {','.join(known)} (--list describes them)")
    unknown = [name for name in chosen if name not in known]
    if unknown:
        raise cli.UserError(f"{option}: unknown row {', '.join(unknown)}; choose from {','.join(known)} "
                            "(--list describes them)")
    return chosen


def check_runner_args(args, passthrough, default_nprocs, gpus=0):
    passthrough, args.model = user_paths(passthrough), user_path("--model", args.model)
    if args.real_size:
        apply_real_size(args, default_nprocs, gpus)
    args.batch_sizes = parse_counts(str(args.batch_size), "--batch-size", "batch size") if args.batch_size else [None]
    args.batch_size = args.batch_sizes[-1]  # the largest: what the estimates size
    for name in ("repeat", "max_samples", "epochs", "max_steps", "global_batch", "profile"):
        value, least = getattr(args, name), MIN_SAMPLES if name == "max_samples" else 1
        if value is not None and value < least:
            raise cli.UserError(f"--{name.replace('_', '-')} must be at least {least}, got {value}")
    dev_ratio, records = script_data(passthrough)
    split_sizes(args.max_samples or SCRIPT_MAX_SAMPLES, dev_ratio, math.inf if records is None else records)
    if not 0 < args.timeout < math.inf:
        raise cli.UserError(f"--timeout must be a positive number of seconds, got {args.timeout:g}")
    if args.publish and not re.fullmatch(r"[a-z0-9]+(-[a-z0-9]+)*", args.publish):
        raise cli.UserError(f"--publish {args.publish}: a suffix of lower-case letters, digits and dashes, e.g. compile")
    args.counts = parse_counts(args.nprocs)
    args.node_counts = parse_counts(args.nnodes, "--nnodes", "node count") if args.nnodes else None
    own = [parse_variant(value) for value in args.variant]
    args.variants = {variant.name: variant for variant in BUILT_IN_VARIANTS + own}
    args.strategy_options = parse_strategy_args(args.strategy_args)
    defaults = [v.name for v in DEFAULT_ROWS + own] + (REAL_SIZE_EXTRA_ROWS if args.real_size else [])
    chosen = names("--only", args.only, args.variants) if args.only is not None else defaults
    skip = names("--skip", args.skip, args.variants) if args.skip is not None else []
    args.rows = [args.variants[name] for name in dict.fromkeys(chosen) if name not in skip]
    if not args.rows and not args.list:
        raise cli.UserError("--only and --skip leave no row to run")
    if args.global_batch:
        if args.batch_size:
            raise cli.UserError("--global-batch sets each script's --batch-size: pass one or the other")
        micro = args.grad_accum or 1
        uneven = [count for count in world_sizes(args) if args.global_batch % (count * micro)]
        if uneven:
            raise cli.UserError(f"--global-batch {args.global_batch} does not split evenly over "
                                f"{' and '.join(map(str, uneven))} processes (--nprocs {args.nprocs}"
                                + (f" x --nnodes {args.nnodes})" if args.node_counts else ")")
                                + (f" x {micro} micro-batches" if micro > 1 else ""))
    args.passthrough = passthrough
    args.output_dir = Path(args.output_dir).resolve()
    if args.output_dir.exists() and not args.output_dir.is_dir():
        raise cli.UserError(f"--output-dir {args.output_dir} is a file, not a folder")
    return args


def script_data(passthrough):
    """The --dev-ratio and the data's record count the scripts will use (the count None where the file
    cannot be read: the scripts say why)."""
    parser = argparse.ArgumentParser(add_help=False, allow_abbrev=False)
    parser.add_argument("--dev-ratio", default=SCRIPT_DEV_RATIO)
    parser.add_argument("--data", default=SCRIPT_DEFAULTS.get_default("data"))
    known, _ = parser.parse_known_args(passthrough)
    try:
        dev_ratio = float(known.dev_ratio)
    except ValueError:
        dev_ratio = SCRIPT_DEV_RATIO  # the scripts refuse it, in one line
    try:
        records = len(json.loads(Path(known.data).read_text(encoding="utf-8")))
    except (OSError, ValueError, TypeError):
        records = None
    return dev_ratio, records


def world_sizes(args):
    """The process counts of the distributed rows: --nprocs on each of --nnodes nodes."""
    return sorted({nnodes * nprocs for nnodes in args.node_counts or [1] for nprocs in args.counts})


def real_size_counts(gpus):
    """--real-size's process counts for the rows and for the sharded rows: 2, and 2 and 4, on a CPU; on
    `gpus` GPUs, a process per GPU, those that fit (1 GPU: all at 1; 2 or 3: 2; 4 or more: 2, and 4)."""
    if not gpus:
        return REAL_SIZE_COUNTS, REAL_SIZE_SHARDED_COUNTS
    return ([min(count, gpus) for count in REAL_SIZE_COUNTS],
            [count for count in REAL_SIZE_SHARDED_COUNTS if count <= gpus] or [gpus])


def apply_real_size(args, default_nprocs, gpus):
    """--real-size: base-shape at real_size_counts' process counts (args.sharded_counts for the sharded
    rows), and the plan's defaults where the command line gives none."""
    counts, args.sharded_counts = real_size_counts(gpus)
    if args.model not in (None, "base-shape"):
        raise cli.UserError(f"--real-size trains --model base-shape, not {args.model}: leave --model out")
    if args.nprocs != default_nprocs:
        raise cli.UserError(f"--real-size runs {','.join(map(str, counts))} process(es) per row, "
                            f"{','.join(map(str, args.sharded_counts))} for the sharded ones: leave --nprocs out")
    args.model, args.nprocs = "base-shape", ",".join(map(str, counts))
    for name, value in REAL_SIZE_DEFAULTS.items():
        if getattr(args, name) is None:
            setattr(args, name, value)


def list_rows(variants):
    print("Strategies and variants (a variant is a strategy plus options; --only picks rows, --variant adds one):")
    width = max(len(name) for name in variants)
    options_width = max(len(" ".join(variant.options)) for variant in variants.values())
    for variant in variants.values():
        options = " ".join(variant.options) or "-"
        default = " [default row]" if variant in DEFAULT_ROWS else ""
        gpu = " [GPU only]" if variant.needs_gpu else ""
        print(f"  {variant.name:<{width}}  {variant.strategy:<12}  {options:<{options_width}}  "
              f"{variant.about}{default}{gpu}")


def devices(entry, nprocs, gpus):
    """How many model replicas share each global batch."""
    if entry.name == "single" or (entry.splits_batch and not gpus):
        return 1
    return nprocs


def batch_options(args, entry, gpus, nprocs, batch_size):
    """--batch-size for the script, so that every device gets the same share of a batch."""
    replicas = devices(entry, nprocs, gpus)
    per_device = args.global_batch // (replicas * (args.grad_accum or 1)) if args.global_batch else batch_size
    if entry.splits_batch and replicas > 1:
        return ["--batch-size", str((per_device or SCRIPT_BATCH_SIZE) * replicas)]
    return ["--batch-size", str(per_device)] if per_device else []


def script_options(args, variant, run_dir, model, gpus, nprocs, batch_size):
    """What a script gets after the launcher's part: the options every row shares, then this
    strategy's and this variant's own; `batch_size` per device (None: the script's)."""
    entry = STRATEGIES[variant.strategy]
    shared = {"--max-samples": args.max_samples, "--epochs": args.epochs, "--max-steps": args.max_steps,
              "--precision": args.precision if entry.mixed_precision else None, "--grad-accum": args.grad_accum,
              "--profile": args.profile if entry.profiles else None}
    options = ["--output-dir", relative(run_dir), "--model", model]
    options += [word for option, value in shared.items() if value for word in (option, str(value))]
    return (options + batch_options(args, entry, gpus, nprocs, batch_size) + args.passthrough
            + args.strategy_options.get(entry.name, []) + list(variant.options))


def plan(args, gpus):
    """The cells to run: each row at each batch size, node and process count (rows that depend on
    neither count, once per batch size)."""
    cells = []
    for variant in args.rows:
        entry = STRATEGIES[variant.strategy]
        counts = args.counts if entry.distributed else [1 if entry.name == "single" else args.counts[-1]]
        if args.real_size and variant.name in REAL_SIZE_SHARDED_ROWS:
            counts = args.sharded_counts
        node_counts = args.node_counts if args.node_counts and entry.distributed else [1]
        for batch_size, nnodes, nprocs in itertools.product(args.batch_sizes, node_counts, counts):
            name = (variant.name + (f"-b{batch_size}" if len(args.batch_sizes) > 1 else "")
                    + (f"-nodes{nnodes}" if len(node_counts) > 1 else "")
                    + (f"-n{nprocs}" if entry.distributed and len(counts) > 1 else ""))
            cells.append({"row": name, "variant": variant.name, "strategy": entry.name, "script": entry.script,
                          "launcher": entry.launcher, "nnodes": nnodes, "nprocs": nprocs, "batch_size": batch_size,
                          "options": list(variant.options), "log": relative(args.output_dir / f"{name}.log"),
                          "status": "pending", "reason": None, "runs": []})
    return cells


def not_runnable(variant, gpus):
    if variant.needs_gpu and not gpus:
        return f"{variant.name} needs a GPU ({variant.about})"
    return None
