"""What every strategy script shares: the data, the training loop, and the collectives it runs on.

A strategy script builds a `Strategy` (its device, its rank, and how it runs backward, accumulates
gradients, steps the optimizer, averages a loss and gathers predictions across processes), wraps the
model its own way, and hands both to `Trainer`. Nothing in this file knows which strategy is running.
Read it top to bottom: the data every process loads alike, the loop, then the Strategy it calls.
The rest lives in support/, a module per duty (docs/architecture.md): options, launch (ranks),
machine (device, cores), models, checkpoints, callbacks (the points of the loop where a script's
instruments, from instruments/, hook in).
"""
import contextlib
import json
import math
import random
import unicodedata
from pathlib import Path
from typing import NamedTuple

import numpy as np
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.utils.data import DataLoader, Dataset, Sampler
from tqdm import tqdm

from support import checkpoints, launch, models, options
from support.errors import UserError
from support.machine import computes_natively, set_threads, use_attention_without_plans, use_tf32
from support.task import LABELS


# ----------------------------------------------------------------------------- data

class Prepared(NamedTuple):
    """What load_data_and_model returns: the encoded data, and the model with its tokenizer, its name
    and the learning rate chosen for it."""
    train_set: "EncodedDataset"
    dev_set: "EncodedDataset"
    tokenizer: object
    model: torch.nn.Module
    model_name: str
    lr: float


def load_data_and_model(args, strategy):
    """Load, split and encode the data, build the model for it and pick its learning rate (--lr, else
    the model's); rank 0 resolves --model for all."""
    use_tf32(args.tf32, strategy.device)  # before any model is built, or compiled
    use_attention_without_plans(strategy.device)
    records = load_records(args.data)
    train_records, dev_records = split_records(records, args.max_samples, args.dev_ratio, args.seed)
    name = strategy.broadcast_object(models.resolve_model(args.model) if strategy.is_main else None)
    texts = [text for text, _ in train_records]
    tokenizer, model, model_name, lr = models.load_model(args, texts, name, LABELS, announce=strategy.is_main)
    train_set = EncodedDataset(train_records, tokenizer, args.max_seq_len)
    dev_set = EncodedDataset(dev_records, tokenizer, args.max_seq_len)
    return Prepared(train_set, dev_set, tokenizer, model, model_name, lr)


def set_seed(seed):
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)


def load_records(path):
    """Read and check the [text, label] records; texts come word-segmented and are joined back."""
    path = Path(path)
    if path.is_dir():
        raise UserError(f"--data {path} is a folder: name its JSON file of [text, label] records, like data/train.json")
    if not path.is_file():
        raise UserError(f"data file not found: {path}")
    try:
        raw = json.loads(path.read_text(encoding="utf-8"))
    except (json.JSONDecodeError, UnicodeDecodeError) as error:
        raise UserError(f"{path} is not valid JSON: {error}") from None
    except OSError as error:  # not ours to read
        raise UserError(f"cannot read the data file {path}: {error.strerror}") from None
    if not isinstance(raw, list):
        raise UserError(f"{path} must hold a JSON list of [text, label] records, found {type(raw).__name__}")
    records = []
    for index, record in enumerate(raw):
        if not (isinstance(record, list) and len(record) == 2 and isinstance(record[0], str)):
            raise UserError(f"{path}: record {index} is not [text, label]: {str(record)[:80]}")
        text, label = normalize_text(record[0]), record[1]
        if isinstance(label, bool) or not isinstance(label, int) or not 0 <= label < len(LABELS):
            raise UserError(f"{path}: record {index} has label {label!r}; labels are integers 0-{len(LABELS) - 1}")
        if empty_text(text):
            raise UserError(f"{path}: record {index} has an empty text (only spaces, control or zero-width "
                            "characters)")
        records.append((text, label))
    return records


def normalize_text(text):
    """Texts come word-segmented with spaces; BERT's Chinese tokenizer wants the characters joined."""
    return "".join(text.split())


def empty_text(text):
    """Whether `text` holds nothing the tokenizer keeps: only spaces, control or format characters (the
    zero-width ones). The one rule by which training and predict.py refuse a text as empty."""
    return all(unicodedata.category(character).startswith("C") for character in normalize_text(text))


def split_records(records, max_samples, dev_ratio, seed):
    """Take the first `max_samples`, shuffle them with `seed`, hold out `dev_ratio` for dev.

    Depends on nothing but these arguments, so every strategy and process count trains and
    evaluates on exactly the same samples.
    """
    _, dev_size = options.split_sizes(max_samples, dev_ratio, len(records))
    samples = records[:max_samples]
    random.Random(seed).shuffle(samples)
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


