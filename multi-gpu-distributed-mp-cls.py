"""Fine-tune Chinese BERT with DistributedDataParallel (DDP), the processes started by the script itself
with torch.multiprocessing.spawn: no launcher.

    python multi-gpu-distributed-mp-cls.py                # one process per GPU, or 2 CPU processes
    python multi-gpu-distributed-mp-cls.py --nprocs 4

    # two machines, 2 GPUs each (run on each; --node-rank 0 on the machine at MASTER_IP):
    python multi-gpu-distributed-mp-cls.py --nnodes 2 --node-rank 0 --nprocs 2 \\
        --master-addr MASTER_IP --master-port 29500

The training is that of multi-gpu-distributed-cls.py (compare them with diff): what changes is who
starts the processes and hands out their ranks. Here the script does torchrun's job itself.
"""
import contextlib
import os
from datetime import timedelta

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch.nn.parallel import DistributedDataParallel

import common
import instruments
from support import cli, machine, models, options, spawn_setup


class DDP(common.TorchDistributed):
    name = "ddp"
    launcher = "spawn"

    def accumulating(self, model, last):
        # With --grad-accum N, no_sync() keeps DDP from all-reducing the gradients of a step's first
        # N - 1 micro-batches: they add up in each process, and the last micro-batch's backward
        # all-reduces the sum, once per optimizer step instead of N times. DDP reads the flag in
        # forward as well as backward, so the context covers both.
        return contextlib.nullcontext() if last else model.no_sync()


def main():
    parser = options.build_parser(__file__, __doc__)
    options.add_distributed_args(parser, backend=True)
    # [launch] The options torchrun took (--nprocs, --nnodes, --node-rank, --master-addr, --master-port), now
    #    the script's own, and torchrun's checks: a free port unless one is named, a rank per machine.
    spawn_setup.add_launch_args(parser)
    args = options.parse(parser)

    # [spawn] Start the processes and wait for them. spawn (not fork) gives each a fresh interpreter, as
    #    CUDA requires. If one fails, the others are stopped, as torchrun would; the same on Ctrl-C.
    first_failure = mp.get_context("spawn").Value("i", -1)
    processes = mp.start_processes(worker, args=(args, first_failure), nprocs=args.nprocs, join=False)
    spawn_setup.wait_for(processes, first_failure, args)


def worker(local_rank, args, first_failure):
    """The body of every process; spawn calls it with the process's index on this machine."""
    # [ranks] The global rank (0 .. world size - 1, across all machines) decides who prints and saves;
    #    the local rank (0 .. processes on this machine - 1) decides which GPU this process uses.
    #    torchrun would have put them in the environment; here the script computes them.
    rank = args.node_rank * args.nprocs + local_rank
    os.environ.update(RANK=str(rank), LOCAL_RANK=str(local_rank), WORLD_SIZE=str(args.nnodes * args.nprocs),
                      MASTER_ADDR=args.master_addr, MASTER_PORT=str(args.master_port))
    # [failure] A failing rank notes it failed first, before cli.run leaves the group (which makes the others
    #    fail too): the parent then names the cause, not a rank that only lost its peer.
    cli.run(spawn_setup.noting_the_first_failure(first_failure, rank, lambda: train(args, rank, local_rank)))


def train(args, rank, local_rank):
    common.set_seed(args.seed)
    world_size = args.nnodes * args.nprocs
    device = machine.resolve_device(args.device, local_rank, share_gpus=args.backend == "gloo")

    # [group] Pin the GPU before joining the group, so NCCL sets up its communicator on the right card.
    if device.type == "cuda":
        torch.cuda.set_device(device)
    dist.init_process_group(machine.backend_for(device, args.backend), timeout=timedelta(seconds=args.dist_timeout))
    # [leave] cli.run leaves the group on every exit path, failures included, so no process is left waiting.
    strategy = DDP(device, rank, world_size, local_world_size=args.nprocs)

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
