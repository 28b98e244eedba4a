"""What every strategy script shares: the command line, the data, the model, the training loop.

A strategy script builds a `Strategy` (its device, its rank, and how it runs backward, accumulates
gradients, steps the optimizer, averages a loss and gathers predictions across processes), wraps the
model its own way, and hands both to `Trainer`. Nothing in this file knows which strategy is running.
"""
import argparse
import collections
import contextlib
import itertools
import json
import math
import os
import random
import re
import resource
import shutil
import signal
import socket
import sys
import time
import traceback
from pathlib import Path

os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

import numpy as np
import torch
import torch.distributed as dist
import torch.nn.functional as F
import transformers
from sklearn.metrics import accuracy_score, classification_report, f1_score
from torch.utils.data import DataLoader, Dataset, Sampler
from tqdm import tqdm

import measure

ROOT = Path(__file__).resolve().parent
LABELS = ["其他", "喜好", "悲伤", "厌恶", "愤怒", "高兴"]
HUB_MODEL_ID = "hfl/chinese-bert-wwm-ext"
LOCAL_MODEL_DIR = ROOT / "model_hub" / "chinese-bert-wwm-ext"
# The real model's architecture, from its published config.json: --model base-shape builds it offline.
BASE_SHAPE_CONFIG = ROOT / "configs" / "models" / "chinese-bert-wwm-ext.json"
# Models with random weights learn from scratch (a higher rate); BERT-base's depth needs a lower one than tiny's.
DEFAULT_LR = {"tiny": 1e-3, "base-shape": 1e-4, "pretrained": 3e-5}
RANDOM_WEIGHTS_BANNER = "random weights: figures compare strategies, not models"
# A training checkpoint (--save-steps, --resume): the state, and what its step means, readable by a person.
CHECKPOINT_FILE, MEANING_FILE = "training_state.pt", "meaning.json"
PRECISIONS = ["fp32", "bf16", "fp16"]
# CPU flags of native 16-bit arithmetic (/proc/cpuinfo); without them torch emulates the type in fp32.
NATIVE_CPU_FLAGS = {"bf16": {"avx512_bf16", "amx_bf16"}, "fp16": {"avx512_fp16", "amx_fp16"}}

transformers.logging.set_verbosity_error()
transformers.logging.disable_progress_bar()


class UserError(Exception):
    """A problem the user can fix (bad data, missing model, wrong launch): reported in one line.

    Most are found by every process alike, and rank 0 speaks for all; one that only some processes
    meet (`only_this_rank=True`) is reported by each of them.
    """

    def __init__(self, message, only_this_rank=False):
        super().__init__(message)
        self.only_this_rank = only_this_rank


def run(main):
    """Run `main()`, turning failures into one clear line on stderr and a non-zero exit."""
    rank = current_rank()
    # SIGTERM (a scheduler or launcher stopping the job) unwinds like Ctrl-C: cleanup code runs.
    signal.signal(signal.SIGTERM, signal.default_int_handler)
    try:
        main()
    except UserError as error:
        if rank == 0 or error.only_this_rank:
            print(f"error: {error}", file=sys.stderr)
        sys.exit(2)
    except KeyboardInterrupt:
        print(f"rank {rank}: interrupted", file=sys.stderr)
        sys.exit(130)
    except (dist.DistNetworkError, dist.DistStoreError) as error:
        # The rendezvous never came together within --dist-timeout: a wrong address, a blocked port, or
        # a process (a node) that never started. Where is in the message; a traceback would add nothing.
        print(f"error: rank {rank} could not reach the process group at {os.environ.get('MASTER_ADDR')}:"
              f"{os.environ.get('MASTER_PORT')} within --dist-timeout: {str(error).splitlines()[0]}", file=sys.stderr)
        sys.exit(1)
    except Exception as error:
        traceback.print_exc()
        print(f"error: rank {rank} failed: {type(error).__name__}: {error}", file=sys.stderr)
        sys.exit(1)


def current_rank():
    for name in ("RANK", "HOROVOD_RANK", "OMPI_COMM_WORLD_RANK", "SLURM_PROCID"):
        if name in os.environ:
            return int(os.environ[name])
    return 0


# ----------------------------------------------------------------------------- command line

class HelpFormatter(argparse.ArgumentDefaultsHelpFormatter, argparse.RawDescriptionHelpFormatter):
    """Show each option's default and keep the script's docstring as written."""


def build_parser(script_file, description):
    """The options every script accepts; scripts add their own with `parser.add_argument`."""
    stem = Path(script_file).stem
    parser = argparse.ArgumentParser(description=description, formatter_class=HelpFormatter)
    parser.add_argument("--model", default="auto",
                        help="'auto' (local weights, else the hub, else tiny), 'tiny', 'base-shape' (the real model's "
                             "architecture, random weights, offline), a folder or a hub id")
    parser.add_argument("--data", default=str(ROOT / "data" / "train.json"), help="JSON list of [text, label]")
    parser.add_argument("--max-samples", type=int, default=10000, help="use the first N records")
    parser.add_argument("--dev-ratio", type=float, default=0.08, help="share of samples held out for dev")
    parser.add_argument("--epochs", type=int, default=1)
    parser.add_argument("--max-steps", type=int, default=0, metavar="N",
                        help="stop after N optimizer steps (at most --epochs' worth), then evaluate on the whole dev "
                             "set as usual; 0 = every step of --epochs")
    parser.add_argument("--batch-size", type=int, default=32, help="per process and micro-batch")
    parser.add_argument("--grad-accum", type=int, default=1, metavar="N",
                        help="micro-batches per optimizer step (gradient accumulation): the global batch is "
                             "--batch-size x processes x N")
    parser.add_argument("--lr", type=float, default=None,
                        help=f"default {DEFAULT_LR['tiny']} for the tiny model, {DEFAULT_LR['base-shape']} for "
                             f"base-shape, {DEFAULT_LR['pretrained']} otherwise")
    parser.add_argument("--weight-decay", type=float, default=0.01)
    parser.add_argument("--max-seq-len", type=int, default=128, help="longer texts are truncated")
    parser.add_argument("--seed", type=int, default=123)
    parser.add_argument("--log-steps", type=int, default=50, help="print the training loss every N steps")
    parser.add_argument("--eval-steps", type=int, default=0, help="evaluate every N steps; 0 = only at the end")
    parser.add_argument("--output-dir", default=str(ROOT / "output" / stem))
    parser.add_argument("--device", choices=["auto", "cpu", "cuda"], default="auto")
    parser.add_argument("--num-workers", type=int, default=0, help="DataLoader worker processes")
    parser.add_argument("--threads", type=int,
                        help="torch threads per process; None = the cores this process may use, shared "
                             "equally by the processes on this machine, whatever the launcher set")
    parser.add_argument("--group-by-length", action=argparse.BooleanOptionalAction, default=True,
                        help="batch texts of similar length together: 2x faster here, same accuracy "
                             "(benchmarks/pipeline.py)")
    parser.add_argument("--no-shuffle", action="store_true", help="keep the training order fixed")
    parser.add_argument("--dropout", type=float, default=None, help="override the model's dropout probabilities")
    parser.add_argument("--gradient-checkpointing", action="store_true",
                        help="keep only each layer's input in forward and recompute the rest in backward: less "
                             "activation memory for about one more forward pass of compute")
    parser.add_argument("--save-steps", type=int, default=0,
                        help="save a training checkpoint (for --resume) every N steps; 0 = never")
    parser.add_argument("--resume", action="store_true",
                        help="continue from the training checkpoint in --output-dir, if there is one")
    parser.add_argument("--profile", type=int, default=0, metavar="STEPS",
                        help="record STEPS training steps with torch.profiler after 2 warm-up steps: "
                             "<output-dir>/trace.json and milliseconds per phase in result.json (slower)")
    return parser


