"""Fine-tune Chinese BERT with DeepSpeed ZeRO: one process per GPU, started by the deepspeed launcher.

    deepspeed --num_gpus 2 multi-gpu-deepspeed-cls.py                    # ZeRO stage 2, fp32
    deepspeed --num_gpus 2 multi-gpu-deepspeed-cls.py --precision bf16   # bf16 weights, fp32 master copy
    deepspeed --num_gpus 2 multi-gpu-deepspeed-cls.py --zero-stage 3 --offload optimizer+param
    deepspeed --num_gpus 2 multi-gpu-deepspeed-cls.py --deepspeed-config configs/deepspeed/zero3.json
    python multi-gpu-deepspeed-cls.py --estimate-memory 8     # model-state memory on 8 GPUs, then exit

    # several machines: a hostfile names each one and its GPUs ("worker-1 slots=8" per line);
    # run this on the first machine, which reaches the others over passwordless ssh:
    deepspeed --hostfile hostfile multi-gpu-deepspeed-cls.py

As with DDP, each process trains on its own shard of every batch. ZeRO also splits the training
state across the processes instead of copying it into each: stage 1 splits the optimizer state,
stage 2 also the gradients, stage 3 also the weights; stage 0 splits nothing (plain data
parallelism). Without GPUs the same code runs CPU processes that talk over gloo.
"""
import argparse
import contextlib
import glob
import json
import os
import shutil
import warnings
from datetime import timedelta
from pathlib import Path

import pydantic
import torch
import torch.distributed as dist

import common

# DeepSpeed 0.19 still calls collectives that torch 2.13 has renamed: a warning per call site and rank.
warnings.filterwarnings("ignore", category=FutureWarning, message=r"`torch\.distributed\.\w+` is deprecated")

# --offload choice -> the zero_optimization sections that move state to the CPU.
OFFLOAD_KEYS = {"none": [], "optimizer": ["offload_optimizer"],
                "optimizer+param": ["offload_optimizer", "offload_param"]}
BATCH_KEYS = ("train_micro_batch_size_per_gpu", "gradient_accumulation_steps", "train_batch_size")


