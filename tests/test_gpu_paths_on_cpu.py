"""What the GPU paths do differently, checked on the CPU with synthetic profiler events, tensors told
they live on a GPU and the scripts' own set-up functions: each defect a reading of the CUDA code found
(the GPU itself confirms them in tests/test_gpu.py and scripts/gpu-check.sh)."""
import importlib.util
from argparse import Namespace
from types import SimpleNamespace

import pytest
import torch

from libraries import deepspeed_setup
from instruments import measure
from conftest import ROOT, run

CPU, CUDA = torch.autograd.DeviceType.CPU, torch.autograd.DeviceType.CUDA
MAIN_THREAD = 1


def event(name, start_ms, end_ms, device=CPU, annotation=False, thread=MAIN_THREAD):
    """A profiler event as torch.profiler reports it (times in microseconds)."""
    return SimpleNamespace(name=name, device_type=device, is_user_annotation=annotation, thread=thread,
                           time_range=SimpleNamespace(start=start_ms * 1000, end=end_ms * 1000), cpu_parent=None)


def test_step_anatomy_on_cuda_counts_cpu_side_steps_and_only_real_kernels_as_busy():
    """Two 100 ms steps. In each, a compute kernel, then an NCCL all-reduce kernel: the first overlaps
    the compute for 10 ms and runs alone for 20; the second runs alone for 30. With CUDA activity the
    profiler also reports a GPU-side copy of every record_function range (steps and phases): they
    must neither double the steps nor count as compute that hides the all-reduce."""
    events = []
    for start in (0, 100):
        ranges = [(f"ProfilerStep#{start // 100}", start, start + 100), ("forward", start, start + 40),
                  ("backward", start + 40, start + 90)]
        for name, begin, end in ranges:
            events += [event(name, begin, end), event(name, begin, end, device=CUDA, annotation=True, thread=7)]
    events += [event("ampere_sgemm", 0, 60, device=CUDA, thread=7),
               event("ncclDevKernel_AllReduce_Sum_f32_RING_LL", 50, 80, device=CUDA, thread=7),
               event("ampere_sgemm", 100, 150, device=CUDA, thread=7),
               event("ncclDevKernel_AllReduce_Sum_f32_RING_LL", 150, 180, device=CUDA, thread=7)]

    anatomy = measure.step_anatomy(events, on_gpu=True)

    assert anatomy["steps"] == 2 and anatomy["step_ms"] == 100
    assert anatomy["communication_ms"] == 30  # (30 + 30) ms over 2 steps
    assert anatomy["phases_ms"]["exposed communication"] == 25  # (20 + 30) / 2
    assert anatomy["overlapped_communication_ms"] == 5
    assert anatomy["phases_ms"]["forward"] == 40
    assert anatomy["phases_ms"]["backward"] == 25  # 50 ms, less the 25 it waited on the all-reduce


def test_model_state_is_counted_per_device_and_only_the_gpu_part_leaves_the_gpu_peak(monkeypatch):
    """An offloading run keeps some model state in CPU memory: subtracting all of it from the GPU's
    peak would understate (even make negative) what the GPU spends beyond model state. The counter
    must split the bytes by device, and the GPU figure subtract only the GPU's."""
    model = torch.nn.Linear(512, 512)  # 1 MiB of fp32 weights, 1 of gradients, 2 of Adam moments
    optimizer = torch.optim.Adam(model.parameters())
    model(torch.ones(2, 512)).sum().backward()
    optimizer.step()
    count = measure.ModelStateCount()
    count.on_train_begin(SimpleNamespace(strategy=SimpleNamespace(), model=model, optimizer=optimizer), 0)  # no engine
    count.count()
    whole = count.bytes["total"]
    assert count.bytes_by_device == {"cpu": whole} and whole >= 4 * 2**20

    # As if the weights were on the GPU and the rest offloaded: the counter reads storage.device.
    on_gpu = {model.weight.untyped_storage().data_ptr(), model.bias.untyped_storage().data_ptr()}
    real_device = torch.UntypedStorage.device.__get__

    def device_of(storage):
        return torch.device("cuda", 0) if storage.data_ptr() in on_gpu else real_device(storage)
    monkeypatch.setattr(torch.UntypedStorage, "device", property(device_of))
    count.count()
    weights = model.weight.untyped_storage().nbytes() + model.bias.untyped_storage().nbytes()
    assert count.bytes_by_device["cuda"] == weights
    assert count.bytes_by_device["cuda"] + count.bytes_by_device["cpu"] == whole
    fields = count.result_fields(torch.device("cuda", 0), peak_memory_mb=10.0)
    assert fields["peak_memory_beyond_model_state_mb"] == 9.0  # 10 MB less the 1 MiB of weights on the GPU
    assert "peak_memory_beyond_model_state_mb" not in count.result_fields(torch.device("cpu"), peak_memory_mb=10.0)


