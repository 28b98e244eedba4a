"""The tests' hooks inside a training process, plugged in as the file SUITE_CALLBACKS names (conftest
sets it for every run a test starts) and switched on by their own variables: a failure injected at a
given step, to check that a failing rank ends the whole job and that --resume continues where a crash
left off; steps slowed down after a given one, so that a signal sent then lands during training;
DDP's gradient all-reduces counted, to check that gradient accumulation all-reduces once per step;
dynamo's traces counted, to check that each graph is traced once; and bytes wasted on purpose, to
check that the byte checks catch a strategy sending more than it should."""
import contextlib
import os
import time

from instruments import measure

FAIL_AT_ENV = "SUITE_FAIL_AT"  # "RANK:STEP": that rank fails right after that optimizer step
SLOW_AFTER_ENV = "SUITE_SLOW_AFTER"  # "STEP": rank 0 says "slow from here", then every step takes a second more
COUNT_ALLREDUCES_ENV = "SUITE_COUNT_ALLREDUCES"  # count DDP's gradient all-reduces (result.json: gradient_allreduces)
COUNT_TRACES_ENV = "SUITE_COUNT_TRACES"  # count dynamo's traces and frames (result.json: compile_traces)
WASTE_ENV = "SUITE_WASTE"  # "broadcast": a stray broadcast each step; "sync": accumulation that syncs every micro-batch


def callbacks():
    """The hooks this process's environment asks for, as callbacks (each sees the trainer as training begins)."""
    asked = [InjectedFailure()] if os.environ.get(FAIL_AT_ENV) else []
    asked += [SlowSteps(int(os.environ[SLOW_AFTER_ENV]))] if os.environ.get(SLOW_AFTER_ENV) else []
    asked += [GradientAllReduceCount()] if os.environ.get(COUNT_ALLREDUCES_ENV) else []
    asked += [CompileTraces()] if os.environ.get(COUNT_TRACES_ENV) else []
    waste = os.environ.get(WASTE_ENV, "").split(",")
    asked += [SyncEveryMicroBatch()] if "sync" in waste else []
    return asked + ([StrayBroadcast()] if "broadcast" in waste else [])


def fail_if_asked(rank, step):
    """Raise when FAIL_AT_ENV ("RANK:STEP") names this rank and this optimizer step."""
    value = os.environ.get(FAIL_AT_ENV)
    if value and [int(part) for part in value.split(":")] == [rank, step]:
        raise RuntimeError(f"failure injected by {FAIL_AT_ENV} at step {step}")


class InjectedFailure(measure.Callback):
    """Fail right after the optimizer step SUITE_FAIL_AT names, counted as the Trainer counts them:
    from the checkpoint's step on --resume."""

    def on_step_end(self, trainer, step, loss):
        fail_if_asked(trainer.strategy.rank, step)


class SlowSteps(measure.Callback):
    """After optimizer step `after`, each step takes a second more, in every process: a test that sends
    a signal when rank 0 says so reaches the run during training, with seconds to spare on a busy machine."""

    def __init__(self, after):
        self.after = after

    def on_step_end(self, trainer, step, loss):
        if step == self.after and trainer.strategy.is_main:
            print(f"slow from step {step}", flush=True)
        if step >= self.after:
            time.sleep(1)


class StrayBroadcast(measure.Callback):
    """Rank 0's first weight broadcast to every process after each step, as a loop that re-syncs its
    weights would: a copy, so that training is unchanged and only the bytes sent grow."""

    def on_step_end(self, trainer, step, loss):
        import torch.distributed as dist
        weight = next(trainer.model.parameters()).detach()
        dist.broadcast(measure.local(weight).clone(), src=0)


class SyncEveryMicroBatch(measure.Callback):
    """No no_sync(): the gradients are exchanged after every micro-batch, not once per step."""

    def on_train_begin(self, trainer, first_step):
        trainer.strategy.accumulating = lambda model, last: contextlib.nullcontext()


class GradientAllReduceCount(measure.Callback):
    """How many gradient all-reduces DDP runs: one per gradient bucket per synchronised backward.
    A communication hook that counts, then runs the same all-reduce DDP runs by default; nothing where
    the model is not DDP and wraps none (Fabric's module wraps its DDP)."""

    def on_train_begin(self, trainer, first_step):
        from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import allreduce_hook
        from torch.nn.parallel import DistributedDataParallel
        ddp = next((module for module in trainer.model.modules() if isinstance(module, DistributedDataParallel)),
                   None)
        self.calls, self.allreduce = None if ddp is None else 0, allreduce_hook
        if ddp is not None:
            ddp.register_comm_hook(None, self.hook)

    def hook(self, process_group, bucket):
        self.calls += 1
        return self.allreduce(process_group, bucket)

    def on_result(self, trainer, result):
        if self.calls is not None:
            result["gradient_allreduces"] = self.calls


class CompileTraces(measure.Callback):
    """How often dynamo traced the model against the frames it compiled: a trace it restarts (to retry
    with some values made constants) is a second one, which a compile that knows them from the start saves."""

    def on_result(self, trainer, result):
        from torch._dynamo.utils import compilation_time_metrics, counters
        traces = sum(len(times) for name, times in compilation_time_metrics.items()
                     if name.startswith("compile_attempt_"))
        result["compile_traces"] = {"traces": traces, "frames": counters["frames"]["ok"]}
