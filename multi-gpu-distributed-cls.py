"""Fine-tune Chinese BERT with DistributedDataParallel (DDP): one process per GPU, started by torchrun.

    torchrun --nproc_per_node 2 multi-gpu-distributed-cls.py
    torchrun --standalone --nproc_per_node 2 multi-gpu-distributed-cls.py   # a free port, not 29500
    python -m torch.distributed.launch --nproc_per_node 2 multi-gpu-distributed-cls.py   # legacy launcher

    # two machines, 2 GPUs each (run on each; --node_rank 0 on the machine at MASTER_IP):
    torchrun --nnodes 2 --node_rank 0 --nproc_per_node 2 --master_addr MASTER_IP --master_port 29500 \\
        multi-gpu-distributed-cls.py

Each process holds a full copy of the model and trains on its own shard of every batch; DDP
averages the gradients across processes during backward, so all copies take the same step.
Without GPUs the same code runs CPU processes that talk over gloo instead of NCCL.
"""
import contextlib
from datetime import timedelta

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel

import common
import instruments
from support import cli, launch, machine, models, options


class DDP(common.TorchDistributed):
    name = "ddp"
    launcher = "torchrun"

    def accumulating(self, model, last):
        # With --grad-accum N, no_sync() keeps DDP from all-reducing the gradients of a step's first
        # N - 1 micro-batches: they add up in each process, and the last micro-batch's backward
        # all-reduces the sum, once per optimizer step instead of N times. DDP reads the flag in
        # forward as well as backward, so the context covers both.
        return contextlib.nullcontext() if last else model.no_sync()


def main():
    parser = options.build_parser(__file__, __doc__)
    options.add_distributed_args(parser, backend=True, local_rank=True)
    args = options.parse(parser)
    common.set_seed(args.seed)

    # [ranks] The global rank (0 .. world size - 1, across all machines) decides who prints and saves;
    #    the local rank (0 .. processes on this machine - 1) decides which GPU this process uses.
    rank, world_size, local_rank, local_world_size = launch.launch_environment(
        "torchrun --nproc_per_node N multi-gpu-distributed-cls.py")
    device = machine.resolve_device(args.device, local_rank, share_gpus=args.backend == "gloo")

    # [group] Pin the GPU before joining the group, so NCCL sets up its communicator on the right card.
    if device.type == "cuda":
        torch.cuda.set_device(device)
    dist.init_process_group(machine.backend_for(device, args.backend), timeout=timedelta(seconds=args.dist_timeout))
    # [leave] cli.run leaves the group on every exit path, failures included, so no process is left waiting.
    strategy = DDP(device, rank, world_size, local_world_size=local_world_size)
    if args.local_rank is not None:  # passed by the legacy launcher only
        strategy.launcher = "torch.distributed.launch"

    data = common.load_data_and_model(args, strategy)
    model = data.model.to(device)
    if args.compile:  # in place, then wrapped; dynamic shapes without DDP's graph split, which torch 2.11 breaks
        model.compile(**models.compile_options(args, strategy))
    # [wrap] DDP broadcasts rank 0's weights to every process, then all-reduces (averages) the
    #    gradients during backward(), overlapping the communication with the computation.
    model = DistributedDataParallel(model, device_ids=[device.index] if device.type == "cuda" else None)

    # [data] Each process reads a different 1/world_size of every global batch, so the global batch
    #    is batch size x world size. The Trainer calls set_epoch so each epoch shuffles anew.
    loaders = common.make_loaders(data, args, world_size, rank)
    optimizer = models.make_optimizer(model, data.lr, args.weight_decay)

    common.Trainer(args, strategy, model, optimizer, data, loaders, instruments.callbacks_for(args)).fit()


if __name__ == "__main__":
    cli.run(main)