class PadBatch:
    """Collate a batch padded to its longest text rounded up to a multiple of `multiple` tokens (at
    most `max_length`), not to --max-seq-len: most texts are short. With a multiple above 1 the steps
    repeat a handful of shapes, which a GPU needs: cuDNN, torch.compile and CUDA graphs each prepare
    once per new shape (--pad-to-multiple-of)."""

    def __init__(self, pad_id, multiple=1, max_length=math.inf):
        self.pad_id, self.multiple, self.max_length = pad_id, multiple, max_length

    def __call__(self, batch):
        indices, sequences, labels, weights = zip(*batch)
        longest = max(len(ids) for ids in sequences)
        length = min(math.ceil(longest / self.multiple) * self.multiple, self.max_length)  # texts are truncated to it
        input_ids = torch.full((len(batch), length), self.pad_id, dtype=torch.long)
        attention_mask = torch.zeros((len(batch), length), dtype=torch.long)
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
    With `fill`, repeats of weight 0 fill every short micro-batch to the full batch size, so that
    the steps' shapes differ only in length.

    Shuffled, each epoch is reordered with seed + epoch (the same order in every process); with
    length grouping, texts of similar length share a global batch, and the short last batch stays
    last so that every other batch is full.
    """

    def __init__(self, lengths, batch_size, num_replicas=1, rank=0, shuffle=True, group_by_length=True, seed=0,
                 accumulation_steps=1, fill=False):
        self.lengths, self.batch_size, self.num_replicas, self.rank = lengths, batch_size, num_replicas, rank
        self.shuffle, self.group_by_length, self.seed, self.epoch = shuffle, group_by_length, seed, 0
        self.fill = fill
        self.steps_skipped = 0
        self.micro_batch_size = batch_size * num_replicas  # over all processes
        self.global_batch_size = global_batch_size(batch_size, num_replicas, accumulation_steps)

    def set_epoch(self, epoch, steps_taken=0):
        """Epoch `epoch` (from 1) comes next. On resume, `steps_taken` of the run are in the checkpoint:
        the batches of this epoch's among them are skipped, not loaded."""
        self.epoch = epoch
        self.steps_skipped = max(0, steps_taken - (epoch - 1) * len(self.global_batch_sizes()))

    def __len__(self):
        return sum(self.micro_batches_per_step()[self.steps_skipped:])

    def steps(self, first_step, last_step):
        """(epoch, step, micro-batches in it) for the run's optimizer steps after first_step up to
        last_step, counted from 1 across epochs."""
        per_step = self.micro_batches_per_step()
        for step in range(first_step, last_step):
            epoch, step_in_epoch = divmod(step, len(per_step))
            yield epoch + 1, step + 1, per_step[step_in_epoch]

    def samples_in_step(self, step):
        """Samples in optimizer step `step` (counted from 1 across epochs): what the callbacks count."""
        sizes = self.global_batch_sizes()
        return sizes[(step - 1) % len(sizes)]

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
        for batch in self.global_batches()[self.steps_skipped:]:
            weight = 1 / len(batch)
            for start in range(0, len(batch), self.micro_batch_size):
                micro_batch = batch[start:start + self.micro_batch_size]
                share = micro_batch[self.rank::self.num_replicas]
                share_size = self.batch_size if self.fill else math.ceil(len(micro_batch) / self.num_replicas)
                repeats = share_size - len(share)
                yield [(index, weight) for index in share] + [(micro_batch[0], 0.0)] * repeats


def global_batch_size(batch_size, world_size, accumulation_steps):
    """Samples per optimizer step: --batch-size per process and micro-batch, x processes, x --grad-accum."""
    return batch_size * world_size * accumulation_steps


def train_sampler(dataset, args, num_replicas=1, rank=0):
    """The training sampler: this process's share of every micro-batch of every global batch,
    reshuffled per epoch. A global batch larger than the training set is refused: its figures would
    describe samples that are not there."""
    sampler = GlobalBatchSampler([len(ids) for ids in dataset.input_ids], args.batch_size, num_replicas, rank,
                                 shuffle=not args.no_shuffle, group_by_length=args.group_by_length, seed=args.seed,
                                 accumulation_steps=args.grad_accum, fill=args.pad_to_multiple_of > 1)
    if sampler.global_batch_size > len(dataset):
        raise UserError(f"a global batch of {sampler.global_batch_size:,} (--batch-size {args.batch_size} x "
                        f"{num_replicas} process(es) x --grad-accum {args.grad_accum}) is more than the "
                        f"{len(dataset):,} training samples: lower --batch-size or raise --max-samples")
    return sampler


