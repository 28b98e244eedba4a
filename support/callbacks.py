"""The points of the training loop where an instrument (instruments/) or a checkpoint hooks in: the
loop knows this protocol, not what is plugged into it."""


class Callback:
    """Called by the Trainer at each point of its loop, in this order, as transformers.TrainerCallback
    and Lightning's callbacks are; an instrument overrides the points it needs."""

    def on_train_begin(self, trainer, first_step):
        """Before the first step; `first_step`: the steps a --resume's checkpoint had taken, else 0."""

    def on_batch_loaded(self, trainer, batch):
        """A training micro-batch is loaded, before it moves to the device."""

    def on_phase_begin(self, trainer, phase):
        """A part of the loop begins: "data loading", "forward", "backward" (each micro-batch's),
        "optimizer step", or "pause" (saving a checkpoint, evaluating: not training time)."""

    def on_phase_end(self, trainer, phase):
        """That part has ended."""

    def on_step_end(self, trainer, step, loss):
        """Optimizer step `step` (counted from 1, from the checkpoint's step on --resume) is taken;
        `loss`: this process's part of its loss, a tensor on the device (reading it waits for the device)."""

    def on_save(self, trainer, step):
        """A training checkpoint of `step` is about to be written (every process: a collective point)."""

    def on_train_end(self, trainer):
        """After the last step."""

    def on_fit_end(self, trainer, metrics, last_loss):
        """Trained, evaluated and saved: the dev metrics, and the last training loss the loop logged."""

    def on_result(self, trainer, result):
        """Add this measurement's fields to `result` (result.json)."""
