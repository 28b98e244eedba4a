"""The training curves, step by step, beside the loop: each optimizer step's loss, learning rate, seconds
and MFU, written as TensorBoard event files (torch.utils.tensorboard's SummaryWriter) into
<output-dir>/tensorboard/, so that `tensorboard --logdir output/benchmark` overlays every row of a
benchmark; the loss per step also goes into result.json, for the runner's chart."""
import importlib.util
from pathlib import Path

import torch

from . import flops, results
from .callbacks import Callback

TENSORBOARD_DIR = "tensorboard"
EVENT_FILES = "events.out.tfevents.*"


class Curves(Callback):
    """Per optimizer step: the loss over the whole global batch, the learning rate, the step's seconds
    (Throughput's marks: the first step's includes its one-time costs) and, where the GPU's peak is
    published, its MFU (rank 0's FLOPs for the step, from the shapes it computed, over its seconds).

    The loop reads the loss only on logging steps, a host sync; here each step's loss (the loop's
    `step_loss`, this process's part, a new tensor each step) stays on the device, and the processes
    average all of them at once when training ends. Rank 0 writes the events as the result is built."""

    def __init__(self, trainer, optimizer, throughput, first_step):
        self.optimizer, self.throughput, self.first_step = optimizer, throughput, first_step
        self.step_losses, self.learning_rates, self.token_sums, self.losses = [], [], [], []
        self.directory = Path(trainer.output_dir) / TENSORBOARD_DIR

    def on_train_begin(self, trainer):
        self.token_sums.append(trainer.progress.tokens.sums.clone())

    def on_step_end(self, trainer, step):
        self.step_losses.append(trainer.step_loss)
        rate = self.optimizer.param_groups[0]["lr"]
        self.learning_rates.append(rate.detach().clone() if isinstance(rate, torch.Tensor) else rate)
        self.token_sums.append(trainer.progress.tokens.sums.clone())  # counted on the CPU, from the batches

    def on_train_end(self, trainer):
        if self.step_losses:  # every process, or none (a --resume past the last step)
            self.losses = trainer.strategy.reduce_mean(torch.stack(self.step_losses).float()).cpu().tolist()
            self.step_losses = []

    def step_seconds(self):
        """Each step's seconds: the first's as Throughput timed it apart, then the gaps between its marks."""
        if not self.losses:
            return []
        return [self.throughput.first_seconds, *self.throughput.step_seconds]

    def step_mfu(self, trainer, result):
        """Each step's MFU against the published peak (rank 0's FLOPs: every process computes about as
        much), or None where no peak is published (a CPU, an unlisted GPU)."""
        if not result.get("peak_tflops") or not self.losses:
            return [None] * len(self.losses)
        config = trainer.strategy.unwrap(trainer.model).config
        computed = slice(len(results.REAL_COUNTS), None)
        devices = result["devices"] / trainer.strategy.world_size  # a process's GPUs
        step_flops = [flops.training_flops(config, *(after - before)[computed].tolist())
                      for before, after in zip(self.token_sums, self.token_sums[1:])]
        return [flops.mfu(work / seconds / devices, result["peak_tflops"]) if seconds > 0 else None
                for work, seconds in zip(step_flops, self.step_seconds())]

    def on_result(self, trainer, result):
        result["train_loss_curve"] = {"first_step": self.first_step + 1,
                                      "loss": [float(f"{loss:.6g}") for loss in self.losses]}
        if not trainer.strategy.is_main:
            return
        if importlib.util.find_spec("tensorboard") is None:
            result["tensorboard"] = "not written: the tensorboard package is not installed (requirements.txt pins it)"
            return
        self.write(self.step_mfu(trainer, result))
        result["tensorboard"] = str(self.directory)

    def write(self, mfus):
        """The event file: a fresh run replaces the folder's earlier ones; a resumed run keeps them and
        tells TensorBoard to hide their steps from its first one on (purge_step)."""
        from torch.utils.tensorboard import SummaryWriter
        if self.first_step == 0:
            for old in self.directory.glob(EVENT_FILES):
                old.unlink()
        writer = SummaryWriter(str(self.directory), purge_step=self.first_step + 1 if self.first_step else None)
        for step, loss, rate, seconds, mfu in zip(range(self.first_step + 1, self.first_step + 1 + len(self.losses)),
                                                  self.losses, self.learning_rates, self.step_seconds(), mfus):
            writer.add_scalar("train/loss", loss, step)
            writer.add_scalar("train/learning_rate", float(rate), step)
            writer.add_scalar("train/step_seconds", seconds, step)
            if mfu is not None:
                writer.add_scalar("train/mfu", mfu, step)
        writer.close()