def add_distributed_args(parser, backend=False):
    """Options of the scripts that run several processes; `backend` for the DDP scripts, whose gloo
    all-reduce works on GPU tensors too."""
    parser.add_argument("--dist-timeout", type=float, default=300,
                        help="seconds a collective call may wait for the other processes before failing")
    if backend:
        parser.add_argument("--backend", choices=["auto", "nccl", "gloo"], default="auto",
                            help="auto = nccl between GPUs, gloo between CPU processes; gloo also lets more "
                                 "processes than GPUs share them (to try the GPU path on one GPU)")


def add_precision_arg(parser, default="fp32", default_help=None):
    """The one precision option of every script that can train in mixed precision."""
    parser.add_argument("--precision", choices=PRECISIONS, default=default,
                        help="fp32, or mixed precision computing in bf16 or fp16 (fp16: GPUs only)"
                             + (f"; None = {default_help}" if default_help else ""))


def check_args(args):
    if args.max_samples < 2:
        raise UserError(f"--max-samples must be at least 2, got {args.max_samples}")
    for name in ("save_steps", "profile", "max_steps"):
        if getattr(args, name) < 0:
            raise UserError(f"--{name.replace('_', '-')} must be 0 or more, got {getattr(args, name)}")
    if not 0 < args.dev_ratio < 1:
        raise UserError(f"--dev-ratio must be between 0 and 1, got {args.dev_ratio}")
    if args.lr is not None and not args.lr > 0:
        raise UserError(f"--lr must be positive, got {args.lr:g}")
    if args.weight_decay < 0:
        raise UserError(f"--weight-decay must be 0 or more, got {args.weight_decay:g}")
    if Path(args.output_dir).exists() and not Path(args.output_dir).is_dir():
        raise UserError(f"--output-dir {args.output_dir} is a file, not a folder")
    if args.threads is not None and args.threads < 1:
        raise UserError(f"--threads must be at least 1, got {args.threads}")
    for name in ("epochs", "batch_size", "grad_accum", "max_seq_len", "log_steps"):
        if getattr(args, name) < 1:
            raise UserError(f"--{name.replace('_', '-')} must be at least 1, got {getattr(args, name)}")
    return args


def launch_environment(how_to_launch):
    """(rank, world size, local rank, processes on this machine) as the launcher set them, or as Slurm
    set them for a plain `srun` of one task per process, or one line saying what is missing."""
    if "RANK" not in os.environ and started_by_srun():
        use_slurm_task_environment()
    if "RANK" not in os.environ or "WORLD_SIZE" not in os.environ:
        raise UserError(f"this script runs under a launcher: {how_to_launch}, or one srun task per process "
                        "(see the README)")
    local = {"LOCAL_RANK": os.environ.get("LOCAL_RANK"),
             "LOCAL_WORLD_SIZE": os.environ.get("LOCAL_WORLD_SIZE") or os.environ.get("LOCAL_SIZE")}
    missing = [name for name, value in local.items() if value is None]
    if missing:
        raise UserError(f"the launcher set RANK and WORLD_SIZE but not {' and '.join(missing)}: set them too "
                        "(this process's index on its machine, and the processes there), as torchrun does")
    return (int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"]), int(local["LOCAL_RANK"]),
            int(local["LOCAL_WORLD_SIZE"]))


# ----------------------------------------------------------------------------- Slurm, no launcher

# What srun sets in every task it starts. SLURM_STEP_ID is missing from the batch script itself, which
# also has SLURM_PROCID 0 and the job's SLURM_NTASKS: a script started there without srun is one
# process, not rank 0 of a group that would wait for the others until --dist-timeout.
SLURM_TASK_VARIABLES = ("SLURM_PROCID", "SLURM_NTASKS", "SLURM_LOCALID", "SLURM_NODEID", "SLURM_STEP_ID")
# The rendezvous port when MASTER_PORT is unset: one per job id, so that two jobs sharing a first node
# do not meet each other's rendezvous (two steps of one job at once need a MASTER_PORT each).
SLURM_PORT_BASE, SLURM_PORT_SPAN = 15000, 10000
# Set when srun, not a launcher, started this process: result.json names srun as its launcher.
srun_started_this_process = False


def started_by_srun():
    return all(name in os.environ for name in SLURM_TASK_VARIABLES)


def use_slurm_task_environment():
    """Set what torchrun would have set (RANK, WORLD_SIZE, LOCAL_RANK, LOCAL_WORLD_SIZE, MASTER_ADDR,
    MASTER_PORT) from srun's SLURM_* variables. The rendezvous is the step's first node, where srun
    starts rank 0; MASTER_ADDR and MASTER_PORT, when set, win."""
    global srun_started_this_process
    srun_started_this_process, env = True, os.environ
    node_id = int(env["SLURM_NODEID"])
    tasks_per_node = expand_tasks_per_node(env.get("SLURM_STEP_TASKS_PER_NODE") or env["SLURM_TASKS_PER_NODE"])
    env.update(RANK=env["SLURM_PROCID"], WORLD_SIZE=env["SLURM_NTASKS"], LOCAL_RANK=env["SLURM_LOCALID"],
               LOCAL_WORLD_SIZE=str(tasks_per_node[node_id]))
    env.setdefault("MASTER_ADDR", first_host(env.get("SLURM_STEP_NODELIST") or env["SLURM_NODELIST"]))
    env.setdefault("MASTER_PORT", str(SLURM_PORT_BASE + int(env.get("SLURM_JOB_ID", 0)) % SLURM_PORT_SPAN))
    if env["RANK"] == "0":
        check_rendezvous_host(env["MASTER_ADDR"], int(env["MASTER_PORT"]))
        print(f"launcher: srun, one task per process: rank, world size and local rank from SLURM_PROCID, "
              f"SLURM_NTASKS and SLURM_LOCALID; rendezvous {env['MASTER_ADDR']}:{env['MASTER_PORT']} "
              f"(the first node; MASTER_ADDR and MASTER_PORT override it)", flush=True)


def expand_tasks_per_node(value):
    """Slurm's compressed tasks per node, one count per node: '2(x3),1' -> [2, 2, 2, 1]."""
    counts = []
    for part in value.split(","):
        count, _, repeat = part.partition("(x")
        counts += [int(count)] * int(repeat.rstrip(")") or 1)
    return counts


def first_host(nodelist):
    """The first host of a Slurm node list, as `scontrol show hostnames` would list it first:
    'gpu[07-09,12]-ib,cpu1' -> 'gpu07-ib'. Zero padding is kept: it is part of the name."""
    prefix, ranges, suffix = re.match(r"([^,\[]*)(?:\[([^\]]*)\])?([^,]*)", nodelist).groups()
    return prefix + (ranges.split(",")[0].split("-")[0] if ranges else "") + suffix


def check_rendezvous_host(address, port):
    """On rank 0, before anyone waits on it: the rendezvous address is this machine's, and its port free.
    Otherwise the other processes would wait --dist-timeout seconds for a rendezvous that never comes."""
    with socket.socket() as probe:
        try:
            probe.bind((socket.gethostbyname(address), 0))
        except OSError:
            raise UserError(f"MASTER_ADDR {address} is not an address of {socket.gethostname()}, where rank 0 "
                            "runs: leave MASTER_ADDR unset (the job's first node) or name this node") from None
    with socket.socket() as probe:
        try:
            probe.bind(("", port))
        except OSError:
            raise UserError(f"MASTER_PORT {port} is already in use on {socket.gethostname()} (rank 0's node): "
                            "set MASTER_PORT to a free port") from None


