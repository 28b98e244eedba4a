"""Measurements beside the lesson, so that a reader of the training loop meets only the strategy:
how many bytes of model state each process really holds against what the ZeRO formulas predict,
how fast the steps ran against the device's limit (MFU), and where a step's time goes (--profile).
A file named in SUITE_CALLBACKS adds callbacks of its own to any script's run, without editing it."""
import importlib.util
import os
import statistics
import sys
import time
from pathlib import Path

import torch
from torch.profiler import ProfilerActivity, record_function
from tqdm import tqdm

from support.callbacks import Callback
from support.errors import UserError
from support.machine import reset_peak_memory, synchronize

from . import flops, results, traffic


class Progress(Callback):
    """What the loop did, counted beside it: its seconds (pauses taken out), steps, samples, what its
    micro-batches held (count_tokens' sums, and their distinct shapes: each new one costs a GPU a plan,
    a compilation or a graph), and rank 0's progress bar."""

    def __init__(self, bar=True):
        self.with_bar, self.samples, self.paused, self.shapes = bar, 0, 0.0, set()
        self.seconds = None  # until the loop ends
        self.sums = torch.zeros(len(results.TOKEN_COUNTS), dtype=torch.float64)

    def on_train_begin(self, trainer, first_step):
        self.strategy, self.step = trainer.strategy, first_step
        self.bar = tqdm(total=trainer.total_steps(), initial=first_step, mininterval=1, dynamic_ncols=True,
                        disable=not (self.with_bar and trainer.strategy.is_main))
        reset_peak_memory(self.strategy.device)
        synchronize(self.strategy.device)
        self.start = time.perf_counter()

    def on_phase_begin(self, trainer, phase):
        if phase == "pause":
            self.pause_start = time.perf_counter()

    def on_phase_end(self, trainer, phase):
        if phase == "pause":
            self.paused += time.perf_counter() - self.pause_start

    def add_pause(self, seconds):
        """Time the caller measured that was not training (the Hugging Face Trainer's evaluations)."""
        self.paused += seconds

    def on_batch_loaded(self, trainer, batch):
        counts = count_tokens(batch)  # where the batch is: the Trainer lesson's are on the GPU already
        self.sums = self.sums.to(counts.device) + counts
        self.shapes.add(tuple(batch["input_ids"].shape))

    def on_step_end(self, trainer, step, loss):
        self.step = step
        self.samples += trainer.train_loader.batch_sampler.samples_in_step(step)
        self.bar.update()

    def on_train_end(self, trainer):
        synchronize(self.strategy.device)
        self.seconds = time.perf_counter() - self.start - self.paused
        self.bar.close()

    def summary(self):
        """Seconds, steps, samples, and the whole job's sums by name and distinct step shapes (summed
        over the processes: every process calls this)."""
        strategy = self.strategy
        sums = strategy.reduce_mean(self.sums.to(strategy.device)).cpu() * strategy.world_size
        shapes = {tuple(shape) for part in strategy.gather_objects(sorted(self.shapes)) for shape in part}
        return {"seconds": self.seconds, "steps": self.step, "samples": self.samples,
                **dict(zip(results.TOKEN_COUNTS, sums.tolist())), "step_shapes": len(shapes)}


def count_tokens(batch):
    """flops.py's three sums (tokens, sequences, and query-key pairs of attention), first over the real
    samples at their own lengths, then over what the model computed (padding and repeats included); then
    the tokens computed in the real samples' rows (results.TOKEN_COUNTS). Computed where the batch is,
    without reading anything back: no wait for a GPU."""
    real = (batch["weight"] > 0).double()
    real_lengths = batch["attention_mask"].sum(dim=1).double() * real
    sequences, length = batch["input_ids"].shape
    computed = torch.tensor([sequences * length, sequences, sequences * length ** 2], dtype=torch.float64,
                            device=real.device)
    return torch.stack([real_lengths.sum(), real.sum(), (real_lengths ** 2).sum(), *computed, real.sum() * length])