def eval_sampler(dataset, args, num_replicas=1, rank=0):
    """Dev samples in order, split over processes; the repeats that even out the last batch weigh 0,
    and evaluation drops them."""
    return GlobalBatchSampler([len(ids) for ids in dataset.input_ids], args.batch_size, num_replicas, rank,
                              shuffle=False, fill=args.pad_to_multiple_of > 1)


def make_loader(dataset, args, tokenizer, batch_sampler):
    # A generator of its own: each epoch's iterator draws a seed from it, not from torch's global
    # generator, so the dropout masks after a --resume are those of the uninterrupted run. Pinned
    # memory only for GPU processes: pinning opens a CUDA context, on GPU 0, even in a --device cpu run.
    pin_memory = args.device != "cpu" and torch.cuda.is_available()
    collate = PadBatch(tokenizer.pad_token_id, args.pad_to_multiple_of, args.max_seq_len)
    return DataLoader(dataset, batch_sampler=batch_sampler, collate_fn=collate,
                      num_workers=args.num_workers, pin_memory=pin_memory, worker_init_fn=launch.ignore_stop_signals,
                      generator=torch.Generator().manual_seed(args.seed))


class Loaders(NamedTuple):
    train: DataLoader
    dev: DataLoader


def make_loaders(data, args, world_size=1, rank=0):
    """The training and dev loaders of `data` (a Prepared): this process's share (`rank` of `world_size`)
    of every global batch."""
    train = train_sampler(data.train_set, args, world_size, rank)
    dev = eval_sampler(data.dev_set, args, world_size, rank)
    return Loaders(make_loader(data.train_set, args, data.tokenizer, train),
                   make_loader(data.dev_set, args, data.tokenizer, dev))


# ----------------------------------------------------------------------------- training

class Run:
    """One training run as every script reports it: its options, strategy, model and data, the steps
    it trains, the lines it prints and the callbacks it calls. The Trainer is a Run that trains; the
    Hugging Face script's Run reports what transformers.Trainer trained."""

    def __init__(self, args, strategy, model, data, loaders, callbacks):
        """`model` as the strategy wrapped it, `data` from load_data_and_model, `loaders` from make_loaders,
        `callbacks` the script's (support/callbacks.py's protocol)."""
        self.args, self.strategy, self.model = args, strategy, model
        self.tokenizer, self.model_name, self.lr = data.tokenizer, data.model_name, data.lr
        self.train_loader, self.dev_loader = loaders
        self.output_dir = Path(args.output_dir)
        self.global_batch_size = self.train_loader.batch_sampler.global_batch_size  # samples per optimizer step
        self.threads = set_threads(args.threads, strategy.local_world_size)
        self.native_precision = computes_natively(strategy.precision, strategy.device)
        self.callbacks = list(callbacks)

    def epoch_steps(self):
        """Optimizer steps in --epochs epochs."""
        return len(self.train_loader.batch_sampler.micro_batches_per_step()) * self.args.epochs

    def total_steps(self):
        """The steps this run trains: --epochs' worth, or --max-steps when it stops sooner."""
        return min(self.epoch_steps(), self.args.max_steps or self.epoch_steps())

    def log(self, message):
        if self.strategy.is_main:
            tqdm.write(message)

    def announce(self):
        """The first lines every script prints: what this run is."""
        strategy = self.strategy
        self.log(f"model: {self.model_name} ({models.parameter_count(self.model):,} parameters) | "
                 f"learning rate: {self.lr:g} | processes: {strategy.world_size} | "
                 f"global batch: {self.global_batch_size} | train samples: {len(self.train_loader.dataset)} | "
                 f"dev samples: {len(self.dev_loader.dataset)} | threads per process: {self.threads}")
        if not self.native_precision:
            self.log(f"note: this {strategy.device.type} has no native {strategy.precision}: torch emulates it, "
                     f"slower than fp32 here (where the hardware has it, mixed precision is faster)")

    def notify(self, point, *args):
        """Call each callback's method for this point of the loop (support/callbacks.py names them)."""
        for callback in self.callbacks:
            getattr(callback, point)(self, *args)


