"""The GPU paths: NCCL (torch's and Horovod's), DataParallel over real GPUs, fp16 with its gradient scaler,
DeepSpeed fp16, FSDP2 in bf16, and the GPU memory each run reports. The rest of the suite runs on the CPU (SMALL's
--device cpu) on every machine; this module runs only where torch sees a CUDA GPU, and is skipped,
with the reason, everywhere else. Each test names the GPUs it needs and is skipped on fewer.

Every run is the tiny model on SMALL's uneven data (332 train, 83 dev) with --device cuda. Launches
go through `python -m torch.distributed.run` (torchrun's module), not a torchrun file beside the
interpreter, so that a system Python with its launchers elsewhere runs them too.
scripts/gpu-check.sh runs this module, then the benchmark."""
import importlib.util
import os

import pytest
import torch

if not torch.cuda.is_available():
    pytest.skip("no CUDA GPU: torch sees none (these tests run on a GPU machine: scripts/gpu-check.sh)",
                allow_module_level=True)

# What every training script imports (common.py and its modules) and what the checks read (safetensors). A GPU
# machine set up by hand may lack one: say which, instead of failing every test alike.
_MISSING = [module for module in ("transformers", "sklearn", "numpy", "tqdm", "safetensors")
            if importlib.util.find_spec(module) is None]
if _MISSING:
    message = f"the suite needs {', '.join(_MISSING)}, not installed here (pip install -r requirements.txt)"
    if os.environ.get("CI"):
        pytest.fail(message, pytrace=False)
    pytest.skip(message, allow_module_level=True)

from conftest import (DEV_SAMPLES, EXACT, PYTHON, ROOT, SMALL, assert_same_weights, free_port, load_weights,  # noqa: E402
                      read_result, require, run, untrained_dev_loss)

GPUS = torch.cuda.device_count()
# SMALL with --device cuda (the last --device given wins): a GPU, or one error line, never the CPU.
GPU = [*SMALL, "--device", "cuda"]
# Two processes for the distributed runs where the machine has two GPUs, else one: the strategy's
# GPU code path (NCCL group, sharding, loss scaling) runs either way.
PROCESSES = min(GPUS, 2)
FAIL_AT_ENV = "SUITE_FAIL_AT"  # "rank:step": that rank raises right after that optimizer step


def needs(gpus):
    return pytest.mark.skipif(GPUS < gpus, reason=f"needs {gpus} CUDA GPUs; this machine has {GPUS}")


def torchrun(processes, script):
    return [PYTHON, "-m", "torch.distributed.run", "--nproc_per_node", str(processes), "--master_port", free_port(),
            script]


def assert_gpu_run(output_dir, world_size, precision="fp32", offloaded=False):
    """The run trained on CUDA, every dev sample once, and reported rank 0's GPU memory: the peak
    allocated since training started, and what of it is not model state on the GPU (activations,
    buffers, workspaces), which the model state held there during the step leaves non-negative."""
    result = read_result(output_dir)
    assert result["device"].startswith("cuda"), result["device"]
    assert result["world_size"] == world_size and result["dev_samples"] == DEV_SAMPLES
    assert result["precision"] == precision
    if precision != "fp32":  # tensor cores: fp16 from compute capability 7 (Volta), bf16 from 8 (Ampere)
        major = torch.cuda.get_device_capability(0)[0]
        assert result["precision_native"] is (major >= (8 if precision == "bf16" else 7))
    peak, beyond = result["peak_memory_mb"], result["peak_memory_beyond_model_state_mb"]
    assert peak > 0 and -0.2 <= beyond <= peak, (peak, beyond)
    on_gpu = result["model_state_bytes_by_device"].get("cuda", 0)
    in_cpu_memory = result["model_state_bytes"]["total"] - on_gpu  # Adam's step counters, or what is offloaded
    assert (in_cpu_memory > result["model_state_bytes"]["total"] / 100) is offloaded, (on_gpu, in_cpu_memory)
    assert beyond == pytest.approx(peak - on_gpu / 2**20, abs=0.2)
    return result


def assert_learns(result):
    assert result["dev_loss"] < untrained_dev_loss() - 0.03, result["dev_loss"]


@pytest.fixture(scope="module")
def single_gpu(tmp_path_factory):
    """single-gpu-cls.py on GPU 0 at batch 32, shuffling and dropout off: the reference."""
    output = tmp_path_factory.mktemp("single-gpu")
    run([PYTHON, "single-gpu-cls.py", *GPU, *EXACT, "--batch-size", "32", "--output-dir", str(output)])
    return output


@needs(1)
def test_one_gpu_learns_and_reports_its_peak_memory(single_gpu):
    result = assert_gpu_run(single_gpu, world_size=1)
    assert_learns(result)
    assert result["model_state_bytes"]["total"] > 0