class DeepSpeed(common.TorchDistributed):
    name = "deepspeed"
    launcher = "deepspeed"

    def __init__(self, device, rank, world_size, local_world_size, precision, config):
        super().__init__(device, rank, world_size, precision, local_world_size)
        self.config = config
        self.zero_stage = config["zero_optimization"]["stage"]
        self.engine = None  # set once deepspeed.initialize has built it

    def accumulating(self, model, last):
        # With --grad-accum N the engine would count micro-batches itself and step at every N-th,
        # which drops the gradients of a last step of fewer (the end of an epoch) or carries them
        # into the next epoch. Say where each step ends instead: its last micro-batch, however many.
        self.engine.set_gradient_accumulation_boundary(last)
        return contextlib.nullcontext()

    def backward(self, loss):
        # The engine scales the loss for fp16 and reduces the gradients: all-reduced at stages 0-1,
        # reduce-scattered to their owners at stages 2-3. It would also divide the loss by N; the
        # suite's weights already make the step's micro-batches add up to its mean.
        self.engine.backward(loss, scale_wrt_gas=False)

    def step(self, model, optimizer):
        # Once per optimizer step, after its last micro-batch: steps the optimizer, then zeroes.
        self.engine.step()

    def unwrap(self, model):
        return model.module

    def save_model(self, model, tokenizer, path):
        shards = path.with_name(f".{path.name}.zero-shards")
        if self.zero_stage > 0:
            if self.is_main:  # shards an interrupted earlier run left behind must not be merged in
                shutil.rmtree(shards, ignore_errors=True)
            dist.barrier()
            # save_checkpoint is collective: every rank writes its own shard (rank 0 alone would
            # wait for the others forever).
            self.engine.save_checkpoint(shards, tag="final")
        if self.is_main:
            # Rank 0 merges the shards into the same portable folder every other script writes.
            portable = type(model.module)(model.module.config)
            portable.load_state_dict(self.full_fp32_weights(model, shards / "final"))
            common.save_model(portable, tokenizer, path)
            shutil.rmtree(shards, ignore_errors=True)

    def full_fp32_weights(self, model, shard_dir):
        """Every weight, whole and in fp32."""
        if self.zero_stage == 0:
            # Nothing is partitioned: every rank holds the whole model. In fp16/bf16 these are the
            # 16-bit weights the model computes with, widened back to fp32.
            return {name: tensor.float() for name, tensor in model.module.state_dict().items()}
        shard_files = glob.glob(str(shard_dir / "*optim_states.pt"))
        if len(shard_files) != self.world_size:
            raise common.UserError(f"rank 0 sees {len(shard_files)} of {self.world_size} ZeRO shards in {shard_dir}: "
                                   "--output-dir must be on a filesystem every machine shares")
        # The optimizer shards hold the fp32 master weights; zero_to_fp32 stitches them together.
        from deepspeed.utils.zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint
        return get_fp32_state_dict_from_zero_checkpoint(str(shard_dir.parent), tag=shard_dir.name)

    def save_state(self, model, optimizer, path, state):
        # --save-steps: DeepSpeed's own sharded checkpoint, every rank its part. It writes `latest`,
        # the name of the newest complete one, last: until then the previous one stands. Older
        # ones are removed after.
        tag = Path(path) / f"step{state['step']}"
        if self.is_main:
            tag.mkdir(parents=True, exist_ok=True)
            common.write_json(tag / common.MEANING_FILE, {"step": state["step"], **state["meaning"]})
        self.engine.save_checkpoint(path, tag=tag.name, client_state=state)
        if self.is_main:
            for old in Path(path).glob("step*"):
                if old != tag:
                    shutil.rmtree(old)

    def checkpoint_meaning(self, path):
        latest = Path(path) / "latest"
        if not latest.is_file():
            return None
        meaning = Path(path) / latest.read_text(encoding="utf-8").strip() / common.MEANING_FILE
        return json.loads(meaning.read_text(encoding="utf-8")) if meaning.is_file() else None

    def load_state(self, model, optimizer, path):
        _, state = self.engine.load_checkpoint(path)
        return state

    def result_extras(self):
        return {"zero_stage": self.zero_stage, "offload": offload_label(self.config["zero_optimization"]),
                "optimizer_steps": self.engine.global_steps, "deepspeed_config": self.config}

    def versions(self):
        import deepspeed
        return {"deepspeed": deepspeed.__version__}


def add_deepspeed_args(parser):
    parser.add_argument("--zero-stage", type=int, choices=[0, 1, 2, 3],
                        help="what ZeRO partitions; None = the config file's, else 2")
    parser.add_argument("--deepspeed-config", metavar="JSON",
                        help="a DeepSpeed config, e.g. configs/deepspeed/zero3.json; the flags given override it")
    parser.add_argument("--offload", choices=list(OFFLOAD_KEYS),
                        help="keep the optimizer state (and, at stage 3, the weights) in CPU memory; "
                             "None = the config file's, else none")
    common.add_precision_arg(parser, default=None, default_help="the config file's, else fp32")
    parser.add_argument("--estimate-memory", type=int, nargs="*", metavar="N",
                        help="print the model-state memory per GPU and per machine for each --zero-stage and "
                             "--offload, for GPUS_PER_NODE [NODES] (None given = this launch's processes), "
                             "then exit")
    # The deepspeed launcher passes --local_rank=N; it also sets LOCAL_RANK, which is what we read.
    parser.add_argument("--local-rank", "--local_rank", type=int, help=argparse.SUPPRESS)


def import_deepspeed(device):
    """DeepSpeed picks its accelerator once, when first imported: name it, so that --device cpu is
    honoured on a GPU machine (and a CPU machine skips the detection and its warning)."""
    os.environ["DS_ACCELERATOR"] = device.type  # --device wins over an exported DS_ACCELERATOR
    import deepspeed
    return deepspeed