def set_seed(seed):
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)


def resolve_device(choice, local_rank=0, share_gpus=None):
    """`auto` picks this process's GPU when there is one, else the CPU. With `share_gpus` (gloo),
    processes beyond the GPU count take turns on the GPUs there are; None: the script has no
    --backend to offer for it."""
    if choice == "cuda" and not torch.cuda.is_available():
        raise UserError("--device cuda was asked for, but torch sees no CUDA GPU")
    if choice == "cpu" or not torch.cuda.is_available():
        return torch.device("cpu")
    gpus = torch.cuda.device_count()
    if local_rank >= gpus and not share_gpus:
        offer = "" if share_gpus is None else ", or share the GPUs over --backend gloo"
        raise UserError(f"local rank {local_rank} has no GPU: this machine has {gpus}; start at most that many "
                        f"processes per machine{offer}", only_this_rank=True)
    return torch.device("cuda", local_rank % gpus)


def check_precision(precision, device):
    """Refuse, in one line, a precision the device cannot train in."""
    if precision == "fp16" and device.type == "cpu":
        raise UserError("--precision fp16 needs a GPU (CPUs emulate fp16, many times slower than fp32); "
                        "on CPU use --precision bf16 or fp32")
    if precision == "bf16" and device.type == "cuda" and torch.cuda.get_device_capability(device)[0] < 8:
        raise UserError(f"--precision bf16 needs a GPU from Ampere on; {torch.cuda.get_device_name(device)} "
                        "has no bf16: use --precision fp16 or fp32")


def computes_natively(precision, device):
    """Whether the hardware computes `precision` itself. torch has no query for CPUs: read their flags.
    GPUs: bf16 from Ampere (compute capability 8), fp16 tensor cores from Volta (7)."""
    if precision == "fp32":
        return True
    if device.type == "cuda":
        return torch.cuda.get_device_capability(device)[0] >= (8 if precision == "bf16" else 7)
    return bool(NATIVE_CPU_FLAGS[precision] & cpu_flags())


def cpu_flags():
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("flags"):
                return set(line.split(":", 1)[1].split())
    except OSError:
        pass
    return set()


def usable_cores():
    """The cores this process may run on: its CPU affinity, capped by the container's CPU quota.
    os.cpu_count() counts the whole machine's."""
    cores = len(os.sched_getaffinity(0))
    quota = cgroup_cpu_quota()
    return max(1, min(cores, int(quota))) if quota else cores


def cgroup_cpu_quota(root=Path("/sys/fs/cgroup")):
    """The container's CPU quota in cores (cgroup v2, else v1), or None when there is none."""
    try:
        quota, period = (root / "cpu.max").read_text().split()
        return None if quota == "max" else int(quota) / int(period)
    except (OSError, ValueError):
        pass
    try:
        quota = int((root / "cpu" / "cpu.cfs_quota_us").read_text())
        period = int((root / "cpu" / "cpu.cfs_period_us").read_text())
        return quota / period if quota > 0 else None
    except (OSError, ValueError):
        return None