class ModelStateCount(Callback):
    """Bytes of parameters, gradients and optimizer state this process holds, counted from the
    tensors themselves just before the second optimizer step, where all three exist (Adam creates
    its moments in the first step, and zero_grad frees the gradients after each); a run of one step
    adds the gradients counted before it to the rest counted after it.

    Only this process's part counts: FSDP2's local shards of its DTensors, DeepSpeed's partitions
    (reduced gradient partitions, ZeRO-3 weight partitions, and its fp32 master weights, which the
    ZeRO paper counts as optimizer state). A tensor that is a view of another counts once, with the
    whole memory it lives in (flat buffers, padding). Communication buffers (DDP's gradient buckets,
    DeepSpeed's reduce bucket) are not model state.
    """

    def on_train_begin(self, trainer, first_step):
        self.model, self.optimizer, self.steps, self.bytes = trainer.model, trainer.optimizer, 0, None  # until counted
        self.zero_optimizer = getattr(getattr(trainer.strategy, "engine", None), "optimizer", None)  # DeepSpeed's

    def on_phase_begin(self, trainer, phase):
        if phase == "optimizer step":
            self.steps += 1
            if self.steps <= 2:
                self.count()

    def master_weights(self):
        """DeepSpeed's fp32 partitions, one per parameter group: what its torch optimizer updates."""
        zero = self.zero_optimizer
        return [*getattr(zero, "single_partition_of_fp32_groups", []),  # ZeRO-1 and 2
                *getattr(zero, "fp32_partitioned_groups_flat", [])]  # ZeRO-3

    def count(self, gradients=None):
        """`gradients`: where the caller saw them (a ZeRO partition per group, at that group's step
        under the Trainer); by default, those the tensors hold now."""
        optimizer = getattr(self.optimizer, "optimizer", self.optimizer)  # Accelerate's and DeepSpeed's wrap torch's
        zero, master_weights = self.zero_optimizer, self.master_weights()
        masters = {local(master).untyped_storage().data_ptr() for master in master_weights}
        optimized = [p for group in optimizer.param_groups for p in group["params"]
                     if local(p).untyped_storage().data_ptr() not in masters]
        parameters = [*self.model.parameters(), *optimized]
        parameters += [p.ds_tensor for p in parameters if hasattr(p, "ds_tensor")]  # a ZeRO-3 weight partition
        if gradients is None:
            gradients = [p.grad for p in parameters + master_weights if p.grad is not None]
            gradients += [g for group in getattr(zero, "averaged_gradients", {}).values() for g in group or []
                          if isinstance(g, torch.Tensor)]
            if isinstance(getattr(zero, "grad_partitions_flat_buffer", None), torch.Tensor):
                gradients.append(zero.grad_partitions_flat_buffer)
        moments = [value for state in optimizer.state.values() for value in state.values()
                   if isinstance(value, torch.Tensor)]
        seen, self.blocks = {}, {}
        for kind, tensors in (("parameters", parameters), ("gradients", gradients),
                              ("optimizer_state", master_weights + moments)):
            self.blocks[kind] = memory_blocks(tensors, seen)
        self.add_up()

    def on_train_end(self, trainer):
        if self.steps == 1:  # one step: Adam's moments exist only after it, the gradients only before it
            gradients = self.blocks["gradients"]
            self.count(gradients=[])
            self.blocks["gradients"] = gradients
            self.add_up()

    def add_up(self):
        """self.bytes and self.bytes_by_device from the memory blocks counted of each kind."""
        held = {kind: sum(blocks.values()) for kind, blocks in self.blocks.items()}
        self.bytes = {**held, "total": sum(held.values())}
        self.bytes_by_device = {}  # offloaded state lives in CPU memory, the rest on the GPU
        for (device_type, _), nbytes in (item for blocks in self.blocks.values() for item in blocks.items()):
            self.bytes_by_device[device_type] = self.bytes_by_device.get(device_type, 0) + nbytes

    def result_fields(self, device, peak_memory_mb):
        """result.json's model-state fields; on a GPU, also what of the GPU's peak is not model state
        (activations, buffers, workspaces): the peak less the model state held on the GPU only."""
        if self.bytes is None:
            return {"model_state_bytes": None}
        fields = {"model_state_bytes": self.bytes, "model_state_bytes_by_device": self.bytes_by_device}
        if device.type == "cuda":
            fields["peak_memory_beyond_model_state_mb"] = round(
                peak_memory_mb - self.bytes_by_device.get("cuda", 0) / 2**20, 1)
        return fields

    def on_result(self, trainer, result):
        result.update(self.result_fields(trainer.strategy.device, result["peak_memory_mb"]))
        result["model_state_formula_bytes"] = zero_formula(trainer.strategy, self.model)


