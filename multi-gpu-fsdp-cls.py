"""Fine-tune Chinese BERT with FSDP2 (fully_shard): one process per GPU, started by torchrun.

    torchrun --nproc_per_node 2 multi-gpu-fsdp-cls.py
    torchrun --standalone --nproc_per_node 2 multi-gpu-fsdp-cls.py --precision bf16   # GPUs from Ampere on
    torchrun --standalone --nproc_per_node 2 multi-gpu-fsdp-cls.py --no-reshard-after-forward
    torchrun --standalone --nproc_per_node 2 multi-gpu-fsdp-cls.py --offload          # GPUs only

    # two machines, 2 GPUs each (run on each; --node_rank 0 on the machine at MASTER_IP):
    torchrun --nnodes 2 --node_rank 0 --nproc_per_node 2 --master_addr MASTER_IP --master_port 29500 \\
        multi-gpu-fsdp-cls.py

This is multi-gpu-distributed-cls.py (compare them with diff) with the model sharded instead of
copied: each process keeps 1/N of every weight, of its gradient and of its Adam moments, gathers a
layer's whole weights just before computing with them and frees them after, and reduce-scatters the
gradients so that each process receives the average of its own shard only. PyTorch's answer to
DeepSpeed ZeRO-3, with per-parameter sharding on DTensor. Without GPUs the same code runs CPU
processes that talk over gloo.
"""
import argparse
import contextlib
from datetime import timedelta

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict import (StateDictOptions, get_model_state_dict, get_state_dict,
                                                     set_state_dict)
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy, OffloadPolicy, fully_shard

import common
import instruments
from support import checkpoints, cli, launch, machine, models, options

# The 16-bit type the sharded weights are gathered in for computing, for each --precision choice.
PARAM_DTYPES = {"fp16": torch.float16, "bf16": torch.bfloat16, "fp32": None}


class FSDP2(common.TorchDistributed):
    name = "fsdp2"
    launcher = "torchrun"

    def __init__(self, device, rank, world_size, local_world_size, precision, reshard_after_forward, offload):
        super().__init__(device, rank, world_size, precision, local_world_size)
        self.reshard_after_forward, self.offload = reshard_after_forward, offload
        # fp16's narrow range needs loss scaling: torch.amp.GradScaler takes FSDP2's sharded
        # (DTensor) gradients as they are (FSDP1 needed a ShardedGradScaler). GPUs only.
        self.scaler = torch.amp.GradScaler(device.type, enabled=precision == "fp16")

    def accumulating(self, model, last):
        # With --grad-accum N, the first N - 1 micro-batches of a step keep their gradients whole
        # and unreduced (more memory: a whole gradient per process until the step's last
        # micro-batch), which then reduce-scatters the sum: once per step instead of N times.
        model.set_requires_gradient_sync(last)
        return contextlib.nullcontext()

    def backward(self, loss):
        self.scaler.scale(loss).backward()

    def step(self, model, optimizer):
        self.scaler.step(optimizer)
        self.scaler.update()
        optimizer.zero_grad(set_to_none=True)

    def save_model(self, model, tokenizer, path):
        # The portable model folder needs every weight whole: each process sends its shards and
        # rank 0 alone receives the full state dict, in CPU memory (collective: all must call it).
        state = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
        if self.is_main:
            checkpoints.save_model(model, tokenizer, path, state_dict=state)

    def save_state(self, model, optimizer, path, state):
        # --save-steps: every process writes its own shards with torch.distributed.checkpoint (no
        # gather of the whole model). It writes in place, so into a staging folder that rank 0 swaps
        # in once every shard is there (dcp.save returns once all of them and the index are written).
        with checkpoints.staged_checkpoint(path, state, self.is_main, dist.barrier) as staging:
            model_state, optimizer_state = get_state_dict(model, optimizer)
            dcp.save({"model": model_state, "optimizer": optimizer_state}, checkpoint_id=staging)

    def load_state(self, model, optimizer, path):
        model_state, optimizer_state = get_state_dict(model, optimizer)
        shards = {"model": model_state, "optimizer": optimizer_state}
        dcp.load(shards, checkpoint_id=path)  # each process reads its own shards, in place
        set_state_dict(model, optimizer, model_state_dict=shards["model"], optim_state_dict=shards["optimizer"])
        return checkpoints.read_training_state(path)

    def extra_state(self):
        return {"scaler": self.scaler.state_dict()}

    def load_extra_state(self, state):
        self.scaler.load_state_dict(state["scaler"])

    def checkpoint_layout(self):
        return {"offload": "param+optimizer" if self.offload else "none"}

    def result_extras(self):
        return {"reshard_after_forward": self.reshard_after_forward, **self.checkpoint_layout()}