def set_threads(requested, processes_on_this_machine):
    """The suite's one thread policy: each process gets an equal share of the usable cores (or
    --threads), whatever OMP_NUM_THREADS the launcher set (torchrun sets 1, spawn nothing), so that
    rows differ by strategy, not by thread count. More threads than cores make them wait on each other."""
    threads = requested or max(1, usable_cores() // processes_on_this_machine)
    torch.set_num_threads(threads)
    return threads


# ----------------------------------------------------------------------------- data

def load_records(path):
    """Read and check the [text, label] records; texts come word-segmented and are joined back."""
    path = Path(path)
    if not path.is_file():
        raise UserError(f"data file not found: {path}")
    try:
        raw = json.loads(path.read_text(encoding="utf-8"))
    except (json.JSONDecodeError, UnicodeDecodeError) as error:
        raise UserError(f"{path} is not valid JSON: {error}") from None
    if not isinstance(raw, list):
        raise UserError(f"{path} must hold a JSON list of [text, label] records, found {type(raw).__name__}")
    records = []
    for index, record in enumerate(raw):
        if not (isinstance(record, list) and len(record) == 2 and isinstance(record[0], str)):
            raise UserError(f"{path}: record {index} is not [text, label]: {str(record)[:80]}")
        text, label = normalize_text(record[0]), record[1]
        if isinstance(label, bool) or not isinstance(label, int) or not 0 <= label < len(LABELS):
            raise UserError(f"{path}: record {index} has label {label!r}; labels are integers 0-{len(LABELS) - 1}")
        if not text:
            raise UserError(f"{path}: record {index} has an empty text")
        records.append((text, label))
    return records


def normalize_text(text):
    """Texts come word-segmented with spaces; BERT's Chinese tokenizer wants the characters joined."""
    return "".join(text.split())


def split_records(records, max_samples, dev_ratio, seed):
    """Take the first `max_samples`, shuffle them with `seed`, hold out `dev_ratio` for dev.

    Depends on nothing but these arguments, so every strategy and process count trains and
    evaluates on exactly the same samples.
    """
    if max_samples > len(records):
        raise UserError(f"--max-samples {max_samples} asks for more records than the data has ({len(records)})")
    samples = records[:max_samples]
    random.Random(seed).shuffle(samples)
    dev_size = round(len(samples) * dev_ratio)
    if dev_size == 0 or dev_size == len(samples):
        raise UserError(f"--dev-ratio {dev_ratio} of {len(samples)} samples leaves an empty train or dev set")
    return samples[dev_size:], samples[:dev_size]


class EncodedDataset(Dataset):
    """Token ids computed once, up front: no tokenizer work in the training loop or per epoch."""

    def __init__(self, records, tokenizer, max_seq_len):
        texts = [text for text, _ in records]
        self.input_ids = tokenizer(texts, truncation=True, max_length=max_seq_len)["input_ids"]
        self.labels = [label for _, label in records]

    def __len__(self):
        return len(self.labels)

    def __getitem__(self, key):
        index, weight = key  # GlobalBatchSampler hands out (index, loss weight) pairs
        return index, self.input_ids[index], self.labels[index], weight


class PadToLongest:
    """Collate a batch padded to its own longest text, not to --max-seq-len: most texts are short."""

    def __init__(self, pad_id):
        self.pad_id = pad_id

    def __call__(self, batch):
        indices, sequences, labels, weights = zip(*batch)
        longest = max(len(ids) for ids in sequences)
        input_ids = torch.full((len(batch), longest), self.pad_id, dtype=torch.long)
        attention_mask = torch.zeros((len(batch), longest), dtype=torch.long)
        for row, ids in enumerate(sequences):
            input_ids[row, :len(ids)] = torch.tensor(ids)
            attention_mask[row, :len(ids)] = 1
        return {"index": torch.tensor(indices), "input_ids": input_ids, "attention_mask": attention_mask,
                "labels": torch.tensor(labels), "weight": torch.tensor(weights, dtype=torch.float32)}


class GlobalBatchSampler(Sampler):
    """Cuts each epoch into global batches (the samples of one optimizer step, over all processes and
    micro-batches) and yields this process's share of each micro-batch, as lists of (dataset index,
    loss weight).

    The loss-weighting rule every strategy follows: each sample weighs 1 / (samples in its global
    batch), whichever process and micro-batch holds it, so the weighted sums add up to the mean over
    the global batch, exactly as on one device, also when the last global batch of an epoch is short
    (then it has fewer micro-batches, or a short one). When a micro-batch does not split evenly, the
    processes with one sample fewer get a repeat of weight 0: every process runs the same number of
    batches (a collective never waits for a process that has finished), and no sample counts twice.

    Shuffled, each epoch is reordered with seed + epoch (the same order in every process); with
    length grouping, texts of similar length share a global batch, and the short last batch stays
    last so that every other batch is full.
    """

    def __init__(self, lengths, batch_size, num_replicas=1, rank=0, shuffle=True, group_by_length=True, seed=0,
                 accumulation_steps=1):
        self.lengths, self.batch_size, self.num_replicas, self.rank = lengths, batch_size, num_replicas, rank
        self.shuffle, self.group_by_length, self.seed, self.epoch = shuffle, group_by_length, seed, 0
        self.micro_batch_size = batch_size * num_replicas  # over all processes
        self.global_batch_size = self.micro_batch_size * accumulation_steps

    def set_epoch(self, epoch):
        self.epoch = epoch

    def __len__(self):
        return sum(self.micro_batches_per_step())

    def global_batch_sizes(self):
        """Samples in each global batch of an epoch, in order (the same for every epoch)."""
        full, rest = divmod(len(self.lengths), self.global_batch_size)
        return [self.global_batch_size] * full + [rest] * bool(rest)

    def micro_batches_per_step(self):
        """Micro-batches in each global batch of an epoch: all of them full but the last one's."""
        return [math.ceil(size / self.micro_batch_size) for size in self.global_batch_sizes()]

    def global_batches(self):
        size, count = self.global_batch_size, len(self.lengths)
        order = list(range(count))
        if self.shuffle:
            generator = torch.Generator().manual_seed(self.seed + self.epoch)
            order = torch.randperm(count, generator=generator).tolist()
        if self.shuffle and self.group_by_length:
            # Sort chunks of 50 global batches by length, then shuffle the order of the full batches.
            chunk = 50 * size
            order = [i for start in range(0, count, chunk)
                     for i in sorted(order[start:start + chunk], key=self.lengths.__getitem__, reverse=True)]
        batches = [order[start:start + size] for start in range(0, count, size)]
        if self.shuffle and self.group_by_length:
            full = count // size
            batches = [batches[b] for b in torch.randperm(full, generator=generator).tolist()] + batches[full:]
        return batches

    def __iter__(self):
        for batch in self.global_batches():
            weight = 1 / len(batch)
            for start in range(0, len(batch), self.micro_batch_size):
                micro_batch = batch[start:start + self.micro_batch_size]
                share = micro_batch[self.rank::self.num_replicas]
                repeats = math.ceil(len(micro_batch) / self.num_replicas) - len(share)
                yield [(index, weight) for index in share] + [(micro_batch[0], 0.0)] * repeats


def train_sampler(dataset, args, num_replicas=1, rank=0):
    """The training sampler: this process's share of every micro-batch of every global batch,
    reshuffled per epoch."""
    return GlobalBatchSampler([len(ids) for ids in dataset.input_ids], args.batch_size, num_replicas, rank,
                              shuffle=not args.no_shuffle, group_by_length=args.group_by_length, seed=args.seed,
                              accumulation_steps=args.grad_accum)


def eval_sampler(dataset, args, num_replicas=1, rank=0):
    """Dev samples in order, split over processes; the repeats that even out the last batch weigh 0,
    and evaluation drops them."""
    return GlobalBatchSampler([len(ids) for ids in dataset.input_ids], args.batch_size, num_replicas, rank,
                              shuffle=False)


def make_loader(dataset, args, tokenizer, batch_sampler):
    # A generator of its own: each epoch's iterator draws a seed from it, not from torch's global
    # generator, so the dropout masks after a --resume are those of the uninterrupted run. Pinned
    # memory only for GPU processes: pinning opens a CUDA context, on GPU 0, even in a --device cpu run.
    pin_memory = args.device != "cpu" and torch.cuda.is_available()
    return DataLoader(dataset, batch_sampler=batch_sampler, collate_fn=PadToLongest(tokenizer.pad_token_id),
                      num_workers=args.num_workers, pin_memory=pin_memory,
                      generator=torch.Generator().manual_seed(args.seed))


def each_sample_once(indices, weights, *columns):
    """Keep the real samples of gathered evaluation outputs (weight > 0), in dataset order; the
    repeats that evened out the processes' batches weigh 0."""
    real = weights > 0
    order = np.argsort(indices[real], kind="stable")
    return (indices[real][order], *(column[real][order] for column in columns))


# ----------------------------------------------------------------------------- model

def resolve_model(choice):
    """Turn --model into 'tiny', a local folder or a hub id; 'auto' falls back step by step. Call it
    in one process and share the answer: processes that probe the network each on its own may
    disagree."""
    if choice != "auto":
        return choice
    if LOCAL_MODEL_DIR.is_dir():
        return str(LOCAL_MODEL_DIR)
    if hub_has(HUB_MODEL_ID):
        return HUB_MODEL_ID
    banner = "=" * 78
    print(f"{banner}\n No {LOCAL_MODEL_DIR.relative_to(ROOT)} and no reachable hub: using the TINY randomly"
          f"\n initialised BERT. Figures measure the strategies, not Chinese BERT quality."
          f"\n See model_hub/README.md to get {HUB_MODEL_ID}.\n{banner}", file=sys.stderr)
    return "tiny"


def hub_has(model_id):
    """True when the hub model is cached locally or the hub answers within a few seconds."""
    from huggingface_hub import constants, try_to_load_from_cache
    if isinstance(try_to_load_from_cache(model_id, "config.json"), str):
        return True
    if constants.HF_HUB_OFFLINE:
        return False
    host = constants.ENDPOINT.split("://")[-1].split("/")[0]
    try:
        socket.create_connection((host, 443), timeout=3).close()
        return True
    except OSError:
        return False


def character_vocabulary(train_texts):
    """BERT's special tokens, then the characters of the training texts, most frequent first.

    BERT's tokenizer splits Chinese into characters but keeps Latin words and digits whole, then
    cuts them into "##"-continued pieces: every character comes in both forms.
    """
    counts = collections.Counter(char for text in train_texts for char in text.lower())
    chars = sorted(counts, key=lambda char: (-counts[char], char))
    return ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]"] + chars + [f"##{char}" for char in chars]


def randomly_initialised(vocab, config, seed):
    """A tokenizer over `vocab` and a BERT classifier of `config` with weights drawn from `seed`."""
    tokenizer = transformers.BertTokenizer(vocab={token: i for i, token in enumerate(vocab)})
    with torch.random.fork_rng():
        torch.manual_seed(seed)
        model = transformers.BertForSequenceClassification(config)
    return tokenizer, model


def build_tiny_model(train_texts, seed, config_overrides):
    """A 2-layer BERT (hidden 128) with a character vocabulary from the training texts.

    Deterministic from the texts and the seed, built in a second, no download: what tests and
    machines without the real weights use.
    """
    vocab = character_vocabulary(train_texts)
    config = transformers.BertConfig(vocab_size=len(vocab), hidden_size=128, num_hidden_layers=2,
                                     num_attention_heads=2, intermediate_size=512, max_position_embeddings=512,
                                     **config_overrides)
    return randomly_initialised(vocab, config, seed)


