"""What a strategy sends: the bytes its collectives carried per optimizer step, read from what ran
(torch.profiler's records of torch.distributed's operators, or Horovod's own calls), against what
the ZeRO paper's formulas allow. measure.CollectiveBytes records them beside the loop; this module
turns the records into bytes and holds the formulas.

Each collective counts with its payload: the whole buffer it works on (an all-reduce's tensor, an
all-gather's gathered output, a reduce-scatter's unreduced input), in the bytes of its type. What a
ring algorithm moves in and out of each process follows from it (nccl-tests' bus bandwidth factors):
2(n-1)/n of the payload for an all-reduce, (n-1)/n for an all-gather or a reduce-scatter, the payload
for a broadcast or a reduce. With P parameters of b bytes the ZeRO paper's volumes per step are then:
DDP and ZeRO-1/2 an all-reduce of the gradients, 2(n-1)/n P b; ZeRO-3 and FSDP an all-gather of the
weights in forward and again in backward and a reduce-scatter of the gradients, 3(n-1)/n P b."""
import atexit
import collections
import math

KINDS = ("all-reduce", "reduce-scatter", "all-gather", "broadcast", "reduce", "other")
RING_FACTORS = {"all-reduce": lambda n: 2 * (n - 1) / n, "reduce-scatter": lambda n: (n - 1) / n,
                "all-gather": lambda n: (n - 1) / n}

# torch.distributed's operators as the profiler records them ("c10d::<name>"), with its kind and where
# the payload is among its arguments: (argument, whether that argument is one process's part of it).
C10D_OPERATORS = {
    "allreduce_": ("all-reduce", 0, False), "allreduce_coalesced_": ("all-reduce", 0, False),
    "broadcast_": ("broadcast", 0, False), "reduce_": ("reduce", 0, False),
    "_allgather_base_": ("all-gather", 0, False), "allgather_into_tensor_coalesced_": ("all-gather", 0, False),
    "allgather_": ("all-gather", 1, True), "allgather_coalesced_": ("all-gather", 1, True),
    "_reduce_scatter_base_": ("reduce-scatter", 1, False),
    "reduce_scatter_tensor_coalesced_": ("reduce-scatter", 1, False),
    "reduce_scatter_": ("reduce-scatter", 0, True),
}
# The profiler's names of C++ types, by bytes per element (a type not named here counts 4 bytes).
ELEMENT_BYTES = {"double": 8, "long int": 8, "float": 4, "int": 4, "c10::Half": 2, "c10::BFloat16": 2,
                 "short int": 2, "bool": 1, "unsigned char": 1, "signed char": 1}
BACKENDS = ("gloo:", "nccl:")  # the backends' own records of each call: with the element type of a tensor list


def collective_calls(events, world_size):
    """(kind, payload bytes) of each collective torch.distributed ran among the profiler's `events`
    (recorded with record_shapes), outermost calls only."""
    types = element_types(events)
    calls = []
    for event in events:
        if not event.name.startswith("c10d::") or inside_c10d(event):
            continue
        operator = C10D_OPERATORS.get(event.name.removeprefix("c10d::"))
        if operator is None:  # a barrier, a point-to-point send: no payload of a kind here
            calls.append(("other", 0))
            continue
        kind, argument, per_process = operator
        shapes = event.structured_input_shapes[argument]
        tensors = shapes if shapes and isinstance(shapes[0], list) else [shapes]
        type_name = event.input_dtypes[argument]
        if type_name == "TensorList":  # its type is in the backend's record of the call (else fp32's assumed)
            type_name = types[tuple(tensors[0])].popleft() if types[tuple(tensors[0])] else "float"
        size = sum(math.prod(shape) for shape in tensors) * ELEMENT_BYTES.get(type_name, 4)
        calls.append((kind, size * (world_size if per_process else 1)))
    return calls


def element_types(events):
    """{first tensor's shape: element types in call order} of the backends' records."""
    types = collections.defaultdict(collections.deque)
    for event in sorted((e for e in events if e.name.startswith(BACKENDS)), key=lambda e: e.time_range.start):
        if event.structured_input_shapes and event.input_dtypes:
            first = event.structured_input_shapes[0]
            types[tuple(first[0] if first and isinstance(first[0], list) else first)].append(event.input_dtypes[0])
    return types


