"""Fine-tune Chinese BERT with DeepSpeed ZeRO: one process per GPU, started by the deepspeed launcher.

    deepspeed --num_gpus 2 multi-gpu-deepspeed-cls.py                    # ZeRO stage 2, fp32
    deepspeed --num_gpus 2 multi-gpu-deepspeed-cls.py --precision bf16   # bf16 weights, fp32 master copy
    deepspeed --num_gpus 2 multi-gpu-deepspeed-cls.py --zero-stage 3 --offload optimizer+param
    deepspeed --num_gpus 2 multi-gpu-deepspeed-cls.py --deepspeed-config configs/deepspeed/zero3.json
    python multi-gpu-deepspeed-cls.py --estimate-memory 8     # model-state memory on 8 GPUs, then exit

    # several machines: a hostfile names each one and its GPUs ("worker-1 slots=8" per line); the first
    # starts the others over ssh, or each runs this with --no_ssh --node_rank N --master_addr worker-1:
    deepspeed --hostfile hostfile multi-gpu-deepspeed-cls.py

As with DDP, each process trains on its own shard of every batch. ZeRO also splits the training
state across the processes instead of copying it into each: stage 1 splits the optimizer state,
stage 2 also the gradients, stage 3 also the weights; stage 0 splits nothing (plain data
parallelism). Without GPUs the same code runs CPU processes that talk over gloo.
"""
import atexit
import contextlib
import glob
import shutil
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist

import common
import instruments
from libraries import deepspeed_setup
from support import checkpoints, cli, launch, machine, models, options


class DeepSpeed(common.TorchDistributed):
    name = "deepspeed"
    launcher = "deepspeed"

    def __init__(self, device, rank, world_size, local_world_size, precision, config):
        super().__init__(device, rank, world_size, precision, local_world_size)
        self.config = config
        self.zero_stage = config["zero_optimization"]["stage"]
        self.offload = deepspeed_setup.offload_label(config["zero_optimization"])
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
            checkpoints.save_model(portable, tokenizer, path)
            shutil.rmtree(shards, ignore_errors=True)

    def full_fp32_weights(self, model, shard_dir):
        """Every weight, whole and in fp32."""
        if self.zero_stage == 0:
            # Nothing is partitioned: every rank holds the whole model. In fp16/bf16 these are the
            # 16-bit weights the model computes with, widened back to fp32.
            return {name: tensor.float() for name, tensor in model.module.state_dict().items()}
        shard_files = glob.glob(str(shard_dir / "*optim_states.pt"))
        if len(shard_files) != self.world_size:
            raise cli.UserError(f"rank 0 sees {len(shard_files)} of {self.world_size} ZeRO shards in {shard_dir}: "
                                "--output-dir must be on a filesystem every machine shares")
        # The optimizer shards hold the fp32 master weights; zero_to_fp32 stitches them together.
        from deepspeed.utils.zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint
        return get_fp32_state_dict_from_zero_checkpoint(str(shard_dir.parent), tag=shard_dir.name)

    def save_state(self, model, optimizer, path, state):
        # --save-steps: DeepSpeed's own sharded checkpoint, every rank its part, then `latest` (rank
        # 0, not waiting for the others) and, once all are written, its meaning.json: until then
        # the previous one stands. Older ones are removed after; a save that fails removes its own.
        tag = Path(path) / f"step{state['step']}"
        with deepspeed_setup.step_folder(tag, state, self.is_main):  # with its meaning.json
            self.engine.save_checkpoint(path, tag=tag.name, client_state=state)
        if self.is_main:
            for old in Path(path).glob("step*"):
                if old != tag:
                    shutil.rmtree(old)

    # --resume: the step folder `latest` names, else the newest complete one (with its meaning.json).
    checkpoint_folders = staticmethod(deepspeed_setup.step_folders)
    checkpoint_meaning = staticmethod(checkpoints.meaning_in)

    def checkpoint_layout(self):
        return {"zero_stage": self.zero_stage, "offload": self.offload}

    def load_state(self, model, optimizer, path):
        _, state = self.engine.load_checkpoint(path.parent, tag=path.name)
        return state

    def result_extras(self):
        return {**self.checkpoint_layout(), "optimizer_steps": self.engine.global_steps,
                "deepspeed_config": self.config, "reduce_bucket_bytes": deepspeed_setup.reduce_bucket_bytes(self.config)}

    def versions(self):
        import deepspeed
        return {"deepspeed": deepspeed.__version__}