@needs(1)
def test_compiled_tf32_on_one_gpu_tracks_eager_fp32_and_reports_its_mfu(tmp_path, single_gpu):
    """--compile --tf32: static shapes, a graph per padded length (a GPU pads to multiples of 16), the
    steps' pace against the GPU's published TF32 peak where flops.py knows the GPU, and the eager IEEE
    fp32 run's metrics within TF32's precision (10 mantissa bits in the products)."""
    from instruments import flops
    run([PYTHON, "single-gpu-cls.py", *GPU, *EXACT, "--batch-size", "32", "--compile", "--tf32",
         "--output-dir", str(tmp_path)])
    result = assert_gpu_run(tmp_path, world_size=1)
    assert result["compiled"] is True and result["compile_dynamic"] == "static"
    assert result["pad_to_multiple_of"] == 16 and result["compiled_graphs"] == result["step_shapes"] <= 128 // 16
    assert result["compute_precision"] == "tf32" and result["first_step_seconds"] > 0
    peak, _ = flops.published_peak(torch.cuda.get_device_name(0), "tf32")
    assert (result["mfu"] is not None) is (peak is not None) and (result["mfu"] or 0) < 1
    assert abs(result["dev_loss"] - read_result(single_gpu)["dev_loss"]) < 0.01


@needs(1)
@pytest.mark.parametrize("script", ["single-gpu-cls.py", "multi-gpu-distributed-mp-amp-cls.py"])
def test_cuda_graphs_replay_the_steps_and_track_eager_fp32(tmp_path, single_gpu, script):
    """--compile-mode reduce-overhead: one device, and DDP with bf16 autocast (its spawn script, one
    process): a CUDA graph recorded per step shape and part, metrics within bf16's of the eager run."""
    options = ["--nprocs", "1", "--precision", "bf16"] if "amp" in script else []
    run([PYTHON, script, *GPU, *EXACT, *options, "--batch-size", "32", "--compile-mode", "reduce-overhead",
         "--output-dir", str(tmp_path)])
    result = assert_gpu_run(tmp_path, world_size=1, precision="bf16" if options else "fp32")
    assert result["compile_mode"] == "reduce-overhead" and result["step_shapes"] <= 128 // 16
    assert result["cuda_graphs"] >= result["step_shapes"], result["cuda_graphs"]
    assert abs(result["dev_loss"] - read_result(single_gpu)["dev_loss"]) < (0.05 if options else 0.01)


@needs(1)
def test_a_training_step_on_the_gpu_never_waits_for_it():
    """The model's forward and backward with the Trainer's mask (models.prepared_mask): no operation that
    makes the CPU wait for the GPU (torch's sync debug mode raises on one), where the 2D mask makes
    transformers read `mask.all()` back."""
    import common
    from support import models
    records = common.load_records(ROOT / "data" / "train.json")[:40]
    tokenizer, model = models.build_tiny_model([text for text, _ in records], 0, {"num_labels": 6})
    dataset = common.EncodedDataset(records, tokenizer, 128)
    batch = common.PadBatch(tokenizer.pad_token_id, 16)([dataset[index, 1.0] for index in range(8)])
    batch = {key: value.cuda() for key, value in batch.items()}
    model.cuda()
    torch.cuda.set_sync_debug_mode("error")
    try:
        model(input_ids=batch["input_ids"], attention_mask=models.prepared_mask(batch["attention_mask"])
              ).logits.sum().backward()
        with pytest.raises(RuntimeError, match="synchroniz"):
            model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"])
    finally:
        torch.cuda.set_sync_debug_mode("default")


@needs(1)
def test_padded_16_bit_attention_avoids_cudnn_plans():
    """A BERT-shaped masked attention in bf16 and fp16, after the scripts' set-up: a fused kernel
    that needs no per-shape plan (torch puts cuDNN first on Hopper and later), never cuDNN's."""
    from support import machine
    from torch.nn.attention import SDPBackend
    machine.use_attention_without_plans(torch.device("cuda", 0))
    for dtype in (torch.bfloat16, torch.float16):
        q, k, v = (torch.randn(32, 12, 37, 64, device="cuda", dtype=dtype) for _ in range(3))
        mask = torch.ones(32, 1, 1, 37, device="cuda", dtype=torch.bool)
        mask[:, :, :, 30:] = False
        chosen = SDPBackend(torch._fused_sdp_choice(q, k, v, mask))
        assert chosen in (SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION), (dtype, chosen)


@needs(2)
def test_nccl_ddp_on_two_gpus_equals_one_gpu_at_the_same_global_batch(tmp_path, single_gpu):
    process = run([*torchrun(2, "multi-gpu-distributed-cls.py"), *GPU, *EXACT, "--batch-size", "16",
                   "--output-dir", str(tmp_path)])
    assert_gpu_run(tmp_path, world_size=2)
    assert read_result(tmp_path)["global_batch_size"] == 32
    assert process.stdout.count("耗时：") == 1  # only rank 0 reports
    assert_same_weights(single_gpu / "model", tmp_path / "model")