class Throughput(Callback):
    """How fast the steps ran and how close to the device's limit. The first step is timed apart: it
    pays the one-time costs (torch.compile, loading the kernels of new shapes, the allocator's first
    blocks), which a user pays once per run. Steady steps are the later steps that neither compiled a
    graph nor recorded a CUDA graph (a new shape does both, on its first and second step) nor ran under
    a profiler (CollectiveBytes' few steps, --profile's, which slow every operator): their median,
    samples/s, model FLOP/s (flops.py, from the shapes each micro-batch computed) and MFU, the FLOP/s
    per device over the GPU's published dense peak for the precision the run computes in. The seconds
    torch.compile spent while training are reported apart.

    A step's end is marked without waiting for the GPU (CUDA events, read when the loop has ended),
    so measuring adds no host sync to the loop but one, after the first step.
    """

    def __init__(self, progress):
        self.progress = progress
        self.first_step, self.compiled_graphs, self.cuda_graphs, self.compile_seconds = None, None, None, None
        # Per step: its end mark, samples, token sums so far (and before the first), whether it compiled or recorded.
        self.marks, self.samples, self.token_sums, self.warming = [], [], [], []

    def mark(self):
        if self.device.type == "cuda":
            event = torch.cuda.Event(enable_timing=True)
            event.record()
            return event
        return time.perf_counter()

    def graphs_so_far(self):
        """(graphs dynamo compiled, CUDA graphs recorded) so far: a step that changes either is not steady."""
        if not self.args.compile:
            return None, None
        from torch._dynamo.utils import counters
        recorded = cuda_graphs_recorded(self.device) if self.args.compile_mode == "reduce-overhead" else None
        return counters["stats"]["unique_graphs"], recorded

    def on_train_begin(self, trainer, first_step):
        self.device, self.args = trainer.strategy.device, trainer.args
        self.token_sums.append(self.progress.sums.clone())
        synchronize(self.device)
        self.start = time.perf_counter()
        self.graphs = self.graphs_so_far()

    def on_step_end(self, trainer, step, loss):
        graphs = self.graphs_so_far()
        if self.first_step is None:
            synchronize(self.device)
            self.first_seconds = time.perf_counter() - self.start
            self.first_step = step
        # A profiler still on here recorded this step: callbacks after this one stop theirs (callbacks_for's order).
        self.warming.append(graphs != self.graphs or torch.autograd.profiler._is_profiler_enabled)
        self.graphs = graphs
        self.marks.append(self.mark())
        self.samples.append(trainer.train_loader.batch_sampler.samples_in_step(step))
        self.token_sums.append(self.progress.sums.clone())  # no read back: a copy where they are

    def on_train_end(self, trainer):
        synchronize(self.device)
        self.compiled_graphs, self.cuda_graphs = self.graphs_so_far()
        if self.args.compile:  # dynamo's own clock: tracing and compiling forward and backward graphs
            from torch._dynamo.utils import calculate_time_spent
            spent = calculate_time_spent()
            self.compile_seconds = round(spent.get("entire_frame_compile", 0) + spent.get("entire_backward_compile", 0),
                                         2)
        self.step_seconds = [self.seconds(index) for index in range(1, len(self.marks))]

    def seconds(self, index):
        """The seconds of this launch's step `index` (from 0): the first's as timed apart, then the gap
        between its mark and the one before (CUDA events: read once the GPU has passed both, which
        curves.py's writes while training wait for)."""
        if index == 0:
            return self.first_seconds
        before, after = self.marks[index - 1], self.marks[index]
        if self.device.type != "cuda":
            return after - before
        after.synchronize()
        return before.elapsed_time(after) / 1000

    def steady(self, config):
        """(seconds of each steady step, their samples, their share of this process's model FLOPs): the
        share is exact whatever the shapes of the steps left out."""
        sums = torch.stack(self.token_sums).cpu()[:, results.COMPUTED_SUMS]  # what the model computed
        steps = [k for k in range(1, len(self.marks)) if not self.warming[k]]
        tokens = sum((sums[k + 1] - sums[k] for k in steps), torch.zeros(sums.shape[1], dtype=sums.dtype))
        share = flops.training_flops(config, *tokens.tolist()) / flops.training_flops(config, *sums[-1].tolist())
        return [self.step_seconds[k - 1] for k in steps], sum(self.samples[k] for k in steps), share

    def on_result(self, trainer, result):
        if self.first_step is None:  # nothing trained (a --resume past the last step)
            return
        config = trainer.strategy.unwrap(trainer.model).config
        model_flops = flops.training_flops(config, *(result[name] for name in results.COMPUTED_COUNTS))  # the job's
        seconds, samples, share = self.steady(config)
        strategy = trainer.strategy
        devices = len(strategy.gpus_in_use()) * strategy.world_size if self.device.type == "cuda" else 1
        steady_seconds = sum(seconds)
        steady_flops = model_flops * share / steady_seconds if steady_seconds > 0 else None
        # The FLOPs the real tokens need, each text at its own length: padding is work no user wants.
        real_share = flops.training_flops(config, *(result[name] for name in results.REAL_COUNTS)) / model_flops
        result.update({
            "first_step_seconds": round(self.first_seconds, 3),
            "compile_seconds": self.compile_seconds,
            "steady_steps": len(seconds),
            "steady_step_seconds": round(statistics.median(seconds), 4) if seconds else None,
            "steady_samples_per_second": round(samples / steady_seconds, 2) if steady_seconds > 0 else None,
            "real_tokens_per_second": round(result["real_tokens"] / result["train_seconds"], 1),
            "computed_tokens_per_second": round(result["computed_tokens"] / result["train_seconds"], 1),
            "model_flops": model_flops,
            "model_flops_per_second": round(model_flops / result["train_seconds"]),
            "steady_model_flops_per_second": round(steady_flops) if steady_flops else None,
            "real_flops_share": round(real_share, 4),
            "compute_precision": compute_precision(trainer),
            "compiled_graphs": self.compiled_graphs,
            "cuda_graphs": self.cuda_graphs,
            "devices": devices,
        })
        result.update(published_mfu(self.device, result["compute_precision"], steady_flops, devices))
        if result["mfu"] is not None:
            result["mfu_real"] = round(result["mfu"] * real_share, 4)