def build_config(args, device, world_size):
    """The DeepSpeed config: the file (if any), the flags on top of it, then the batch sizes."""
    config = common.read_json_object(args.deepspeed_config, "DeepSpeed config") if args.deepspeed_config else {}
    if "optimizer" in config or "scheduler" in config:
        raise common.UserError(f"{args.deepspeed_config}: remove its optimizer/scheduler section: this script "
                               "builds AdamW from --lr and --weight-decay, as every script of the suite does")
    zero = config.setdefault("zero_optimization", {})
    if args.zero_stage is not None:
        zero["stage"] = args.zero_stage
    zero.setdefault("stage", 2)
    if zero["stage"] not in (0, 1, 2, 3):
        raise common.UserError(f"{args.deepspeed_config}: ZeRO stage must be 0, 1, 2 or 3, got {zero['stage']!r}")
    if args.offload is not None:
        for key in OFFLOAD_KEYS["optimizer+param"]:
            zero.pop(key, None)
        for key in OFFLOAD_KEYS[args.offload]:
            zero[key] = {"device": "cpu", "pin_memory": device.type == "cuda"}
    offload = offload_label(zero)
    if "param" in offload and zero["stage"] != 3:
        raise common.UserError(f"offloading the weights needs --zero-stage 3 (only stage 3 partitions them); "
                               f"this run asks for stage {zero['stage']}")
    if offload != "none" and zero["stage"] == 0:
        raise common.UserError("offloading the optimizer needs --zero-stage 1, 2 or 3: stage 0 has no ZeRO optimizer")

    # Precision: the flag, else what the file enables, else fp32 like every other row of the
    # benchmark (DeepSpeed's own default is 16-bit: mixing it in would compare two things at once).
    precision = args.precision or next((p for p in ("fp16", "bf16") if config.get(p, {}).get("enabled")), "fp32")
    common.check_precision(precision, device)
    for name in ("fp16", "bf16"):
        config[name] = {**config.get(name, {}), "enabled": precision == name}

    # DeepSpeed clips the gradient norm to 1.0 unless the config says otherwise; no other script
    # of the suite clips, so neither does this one unless the file asks for it.
    config.setdefault("gradient_clipping", 0.0)

    # The DataLoader is ours and reads --batch-size per process and micro-batch, so the global batch
    # is the same as in every other script: --batch-size x processes x --grad-accum.
    batch = dict(zip(BATCH_KEYS, (args.batch_size, args.grad_accum, args.batch_size * world_size * args.grad_accum)))
    for key, value in batch.items():
        if config.get(key, value) != value:
            raise common.UserError(f"{args.deepspeed_config} sets {key} {config[key]}, but the command line gives "
                                   f"{value}: batch sizes come from --batch-size and --grad-accum")
    config.update(batch)
    return config, precision


def offload_label(zero):
    parts = [part for key, part in (("offload_optimizer", "optimizer"), ("offload_param", "param"))
             if zero.get(key, {}).get("device", "none") != "none"]
    return "+".join(parts) or "none"


def make_optimizer(model, lr, args, config):
    optimizer = common.make_optimizer(model, lr, args.weight_decay)
    if "optimizer" not in offload_label(config["zero_optimization"]):
        return optimizer
    # ZeRO-Offload steps the optimizer on the CPU, where DeepSpeed's vectorised Adam (a C++ op,
    # compiled on first use and cached) is several times faster than torch's AdamW. Same groups.
    from deepspeed.ops.adam import DeepSpeedCPUAdam
    groups = [{"params": group["params"], "weight_decay": group["weight_decay"]} for group in optimizer.param_groups]
    return DeepSpeedCPUAdam(groups, lr=lr, adamw_mode=True)


