"""The tests' hooks inside a training process, switched on by their environment variables (named in
measure.py, which loads this file only when one is set): a failure injected at a given step, to check
that a failing rank ends the whole job and that --resume continues where a crash left off, and DDP's
gradient all-reduces counted, to check that gradient accumulation all-reduces once per step."""
import os

import measure


def callbacks(trainer):
    """The hooks this process's environment asks for, as callbacks of `trainer`."""
    allreduces = gradient_allreduce_count(trainer.model)
    return [InjectedFailure()] + ([allreduces] if allreduces else [])


def fail_if_asked(rank, step):
    """Raise when measure.FAIL_AT_ENV ("RANK:STEP") names this rank and this optimizer step."""
    value = os.environ.get(measure.FAIL_AT_ENV)
    if value and [int(part) for part in value.split(":")] == [rank, step]:
        raise RuntimeError(f"failure injected by {measure.FAIL_AT_ENV} at step {step}")


class InjectedFailure(measure.Callback):
    """Fail right after the optimizer step SUITE_FAIL_AT names, counted as the Trainer counts them:
    from the checkpoint's step on --resume."""

    def on_step_end(self, trainer, step):
        fail_if_asked(trainer.strategy.rank, step)


class GradientAllReduceCount(measure.Callback):
    """How many gradient all-reduces DDP runs: one per gradient bucket per synchronised backward.
    A communication hook that counts, then runs the same all-reduce DDP runs by default."""

    def __init__(self, ddp):
        from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import allreduce_hook
        self.calls, self.allreduce = 0, allreduce_hook
        ddp.register_comm_hook(None, self.hook)

    def hook(self, process_group, bucket):
        self.calls += 1
        return self.allreduce(process_group, bucket)

    def on_result(self, trainer, result):
        result["gradient_allreduces"] = self.calls


def gradient_allreduce_count(model):
    """A counter of DDP's gradient all-reduces when measure.COUNT_ALLREDUCES_ENV asks for one and
    `model` is DDP or wraps it (Fabric's module wraps its DDP), else None."""
    from torch.nn.parallel import DistributedDataParallel
    ddp = next((module for module in model.modules() if isinstance(module, DistributedDataParallel)), None)
    if os.environ.get(measure.COUNT_ALLREDUCES_ENV) and ddp is not None:
        return GradientAllReduceCount(ddp)
    return None