def cuda_graphs_recorded(device):
    """The CUDA graphs torch.compile's reduce-overhead mode recorded on `device`: the nodes of its graph
    trees, one per step shape and part (forward, backward) it replays."""
    from torch._inductor import cudagraph_trees
    manager = cudagraph_trees.get_manager(device.index, create_if_none_exists=False)
    nodes = [node for roots in manager.roots.values() for node in roots] if manager else []
    count = 0
    while nodes:
        node = nodes.pop()
        count += 1
        nodes += [child for children in node.children.values() for child in children]
    return count


def compute_precision(trainer):
    """What the matrix products compute in: the mixed precision's 16-bit type, else TF32 where --tf32
    asked for it, else IEEE fp32."""
    precision = trainer.strategy.precision
    return "tf32" if precision == "fp32" and trainer.args.tf32 else precision


def published_mfu(device, precision, flop_per_second, devices):
    """MFU against the GPU's published dense peak, or why there is none."""
    if device.type != "cuda":
        return {"mfu": None, "mfu_note": f"no published peak for a {device.type}: the runner measures one "
                                         "(microbenchmarks/matmul_peak.py)"}
    peak, source = flops.published_peak(torch.cuda.get_device_name(device), precision)
    if peak is None:
        return {"mfu": None, "mfu_note": source}
    mfu = flops.mfu(flop_per_second and flop_per_second / devices, peak)
    return {"mfu": round(mfu, 4) if mfu is not None else None, "peak_tflops": peak, "peak_source": source}


