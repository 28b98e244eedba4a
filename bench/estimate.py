"""--real-size's checks before any launch (the memory a plan needs), how long a plan should take here,
and whether its rows have enough steps to time. Torch is imported only to time a step."""
import json
import math
import statistics
import time
from pathlib import Path

from support import cli
from support.task import LABELS, base_shape_config
from support.options import split_sizes

from .options import devices, script_data
from .rows import ROOT, SCRIPT_BATCH_SIZE, SCRIPT_DEV_RATIO, SCRIPT_MAX_SAMPLES, STRATEGIES, relative


# One launch's resident memory per process, from a 2-process DDP run of base-shape (2.66 GB peak on rank 0):
# the whole model state (16 bytes a parameter in fp32 with Adam, the unsharded rows' bound), 4 more for
# DDP's gradient buckets or a gathered copy of the weights, and 1 GiB of libraries and activations at batch 8.
BYTES_PER_PARAMETER, BYTES_BEYOND_PARAMETERS = 20, 2**30
# A launch's cost besides its steps: launcher, imports, building BERT-base, evaluating, saving its 400 MB.
# Measured on 2 quiet cores (docs/results/amd-epyc-2-cores-base-shape): 12 s (one device) to 38 s (ZeRO-3,
# 4 processes), 18 s the median; on 2 loaded cores up to 173 s. With 30 s that run's 17 launches were
# estimated at 13 minutes; they took 9.
LAUNCH_SECONDS = 30


def bert_parameters(config, labels):
    """BertForSequenceClassification's parameter count from its config's shapes, without building it."""
    hidden, inner = config["hidden_size"], config["intermediate_size"]
    embeddings = hidden * (config["vocab_size"] + config["max_position_embeddings"] + config["type_vocab_size"])
    layer_norm = 2 * hidden
    layer = 4 * (hidden * hidden + hidden) + (hidden * inner + inner) + (inner * hidden + hidden) + 2 * layer_norm
    pooler, classifier = hidden * hidden + hidden, hidden * labels + labels
    return embeddings + layer_norm + config["num_hidden_layers"] * layer + pooler + classifier


def real_size_parameters():
    """base-shape's parameter count: BERT-base with a head for the task's labels."""
    return bert_parameters(base_shape_config(), len(LABELS))


def available_memory_bytes():
    """Memory the kernel can give new processes now (MemAvailable): other jobs' memory is not ours."""
    for line in Path("/proc/meminfo").read_text().splitlines():
        if line.startswith("MemAvailable:"):
            return int(line.split()[1]) * 1024
    raise cli.UserError("cannot read MemAvailable from /proc/meminfo: the memory check needs Linux")


def processes(cell):
    """The processes a cell's launch starts (DataParallel's and single's one, whatever --nprocs)."""
    return cell["nprocs"] if STRATEGIES[cell["strategy"]].distributed else 1


def check_memory(cells, parameters, available):
    """Refuse, before any model is built, a plan whose largest launch would not fit in `available` bytes."""
    largest = max(cells, key=processes)
    needed = processes(largest) * (BYTES_PER_PARAMETER * parameters + BYTES_BEYOND_PARAMETERS)
    if needed > available:
        raise cli.UserError(f"this plan needs about {needed / 2**30:.1f} GiB for {largest['row']} "
                            f"({processes(largest)} processes of {parameters / 1e6:.1f} M parameters) but "
                            f"{available / 2**30:.1f} GiB is available: run fewer processes (--only) or free memory")
    return needed


def time_one_step(args):
    """Seconds of a steady base-shape training step here on one thread, at the plan's batch: the first
    step (Adam creates its state) is not timed, the second is. One thread, as each process of a
    2-process row gets on 2 cores; timing on all cores would also time how the threads of a loaded
    machine wait for each other."""
    import torch
    import common
    from support import models
    batch_size = args.batch_size or SCRIPT_BATCH_SIZE
    texts = [text for text, _ in common.load_records(ROOT / "data" / "train.json")[:batch_size]]
    tokenizer, model = models.build_base_shape_model(texts, 0, {"num_labels": len(LABELS)})
    batch = tokenizer(texts, padding=True, truncation=True, max_length=128, return_tensors="pt")
    labels = torch.zeros(len(texts), dtype=torch.long)
    optimizer = models.make_optimizer(model, 1e-4, 0.01)
    seconds, threads = [], torch.get_num_threads()
    torch.set_num_threads(1)
    for _ in range(2):
        start = time.perf_counter()
        model(**batch, labels=labels).loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        seconds.append(time.perf_counter() - start)
    torch.set_num_threads(threads)
    return seconds[-1]


def estimate_seconds(cells, step_seconds, args):
    """The plan's duration from a step timed on one thread: each launch's fixed cost, then its steps
    and its evaluation. N processes, each with its own batch, share the machine's cores: a step takes
    N / cores times the one-thread step. The dev batches are split over the processes, each a forward
    pass, about a third of a step."""
    from support import machine
    cores = machine.usable_cores()
    batch_size = args.batch_size or SCRIPT_BATCH_SIZE
    dev_batches = round((args.max_samples or SCRIPT_MAX_SAMPLES) * SCRIPT_DEV_RATIO) / batch_size
    evaluation = step_seconds * dev_batches / 3 / cores
    return sum(LAUNCH_SECONDS + step_seconds * processes(cell) / cores * args.max_steps + evaluation
               for cell in cells) * args.repeat


