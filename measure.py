"""Measurements the Trainer takes beside the lesson, so that a reader of the training loop meets only
the strategy: how many bytes of model state each process really holds."""
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
