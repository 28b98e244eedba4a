"""The helpers of multi-gpu-deepspeed-cls.py that are not the lesson: its options, the config merging
and checks, the optimizer choice, --estimate-memory, DeepSpeed's config errors in one line, the
shared memory it leaves behind, and the ranks' end when the deepspeed command is stopped."""
import contextlib
import json
import os
import signal
import threading
import time
import warnings
from pathlib import Path

import pydantic
import torch

import common
from support import checkpoints, cli, files, launch, machine, models, options

# DeepSpeed 0.19 still calls collectives that torch 2.13 has renamed: a warning per call site and rank.
warnings.filterwarnings("ignore", category=FutureWarning, message=r"`torch\.distributed\.\w+` is deprecated")

# --offload choice -> the zero_optimization sections that move state to the CPU.
OFFLOAD_KEYS = {"none": [], "optimizer": ["offload_optimizer"],
                "optimizer+param": ["offload_optimizer", "offload_param"]}
BATCH_KEYS = ("train_micro_batch_size_per_gpu", "gradient_accumulation_steps", "train_batch_size")
# DeepSpeed's default reduce bucket holds 5e8 elements, allocated whole at every backward (with
# contiguous_gradients): 1.9 GB of fp32 gradients on every GPU, whatever the model. The suite's
# configs use DDP's bucket instead, 25 MiB of fp32 gradients, so that the two rows compare.
REDUCE_BUCKET_ELEMENTS = 25 * 2**20 // 4


def refuse_optimizer_sections(config, path):
    """Every script of the suite builds its AdamW from --lr and --weight-decay, at a constant rate."""
    if "optimizer" in config or "scheduler" in config:
        raise cli.UserError(f"{path}: remove its optimizer/scheduler section: the suite builds AdamW from --lr "
                            "and --weight-decay, with a constant learning rate")


def add_deepspeed_args(parser):
    parser.add_argument("--zero-stage", type=int, choices=[0, 1, 2, 3],
                        help="ZeRO's stage (default: the config's, else 2)")
    parser.add_argument("--deepspeed-config", metavar="JSON",
                        help="a config such as configs/deepspeed/zero3.json; the flags given override it")
    parser.add_argument("--offload", choices=list(OFFLOAD_KEYS),
                        help="optimizer state (stage 3: weights too) in CPU memory (default: the config's, "
                             "else none)")
    options.add_precision_arg(parser, default=None, default_help="the config's, else fp32")
    parser.add_argument("--estimate-memory", type=int, nargs="*", metavar="N",
                        help="print the model-state memory per GPU and machine of each stage and offload on "
                             "GPUS_PER_NODE [NODES] (default: this launch's), then exit")


def import_deepspeed(device):
    """DeepSpeed picks its accelerator once, when first imported: name it, so that --device cpu is
    honoured on a GPU machine (and a CPU machine skips the detection and its warning)."""
    os.environ["DS_ACCELERATOR"] = device.type  # --device wins over an exported DS_ACCELERATOR
    import deepspeed
    return deepspeed


def stop_with_the_launcher(local_rank):
    """The `deepspeed` command starts deepspeed.launcher.launch, which starts the ranks; a signal sent
    to the command alone (a `timeout`, a scheduler, a CI cancel) ends it but is not passed on, and the
    ranks would train on (they stop with their parent, launch.py: support/launch.py). launch.py does
    pass SIGTERM on to every rank: local rank 0 watches for it to lose its parent, the command, and
    then sends it one. (Started by anything else, nothing changes.)"""
    if local_rank != 0:
        return
    import psutil  # a dependency of DeepSpeed's launcher
    try:
        launch = psutil.Process(os.getppid())
        if "deepspeed.launcher.launch" not in launch.cmdline():
            return
        command = launch.ppid()
    except psutil.Error:  # a parent this process may not inspect is not DeepSpeed's launcher
        return

    def watch():
        with contextlib.suppress(psutil.NoSuchProcess):
            while launch.ppid() == command:
                time.sleep(1)
            launch.send_signal(signal.SIGTERM)

    threading.Thread(target=watch, daemon=True).start()


@contextlib.contextmanager
def step_folder(tag, state, is_main):
    """The folder of one --save-steps checkpoint, which rank 0 creates and removes if the save fails.
    What its step means goes in last, once the engine's save has returned (after a barrier: every
    rank's part is written): a folder with it is complete. DeepSpeed writes `latest` before that barrier."""
    if is_main:
        tag.mkdir(parents=True, exist_ok=True)
    with files.removed_on_failure(tag, remove=is_main):
        yield
        if is_main:
            files.write_json(tag / checkpoints.MEANING_FILE, {"step": state["step"], **state["meaning"]})