def test_the_model_gets_a_mask_it_need_not_read_back(monkeypatch):
    """Given the 2D padding mask, transformers asks on every forward whether any token is padding
    (`mask.all()` read as a bool): on a GPU the CPU then waits for the GPU once per micro-batch. The
    4D mask the Trainer passes (models.prepared_mask) goes to SDPA as it is: no tensor read as a bool,
    and the same logits."""
    import common
    from support import models
    records = common.load_records(ROOT / "data" / "train.json")[:40]
    tokenizer, model = models.build_tiny_model([text for text, _ in records], 0, {"num_labels": 6})
    dataset = common.EncodedDataset(records, tokenizer, 128)
    batch = common.PadBatch(tokenizer.pad_token_id, 16)([dataset[index, 1.0] for index in range(8)])
    reads, to_bool = [], torch.Tensor.__bool__
    monkeypatch.setattr(torch.Tensor, "__bool__", lambda tensor: reads.append(tensor.shape) or to_bool(tensor))
    model.eval()
    with torch.no_grad():
        unprepared = model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits
        assert reads, "transformers no longer reads the 2D mask back: prepared_mask may be unneeded"
        reads.clear()
        prepared = model(input_ids=batch["input_ids"], attention_mask=models.prepared_mask(batch["attention_mask"]))
    assert reads == [] and torch.equal(prepared.logits, unprepared)


def test_cuda_graphs_are_refused_in_one_line_where_they_cannot_run(monkeypatch):
    """--compile-mode reduce-overhead: on a CPU, and for the strategies whose hooks move gradients or
    weights between the compiled kernels; the rest compile with it."""
    from support import cli, models
    from support.options import build_parser, resolve
    args = resolve(build_parser("single-gpu-cls.py", "").parse_args(["--compile-mode", "reduce-overhead",
                                                                    "--pad-to-multiple-of", "16"]))
    cuda = torch.device("cuda", 0)
    for device, name, problem in [(torch.device("cpu"), "single-device", "which need a GPU"),
                                  (cuda, "fsdp2", "fsdp2 updates gradients or weights in hooks"),
                                  (cuda, "deepspeed", "deepspeed updates"), (cuda, "horovod", "horovod updates")]:
        with pytest.raises(cli.UserError, match=f"^--compile-mode reduce-overhead.*{problem}"):
            models.compile_options(args, SimpleNamespace(device=device, name=name))
    for name in models.CUDA_GRAPH_STRATEGIES:
        options = models.compile_options(args, SimpleNamespace(device=cuda, name=name, world_size=2))
        assert options == {"mode": "reduce-overhead", "dynamic": False}  # static shapes: a graph per length
    # DDP's graph split (a graph per gradient bucket) only where there is an all-reduce to overlap: one
    # process compiles one graph per shape.
    monkeypatch.setattr(torch._dynamo.config, "optimize_ddp", True)
    models.compile_options(args, SimpleNamespace(device=cuda, name="ddp", world_size=2))
    assert torch._dynamo.config.optimize_ddp is True
    models.compile_options(args, SimpleNamespace(device=cuda, name="ddp", world_size=1))
    assert torch._dynamo.config.optimize_ddp is False
    assert args.compile is True  # the mode implies --compile


def deepspeed_args(config=None):
    return Namespace(deepspeed_config=config, zero_stage=None, offload=None, precision=None, batch_size=16,
                     grad_accum=1)


CONFIGS = sorted(str(path) for path in (ROOT / "configs" / "deepspeed").glob("*.json"))


@pytest.mark.parametrize("config", [None, *CONFIGS])
def test_deepspeed_reduce_bucket_is_ddps_size_not_deepspeeds_two_gigabytes(config):
    """DeepSpeed's default reduce bucket (5e8 elements) is allocated whole at every backward: 1.9 GB
    of fp32 on each GPU for any model. The script's default and every shipped config (which the Trainer
    script passes to transformers as they are) use DDP's 25 MiB."""
    built, _ = deepspeed_setup.build_config(deepspeed_args(config), torch.device("cpu"), world_size=2)
    zero = built["zero_optimization"]
    assert zero["reduce_bucket_size"] == deepspeed_setup.REDUCE_BUCKET_ELEMENTS
    expected = 0 if zero["stage"] == 0 else 25 * 2**20
    assert deepspeed_setup.reduce_bucket_bytes(built) == expected


def test_fabric_deepspeed_config_uses_ddps_bucket_size(monkeypatch):
    from libraries import fabric_setup
    monkeypatch.setenv("DS_ACCELERATOR", "cpu")  # the function names cuda; monkeypatch restores it
    monkeypatch.setattr(fabric_setup, "DeepSpeedStrategy", lambda config, timeout: config)
    config = fabric_setup.fabric_strategy(Namespace(fabric_strategy="deepspeed", dist_timeout=60, batch_size=16,
                                                    grad_accum=1))
    assert config["zero_optimization"]["reduce_bucket_size"] == deepspeed_setup.REDUCE_BUCKET_ELEMENTS