def zero_formula(strategy, model):
    """The model state per process that the ZeRO paper's formulas predict for this run: with P
    parameters over N processes, weights (w bytes each), gradients (g bytes each) and optimizer state
    (Adam's two fp32 moments, plus a fp32 master copy where the library keeps one) held whole at
    stage 0 (DDP and every unsharded strategy); ZeRO-1 divides the optimizer state by N, ZeRO-2 the
    gradients too, ZeRO-3 and FSDP2 the weights too. Two rules of DeepSpeed's own apply: its ZeRO-1
    reduces the gradients into their partitions at the end of backward (whole during backward, a
    partition at the step), and its ZeRO-3 keeps weights under its persistence threshold whole too."""
    engine, n = getattr(strategy, "engine", None), strategy.world_size
    parameters = [p for p in model.parameters() if p.requires_grad]
    numel = {id(p): getattr(p, "ds_numel", p.numel()) for p in parameters}  # DTensor.numel() is the whole
    count = sum(numel.values())
    if engine is not None:
        stage = engine.zero_optimization_stage()
        weight_bytes = 2 if engine.fp16_enabled() or engine.bfloat16_enabled() else 4
        master_bytes = 4 if stage or weight_bytes == 2 else 0  # DeepSpeed's own fp32 copy
    else:
        stage = 3 if any(is_dtensor(p) for p in parameters) else 0
        weight_bytes, master_bytes = parameters[0].element_size(), 0  # FSDP2 keeps its shards in fp32
    persistent = sum(numel[id(p)] for p in parameters if getattr(p, "ds_persist", False))
    gradients_sharded = stage >= 2 or (engine is not None and stage == 1)
    predicted = {"parameters": weight_bytes * (persistent + count / n if stage == 3 else count),
                 "gradients": weight_bytes * count / (n if gradients_sharded else 1),
                 "optimizer_state": (8 + master_bytes) * count / (n if stage >= 1 else 1)}
    predicted = {key: round(value) for key, value in predicted.items()}
    return {**predicted, "total": sum(predicted.values()), "zero_stage": stage, "processes": n,
            "parameter_count": count}


def memory_blocks(tensors, seen):
    """{(device type, address): bytes} of the memory the `tensors` live in, each block once and none
    already in `seen`, which they join (a view counts with the tensor it views, even across calls)."""
    blocks = {}
    for tensor in tensors:
        storage = local(tensor).untyped_storage()
        block = (storage.device.type, storage.data_ptr())
        if storage.nbytes() and block not in seen:
            seen[block] = blocks[block] = storage.nbytes()
    return blocks


def local(tensor):
    """This process's part of a tensor: the local shard of FSDP2's DTensors."""
    return tensor.to_local() if is_dtensor(tensor) else tensor


def is_dtensor(tensor):
    """Whether `tensor` is a DTensor, without importing torch.distributed.tensor (a second of every
    start): a run whose strategy shards with DTensors has imported it."""
    module = sys.modules.get("torch.distributed.tensor")
    return module is not None and isinstance(tensor, module.DTensor)


class CollectiveBytes(Callback):
    """The bytes this process's collectives carried per optimizer step, by kind (traffic.py), recorded
    over the steps after the first (which may pay one-time exchanges), up to WINDOW_STEPS of them.
    What ran, not what the model implies: torch.profiler's records of torch.distributed's operators,
    Horovod's own calls where its thread hides them; with --profile, the step profile's records."""

    WINDOW_STEPS = 3

    def __init__(self, profile=None):
        self.profile, self.started, self.from_profile = profile, False, False  # profile: the run's StepProfile

    def on_train_begin(self, trainer, first_step):
        self.world_size, self.model = trainer.strategy.world_size, trainer.model
        self.record, self.note = traffic.record_for(trainer.strategy)
        remaining = trainer.total_steps() - first_step
        self.start_after = first_step + (remaining > 1)  # after the first step, unless it is the only one
        self.stop_after = min(self.start_after + self.WINDOW_STEPS, first_step + remaining)
        if remaining < 1:
            self.record = None
        if isinstance(self.record, traffic.ProfilerRecord) and self.profile is not None:
            self.record, self.from_profile = None, True  # one profiler at a time: the step profile's records serve
        if self.start_after == first_step:
            self.begin()

    def on_step_end(self, trainer, step, loss):
        if step == self.start_after and not self.started:
            self.begin()
        elif step == self.stop_after and self.started:
            self.record.stop()

    def begin(self):
        if self.record is not None:
            self.started = True
            self.record.start()

    def on_result(self, trainer, result):
        if self.from_profile:
            result["collective_bytes"] = self.profile.collective_bytes()
        elif self.record is not None and self.record.calls is not None:
            result["collective_bytes"] = traffic.per_step(self.record.calls, self.stop_after - self.start_after,
                                                          self.world_size, self.record.source)
        elif self.note is not None:
            result["collective_bytes"] = traffic.not_measured(self.world_size, self.note)
        sent = traffic.formula(trainer.strategy, self.model, trainer.args.grad_accum,
                               sharded=any(is_dtensor(p) for p in self.model.parameters()))
        if "collective_bytes" in result and sent is not None:
            result["collective_formula_bytes"] = {"kinds": sent, "payload_bytes": sum(sent.values()),
                                                  "ring_bytes": traffic.ring_total(sent, self.world_size)}