class Trainer(Run):
    """The train / evaluate / save loop every strategy runs."""

    def __init__(self, args, strategy, model, optimizer, data, loaders, callbacks):
        super().__init__(args, strategy, model, data, loaders, callbacks)
        self.optimizer = optimizer

    def fit(self):
        """Train, evaluate on dev, save the model (collectively where sharded); the callbacks report."""
        self.announce()
        checkpoints.check_free_space(self)
        first_step = checkpoints.resume(self)
        # Callbacks beside the loop, called at its named points: the script's instruments, and a
        # checkpoint when a scheduler signals with --save-on-signal.
        if self.args.save_on_signal:
            self.callbacks.append(checkpoints.SaveOnSignal())
        last_loss = self.train(first_step)
        metrics = self.evaluate()
        if self.args.save_model:
            self.strategy.save_model(self.model, self.tokenizer, self.output_dir / "model")
        self.notify("on_fit_end", metrics, last_loss)

    def train(self, first_step=0):
        """The training loop, from first_step (a checkpoint's); returns the last loss it logged."""
        args, strategy, model = self.args, self.strategy, self.model
        loss_sum, steps_summed, last_loss = torch.zeros((), device=strategy.device), 0, float("nan")
        model.train()
        self.notify("on_train_begin", first_step)
        for epoch, step, micro_batches in self.optimizer_steps(first_step):
            # One optimizer step: the gradients of its micro-batches add up (--grad-accum), each
            # sample weighed by 1 / (samples in the step), then one update.
            step_loss = torch.zeros((), device=strategy.device)  # this process's part of the step's loss
            for batch, last in micro_batches:
                with strategy.accumulating(model, last=last):
                    with self.phase("forward"):
                        _, loss = self.forward(batch)
                    with self.phase("backward"):
                        strategy.backward(loss)
                step_loss += loss.detach()
            with self.phase("optimizer step"):
                strategy.step(model, self.optimizer)
            loss_sum += step_loss
            self.notify("on_step_end", step, step_loss)
            steps_summed += 1
            if step % args.log_steps == 0 or step == self.total_steps():
                # Reading the loss makes the CPU wait for the device (.item()) and the other
                # processes (reduce_mean): on logging steps only. Not a step's only wait: fp16's
                # loss scaling (GradScaler, DeepSpeed's) reads whether the gradients overflowed,
                # Horovod's step waits for its all-reduces.
                last_loss = strategy.reduce_mean(loss_sum / steps_summed).item()
                loss_sum, steps_summed = loss_sum.zero_(), 0
                self.log(f"【train】 epoch：{epoch}/{args.epochs} step：{step}/{self.total_steps()} loss：{last_loss:.6f}")
            if self.due(step, args.save_steps):
                with self.phase("pause"):
                    checkpoints.save(self, step)
            if self.due(step, args.eval_steps):
                with self.phase("pause"):
                    self.evaluate_while_training(step)
        self.notify("on_train_end")
        return last_loss

    def optimizer_steps(self, first_step):
        """Each optimizer step after first_step: its epoch, its number, and its micro-batches, each
        on the device with whether it is the step's last."""
        sampler, epoch = self.train_loader.batch_sampler, None
        for step_epoch, step, micro_batches in sampler.steps(first_step, self.total_steps()):
            if step_epoch != epoch:  # a new shuffle each epoch, the same in every process
                epoch = step_epoch
                sampler.set_epoch(epoch, steps_taken=step - 1)
                batches = iter(self.train_loader)
            yield epoch, step, self.loaded(batches, micro_batches)

    def loaded(self, batches, count):
        """The next `count` micro-batches of the loader, on the device, with whether each is the last."""
        for index in range(count):
            with self.phase("data loading"):
                batch = next(batches)
                self.notify("on_batch_loaded", batch)
                batch = self.to_device(batch)
            yield batch, index == count - 1

    def due(self, step, every):
        """Whether an every-N-steps action (--save-steps, --eval-steps) falls on `step`; never on the
        last, which fit saves and evaluates anyway."""
        return bool(every) and step % every == 0 and step != self.total_steps()

    def evaluate_while_training(self, step):
        metrics = self.evaluate()
        self.log(f"【dev】 step：{step} loss：{metrics['loss']:.6f} accuracy：{metrics['accuracy']:.4f}")
        self.model.train()

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
        check_every_dev_sample(indices, len(self.dev_loader.dataset))
        # Rank 0 scores and shares the metrics: the other processes skip sklearn's import, and wait for them
        # rather than leave right after the gather, which could free a gloo group while gloo's thread still
        # waits for the GIL to free the gather's tensors, and hang at exit.
        metrics = dev_metrics(predictions, labels, losses) if self.strategy.is_main else None
        return self.strategy.broadcast_object(metrics)

    def forward(self, batch):
        """Logits, and this process's part of the global batch's mean loss (weighted_loss)."""
        with self.strategy.autocast():
            logits = model_logits(self.model, batch)
        return logits, weighted_loss(logits, batch, self.strategy.world_size)

    @contextlib.contextmanager
    def phase(self, name):
        """A named part of the loop: the callbacks see it begin and end."""
        self.notify("on_phase_begin", name)
        yield
        self.notify("on_phase_end", name)

    def to_device(self, batch):
        return {key: value.to(self.strategy.device, non_blocking=True) for key, value in batch.items()}