def print_memory_estimate(args, gpus_per_node, nodes):
    """What the weights, gradients and Adam state need per GPU and per machine, for each choice of
    --zero-stage and --offload: DeepSpeed's estimators for stages 2 and 3, and the same byte
    counts for stages 0 and 1, which it has no estimator for. Activations come on top."""
    from deepspeed.runtime.zero.stage3 import estimate_zero3_model_states_mem_needs, model_to_params
    from deepspeed.runtime.zero.stage_1_and_2 import estimate_zero2_model_states_mem_needs
    train_records, _ = common.split_records(common.load_records(args.data), args.max_samples, args.dev_ratio,
                                            args.seed)
    _, model, model_name, _ = common.load_model(args, [text for text, _ in train_records],
                                                common.resolve_model(args.model))
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
        raise common.UserError("--estimate-memory takes GPUS_PER_NODE [NODES], each at least 1")
    if values:
        return values[0], values[1] if len(values) == 2 else 1
    if "WORLD_SIZE" in os.environ:
        per_node = int(os.environ.get("LOCAL_SIZE", os.environ["WORLD_SIZE"]))
        return per_node, int(os.environ["WORLD_SIZE"]) // per_node
    return max(1, torch.cuda.device_count()), 1


def main():
    parser = common.build_parser(__file__, __doc__)
    common.add_distributed_args(parser)
    add_deepspeed_args(parser)
    args = common.check_args(parser.parse_args())
    common.set_seed(args.seed)

    if args.estimate_memory is not None:
        gpus_per_node, nodes = estimate_layout(args.estimate_memory)
        if common.current_rank() == 0:
            import_deepspeed(torch.device("cpu"))
            print_memory_estimate(args, gpus_per_node, nodes)
        return

    # 1. The global rank decides who prints and saves; the local rank decides which GPU this
    #    process uses (the launcher also passes it as --local_rank).
    rank, world_size, local_rank, local_world_size = common.launch_environment(
        "deepspeed --num_gpus N multi-gpu-deepspeed-cls.py")
    device = common.resolve_device(args.device, local_rank)
    deepspeed = import_deepspeed(device)

    # 2. One config for the engine: ZeRO stage, offload, precision and the batch sizes, checked
    #    before any process starts work, so a bad combination fails at once and everywhere alike.
    config, precision = build_config(args, device, world_size)

    # 3. Pin the GPU, then join the group (NCCL between GPUs, gloo between CPU processes).
    if device.type == "cuda":
        torch.cuda.set_device(device)
    deepspeed.init_distributed(common.backend_for(device), timeout=timedelta(seconds=args.dist_timeout))
    try:
        strategy = DeepSpeed(device, rank, world_size, local_world_size, precision, config)

        train_set, dev_set, tokenizer, model, model_name, lr = common.prepare_data(args, strategy)

        # 4. Our own loaders, sharded exactly as DDP's, instead of DeepSpeed's: the same samples
        #    reach the same ranks in every script, and each dev sample is evaluated once.
        train_loader = common.make_loader(train_set, args, tokenizer,
                                          common.train_sampler(train_set, args, world_size, rank))
        dev_loader = common.make_loader(dev_set, args, tokenizer, common.eval_sampler(dev_set, args, world_size, rank))
        optimizer = make_optimizer(model, lr, args, config)

        # 5. The engine moves the model to the device, casts it to fp16/bf16, partitions the
        #    optimizer state (stage 1+), gradients (2+) and weights (3) and wraps the optimizer.
        try:
            engine, _, _, _ = deepspeed.initialize(model=model, optimizer=optimizer, config=config)
        except pydantic.ValidationError as error:  # an unknown or invalid key in the config file
            problems = "; ".join(f"{'.'.join(map(str, e['loc']))}: {e['msg']}" for e in error.errors())
            raise common.UserError(f"DeepSpeed rejected the config ({error.title}): {problems}") from None
        strategy.engine = engine
        if strategy.is_main:
            print(f"DeepSpeed ZeRO stage {strategy.zero_stage}, offload {offload_label(config['zero_optimization'])}, "
                  f"{precision}: global batch {config['train_batch_size']} = {args.batch_size} per process x "
                  f"{world_size} processes x {config['gradient_accumulation_steps']} accumulation steps")

        trainer = common.Trainer(args, strategy, engine, optimizer, tokenizer, train_loader, dev_loader,
                                 model_name, lr)
        trainer.fit()
    finally:
        # 6. Leave the group on every exit path, failures included, so no process is left waiting.
        dist.destroy_process_group()


if __name__ == "__main__":
    common.run(main)