def add_fsdp_args(parser):
    options.add_precision_arg(parser)
    parser.add_argument("--reshard-after-forward", action=argparse.BooleanOptionalAction, default=True,
                        help="free each layer's gathered weights after its forward and gather them again for "
                             "backward (least memory, like ZeRO-3); --no-... keeps them (one all-gather fewer)")
    parser.add_argument("--offload", action="store_true",
                        help="keep the weight, gradient and optimizer shards in CPU memory (GPUs only)")


def group_backend(device, offload):
    """NCCL between GPUs, gloo between CPUs. --offload keeps the shards in CPU memory, and some
    collectives then run on CPU tensors (fp16's gradient scaler all-reduces its overflow flag over
    the mesh), which NCCL cannot carry: gloo carries those, NCCL the GPU ones."""
    if offload and device.type == "cuda":
        return "cpu:gloo,cuda:nccl"
    return machine.backend_for(device)


def main():
    parser = options.build_parser(__file__, __doc__)
    options.add_distributed_args(parser)
    add_fsdp_args(parser)
    args = options.parse(parser)
    common.set_seed(args.seed)

    # [ranks] The global rank (0 .. world size - 1, across all machines) decides who prints and saves;
    #    the local rank (0 .. processes on this machine - 1) decides which GPU this process uses.
    rank, world_size, local_rank, local_world_size = launch.launch_environment(
        "torchrun --nproc_per_node N multi-gpu-fsdp-cls.py")
    device = machine.resolve_device(args.device, local_rank)
    machine.check_precision(args.precision, device)
    if args.offload and device.type == "cpu":
        raise cli.UserError("--offload moves the shards from GPU to CPU memory: on CPU they are there already")

    # [group] Pin the GPU before joining the group. The device mesh is the group FSDP shards over: here
    #    all processes, in one dimension (a 2-D mesh would add replication across machines, HSDP).
    if device.type == "cuda":
        torch.cuda.set_device(device)
    dist.init_process_group(group_backend(device, args.offload), timeout=timedelta(seconds=args.dist_timeout))
    # [leave] cli.run leaves the group on every exit path, failures included, so no process is left waiting.
    mesh = init_device_mesh(device.type, (world_size,))
    strategy = FSDP2(device, rank, world_size, local_world_size, args.precision, args.reshard_after_forward,
                     args.offload)

    data = common.load_data_and_model(args, strategy)
    model = data.model  # compiled layer by layer below
    # [precision] Mixed precision is FSDP's own: it gathers the weights in 16 bits to compute, and keeps
    #    the shards, the optimizer and the gradient reductions in fp32 (no autocast needed).
    #    The --offload shards live in CPU memory and the optimizer steps there.
    policies = dict(mesh=mesh, reshard_after_forward=args.reshard_after_forward,
                    mp_policy=MixedPrecisionPolicy(param_dtype=PARAM_DTYPES[args.precision],
                                                   reduce_dtype=torch.float32),
                    offload_policy=CPUOffloadPolicy() if args.offload else OffloadPolicy())

    # [wrap] Shard each encoder layer as a unit of its own: its weights are gathered (all-gather)
    #    just before its forward and freed after, so a process holds at most one whole layer
    #    beyond its shards, and gathering the next layer overlaps computing this one. The
    #    layers first, the root last: the root takes what is left (embeddings, pooler and
    #    classifier), and fully_shard moves the weights to the mesh's device.
    for layer in model.bert.encoder.layer:
        if args.compile:  # each layer, before it is sharded (FSDP's hooks run eager), not the root too, which
            layer.compile(**models.compile_options(args, strategy))  # would trace them again: torchtitan's way
        fully_shard(layer, **policies)
    fully_shard(model, **policies)

    # [data] Each process reads a different 1/world_size of every global batch, as with DDP.
    loaders = common.make_loaders(data, args, world_size, rank)

    # [optimizer] The optimizer after sharding: it must hold the shards (DTensors), so that each process
    #    keeps and steps the Adam moments of its own 1/N only.
    optimizer = models.make_optimizer(model, data.lr, args.weight_decay)

    # [backward] backward() reduce-scatters each layer's gradients as soon as they are computed,
    #    averaged over the processes, overlapping the communication with the layers below.
    common.Trainer(args, strategy, model, optimizer, data, loaders, instruments.callbacks_for(args)).fit()


if __name__ == "__main__":
    cli.run(main)