def base_shape_config():
    """The architecture values of hfl/chinese-bert-wwm-ext's published config.json."""
    return read_json_object(BASE_SHAPE_CONFIG, "model config")["config"]


def build_base_shape_model(train_texts, seed, config_overrides):
    """hfl/chinese-bert-wwm-ext's exact architecture (BERT-base, vocabulary 21,128) with random weights.

    The tokenizer knows the tiny model's characters; unused tokens fill the vocabulary up to the
    real size, so that the embedding matrix, and with it every figure of memory and communication,
    has the real model's shape. Deterministic from the texts and the seed, no download.
    """
    values = base_shape_config()
    vocab = character_vocabulary(train_texts)
    if len(vocab) > values["vocab_size"]:
        raise UserError(f"the training texts have {len(vocab)} tokens, more than base-shape's vocabulary of "
                        f"{values['vocab_size']}: use fewer --max-samples")
    vocab += [f"[unused{i}]" for i in range(values["vocab_size"] - len(vocab))]
    return randomly_initialised(vocab, transformers.BertConfig(**values, **config_overrides), seed)


def parameter_count(model):
    """The model's parameters, whole even where a strategy shards them (DeepSpeed ZeRO-3 keeps the
    whole count in ds_numel; an FSDP2 DTensor's numel() is the whole tensor's)."""
    return sum(getattr(p, "ds_numel", p.numel()) for p in model.parameters())


def load_model(args, train_texts, name):
    """Return (tokenizer, model, model name, learning rate) for the resolved --model `name`, with the
    6 emotion labels."""
    overrides = {"num_labels": len(LABELS), "id2label": dict(enumerate(LABELS)),
                 "label2id": {label: i for i, label in enumerate(LABELS)}}
    if args.dropout is not None:
        overrides.update(hidden_dropout_prob=args.dropout, attention_probs_dropout_prob=args.dropout,
                         classifier_dropout=args.dropout)
    if name == "tiny":
        tokenizer, model = build_tiny_model(train_texts, args.seed, overrides)
    elif name == "base-shape":
        tokenizer, model = build_base_shape_model(train_texts, args.seed, overrides)
    else:
        tokenizer, model = load_pretrained(name, args.seed, overrides)
    max_positions = model.config.max_position_embeddings
    if args.max_seq_len > max_positions:
        raise UserError(f"--max-seq-len {args.max_seq_len} exceeds the model's {max_positions} positions")
    if args.gradient_checkpointing:
        # Non-reentrant checkpointing: the form DDP, FSDP2 and the rest accept without special cases.
        model.activation_checkpointing_enable(activation_checkpointing_kwargs={"use_reentrant": False})
    lr = args.lr if args.lr is not None else DEFAULT_LR.get(name, DEFAULT_LR["pretrained"])
    return tokenizer, model, name, lr


def load_pretrained(name, seed, overrides):
    if not Path(name).is_dir() and (name.startswith((".", "/")) or name.count("/") != 1):
        raise UserError(f"model not found: {name} is neither a folder nor a hub id like {HUB_MODEL_ID}")
    try:
        tokenizer = transformers.AutoTokenizer.from_pretrained(name)
        with torch.random.fork_rng():
            torch.manual_seed(seed)  # the new classification head starts the same in every process
            model = transformers.AutoModelForSequenceClassification.from_pretrained(name, **overrides)
    except (OSError, ValueError) as error:
        first_line = str(error).strip().splitlines()[0] if str(error).strip() else type(error).__name__
        raise UserError(f"could not load model {name}: {first_line}") from None
    return tokenizer, model


def make_optimizer(model, lr, weight_decay):
    """AdamW without weight decay on biases and LayerNorm weights, as BERT was trained."""
    decay, no_decay = [], []
    for name, param in model.named_parameters():
        (no_decay if param.ndim < 2 else decay).append(param)
    return torch.optim.AdamW([{"params": decay, "weight_decay": weight_decay},
                              {"params": no_decay, "weight_decay": 0.0}], lr=lr)


# ----------------------------------------------------------------------------- strategy

class Strategy:
    """How one process trains: the defaults are a single device. Scripts override what differs."""

    name = "single-device"
    launcher = "python"

    def __init__(self, device, rank=0, world_size=1, precision="fp32", local_world_size=1):
        self.device, self.rank, self.world_size, self.precision = device, rank, world_size, precision
        self.local_world_size = local_world_size  # processes on this machine, which share its cores

    @property
    def is_main(self):
        return self.rank == 0

    def gpus(self):
        """The GPUs whose random generators this process draws from (dropout): its own."""
        if self.device.type != "cuda":
            return []
        return [self.device.index if self.device.index is not None else torch.cuda.current_device()]

    def autocast(self):
        return contextlib.nullcontext()

    def accumulating(self, model, last):
        """The context of one micro-batch's forward and backward; `last` ends the optimizer step's
        micro-batches (gradient accumulation). One device just adds up the gradients."""
        return contextlib.nullcontext()

    def backward(self, loss):
        loss.backward()

    def step(self, model, optimizer):
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)

    def reduce_mean(self, tensor):
        """The average of `tensor` over all processes (off the training step's path: logging, totals, checks)."""
        return tensor

    def gather(self, tensor):
        """`tensor` from every process, concatenated along dim 0 (same shape on every process)."""
        return tensor

    def unwrap(self, model):
        return model

    def save_model(self, model, tokenizer, path):
        if self.is_main:
            save_model(self.unwrap(model), tokenizer, path)

    def broadcast_object(self, value):
        """Rank 0's `value` in every process."""
        return value

    def gather_objects(self, value):
        """Every process's `value`, in rank order, in every process."""
        return [value]

    def save_state(self, model, optimizer, path, state):
        """Write a training checkpoint: the weights, the optimizer moments and `state` (the step, what
        it means, every process's random states, the strategy's own). Rank 0 writes it into a staged
        folder swapped in whole: a half-written checkpoint is never taken for one."""
        if self.is_main:
            with staged_dir(path) as staging:
                write_training_state(staging, {"model": self.unwrap(model).state_dict(),
                                               "optimizer": optimizer.state_dict(), **state})

    def checkpoint_meaning(self, path):
        """The step and settings of the complete checkpoint in `path`, or None when there is none."""
        path = Path(path)
        if not (path / CHECKPOINT_FILE).is_file() or not (path / MEANING_FILE).is_file():
            return None
        return json.loads((path / MEANING_FILE).read_text(encoding="utf-8"))

    def load_state(self, model, optimizer, path):
        """Restore a `save_state` checkpoint in every process; returns its `state`. weights_only: a
        checkpoint someone hands you holds tensors and plain values, and loading it runs no code."""
        # Loaded to the CPU; load_state_dict copies each tensor to where its parameter lives.
        state = torch.load(Path(path) / CHECKPOINT_FILE, map_location="cpu", weights_only=True)
        self.unwrap(model).load_state_dict(state.pop("model"))
        optimizer.load_state_dict(state.pop("optimizer"))
        return state

    def extra_state(self):
        """The strategy's own state that --resume restores (a gradient scaler's), as plain values."""
        return {}

    def load_extra_state(self, state):
        pass

    def versions(self):
        """Versions of the strategy's own libraries, for the result file."""
        return {}

    def result_extras(self):
        """The strategy's own entries for the result file (they may refine the common ones)."""
        return {}


