"""Measurements the Trainer takes beside the lesson, so that a reader of the training loop meets only
the strategy: how many bytes of model state each process really holds, and (for the tests) how many
gradient all-reduces DDP runs."""
import os

import torch
from torch.distributed.tensor import DTensor


class ModelStateCount:
    """Bytes of parameters, gradients and optimizer state this process holds, counted from the
    tensors themselves just before the second optimizer step, where all three exist (Adam creates
    its moments in the first step, and zero_grad frees the gradients after each).

    Only this process's part counts: FSDP2's local shards of its DTensors, DeepSpeed's partitions
    (its fp32 master partitions, reduced gradient partitions, ZeRO-3 weight partitions). A tensor
    that is a view of another counts once, with the whole memory it lives in (flat buffers,
    padding). Communication buffers (DDP's gradient buckets, for one) are not model state.
    """

    def __init__(self, strategy, model, optimizer):
        self.model, self.optimizer, self.steps, self.bytes = model, optimizer, 0, None
        self.zero_optimizer = getattr(getattr(strategy, "engine", None), "optimizer", None)  # DeepSpeed's
        self.strategy_step = strategy.step
        strategy.step = self.count_then_step  # on this strategy object only

    def count_then_step(self, model, optimizer):
        self.steps += 1
        if self.steps <= 2:
            self.count()
        self.strategy_step(model, optimizer)

    def count(self):
        optimizer = getattr(self.optimizer, "optimizer", self.optimizer)  # Accelerate wraps the torch optimizer
        parameters = [*self.model.parameters(), *(p for group in optimizer.param_groups for p in group["params"])]
        parameters += [p.ds_tensor for p in parameters if hasattr(p, "ds_tensor")]  # a ZeRO-3 weight partition
        gradients = [p.grad for p in parameters if p.grad is not None]
        zero = self.zero_optimizer
        parameters += [*getattr(zero, "single_partition_of_fp32_groups", []),
                       *getattr(zero, "fp32_partitioned_groups_flat", [])]
        gradients += [g for group in getattr(zero, "averaged_gradients", {}).values() for g in group or []
                      if isinstance(g, torch.Tensor)]
        if isinstance(getattr(zero, "grad_partitions_flat_buffer", None), torch.Tensor):
            gradients.append(zero.grad_partitions_flat_buffer)
        seen = set()
        self.bytes = {
            "parameters": storage_bytes(parameters, seen),
            "gradients": storage_bytes(gradients, seen),
            "optimizer_state": storage_bytes([value for state in optimizer.state.values() for value in state.values()
                                              if isinstance(value, torch.Tensor)], seen)}
        self.bytes["total"] = sum(self.bytes.values())


def storage_bytes(tensors, seen):
    """Bytes of the memory the `tensors` live in, each block counted once (across calls too, by `seen`)."""
    total = 0
    for tensor in tensors:
        if isinstance(tensor, DTensor):
            tensor = tensor.to_local()
        storage = tensor.untyped_storage()
        if storage.nbytes() and storage.data_ptr() not in seen:
            seen.add(storage.data_ptr())
            total += storage.nbytes()
    return total


# Tests set it to count DDP's gradient all-reduces (result.json: gradient_allreduces).
COUNT_ALLREDUCES_ENV = "SUITE_COUNT_ALLREDUCES"


class GradientAllReduceCount:
    """How many gradient all-reduces DDP runs: one per gradient bucket per synchronised backward.
    A communication hook that counts, then runs the same all-reduce DDP runs by default."""

    def __init__(self, model):
        from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import allreduce_hook
        self.calls, self.allreduce = 0, allreduce_hook
        model.register_comm_hook(None, self.hook)

    def hook(self, process_group, bucket):
        self.calls += 1
        return self.allreduce(process_group, bucket)


def gradient_allreduce_count(model):
    """A counter of DDP's gradient all-reduces when COUNT_ALLREDUCES_ENV asks for one, else None."""
    from torch.nn.parallel import DistributedDataParallel
    if os.environ.get(COUNT_ALLREDUCES_ENV) and isinstance(model, DistributedDataParallel):
        return GradientAllReduceCount(model)
    return None