def inside_c10d(event):
    parent = event.cpu_parent
    while parent is not None:
        if parent.name.startswith("c10d::"):
            return True
        parent = parent.cpu_parent
    return False


def per_step(calls, steps, world_size, source):
    """result.json's collective_bytes: per process and optimizer step, the payload bytes and calls of
    each kind, and what a ring moves in and out of each process."""
    sizes = {kind: [size for called, size in calls if called == kind] for kind in KINDS}
    kinds = {kind: {"bytes": round(sum(sizes[kind]) / steps), "calls": round(len(sizes[kind]) / steps, 2)}
             for kind in KINDS if sizes[kind]}
    return {"steps": steps, "processes": world_size, "source": source, "kinds": kinds,
            "payload_bytes": sum(kind["bytes"] for kind in kinds.values()),
            "ring_bytes": round(sum(ring_bytes(kind, totals["bytes"], world_size) for kind, totals in kinds.items()))}


def ring_bytes(kind, payload, world_size):
    """The bytes a ring moves in and out of each process for a collective of `payload` bytes."""
    return payload * RING_FACTORS.get(kind, lambda n: 1)(world_size)


def not_measured(world_size, note):
    """collective_bytes for a run whose collectives no record here sees."""
    return {"steps": 0, "processes": world_size, "source": None, "kinds": {}, "payload_bytes": None,
            "ring_bytes": None, "note": note}


DATAPARALLEL_NOTE = ("DataParallel runs in one process: its scatter of the inputs, copy of the weights to each GPU and "
                     "gather of the outputs and gradients are copies between devices, not collectives")


class ProfilerRecord:
    """torch.distributed's collectives over a window of steps, from torch.profiler's records of its
    operators: DDP's C++ reducer, FSDP2's and DeepSpeed's calls, and any other that goes through it."""
    source = "torch.profiler's records of torch.distributed's operators"

    def __init__(self, world_size):
        self.world_size, self.calls = world_size, None

    def start(self):
        import torch.profiler
        self.profiler = torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU], record_shapes=True)
        self.profiler.start()
        # A run stopped inside the window (a signal's checkpoint, an error) must not exit with the profiler
        # on: its teardown at the interpreter's end changes the process's exit status.
        atexit.register(self.profiler.stop)

    def stop(self):
        atexit.unregister(self.profiler.stop)
        self.profiler.stop()
        self.calls = collective_calls(list(self.profiler.events()), self.world_size)
        self.profiler = None


class HorovodRecord:
    """Horovod's gradient all-reduces, counted as its DistributedOptimizer asks for them: they run on
    Horovod's background thread, which torch.profiler does not see. Counts the tensors as sent (fp16
    with --fp16-allreduce's compression)."""
    source = "Horovod's DistributedOptimizer's all-reduce calls"

    def __init__(self, world_size):
        from horovod.torch import optimizer
        self.module, self.world_size, self.calls = optimizer, world_size, None

    def start(self):
        self.calls, self.originals = [], {}
        for name in ("allreduce_async_", "grouped_allreduce_async_"):
            self.originals[name] = original = getattr(self.module, name)
            setattr(self.module, name, self.counting(original))

    def counting(self, original):
        def call(tensors, *args, **kwargs):
            group = tensors if isinstance(tensors, (list, tuple)) else [tensors]
            self.calls.append(("all-reduce", sum(tensor.numel() * tensor.element_size() for tensor in group)))
            return original(tensors, *args, **kwargs)
        return call

    def stop(self):
        for name, original in self.originals.items():
            setattr(self.module, name, original)


def record_for(strategy):
    """How this run's collectives are recorded: a ProfilerRecord or a HorovodRecord, or None, and why
    not where a row should say so (one device has none; DataParallel's are copies in one process)."""
    if strategy.name == "dataparallel":
        return None, DATAPARALLEL_NOTE
    if strategy.world_size == 1:  # one process sends nothing: its steps are not slowed to record it
        return None, None
    if not strategy.is_main:  # result.json reports rank 0's; reading the profiler's records costs ~1 s CPU
        return None, None
    if strategy.name == "horovod":
        return HorovodRecord(strategy.world_size), None
    return ProfilerRecord(strategy.world_size), None