class TorchDistributed(Strategy):
    """The Trainer's collectives (logging, evaluation, checkpoints) over torch.distributed (DDP and DeepSpeed)."""

    def broadcast_object(self, value):
        values = [value]
        dist.broadcast_object_list(values, src=0)
        return values[0]

    def gather_objects(self, value):
        values = [None] * self.world_size
        dist.all_gather_object(values, value)
        return values

    def reduce_mean(self, tensor):
        # SUM then divide by the world size: ReduceOp.AVG exists only on NCCL.
        tensor = tensor.clone()
        dist.all_reduce(tensor)
        return tensor / self.world_size

    def gather(self, tensor):
        parts = [torch.empty_like(tensor) for _ in range(self.world_size)]
        dist.all_gather(parts, tensor.contiguous())
        return torch.cat(parts)


def backend_for(device, choice="auto"):
    """NCCL between GPUs, Gloo between CPU processes: the only difference between the two paths."""
    if choice == "nccl" and device.type == "cpu":
        raise UserError("--backend nccl needs GPUs; CPU processes talk over gloo (--backend auto or gloo)")
    if choice != "auto":
        return choice
    return "nccl" if device.type == "cuda" else "gloo"


# ----------------------------------------------------------------------------- training

class Trainer:
    """The train / evaluate / save loop every strategy runs."""

    def __init__(self, args, strategy, model, optimizer, tokenizer, train_loader, dev_loader, model_name, lr):
        self.args, self.strategy, self.model, self.optimizer = args, strategy, model, optimizer
        self.tokenizer, self.train_loader, self.dev_loader = tokenizer, train_loader, dev_loader
        self.model_name, self.lr = model_name, lr
        self.output_dir = Path(args.output_dir)
        self.global_batch_size = train_loader.batch_sampler.global_batch_size  # samples per optimizer step
        self.threads = set_threads(args.threads, strategy.local_world_size)
        self.native_precision = computes_natively(strategy.precision, strategy.device)

    def log(self, message):
        if self.strategy.is_main:
            tqdm.write(message)

    def to_device(self, batch):
        return {key: value.to(self.strategy.device, non_blocking=True) for key, value in batch.items()}

    def forward(self, batch):
        """Logits, and this process's part of the global batch's mean loss (computed here, not inside
        the model, so that every strategy weighs samples the same way)."""
        with self.strategy.autocast():
            logits = self.model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits
        per_sample = F.cross_entropy(logits.float(), batch["labels"], reduction="none")
        # The loss-weighting rule (see GlobalBatchSampler): weighted by 1 / (samples in the global
        # batch), the sums over processes and micro-batches add up to the single-device mean. Every
        # library here averages the gradients over the processes; multiplying by their count turns
        # that average into the sum.
        return logits, (per_sample * batch["weight"]).sum() * self.strategy.world_size

    def log_start(self):
        """The first lines every script prints: what this run is."""
        strategy = self.strategy
        self.log(f"model: {self.model_name} ({parameter_count(self.model):,} parameters) | "
                 f"learning rate: {self.lr:g} | processes: {strategy.world_size} | "
                 f"global batch: {self.global_batch_size} | "
                 f"train samples: {len(self.train_loader.dataset)} | dev samples: {len(self.dev_loader.dataset)} | "
                 f"threads per process: {self.threads}")
        if not self.native_precision:
            self.log(f"note: this {strategy.device.type} has no native {strategy.precision}: torch emulates it, "
                     f"slower than fp32 here (where the hardware has it, mixed precision is faster)")

    def fit(self):
        """Train, evaluate on dev, save the model (rank 0) and write result.json (rank 0)."""
        self.log_start()
        first_step = self.resume_step()
        model_state = measure.ModelStateCount(self.strategy, self.model, self.optimizer)
        allreduces = measure.gradient_allreduce_count(self.model)
        measure.inject_failure(self.strategy, first_step)  # the tests' SUITE_FAIL_AT
        profile = None
        if self.args.profile:
            profile = measure.StepProfile(self, self.args.profile, self.total_steps() - first_step)
        with profile or contextlib.nullcontext():
            progress = self.train(first_step)
        metrics = self.evaluate()
        self.strategy.save_model(self.model, self.tokenizer, self.output_dir / "model")
        return self.write_result(progress, metrics, first_step, model_state, allreduces, profile)

    def write_result(self, progress, metrics, first_step, model_state, allreduces, profile=None):
        """result.json, built here alone for every script (multi-gpu-transformers-cls.py measures the
        library's loop and calls this too): the run's fields, then what the measurements counted.
        Rank 0 prints the report and writes the file."""
        strategy = self.strategy
        result = self.result(progress, metrics)
        result["resumed_from_step"] = first_step
        result.update(model_state.result_fields(strategy.device, result["peak_memory_mb"]))
        result["model_state_formula_bytes"] = measure.zero_formula(strategy, self.model)
        if allreduces:
            result["gradient_allreduces"] = allreduces.calls
        if profile and strategy.is_main:
            result["profile"] = profile.summary()
        if self.strategy.is_main:
            self.report(result, metrics)
            write_json(self.output_dir / "result.json", result)
        return result

    def meaning(self):
        """What a step of this run means: a checkpoint resumes only into a run where all of it is equal
        (the precision too: an fp16 run's checkpoint holds a gradient scaler, DeepSpeed's 16-bit weights)."""
        args, strategy = self.args, self.strategy
        return {"world_size": strategy.world_size, "batch_size_per_process": args.batch_size,
                "global_batch_size": self.global_batch_size, "gradient_accumulation_steps": args.grad_accum,
                "data": str(Path(args.data).resolve()),
                "max_samples": args.max_samples, "dev_ratio": args.dev_ratio, "seed": args.seed,
                "shuffle": not args.no_shuffle, "group_by_length": args.group_by_length, "model": self.model_name,
                "precision": strategy.precision}

    def save_checkpoint(self, step):
        state = {"step": step, "meaning": self.meaning(),
                 "random_states": self.strategy.gather_objects(random_states(self.strategy.gpus())),
                 "strategy_state": self.strategy.extra_state()}
        self.strategy.save_state(self.model, self.optimizer, self.output_dir / "checkpoint", state)

    def resume_step(self):
        """With --resume, restore the checkpoint in --output-dir and return its step (else 0). Rank 0
        decides whether there is one; every process must be able to read it."""
        checkpoint, strategy = self.output_dir / "checkpoint", self.strategy
        if not self.args.resume:
            return 0
        saved = strategy.checkpoint_meaning(checkpoint)
        if not strategy.broadcast_object(saved is not None):
            self.log(f"--resume: no checkpoint in {checkpoint}, starting from step 0")
            return 0
        if strategy.reduce_mean(torch.tensor(float(saved is not None), device=strategy.device)).item() < 1:
            raise UserError(f"--resume: rank 0 found a checkpoint in {checkpoint} that another process cannot "
                            "read: --output-dir must be on a filesystem every machine shares")
        differences = [f"{key} {saved.get(key)!r} (now {value!r})" for key, value in self.meaning().items()
                       if saved.get(key) != value]
        if differences:
            raise UserError(f"--resume: the checkpoint in {checkpoint} was written with " + ", ".join(differences)
                            + ": its step means other samples here. Resume with its settings, or remove it")
        state = strategy.load_state(self.model, self.optimizer, checkpoint)
        set_random_states(state["random_states"][strategy.rank])
        strategy.load_extra_state(state["strategy_state"])
        self.log(f"--resume: continuing from step {state['step']} ({checkpoint})")
        return state["step"]

    def epoch_steps(self):
        """Optimizer steps in --epochs epochs."""
        return len(self.train_loader.batch_sampler.micro_batches_per_step()) * self.args.epochs

    def total_steps(self):
        """The steps this run trains: --epochs' worth, or --max-steps when it stops sooner."""
        return min(self.epoch_steps(), self.args.max_steps or self.epoch_steps())

    def train(self, first_step=0):
        """The training loop; returns what it did: seconds, steps, samples and tokens, last loss."""
        args, strategy = self.args, self.strategy
        sampler = self.train_loader.batch_sampler
        micro_batches_per_step = sampler.micro_batches_per_step()  # N, the last step of an epoch maybe fewer
        steps_per_epoch = len(micro_batches_per_step)
        total_steps = self.total_steps()
        global_batch_sizes = sampler.global_batch_sizes()
        progress = tqdm(total=total_steps, initial=first_step, disable=not strategy.is_main, mininterval=1,
                        dynamic_ncols=True)
        step, paused_seconds, samples = first_step, 0.0, 0
        tokens = torch.zeros(2, dtype=torch.float64)  # real and computed (padding included), this process
        loss_sum = torch.zeros((), device=strategy.device)
        losses_summed, last_loss = 0, float("nan")
        reset_peak_memory(strategy.device)
        synchronize(strategy.device)
        start = time.perf_counter()
        for epoch in range(first_step // steps_per_epoch + 1, math.ceil(total_steps / steps_per_epoch) + 1):
            sampler.set_epoch(epoch)  # a new shuffle each epoch, the same in every process
            self.model.train()
            # On resume, pass over the micro-batches of the steps the checkpoint has already taken.
            done_this_epoch = max(0, first_step - (epoch - 1) * steps_per_epoch)
            batches = itertools.islice(self.train_loader, sum(micro_batches_per_step[:done_this_epoch]), None)
            last_step_in_epoch = min(steps_per_epoch, total_steps - (epoch - 1) * steps_per_epoch)  # --max-steps
            for step_in_epoch in range(done_this_epoch, last_step_in_epoch):
                # One optimizer step: the gradients of its micro-batches add up (--grad-accum), each
                # sample weighed by 1 / (samples in the step), then one update.
                micro_batches = micro_batches_per_step[step_in_epoch]
                for micro_batch, batch in enumerate(itertools.islice(batches, micro_batches)):
                    tokens += count_tokens(batch)
                    batch = self.to_device(batch)
                    with strategy.accumulating(self.model, last=micro_batch == micro_batches - 1):
                        _, loss = self.forward(batch)
                        strategy.backward(loss)
                    loss_sum += loss.detach()
                strategy.step(self.model, self.optimizer)
                step += 1
                samples += global_batch_sizes[step_in_epoch]
                losses_summed += 1
                progress.update()
                if step % args.log_steps == 0 or step == total_steps:
                    # Reading the loss makes the CPU wait for the device (.item()) and the other
                    # processes (reduce_mean): on logging steps only. Not a step's only wait: fp16's
                    # loss scaling (GradScaler, DeepSpeed's) reads whether the gradients overflowed,
                    # Horovod's step waits for its all-reduces.
                    last_loss = strategy.reduce_mean(loss_sum / losses_summed).item()
                    loss_sum.zero_()
                    losses_summed = 0
                    self.log(f"【train】 epoch：{epoch}/{args.epochs} step：{step}/{total_steps} loss：{last_loss:.6f}")
                if args.save_steps and step % args.save_steps == 0 and step != total_steps:
                    pause = time.perf_counter()
                    self.save_checkpoint(step)
                    paused_seconds += time.perf_counter() - pause
                if args.eval_steps and step % args.eval_steps == 0 and step != total_steps:
                    pause = time.perf_counter()
                    metrics = self.evaluate()
                    self.log(f"【dev】 step：{step} loss：{metrics['loss']:.6f} accuracy：{metrics['accuracy']:.4f}")
                    self.model.train()
                    paused_seconds += time.perf_counter() - pause
        synchronize(strategy.device)
        seconds = time.perf_counter() - start - paused_seconds
        progress.close()
        # The whole job's tokens: the sum over processes.
        tokens = strategy.reduce_mean(tokens.to(strategy.device)).cpu() * strategy.world_size
        return {"seconds": seconds, "steps": step, "samples": samples, "last_loss": last_loss,
                "real_tokens": tokens[0].item(), "computed_tokens": tokens[1].item()}

    @torch.no_grad()
    def evaluate(self):
        """Dev metrics over every dev sample exactly once, whatever the number of processes."""
        self.model.eval()
        indices, weights, predictions, labels, losses = [], [], [], [], []
        for batch in self.dev_loader:
            batch = self.to_device(batch)
            logits, _ = self.forward(batch)
            indices.append(batch["index"])
            weights.append(batch["weight"])
            predictions.append(logits.argmax(dim=-1))
            labels.append(batch["labels"])
            losses.append(F.cross_entropy(logits.float(), batch["labels"], reduction="none"))
        gathered = [self.strategy.gather(torch.cat(part)).cpu().numpy()
                    for part in (indices, weights, predictions, labels, losses)]
        indices, predictions, labels, losses = each_sample_once(*gathered)
        if not np.array_equal(indices, np.arange(len(self.dev_loader.dataset))):
            raise RuntimeError(f"evaluated {len(np.unique(indices))} distinct of {len(self.dev_loader.dataset)} "
                               f"dev samples in {len(indices)} predictions")
        return {"samples": len(indices), "loss": float(losses.mean()),
                "accuracy": float(accuracy_score(labels, predictions)),
                "macro_f1": float(f1_score(labels, predictions, average="macro", labels=range(len(LABELS)),
                                           zero_division=0)),
                "report": classification_report(labels, predictions, labels=range(len(LABELS)),
                                                target_names=LABELS, digits=4, zero_division=0)}

    def result(self, progress, metrics):
        args, strategy = self.args, self.strategy
        samples = max(progress["samples"], 1)
        return {
            "strategy": strategy.name,
            "launcher": "srun" if srun_started_this_process else strategy.launcher,
            "world_size": strategy.world_size,
            "device": device_description(strategy.device),
            "threads_per_process": self.threads,
            "model": self.model_name,
            "parameters": parameter_count(self.model),
            "precision": strategy.precision,
            "precision_native": self.native_precision,
            "batch_size_per_process": args.batch_size,
            "global_batch_size": self.global_batch_size,
            "gradient_accumulation_steps": args.grad_accum,
            "epochs": args.epochs,
            "steps": progress["steps"],
            "max_steps": args.max_steps or None,
            "stopped_early": progress["steps"] < self.epoch_steps(),  # by --max-steps, before the last epoch's end
            "learning_rate": self.lr,
            "train_samples": len(self.train_loader.dataset),
            "samples_trained": progress["samples"],
            "train_seconds": round(progress["seconds"], 3),
            "samples_per_second": round(progress["samples"] / progress["seconds"], 2),
            "tokens_per_sample": round(progress["real_tokens"] / samples, 2),
            "padded_tokens_per_sample": round((progress["computed_tokens"] - progress["real_tokens"]) / samples, 2),
            "peak_memory_mb": round(peak_memory_mb(strategy.device), 1),
            "final_train_loss": progress["last_loss"],
            "dev_loss": metrics["loss"],
            "dev_accuracy": metrics["accuracy"],
            "dev_macro_f1": metrics["macro_f1"],
            "dev_samples": metrics["samples"],
            "command": " ".join([Path(sys.argv[0]).name] + sys.argv[1:]),
            "versions": {"python": sys.version.split()[0], "torch": torch.__version__,
                         "transformers": transformers.__version__, **strategy.versions()},
            **strategy.result_extras(),
        }

    def report(self, result, metrics):
        print(f"【dev】 loss：{metrics['loss']:.6f} accuracy：{metrics['accuracy']:.4f} "
              f"macro-F1：{metrics['macro_f1']:.4f}")
        print(metrics["report"])
        print(f"耗时：{result['train_seconds'] / 60:.2f}分钟")
        precision = result["precision"]
        if not result["precision_native"]:
            precision += f" (emulated on this {self.strategy.device.type})"
        print(f"strategy {result['strategy']} ({result['launcher']}, {result['world_size']} process(es) x "
              f"{result['threads_per_process']} thread(s), {result['device']}, {precision}) | model {result['model']}")
        print(f"training loop only: {result['train_seconds']:.1f} s, {result['samples_per_second']:.1f} samples/s, "
              f"{result['tokens_per_sample']:.1f} tokens + {result['padded_tokens_per_sample']:.1f} padding "
              f"per sample, peak memory {result['peak_memory_mb']:.0f} MB (rank 0)")
        if result["stopped_early"]:
            print(f"stopped by --max-steps after {result['steps']} optimizer steps, before the end of "
                  f"{result['epochs']} epoch(s): {result['samples_trained']} samples trained")
        if result["model_state_bytes"]:
            held, formula = result["model_state_bytes"], result["model_state_formula_bytes"]
            print("model state held by rank 0: " + ", ".join(f"{name.replace('_', ' ')} {held[name] / 2**20:.2f} MB"
                                                            for name in ("parameters", "gradients", "optimizer_state"))
                  + f"; the ZeRO formula for stage {formula['zero_stage']} over {formula['processes']} process(es): "
                  + f"{formula['total'] / 2**20:.2f} MB in all (measured {held['total'] / 2**20:.2f} MB)")
        if "peak_memory_beyond_model_state_mb" in result:
            offloaded = result["model_state_bytes_by_device"].get("cpu", 0)
            bucket = result.get("reduce_bucket_bytes")
            print(f"peak GPU memory beyond the model state on the GPU (activations, buffers"
                  + (f", DeepSpeed's reduce bucket {bucket / 2**20:.0f} MB" if bucket else "")
                  + f"): {result['peak_memory_beyond_model_state_mb']:.0f} MB"
                  + (f"; model state offloaded to CPU memory: {offloaded / 2**20:.2f} MB" if offloaded else ""))
        if "profile" in result:
            profile = result["profile"]
            print(f"step anatomy (rank 0, {profile['steps']} steps recorded): {profile['step_ms']:.1f} ms per step = "
                  + " + ".join(f"{name} {ms:.1f}" for name, ms in profile["phases_ms"].items())
                  + f" (+ {profile['unaccounted_ms']:.1f} elsewhere); communication overlapped with computing: "
                  + f"{profile['overlapped_communication_ms']:.1f} ms; trace: {self.output_dir / 'trace.json'}")
        print(f"dev: {result['dev_samples']} samples, accuracy {result['dev_accuracy']:.4f}, "
              f"macro-F1 {result['dev_macro_f1']:.4f}, loss {result['dev_loss']:.4f}")
        print(f"saved: {self.output_dir / 'model'} and {self.output_dir / 'result.json'}")


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


def count_tokens(batch):
    """Real tokens of the batch's real samples, and tokens computed (padding and repeats included)."""
    real = batch["attention_mask"][batch["weight"] > 0].sum()
    return torch.tensor([real.item(), batch["input_ids"].numel()], dtype=torch.float64)


def synchronize(device):
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def device_description(device):
    if device.type == "cuda":
        return f"cuda ({torch.cuda.get_device_name(device)})"
    return "cpu"


def reset_peak_memory(device):
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)