# A Python file whose callbacks() returns more callbacks for the run: a measurement or a fault added to
# any script without editing it. Unset in a plain run.
EXTRA_CALLBACKS_ENV = "SUITE_CALLBACKS"


def extra_callbacks():
    """The callbacks of the file SUITE_CALLBACKS names (none when it is unset)."""
    path = os.environ.get(EXTRA_CALLBACKS_ENV)
    if not path:
        return []
    if not Path(path).is_file():
        raise UserError(f"{EXTRA_CALLBACKS_ENV}={path}: no such file (a Python file defining callbacks())")
    spec = importlib.util.spec_from_file_location("extra_callbacks", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.callbacks()


PHASES = ("data loading", "forward", "backward", "optimizer step")
WARMUP_STEPS = 2  # before the recorded steps: the first steps allocate, compile kernels, fill caches


class StepProfile(Callback):
    """--profile STEPS: record STEPS training steps with torch.profiler after a short warm-up, write
    the trace (Perfetto, chrome://tracing) and summarise where a step's time goes.

    Each phase is a profiler range between two points of the Trainer's loop; on a GPU a phase also
    waits for its kernels, so that it lasts as long as its work (only while profiling).
    Communication is the collectives the profiler sees by name: gloo's run on gloo's threads, NCCL's
    as kernels. What runs while the process computes is overlapped; the rest is exposed (waited
    for), and is taken out of the phase that waited. Horovod's all-reduces run on its own background
    thread, invisible here: its exposed part is the wait in its optimizer's synchronize(), a range
    of the Horovod script's own.
    """

    def __init__(self, steps):
        self.steps, self.phase = steps, None  # the open range

    def on_train_begin(self, trainer, first_step):
        self.device, self.output_dir = trainer.strategy.device, trainer.output_dir
        self.world_size, remaining_steps = trainer.strategy.world_size, trainer.total_steps() - first_step
        self.steps = min(self.steps, remaining_steps)
        warmup = min(WARMUP_STEPS, remaining_steps - self.steps)
        activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if self.device.type == "cuda" else [])
        schedule = torch.profiler.schedule(wait=max(0, warmup - 1), warmup=min(1, warmup), active=self.steps,
                                            repeat=1)
        # With the shapes: the collectives' records then tell their bytes (CollectiveBytes).
        self.profiler = torch.profiler.profile(activities=activities, schedule=schedule, record_shapes=True)
        self.profiler.start()

    def begin(self, name):
        self.end()
        self.phase = record_function(name)
        self.phase.__enter__()

    def end(self):
        if self.phase is not None:
            if self.device.type == "cuda":
                torch.cuda.synchronize(self.device)
            self.phase.__exit__(None, None, None)
            self.phase = None

    def on_phase_begin(self, trainer, phase):
        if phase != "pause":
            self.begin(phase)

    def on_phase_end(self, trainer, phase):
        self.end()

    def on_step_end(self, trainer, step, loss):
        self.profiler.step()

    def on_train_end(self, trainer):
        self.profiler.stop()

    def on_result(self, trainer, result):
        if trainer.strategy.is_main:
            result["profile"] = self.summary()

    def summary(self):
        """Write the trace; return milliseconds per recorded step by phase (they add up to the
        step), and the communication."""
        self.profiler.export_chrome_trace(str(self.output_dir / "trace.json"))
        anatomy = step_anatomy(list(self.profiler.events()), on_gpu=self.device.type == "cuda")
        moved = self.collective_bytes()
        return {**anatomy, "bytes_per_step": {kind: moved["kinds"].get(kind, {}).get("bytes", 0) for kind in
                                              moved["kinds"]}, "ring_bytes_per_step": moved["ring_bytes"]}

    def collective_bytes(self):
        """traffic.per_step of the recorded steps' collectives (those torch.distributed ran)."""
        events = list(self.profiler.events())
        steps = sum(e.name.startswith("ProfilerStep") for e in events if e.device_type == torch.autograd.DeviceType.CPU)
        return traffic.per_step(traffic.collective_calls(events, self.world_size), max(steps, 1), self.world_size,
                                "torch.profiler's records of torch.distributed's operators (--profile's steps)")