def formula(strategy, model, micro_batches, sharded):
    """The payload bytes per optimizer step, by kind, that the strategy's design sends for `model`
    (P trainable parameters) over `micro_batches` micro-batches per step: the ZeRO paper's volumes
    with each library's own rules for accumulation (docs/anatomy.md). `sharded`: the weights are
    FSDP2's DTensors. None where it has no formula here (one device, DataParallel)."""
    parameters = [p for p in model.parameters() if p.requires_grad]
    count = sum(getattr(p, "ds_numel", p.numel()) for p in parameters)  # a DTensor's numel is the whole
    half = strategy.precision in ("bf16", "fp16")
    engine = getattr(strategy, "engine", None)
    if strategy.name == "horovod":
        return {"all-reduce": count * (2 if strategy.gradient_compression == "fp16" else 4)}
    if engine is not None:
        return deepspeed_formula(engine, parameters, count, micro_batches)
    if sharded:  # FSDP2: gathers in the compute type, reduces in fp32 once per step (no sync before the last)
        gathers = micro_batches * (2 if fsdp_reshards_after_forward(model) else 1)
        return {"reduce-scatter": count * 4, "all-gather": gathers * count * (2 if half else 4)}
    ddp = next((m for m in model.modules() if type(m).__name__ == "DistributedDataParallel"), None)
    if ddp is None:
        return None
    # One all-reduce of the gradients per step (no_sync before the last micro-batch), and rank 0's
    # buffers broadcast before the step's synchronised forward (broadcast_buffers, DDP's default).
    sent = {"all-reduce": count * parameters[0].element_size()}
    if ddp.broadcast_buffers:
        sent["broadcast"] = sum(buffer.numel() * buffer.element_size() for buffer in ddp.module.buffers())
    return sent


def deepspeed_formula(engine, parameters, count, micro_batches):
    """DeepSpeed's ZeRO: stage 0 all-reduces the gradients once per step; stage 1 too, then gathers the
    updated weights; stage 2 all-reduces them at every micro-batch (it reduces into its partitions as
    backward goes); stage 3 reduce-scatters at every micro-batch, gathers the weights it shards for
    forward, and again for backward unless they all fit its reuse distance and live-parameter limits
    (1e9 elements by default: it keeps them), and after the step gathers the updated weights under its
    persistence threshold, which every process holds whole."""
    stage = engine.zero_optimization_stage()
    weight_bytes = 2 if engine.fp16_enabled() or engine.bfloat16_enabled() else 4
    gradient_bytes = weight_bytes
    if stage == 3:
        gathered = sum(p.ds_numel for p in parameters if not getattr(p, "ds_persist", False))
        kept = gathered <= min(engine.zero_max_reuse_distance(), engine.zero_max_live_parameters())
        gathers = micro_batches * gathered * (1 if kept else 2) + count - gathered
        return {"reduce-scatter": micro_batches * count * gradient_bytes, "all-gather": gathers * weight_bytes}
    sent = {"all-reduce": (micro_batches if stage == 2 else 1) * count * gradient_bytes}
    if stage:
        sent["all-gather"] = count * weight_bytes
    return sent


def fsdp_reshards_after_forward(model):
    """Whether FSDP2 frees the gathered weights after forward (and gathers them again for backward)."""
    from torch.distributed.fsdp import FSDPModule
    groups = [m._get_fsdp_state()._fsdp_param_group for m in model.modules() if isinstance(m, FSDPModule)]
    return any(group is not None and group.post_forward_mesh_info is not None for group in groups)


def ring_total(sent, world_size):
    """What a ring moves in and out of each process for `sent` ({kind: payload bytes})."""
    return round(sum(ring_bytes(kind, size, world_size) for kind, size in sent.items()))


def summary_line(result):
    """The line a script prints about what rank 0 sent per step, against the formula."""
    measured, allowed = result["collective_bytes"], result.get("collective_formula_bytes")
    if measured["payload_bytes"] is None:
        return f"bytes sent per step: not measured: {measured['note']}"
    kinds = ", ".join(f"{kind} {totals['bytes'] / 2**20:.2f} MB in {totals['calls']:g} call(s)"
                      for kind, totals in measured["kinds"].items()) or "none"
    line = (f"bytes sent per step by rank 0 ({measured['steps']} step(s) recorded): {kinds}; a ring moves "
            f"{measured['ring_bytes'] / 2**20:.2f} MB in and out of each process")
    if allowed:
        line += f" (the formula: {allowed['ring_bytes'] / 2**20:.2f} MB)"
    return line