def test_dataparallel_checkpoint_saves_and_restores_every_gpus_random_state(monkeypatch, tmp_path):
    """DataParallel's copies on GPUs 1.. draw dropout from those GPUs' generators: a checkpoint must
    hold each one (not only the current GPU's), and --resume must restore each to its own GPU."""
    from support import checkpoints
    import common
    spec = importlib.util.spec_from_file_location("dataparallel_script", ROOT / "multi-gpu-dataparallel-cls.py")
    dataparallel_script = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(dataparallel_script)
    generators = {gpu: torch.tensor([gpu, 7], dtype=torch.uint8) for gpu in (0, 1, 2)}
    restored = {}
    monkeypatch.setattr(torch.cuda, "get_rng_state", lambda gpu: generators[gpu].clone())
    monkeypatch.setattr(torch.cuda, "set_rng_state", lambda state, gpu: restored.__setitem__(gpu, state))

    strategy = dataparallel_script.DataParallelStrategy(torch.device("cuda", 2), gpu_ids=[2, 0])
    torch.save(checkpoints.random_states(strategy.gpus_in_use()), tmp_path / "states.pt")
    checkpoints.set_random_states(torch.load(tmp_path / "states.pt", weights_only=True))
    assert restored.keys() == {2, 0}
    assert all(torch.equal(restored[gpu], generators[gpu]) for gpu in (2, 0))
    # One process per GPU (DDP and the rest): its own GPU's generator only.
    assert common.Strategy(torch.device("cuda", 1)).gpus_in_use() == [1]
    assert common.Strategy(torch.device("cpu")).gpus_in_use() == []


def test_fsdp2_offload_joins_a_group_that_carries_cpu_tensors_too():
    """With --offload the sharded gradients are CPU tensors, and fp16's gradient scaler all-reduces
    its overflow flag, a CPU tensor, over the mesh: an NCCL-only group cannot carry it."""
    spec = importlib.util.spec_from_file_location("fsdp_script", ROOT / "multi-gpu-fsdp-cls.py")
    fsdp_script = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(fsdp_script)
    gpu = torch.device("cuda", 0)
    assert fsdp_script.group_backend(gpu, offload=True) == "cpu:gloo,cuda:nccl"
    assert fsdp_script.group_backend(gpu, offload=False) == "nccl"
    assert fsdp_script.group_backend(torch.device("cpu"), offload=False) == "gloo"


def test_attention_leaves_cudnn_on_a_gpu_only(monkeypatch):
    """cuDNN attention builds a plan per new batch shape: every script turns it off on a GPU (before
    the model is built), and leaves the CPU's attention alone."""
    from support import machine
    calls = []
    monkeypatch.setattr(torch.backends.cuda, "enable_cudnn_sdp", calls.append)
    machine.use_attention_without_plans(torch.device("cpu"))
    assert calls == []
    machine.use_attention_without_plans(torch.device("cuda", 0))
    assert calls == [False]


def test_steady_steps_are_those_that_compiled_no_graph_and_recorded_no_cuda_graph(monkeypatch):
    """Six steps of a compiled run replayed as CUDA graphs: the first compiles; the third meets a new
    shape and compiles it, the fourth records that shape's CUDA graph. The steady steps are the second,
    fifth and sixth alone: their seconds, samples and share of the FLOPs (each step its own shape)."""
    from instruments import flops
    args = SimpleNamespace(compile=True, compile_mode="reduce-overhead")
    lengths = [16, 16, 32, 32, 16, 16]
    progress = SimpleNamespace(sums=torch.zeros(6, dtype=torch.float64))
    trainer = SimpleNamespace(strategy=SimpleNamespace(device=torch.device("cpu")), args=args,
                              train_loader=SimpleNamespace(batch_sampler=SimpleNamespace(samples_in_step=lambda s: 8)))
    throughput = measure.Throughput(progress)
    graphs = iter([(0, 0), (1, 0), (1, 0), (2, 0), (2, 2), (2, 2), (2, 2), (2, 2)])  # begin, 6 steps, end
    ends = iter([10.0, 10.1, 15.1, 16.1, 16.2, 16.3])  # the steps' end marks: 0.1, 5 (compiling), 1 (recording) ...
    monkeypatch.setattr(throughput, "graphs_so_far", lambda: next(graphs))
    monkeypatch.setattr(throughput, "mark", lambda: next(ends))
    throughput.on_train_begin(trainer, 0)
    for step, length in enumerate(lengths, start=1):
        progress.sums = progress.sums + torch.tensor([0, 0, 0, 8 * length, 8, 8 * length ** 2])
        throughput.on_step_end(trainer, step, loss=None)
    throughput.on_train_end(trainer)
    config = SimpleNamespace(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_labels=6)
    seconds, samples, share = throughput.steady(config)

    def step_flops(length):
        return flops.training_flops(config, 8 * length, 8, 8 * length ** 2)
    assert seconds == pytest.approx([0.1, 0.1, 0.1]) and samples == 24
    assert share == pytest.approx(3 * step_flops(16) / sum(step_flops(length) for length in lengths))
    assert (throughput.compiled_graphs, throughput.cuda_graphs) == (2, 2)