def peak_memory_mb(device):
    """Peak GPU memory allocated by torch on CUDA; peak resident memory of the process on CPU."""
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device) / 2**20
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


# ----------------------------------------------------------------------------- saving

def save_model(model, tokenizer, path, state_dict=None):
    """Write a portable model folder (safetensors, config, tokenizer) atomically: build it next to
    `path`, then swap it in, so an interrupted run never leaves a half-written checkpoint. A sharded
    model passes its gathered `state_dict`."""
    with staged_dir(path) as staging:
        model.save_pretrained(staging, state_dict=state_dict)
        tokenizer.save_pretrained(staging)


@contextlib.contextmanager
def staged_dir(path):
    """Yield an empty folder next to `path`; when the block succeeds it replaces `path`, when it
    fails (or is interrupted) it is removed, and `path` keeps its previous contents."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    staging = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    shutil.rmtree(staging, ignore_errors=True)
    staging.mkdir()
    try:
        yield staging
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise
    replace_dir(staging, path)


@contextlib.contextmanager
def staged_checkpoint(path, state, is_main, barrier):
    """Yield the staging folder of a training checkpoint that every process writes part of (its
    shards), by a collective save that returns once all of them are written. Rank 0 empties it
    first; after the block it adds `state` and swaps the folder in whole, so an interrupted save
    leaves the previous checkpoint whole. `barrier()` waits for every process."""
    staging = path.with_name(f".{path.name}.staging")  # the same name in every process
    if is_main:
        shutil.rmtree(staging, ignore_errors=True)
    barrier()
    yield staging
    if is_main:
        write_training_state(staging, state)
        replace_dir(staging, path)
    barrier()


def write_training_state(folder, state):
    """The checkpoint's state, and beside it what its step means, readable by a person."""
    torch.save(state, folder / CHECKPOINT_FILE)
    write_json(folder / MEANING_FILE, {"step": state["step"], **state["meaning"]})