@needs(1)
def test_two_processes_sharing_one_gpu_over_gloo_equal_one_gpu(tmp_path, single_gpu):
    """Two DDP processes on GPU 0, talking over gloo (NCCL refuses two ranks on one GPU)."""
    run([*torchrun(2, "multi-gpu-distributed-cls.py"), *GPU, *EXACT, "--backend", "gloo", "--batch-size", "16",
         "--output-dir", str(tmp_path)], env={"CUDA_VISIBLE_DEVICES": "0"})
    result = assert_gpu_run(tmp_path, world_size=2)
    assert result["global_batch_size"] == 32
    assert_same_weights(single_gpu / "model", tmp_path / "model")


@needs(1)
def test_horovod_talks_over_nccl_and_equals_one_gpu_at_the_same_global_batch(tmp_path, single_gpu):
    """multi-gpu-horovod-cls.py under horovodrun, a process per GPU (at most 2), Horovod built with NCCL
    (scripts/build-horovod-gpu-wheel.sh). Horovod's timeline names NCCL's broadcast (the weights) and
    all-reduce (the loss; with 2 processes the gradients too: at one, DistributedOptimizer reduces none),
    where a build without NCCL would copy every GPU tensor to the CPU for Gloo."""
    require("horovod")
    import horovod.torch as hvd
    assert hvd.nccl_built(), "this Horovod was built without NCCL: scripts/build-horovod-gpu-wheel.sh builds one"
    timeline, output = tmp_path / "timeline.json", tmp_path / "run"
    run([PYTHON, "-m", "horovod.runner.launch", "-np", str(PROCESSES), "-H", f"localhost:{PROCESSES}", "--gloo",
         "--timeline-filename", str(timeline), PYTHON, "multi-gpu-horovod-cls.py", *GPU, *EXACT,
         "--batch-size", str(32 // PROCESSES), "--output-dir", str(output)])
    result = assert_gpu_run(output, world_size=PROCESSES)
    assert (result["strategy"], result["global_batch_size"]) == ("horovod", 32)
    names = timeline.read_text()
    assert '"NCCL_BCAST"' in names and '"NCCL_ALLREDUCE"' in names, "Horovod's timeline shows no NCCL operation"
    assert_same_weights(single_gpu / "model", output / "model")


def scaler_state(output_dir):
    """The step and the gradient scaler's state in the training checkpoint of `output_dir`."""
    from support import checkpoints
    state = torch.load(output_dir / "checkpoint" / checkpoints.CHECKPOINT_FILE, map_location="cpu", weights_only=True)
    return state["step"], state["strategy_state"]["scaler"]


@needs(1)
def test_fp16_amp_learns_with_its_grad_scaler_and_the_scale_survives_resume(tmp_path):
    """2 epochs, a checkpoint every 4 steps: the uninterrupted run, and one that crashes at step 10
    and resumes from its step-8 checkpoint. The resumed run's scaler must continue from the saved one:
    at the last checkpoint both runs' scalers are equal. A scaler started afresh on resume would have
    counted 8 steps without overflow fewer (or sat at another scale)."""
    command = [PYTHON, "multi-gpu-distributed-mp-amp-cls.py", "--nprocs", str(PROCESSES), *GPU, "--precision",
               "fp16", "--batch-size", "16", "--epochs", "2", "--save-steps", "4"]
    steps = 2 * -(-332 // (16 * PROCESSES))  # 2 epochs of the 332 training samples, the last step short
    last_checkpoint = (steps - 1) // 4 * 4  # none is written at the last step
    whole, resumed = tmp_path / "whole", tmp_path / "resumed"
    run([*command, "--output-dir", str(whole)])
    result = assert_gpu_run(whole, world_size=PROCESSES, precision="fp16")
    assert (result["strategy"], result["steps"]) == ("ddp-amp", steps)
    assert_learns(result)

    crashed = run([*command, "--output-dir", str(resumed)], env={FAIL_AT_ENV: "0:10"}, check=False)
    assert crashed.returncode != 0 and not (resumed / "result.json").exists(), crashed.stderr[-2000:]
    step, saved = scaler_state(resumed)
    assert step == 8 and set(saved) >= {"scale", "_growth_tracker"}, saved
    assert (saved["scale"], saved["_growth_tracker"]) != (2.0**16, 0), "the checkpoint holds a fresh scaler"

    process = run([*command, "--output-dir", str(resumed), "--resume"])
    assert "--resume: continuing from step 8" in process.stdout
    assert_gpu_run(resumed, world_size=PROCESSES, precision="fp16")
    assert read_result(resumed)["resumed_from_step"] == 8
    (whole_step, whole_scaler), (resumed_step, resumed_scaler) = scaler_state(whole), scaler_state(resumed)
    assert whole_step == resumed_step == last_checkpoint
    assert resumed_scaler == whole_scaler
    # fp16 products and CUDA's atomic adds make two runs differ by rounding: close, not equal.
    assert_same_weights(whole / "model", resumed / "model", atol=1e-3)


@needs(2)
def test_dataparallel_over_two_gpus_equals_one_gpu(tmp_path, single_gpu):
    process = run([PYTHON, "multi-gpu-dataparallel-cls.py", *GPU, *EXACT, "--gpu-ids", "0,1", "--batch-size", "32",
                   "--output-dir", str(tmp_path)])
    assert "DataParallel over GPUs 0,1" in process.stdout
    result = assert_gpu_run(tmp_path, world_size=1)
    assert (result["strategy"], result["global_batch_size"]) == ("dataparallel", 32)
    assert not any(key.startswith("module.") for key in load_weights(tmp_path / "model"))
    assert_same_weights(single_gpu / "model", tmp_path / "model")


@needs(1)
@pytest.mark.parametrize("stage", [2, 3])
def test_deepspeed_fp16_zero_stage_learns(tmp_path, stage):
    require("deepspeed")
    process = run([PYTHON, "-m", "deepspeed.launcher.runner", "--num_gpus", str(PROCESSES), "--master_port",
                   free_port(), "multi-gpu-deepspeed-cls.py", *GPU, "--zero-stage", str(stage), "--precision", "fp16",
                   "--batch-size", "16", "--epochs", "2", "--output-dir", str(tmp_path)])
    assert f"DeepSpeed ZeRO stage {stage}" in process.stdout
    result = assert_gpu_run(tmp_path, world_size=PROCESSES, precision="fp16")
    assert result["zero_stage"] == stage
    # DDP's 25 MiB of fp32 gradients, in fp16: not DeepSpeed's default 5e8 elements (0.95 GB in fp16).
    assert result["reduce_bucket_bytes"] == 25 * 2**20 // 2
    assert result["peak_memory_beyond_model_state_mb"] < 500, result["peak_memory_beyond_model_state_mb"]
    assert_learns(result)
    # The shards were gathered into one model that loads like any other.
    assert (tmp_path / "model" / "model.safetensors").is_file()


@needs(1)
def test_fsdp2_in_bf16_learns(tmp_path):
    major, minor = torch.cuda.get_device_capability(0)
    if major < 8:
        pytest.skip(f"bf16 needs compute capability 8.0 (Ampere) or newer; {torch.cuda.get_device_name(0)} "
                    f"has {major}.{minor}")
    run([*torchrun(PROCESSES, "multi-gpu-fsdp-cls.py"), *GPU, "--precision", "bf16", "--batch-size", "16",
         "--epochs", "2", "--output-dir", str(tmp_path)])
    result = assert_gpu_run(tmp_path, world_size=PROCESSES, precision="bf16")
    assert result["strategy"] == "fsdp2"
    assert_learns(result)
    assert (tmp_path / "model" / "model.safetensors").is_file()


@needs(1)
def test_fsdp2_offload_in_fp16_learns_and_its_cpu_state_stays_out_of_the_gpu_figure(tmp_path):
    """--offload keeps the shards and Adam's moments in CPU memory; fp16's scaler all-reduces its
    overflow flag, a CPU tensor, which the script's gloo+NCCL group carries."""
    run([*torchrun(PROCESSES, "multi-gpu-fsdp-cls.py"), *GPU, "--offload", "--precision", "fp16", "--batch-size",
         "16", "--epochs", "2", "--output-dir", str(tmp_path)])
    result = assert_gpu_run(tmp_path, world_size=PROCESSES, precision="fp16", offloaded=True)
    assert result["offload"] == "param+optimizer" and result["model_state_bytes_by_device"]["cpu"] > 0
    assert_learns(result)


@needs(1)
def test_profile_on_cuda_records_each_step_once_and_splits_it_into_phases(tmp_path):
    """With CUDA activity the profiler reports GPU-side copies of the step and phase ranges: counted,
    they doubled the steps and halved every per-step figure."""
    run([PYTHON, "single-gpu-cls.py", *GPU, "--batch-size", "32", "--profile", "3", "--output-dir", str(tmp_path)])
    profile = read_result(tmp_path)["profile"]
    assert profile["steps"] == 3
    assert sum(profile["phases_ms"].values()) == pytest.approx(profile["step_ms"] - profile["unaccounted_ms"], abs=0.01)
    assert profile["phases_ms"]["forward"] > 0 and profile["phases_ms"]["backward"] > 0
