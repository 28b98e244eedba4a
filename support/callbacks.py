"""The points of the training loop where a measurement or a checkpoint hooks in: measure.py and
checkpoints.py build on this base, without importing each other."""


class Callback:
    """Called by the Trainer at each point of its loop, in this order, as transformers.TrainerCallback
    and Lightning's callbacks are; a measurement overrides the points it needs."""

    def on_train_begin(self, trainer):
        """Before the first step."""

    def on_phase_begin(self, trainer, phase):
        """A part of the loop begins: "data loading", "forward", "backward" (each micro-batch's),
        "optimizer step", or "pause" (saving a checkpoint, evaluating: not training time)."""

    def on_phase_end(self, trainer, phase):
        """That part has ended."""

    def on_step_end(self, trainer, step):
        """Optimizer step `step` (counted from 1, from the checkpoint's step on --resume) is taken."""

    def on_save(self, trainer, step):
        """A training checkpoint of `step` is about to be written (every process: a collective point)."""

    def on_train_end(self, trainer):
        """After the last step."""

    def on_result(self, trainer, result):
        """Add this measurement's fields to `result` (result.json)."""