def replace_dir(staging, path):
    """Put the complete folder `staging` in the place of `path`, whose old contents are removed."""
    old = path.with_name(f".{path.name}.old-{os.getpid()}")
    if path.exists():
        path.rename(old)
    staging.rename(path)
    shutil.rmtree(old, ignore_errors=True)


def read_json_object(path, what):
    """The JSON object in `path` (a config file), or one clear error naming the file."""
    try:
        config = json.loads(Path(path).read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise UserError(f"{what} not found: {path}") from None
    except (json.JSONDecodeError, UnicodeDecodeError) as error:
        raise UserError(f"{path} is not valid JSON: {error}") from None
    if not isinstance(config, dict):
        raise UserError(f"{path} must hold a JSON object (a {what})")
    return config


def write_json(path, data):
    """Write JSON atomically: a reader sees the old file or the new one, never half of one."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    staging = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    staging.write_text(json.dumps(data, ensure_ascii=False, indent=2) + "\n", encoding="utf-8")
    os.replace(staging, path)


def prepare_data(args, strategy):
    """Load, split and encode the data and load the model for it; rank 0 resolves --model for all.

    Returns (train set, dev set, tokenizer, model, model name, learning rate).
    """
    records = load_records(args.data)
    train_records, dev_records = split_records(records, args.max_samples, args.dev_ratio, args.seed)
    name = strategy.broadcast_object(resolve_model(args.model) if strategy.is_main else None)
    tokenizer, model, model_name, lr = load_model(args, [text for text, _ in train_records], name)
    if name == "base-shape" and strategy.is_main:
        banner = "=" * 78
        print(f"{banner}\n base-shape: the architecture of {HUB_MODEL_ID} (BERT-base), {RANDOM_WEIGHTS_BANNER}"
              f"\n{banner}", file=sys.stderr)
    train_set = EncodedDataset(train_records, tokenizer, args.max_seq_len)
    dev_set = EncodedDataset(dev_records, tokenizer, args.max_seq_len)
    return train_set, dev_set, tokenizer, model, model_name, lr
