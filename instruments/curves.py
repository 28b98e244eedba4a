"""The training curves, step by step, beside the loop: each optimizer step's loss, learning rate, seconds
and MFU, written as TensorBoard event files (torch.utils.tensorboard's SummaryWriter) into
<output-dir>/tensorboard/, so that `tensorboard --logdir output/benchmark` overlays every row of a
benchmark; the loss per step also goes into result.json, for the runner's chart."""
import importlib.util
from pathlib import Path

import torch

from support.callbacks import Callback

from . import flops, measure, results

TENSORBOARD_DIR = "tensorboard"
EVENT_FILES = "events.out.tfevents.*"


class Curves(Callback):
    """Per optimizer step: the loss over the whole global batch, the learning rate, the step's seconds
    (Throughput's marks: the first step's includes its one-time costs) and, where the GPU's peak is
    published, its MFU (rank 0's FLOPs for the step, from the shapes it computed, over its seconds).

    The loop reads the loss only on logging steps, a host sync; here each step's loss (on_step_end's,
    this process's part, a new tensor each step) stays on the device until the next
    logging step, checkpoint or the end of training, where the processes average them at once and rank
    0 writes their events: a run stopped by a signal leaves the curves of every step up to its
    checkpoint, and a resumed run adds the steps after it beside them."""

    def __init__(self, throughput):
        self.throughput, self.writer = throughput, None
        self.step_losses, self.learning_rates, self.losses = [], [], []

    def on_train_begin(self, trainer, first_step):
        self.optimizer, self.first_step = trainer.optimizer, first_step
        self.directory = Path(trainer.output_dir) / TENSORBOARD_DIR

    def on_step_end(self, trainer, step, loss):
        self.step_losses.append(loss)
        rate = self.optimizer.param_groups[0]["lr"]
        self.learning_rates.append(rate.detach().clone() if isinstance(rate, torch.Tensor) else rate)
        if step % trainer.args.log_steps == 0:
            self.flush(trainer)

    def on_save(self, trainer, step):
        self.flush(trainer)

    def on_train_end(self, trainer):
        self.flush(trainer)

    def flush(self, trainer):
        """Average the steps not written yet over the processes (every process calls it, at the same
        step), and rank 0 writes them."""
        if not self.step_losses:  # every process, or none (a --resume past the last step)
            return
        written = len(self.losses)
        self.losses += trainer.strategy.reduce_mean(torch.stack(self.step_losses).float()).cpu().tolist()
        self.step_losses = []
        if trainer.strategy.is_main and importlib.util.find_spec("tensorboard") is not None:
            self.write(trainer, written)

    def step_mfu(self, trainer, index, seconds):
        """Step `index`'s MFU against the published peak (rank 0's FLOPs: every process computes about
        as much), or None where no peak is published (a CPU, an unlisted GPU)."""
        device = trainer.strategy.device
        if device.type != "cuda" or seconds <= 0:
            return None
        peak, _ = flops.published_peak(torch.cuda.get_device_name(device), measure.compute_precision(trainer))
        config = trainer.strategy.unwrap(trainer.model).config
        sums = self.throughput.token_sums  # the sums before the first step, then after each
        work = flops.training_flops(config, *(sums[index + 1] - sums[index])[results.COMPUTED_SUMS].tolist())
        return flops.mfu(work / seconds / len(trainer.strategy.gpus_in_use()), peak)

    def on_result(self, trainer, result):
        result["train_loss_curve"] = {"first_step": self.first_step + 1,
                                      "loss": [float(f"{loss:.6g}") for loss in self.losses]}
        if not trainer.strategy.is_main:
            return
        if importlib.util.find_spec("tensorboard") is None:
            result["tensorboard"] = "not written: the tensorboard package is not installed (requirements.txt pins it)"
            return
        if self.writer is not None:
            self.writer.close()
        result["tensorboard"] = str(self.directory)

    def write(self, trainer, start):
        """The events of this launch's steps from `start` (an index) on, flushed to disk. The first write
        opens the event file: a fresh run replaces the folder's earlier ones; a resumed run keeps them and
        tells TensorBoard to hide their steps from its first one on (purge_step)."""
        if self.writer is None:
            from torch.utils.tensorboard import SummaryWriter
            if self.first_step == 0:
                for old in self.directory.glob(EVENT_FILES):
                    old.unlink()
            purge = self.first_step + 1 if self.first_step else None
            self.writer = SummaryWriter(str(self.directory), purge_step=purge)
        for index in range(start, len(self.losses)):
            step, seconds = self.first_step + 1 + index, self.throughput.seconds(index)
            self.writer.add_scalar("train/loss", self.losses[index], step)
            self.writer.add_scalar("train/learning_rate", float(self.learning_rates[index]), step)
            self.writer.add_scalar("train/step_seconds", seconds, step)
            mfu = self.step_mfu(trainer, index, seconds)
            if mfu is not None:
                self.writer.add_scalar("train/mfu", mfu, step)
        self.writer.flush()