def step_folders(path):
    """The step folders of the checkpoint `path`: the one `latest` names first (`latest` itself where
    there is none), then the others."""
    latest = Path(path) / "latest"
    named = Path(path) / latest.read_text(encoding="utf-8").strip() if latest.is_file() else latest
    return [named, *sorted(set(Path(path).glob("step*")) - {named})]


def build_config(args, device, world_size):
    """The DeepSpeed config: the file (if any), the flags on top of it, then the batch sizes."""
    config = files.read_json_object(args.deepspeed_config, "DeepSpeed config") if args.deepspeed_config else {}
    for section in ("zero_optimization", "fp16", "bf16"):
        if not isinstance(config.get(section, {}), dict):
            raise cli.UserError(f"{args.deepspeed_config}: \"{section}\" must be a JSON object (like "
                                f"{{\"enabled\": true}}), got {json.dumps(config[section])}")
    refuse_optimizer_sections(config, args.deepspeed_config)
    zero = config.setdefault("zero_optimization", {})
    if args.zero_stage is not None:
        zero["stage"] = args.zero_stage
    zero.setdefault("stage", 2)
    zero.setdefault("reduce_bucket_size", REDUCE_BUCKET_ELEMENTS)
    if zero["stage"] not in (0, 1, 2, 3):
        raise cli.UserError(f"{args.deepspeed_config}: ZeRO stage must be 0, 1, 2 or 3, got {zero['stage']!r}")
    if args.offload is not None:
        for key in OFFLOAD_KEYS["optimizer+param"]:
            zero.pop(key, None)
        for key in OFFLOAD_KEYS[args.offload]:
            zero[key] = {"device": "cpu", "pin_memory": device.type == "cuda"}
    offload = offload_label(zero)
    if "param" in offload and zero["stage"] != 3:
        raise cli.UserError(f"offloading the weights needs --zero-stage 3 (only stage 3 partitions them); "
                            f"this run asks for stage {zero['stage']}")
    if offload != "none" and zero["stage"] == 0:
        raise cli.UserError("offloading the optimizer needs --zero-stage 1, 2 or 3: stage 0 has no ZeRO optimizer")

    # Precision: the flag, else what the file enables, else fp32 like every other row of the
    # benchmark (DeepSpeed's own default is 16-bit: mixing it in would compare two things at once).
    precision = args.precision or next((p for p in ("fp16", "bf16") if config.get(p, {}).get("enabled")), "fp32")
    machine.check_precision(precision, device)
    for name in ("fp16", "bf16"):
        config[name] = {**config.get(name, {}), "enabled": precision == name}

    # DeepSpeed clips the gradient norm to 1.0 unless the config says otherwise; no other script
    # of the suite clips, so neither does this one unless the file asks for it.
    config.setdefault("gradient_clipping", 0.0)

    # The DataLoader is ours and reads --batch-size per process and micro-batch, so the global batch
    # is the same as in every other script: --batch-size x processes x --grad-accum.
    batch = dict(zip(BATCH_KEYS, (args.batch_size, args.grad_accum,
                                 common.global_batch_size(args.batch_size, world_size, args.grad_accum))))
    for key, value in batch.items():
        if config.get(key, value) != value:
            raise cli.UserError(f"{args.deepspeed_config} sets {key} {config[key]}, but the command line gives "
                                f"{value}: batch sizes come from --batch-size and --grad-accum")
    config.update(batch)
    return config, precision


def reduce_bucket_bytes(config):
    """The reduce bucket ZeRO (stages 1-3) allocates at every backward, in the weights' precision."""
    zero = config["zero_optimization"]
    if zero["stage"] == 0:
        return 0
    sixteen_bits = config.get("fp16", {}).get("enabled") or config.get("bf16", {}).get("enabled")
    return int(zero["reduce_bucket_size"]) * (2 if sixteen_bits else 4)


def offload_label(zero):
    parts = [part for key, part in (("offload_optimizer", "optimizer"), ("offload_param", "param"))
             if zero.get(key, {}).get("device", "none") != "none"]
    return "+".join(parts) or "none"


def adamw_or_cpu_adam(model, lr, args, config):
    """The suite's AdamW, or DeepSpeed's CPU Adam with the same groups where ZeRO offloads the optimizer."""
    optimizer = models.make_optimizer(model, lr, args.weight_decay)
    if "optimizer" not in offload_label(config["zero_optimization"]):
        return optimizer
    # ZeRO-Offload steps the optimizer on the CPU, where DeepSpeed's vectorised Adam (a C++ op,
    # compiled on first use and cached) is several times faster than torch's AdamW. Same groups.
    from deepspeed.ops.adam import DeepSpeedCPUAdam
    groups = [{"params": group["params"], "weight_decay": group["weight_decay"]} for group in optimizer.param_groups]
    return DeepSpeedCPUAdam(groups, lr=lr, adamw_mode=True)