def main():
    parser = options.build_parser(__file__, __doc__)
    options.add_distributed_args(parser, local_rank=True)  # the deepspeed launcher passes --local_rank=N
    deepspeed_setup.add_deepspeed_args(parser)  # --zero-stage, --offload, --precision, --deepspeed-config
    args = options.parse(parser)
    common.set_seed(args.seed)
    if args.estimate_memory is not None:  # a table of what each ZeRO stage needs per GPU, then exit
        deepspeed_setup.estimate_memory(args)
        return

    # [ranks] The global rank (0 .. world size - 1, across all machines) decides who prints and saves;
    #    the local rank (0 .. processes on this machine - 1) decides which GPU this process uses.
    rank, world_size, local_rank, local_world_size = launch.launch_environment(
        "deepspeed --num_gpus N multi-gpu-deepspeed-cls.py")
    deepspeed_setup.stop_with_the_launcher(local_rank)  # it passes no signal on: the ranks stop once it is gone
    device = machine.resolve_device(args.device, local_rank)
    deepspeed = deepspeed_setup.import_deepspeed(device)  # on the accelerator --device names

    # [config] One config drives the engine: the --deepspeed-config file, the flags on top. For
    #    --zero-stage 3 --offload optimizer --precision bf16 --batch-size 16 on 2 GPUs:
    #      {"zero_optimization": {"stage": 3, "offload_optimizer": {"device": "cpu", "pin_memory": true}},
    #       "fp16": {"enabled": false}, "bf16": {"enabled": true}, "gradient_clipping": 0.0,
    #       "train_micro_batch_size_per_gpu": 16, "gradient_accumulation_steps": 1, "train_batch_size": 32}
    #    Built and checked before joining the group, so a bad combination fails at once everywhere.
    config, precision = deepspeed_setup.build_config(args, device, world_size)

    # [group] Pin the GPU before joining the group, so NCCL sets up its communicator on the right card.
    #    init_distributed joins it through deepspeed.comm, the layer the engine communicates with.
    if device.type == "cuda":
        torch.cuda.set_device(device)
    deepspeed.init_distributed(machine.backend_for(device), timeout=timedelta(seconds=args.dist_timeout))
    # [leave] cli.run leaves the group on every exit path, failures included, so no process is left waiting.
    atexit.register(deepspeed_setup.remove_shared_memory_buffer, rank)  # at exit, after cli.run has left the group
    strategy = DeepSpeed(device, rank, world_size, local_world_size, precision, config)

    data = common.load_data_and_model(args, strategy)
    model = data.model
    # [wrap] The engine takes DDP's place: it moves the model to the device, casts it to fp16/bf16,
    #    partitions the optimizer state (stage 1+), gradients (2+) and weights (3), and wraps the
    #    optimizer, built first: AdamW, or DeepSpeed's CPU Adam when the optimizer is offloaded.
    optimizer = deepspeed_setup.adamw_or_cpu_adam(model, data.lr, args, config)
    with deepspeed_setup.config_errors():  # a bad key in the config file: one line, no traceback
        engine, _, _, _ = deepspeed.initialize(model=model, optimizer=optimizer, config=config)
    strategy.engine = engine
    if args.compile:  # DeepSpeed's own: compiles the engine's module in place, so the weights keep their names
        engine.compile(compile_kwargs=models.compile_options(args, strategy))
    if strategy.is_main:
        print(f"DeepSpeed ZeRO stage {strategy.zero_stage}, offload {strategy.offload}, "
              f"{precision}: global batch {config['train_batch_size']} = {args.batch_size} per process x "
              f"{world_size} processes x {config['gradient_accumulation_steps']} accumulation steps")

    # [data] Our own loaders, sharded as DDP's, rather than the ones deepspeed.initialize can build:
    #    the same samples reach the same ranks in every script, each dev sample is evaluated once.
    loaders = common.make_loaders(data, args, world_size, rank)

    common.Trainer(args, strategy, engine, optimizer, data, loaders, instruments.callbacks_for(args)).fit()


if __name__ == "__main__":
    cli.run(main)