def step_anatomy(events, on_gpu):
    """Milliseconds per recorded step by phase, and the communication, from the profiler's events.

    Steps and phases are the CPU-side ranges: with CUDA activity the profiler also reports a GPU-side
    copy of every record_function range (same name, device type CUDA, a user annotation), which
    would count each step twice and, as "busy" time, hide every collective."""
    cpu_side = [e for e in events if e.device_type == torch.autograd.DeviceType.CPU]
    gpu_work = [e for e in events if e.device_type == torch.autograd.DeviceType.CUDA and not e.is_user_annotation]
    steps = [e for e in cpu_side if e.name.startswith("ProfilerStep")]
    main_thread = steps[0].thread
    window = union(interval(e) for e in steps)

    def ms_per_step(spans):
        return round(length(spans) / 1000 / len(steps), 3)

    communication = [e for e in cpu_side + gpu_work if is_collective(e.name)]
    if on_gpu:  # compute is the GPU's real work: kernels and copies, not the annotations
        busy = union(interval(e) for e in gpu_work if not is_collective(e.name))
    else:  # the operators this process computes; a collective launched or waited for is not one
        busy = union(interval(e) for e in cpu_side if e.thread == main_thread and e.name.startswith("aten::")
                     and not (e.cpu_parent and e.cpu_parent.name.startswith("aten::")))
    communicating = intersect(union(interval(e) for e in communication), window)
    exposed = subtract(communicating, busy)
    ranges = {name: union(interval(e) for e in cpu_side if e.name == name and e.thread == main_thread)
              for name in PHASES}
    phases = {name: ms_per_step(subtract(ranges[name], exposed)) for name in PHASES}
    phases["exposed communication"] = ms_per_step(exposed)
    collectives = {}
    for name in sorted({e.name for e in communication}):
        spans = intersect(union(interval(e) for e in communication if e.name == name), window)
        collectives[name] = {"ms": ms_per_step(spans), "exposed_ms": ms_per_step(subtract(spans, busy)),
                             "calls_per_step": sum(e.name == name for e in communication) / len(steps),
                             "during": max(PHASES, key=lambda phase: length(intersect(spans, ranges[phase])))}
    step_ms = ms_per_step(window)
    return {"steps": len(steps), "step_ms": step_ms, "phases_ms": phases,
            "unaccounted_ms": round(step_ms - sum(phases.values()), 3),
            "communication_ms": ms_per_step(communicating),
            "overlapped_communication_ms": round(ms_per_step(communicating) - phases["exposed communication"], 3),
            "collectives": collectives,
            **({"note": HOROVOD_NOTE} if "horovod:synchronize" in collectives else {})}


COLLECTIVE_NAMES = ("gloo:", "horovod:")  # gloo's own threads, Horovod's wait; NCCL's are GPU kernels
HOROVOD_NOTE = ("Horovod all-reduces on its background thread, which torch.profiler does not see: its communication "
                "here is only the wait in synchronize(), all of it exposed (HOROVOD_TIMELINE=file shows the rest)")


def is_collective(name):
    name = name.lower()
    return name.startswith(COLLECTIVE_NAMES) or ("nccl" in name and "kernel" in name)


def interval(event):
    return event.time_range.start, event.time_range.end


def union(intervals):
    """Sorted, disjoint intervals (microseconds) covering the same time as `intervals`."""
    merged = []
    for start, end in sorted(intervals):
        if merged and start <= merged[-1][1]:
            merged[-1][1] = max(merged[-1][1], end)
        else:
            merged.append([start, end])
    return [tuple(span) for span in merged]


def intersect(a, b):
    """The time in both of two unions."""
    spans, i, j = [], 0, 0
    while i < len(a) and j < len(b):
        start, end = max(a[i][0], b[j][0]), min(a[i][1], b[j][1])
        if start < end:
            spans.append((start, end))
        if a[i][1] < b[j][1]:
            i += 1
        else:
            j += 1
    return spans


def subtract(a, b):
    """The time in union `a` and not in union `b`."""
    spans = []
    for start, end in a:
        for b_start, b_end in b:
            if b_end <= start or b_start >= end:
                continue
            if b_start > start:
                spans.append((start, b_start))
            start = max(start, b_end)
            if start >= end:
                break
        if start < end:
            spans.append((start, end))
    return spans


def length(spans):
    return sum(end - start for start, end in spans)