@contextlib.contextmanager
def config_errors():
    """deepspeed.initialize validates the config with pydantic: an unknown or invalid key in the
    config file becomes one line that names it instead of a traceback."""
    try:
        yield
    except pydantic.ValidationError as error:
        problems = "; ".join(f"{'.'.join(map(str, e['loc']))}: {e['msg']}" for e in error.errors())
        raise cli.UserError(f"DeepSpeed rejected the config ({error.title}): {problems}") from None


def remove_shared_memory_buffer(rank):
    """DeepSpeed's CPU collectives give each process a 66 MB /dev/shm file that it never unlinks
    (ops/csrc/cpu/comm/shm.cpp): remove this process's once the group is gone. The others have
    mapped it since the group started and keep their mappings."""
    name = f"deepspeed_allreduce_buffer_{os.getuid()}_{os.environ.get('MASTER_ADDR')}_{os.environ.get('MASTER_PORT')}"
    Path("/dev/shm", f"{name}_{rank}").unlink(missing_ok=True)


def estimate_memory(args):
    """--estimate-memory: rank 0 prints the table (no process group is formed, no training)."""
    gpus_per_node, nodes = estimate_layout(args.estimate_memory)
    if launch.current_rank() == 0:
        import_deepspeed(torch.device("cpu"))
        print_memory_estimate(args, gpus_per_node, nodes)


def print_memory_estimate(args, gpus_per_node, nodes):
    """What the weights, gradients and Adam state need per GPU and per machine, for each choice of
    --zero-stage and --offload: DeepSpeed's estimators for stages 2 and 3, and the same byte
    counts for stages 0 and 1, which it has no estimator for. Activations come on top."""
    from deepspeed.runtime.zero.stage3 import estimate_zero3_model_states_mem_needs, model_to_params
    from deepspeed.runtime.zero.stage_1_and_2 import estimate_zero2_model_states_mem_needs
    train_records, _ = common.split_records(common.load_records(args.data), args.max_samples, args.dev_ratio,
                                            args.seed)
    _, model, model_name, _ = models.load_model(args, [text for text, _ in train_records],
                                                models.resolve_model(args.model), common.LABELS)
    params, largest_layer = model_to_params(model)
    gpus, layout = gpus_per_node * nodes, dict(num_gpus_per_node=gpus_per_node, num_nodes=nodes)
    # Per parameter: 2 bytes of 16-bit weights, 2 of 16-bit and 4 of fp32 gradients, 4 of fp32
    # master weights, 8 of Adam moments; ZeRO divides the partitioned ones by the GPU count. Every
    # process first loads the whole model in fp32 (4 bytes), with DeepSpeed's 1.5 margin.
    loading = 4 * params * gpus_per_node * 1.5
    rows = [(0, "none", loading, 20 * params), (1, "none", loading, 4 * params + 16 * params / gpus)]
    for offload in ("none", "optimizer"):
        cpu, gpu = estimate_zero2_model_states_mem_needs(params, **layout, cpu_offload=offload != "none")
        rows.append((2, offload, cpu, gpu))
    for offload in ("none", "optimizer", "optimizer+param"):
        cpu, gpu, _ = estimate_zero3_model_states_mem_needs(params, largest_layer, **layout, zero_init=False,
                                                            cpu_offload=offload != "none",
                                                            cpu_offload_params=offload == "optimizer+param")
        rows.append((3, offload, cpu, gpu))
    print(f"Model-state memory of {model_name} ({params / 1e6:.1f}M parameters, largest layer "
          f"{largest_layer / 1e6:.1f}M), mixed precision with Adam, {nodes} machine(s) x {gpus_per_node} GPU(s):")
    print(f"{'--zero-stage':>12}  {'--offload':<16}{'per GPU':>12}{'CPU per machine':>18}")
    for stage, offload, cpu, gpu in rows:
        print(f"{stage:>12}  {offload:<16}{size(gpu):>12}{size(cpu):>18}")


def size(count):
    return f"{count / 2**30:.2f} GB" if count >= 2**30 else f"{count / 2**20:.1f} MB"


def estimate_layout(values):
    """(GPUs per machine, machines) from --estimate-memory, else from the launch, else this machine."""
    if len(values) > 2 or any(value < 1 for value in values):
        raise cli.UserError("--estimate-memory takes GPUS_PER_NODE [NODES], each at least 1")
    if values:
        return values[0], values[1] if len(values) == 2 else 1
    if "WORLD_SIZE" in os.environ:
        per_node = int(os.environ.get("LOCAL_SIZE", os.environ["WORLD_SIZE"]))
        return per_node, int(os.environ["WORLD_SIZE"]) // per_node
    return max(1, torch.cuda.device_count()), 1
