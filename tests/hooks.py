"""The tests' hooks inside a training process, plugged in as the file SUITE_CALLBACKS names (conftest
sets it for every run a test starts) and switched on by their own variables: a failure injected at a
given step, to check that a failing rank ends the whole job and that --resume continues where a crash
left off; steps slowed down after a given one, so that a signal sent then lands during training;
DDP's gradient all-reduces counted, to check that gradient accumulation all-reduces once per step; and
bytes wasted on purpose, to check that the byte checks catch a strategy sending more than it should."""
import contextlib
import os
import time

from support import measure

FAIL_AT_ENV = "SUITE_FAIL_AT"  # "RANK:STEP": that rank fails right after that optimizer step
SLOW_AFTER_ENV = "SUITE_SLOW_AFTER"  # "STEP": rank 0 says "slow from here", then every step takes a second more
COUNT_ALLREDUCES_ENV = "SUITE_COUNT_ALLREDUCES"  # count DDP's gradient all-reduces (result.json: gradient_allreduces)
WASTE_ENV = "SUITE_WASTE"  # "broadcast": a stray broadcast each step; "sync": accumulation that syncs every micro-batch


def callbacks(trainer):
    """The hooks this process's environment asks for, as callbacks of `trainer`."""
    asked = [InjectedFailure()] if os.environ.get(FAIL_AT_ENV) else []
    asked += [SlowSteps(int(os.environ[SLOW_AFTER_ENV]))] if os.environ.get(SLOW_AFTER_ENV) else []
    allreduces = gradient_allreduce_count(trainer.model) if os.environ.get(COUNT_ALLREDUCES_ENV) else None
    waste = os.environ.get(WASTE_ENV, "").split(",")
    if "sync" in waste:  # no no_sync(): the gradients are exchanged after every micro-batch, not once per step
        trainer.strategy.accumulating = lambda model, last: contextlib.nullcontext()
    asked += [StrayBroadcast()] if "broadcast" in waste else []
    return asked + ([allreduces] if allreduces else [])


def fail_if_asked(rank, step):
    """Raise when FAIL_AT_ENV ("RANK:STEP") names this rank and this optimizer step."""
    value = os.environ.get(FAIL_AT_ENV)
    if value and [int(part) for part in value.split(":")] == [rank, step]:
        raise RuntimeError(f"failure injected by {FAIL_AT_ENV} at step {step}")


class InjectedFailure(measure.Callback):
    """Fail right after the optimizer step SUITE_FAIL_AT names, counted as the Trainer counts them:
    from the checkpoint's step on --resume."""

    def on_step_end(self, trainer, step):
        fail_if_asked(trainer.strategy.rank, step)


class SlowSteps(measure.Callback):
    """After optimizer step `after`, each step takes a second more, in every process: a test that sends
    a signal when rank 0 says so reaches the run during training, with seconds to spare on a busy machine."""

    def __init__(self, after):
        self.after = after

    def on_step_end(self, trainer, step):
        if step == self.after and trainer.strategy.is_main:
            print(f"slow from step {step}", flush=True)
        if step >= self.after:
            time.sleep(1)


class StrayBroadcast(measure.Callback):
    """Rank 0's first weight broadcast to every process after each step, as a loop that re-syncs its
    weights would: a copy, so that training is unchanged and only the bytes sent grow."""

    def on_step_end(self, trainer, step):
        import torch.distributed as dist
        weight = next(trainer.model.parameters()).detach()
        dist.broadcast(measure.local(weight).clone(), src=0)


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
    """A counter of DDP's gradient all-reduces when `model` is DDP or wraps it (Fabric's module wraps
    its DDP), else None."""
    from torch.nn.parallel import DistributedDataParallel
    ddp = next((module for module in model.modules() if isinstance(module, DistributedDataParallel)), None)
    return GradientAllReduceCount(ddp) if ddp is not None else None