# ----------------------------------------------------------------------------- strategy and collectives

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

    def gpus_in_use(self):
        """The GPUs this process computes on, whose random generators it draws from (dropout): its own."""
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
        # A wrapper's inner model (DDP's, DataParallel's, DeepSpeed's engine's): no "module." prefixes in the
        # checkpoint.
        return getattr(model, "module", model)

    def save_model(self, model, tokenizer, path):
        if self.is_main:
            checkpoints.save_model(self.unwrap(model), tokenizer, path)

    def broadcast_object(self, value):
        """Rank 0's `value` in every process."""
        return value

    def gather_objects(self, value):
        """Every process's `value`, in rank order, in every process."""
        return [value]

    def save_state(self, model, optimizer, path, state):
        """Write a training checkpoint: the weights, the optimizer moments and `state` (the step, what
        it means, every process's random states, the strategy's own). Rank 0 writes it whole."""
        if self.is_main:
            checkpoints.save_whole(path, {"model": self.unwrap(model).state_dict(),
                                          "optimizer": optimizer.state_dict(), **state})

    def checkpoint_folders(self, path):
        """The folders that may hold the checkpoint of `path`: the one the last save made first, then any
        others. One: a save killed while swapping its folder in was finished when the run claimed
        --output-dir (files.clear_dead_staging)."""
        return [path]

    def checkpoint_meaning(self, folder):
        """The step and settings of the complete checkpoint in `folder`, or None when there is none."""
        return checkpoints.read_meaning(folder)

    def checkpoint_layout(self):
        """What the strategy's checkpoint files are laid out by, which a resume must keep (meaning())."""
        return {}

    def load_state(self, model, optimizer, path):
        """Restore the `save_state` checkpoint in `path` (one of checkpoint_folders) in every process;
        returns its `state`."""
        state = checkpoints.read_training_state(path)  # load_state_dict copies each tensor where it lives
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
    """The Trainer's collectives (logging, evaluation, checkpoints) over torch.distributed: DDP, FSDP2,
    DeepSpeed and the Hugging Face Trainer."""

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


def each_sample_once(indices, weights, *columns):
    """Keep the real samples of gathered evaluation outputs (weight > 0), in dataset order; the
    repeats that evened out the processes' batches weigh 0."""
    real = weights > 0
    order = np.argsort(indices[real], kind="stable")
    return (indices[real][order], *(column[real][order] for column in columns))


def dev_metrics(predictions, labels, losses):
    """The dev metrics of every dev sample's prediction, label and loss, each sample once."""
    from sklearn.metrics import accuracy_score, classification_report, f1_score  # 1.5 s to import: only here
    return {"samples": len(labels), "loss": float(losses.mean()),
            "accuracy": float(accuracy_score(labels, predictions)),
            "macro_f1": float(f1_score(labels, predictions, average="macro", labels=range(len(LABELS)),
                                       zero_division=0)),
            "report": classification_report(labels, predictions, labels=range(len(LABELS)),
                                            target_names=LABELS, digits=4, zero_division=0)}


def check_every_dev_sample(indices, dev_size):
    """Evaluation saw each of the `dev_size` dev samples exactly once (each_sample_once's indices)."""
    if not np.array_equal(indices, np.arange(dev_size)):
        raise RuntimeError(f"evaluated {len(np.unique(indices))} distinct of {dev_size} dev samples in "
                           f"{len(indices)} predictions")


def model_logits(model, batch):
    """The model's logits for a batch of the suite's loaders (their index and weight are not its inputs)."""
    return model(input_ids=batch["input_ids"], attention_mask=models.prepared_mask(batch["attention_mask"])).logits


def weighted_loss(logits, batch, world_size):
    """This process's part of the global batch's mean loss, computed here, not inside the model, so
    that every strategy weighs samples the same way (the Hugging Face Trainer's compute_loss too).
    The loss-weighting rule (see GlobalBatchSampler): weighted by 1 / (samples in the global batch),
    the sums over processes and micro-batches add up to the single-device mean. Every library here
    averages the gradients over the processes; multiplying by their count turns that average into
    the sum."""
    per_sample = F.cross_entropy(logits.float(), batch["labels"], reduction="none")
    return (per_sample * batch["weight"]).sum() * world_size