def announce_real_size(args, cells):
    """Check the plan's memory, time a step, and say what the plan will take before it starts."""
    parameters = real_size_parameters()
    needed = check_memory(cells, parameters, available_memory_bytes())
    print(f"real size: {parameters:,} parameters; the largest launch needs about {needed / 2**30:.1f} GiB",
          flush=True)
    step_seconds = time_one_step(args)
    minutes = estimate_seconds(cells, step_seconds, args) / 60
    print(f"real size: a base-shape step took {step_seconds:.1f} s here (one thread, batch "
          f"{args.batch_size}): {len(cells) * args.repeat} launches, about {minutes:.0f} minutes in all", flush=True)


# The committed tiny-model run on 2 cores: how long each row's launch took, for a plan's estimate.
REFERENCE_RUN = ROOT / "docs" / "results" / "amd-epyc-2-cores" / "benchmark.json"


def expected_duration(args, cells, model, gpus):
    """One line, before the first launch: the plan's launches and how long they should take here.
    The tiny model: as long as the committed run's rows took on 2 cores, for its data and epochs. A
    real-size model on a CPU: its steps, timed here on one BERT-base step (hours, usually)."""
    launches = len(cells) * args.repeat
    if gpus:
        return f"plan: {launches} launch(es) on {gpus} GPU(s); no estimate for GPUs yet"
    if model == "tiny":
        reference = json.loads(REFERENCE_RUN.read_text(encoding="utf-8"))
        walls = {row["row"]: row["wall_seconds"] for row in reference["rows"] if row["status"] == "ok"}
        typical = statistics.median(walls.values())
        minutes = sum(walls.get(cell["variant"], typical) for cell in cells) * args.repeat / 60
        other = "" if args.max_samples is None and args.epochs is None else "; more or less with other data or epochs"
        return (f"plan: {launches} launch(es), about {minutes:.0f} minutes on 2 cores as in "
                f"{relative(REFERENCE_RUN.parent)} (the default data, 1 epoch{other})")
    if args.real_size:
        return None  # announce_real_size times a step and says it
    step_seconds = time_one_step(args)
    if args.max_steps:
        seconds = estimate_seconds(cells, step_seconds, args)
    else:
        # The processes of a launch share its batches and the machine's cores: whatever their number,
        # a launch costs the epoch's batches at one step each, over the cores.
        batches = (args.max_samples or SCRIPT_MAX_SAMPLES) * (1 - SCRIPT_DEV_RATIO) * (args.epochs or 1) / (
            args.batch_size or SCRIPT_BATCH_SIZE)
        from support import machine
        seconds = (LAUNCH_SECONDS + step_seconds * batches / machine.usable_cores()) * launches
    hours = seconds / 3600
    return (f"plan: {launches} launch(es) of a BERT-base-sized model on the CPU, about {hours:.1f} hours (a step "
            f"took {step_seconds:.1f} s here); --model tiny compares the strategies in minutes")


# Fewer optimizer steps than this leave too few steady steps to time: the first is timed apart, and the
# median of a handful moves with any one of them.
FEW_STEPS = 20


def few_steps_warning(args, cells, gpus):
    """One line when the plan's largest global batch leaves its rows fewer than FEW_STEPS optimizer steps,
    with the --epochs or --max-samples that gives enough; None when there are enough, or when --max-steps
    asks for fewer."""
    if args.max_steps and args.max_steps < FEW_STEPS:
        return None
    global_batches = row_global_batches(args, cells, gpus)
    largest = max(global_batches.values())
    train, dev_ratio, records = train_samples(args)
    epochs = args.epochs or 1
    steps = {row: math.ceil(train / batch) * epochs for row, batch in global_batches.items()}
    few = [row for row, count in steps.items() if count < FEW_STEPS]
    if not few:
        return None
    fixes = [f"--epochs {math.ceil(FEW_STEPS / (min(steps.values()) // epochs))}"]
    wanted = math.ceil(FEW_STEPS / epochs) * largest  # training samples: full global batches
    enough = math.ceil(wanted / (1 - dev_ratio))
    while enough - round(enough * dev_ratio) < wanted:
        enough += 1
    if records is None or enough <= records:
        fixes.append(f"--max-samples {enough}")
    return (f"warning: {len(few)} row(s) ({', '.join(few)}) train fewer than {FEW_STEPS} optimizer steps, "
            f"{min(steps.values())} at a global batch of {largest:,} ({train:,} training samples, {epochs} "
            f"epoch(s)): too few to time (the first is timed apart); {' or '.join(fixes)} gives {FEW_STEPS} or more")


def row_global_batches(args, cells, gpus):
    """Each row's global batch: what its script gets per process x processes x micro-batches."""
    return {cell["row"]: args.global_batch or (cell["batch_size"] or SCRIPT_BATCH_SIZE) * (
        args.grad_accum or 1) * cell["nnodes"] * devices(STRATEGIES[cell["strategy"]], cell["nprocs"], gpus)
        for cell in cells}


def train_samples(args):
    """The training samples every script will have, the --dev-ratio and the data's records (None: unread)."""
    dev_ratio, records = script_data(args.passthrough)
    train, _ = split_sizes(args.max_samples or SCRIPT_MAX_SAMPLES, dev_ratio, math.inf)
    return train, dev_ratio, records


def check_batches_fit(args, cells, gpus):
    """Before any launch: no row's global batch is more than the training samples, which every script
    refuses (common.train_sampler), one launch after another."""
    train, _, _ = train_samples(args)
    too_large = [f"{row}: {batch:,}" for row, batch in row_global_batches(args, cells, gpus).items() if batch > train]
    if too_large:
        option = "--global-batch" if args.global_batch else "--batch-size"
        raise cli.UserError(f"{len(too_large)} row(s) would train on a global batch larger than the {train:,} "
                            f"training samples ({', '.join(too_large)}), which the scripts refuse: lower {option} "
                            "or raise --max-samples")
