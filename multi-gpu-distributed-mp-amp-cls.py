"""Fine-tune Chinese BERT with DDP started by torch.multiprocessing.spawn, plus automatic mixed precision.

    python multi-gpu-distributed-mp-amp-cls.py                      # fp16 on GPUs, bf16 on CPU
    python multi-gpu-distributed-mp-amp-cls.py --precision bf16     # GPUs from Ampere (A100, RTX 30xx) on
    python multi-gpu-distributed-mp-amp-cls.py --precision fp32     # as multi-gpu-distributed-mp-cls.py

    # two machines, 2 GPUs each (run on each; --node-rank 0 on the machine at MASTER_IP):
    python multi-gpu-distributed-mp-amp-cls.py --nnodes 2 --node-rank 0 --nprocs 2 \\
        --master-addr MASTER_IP --master-port 29500

This is multi-gpu-distributed-mp-cls.py (compare them with diff) with the forward pass under autocast:
matrix products run in 16-bit floats, faster on tensor-core GPUs and with about half the activation
memory, while the weights, the optimizer and the loss stay in fp32.
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
# The 16-bit type autocast computes in, for each --precision choice.
AMP_DTYPES = {"fp16": torch.float16, "bf16": torch.bfloat16, "fp32": None}


class DDPWithAMP(common.TorchDistributed):
    name = "ddp-amp"
    launcher = "spawn"

    def __init__(self, device, rank, world_size, local_world_size, precision):
        super().__init__(device, rank, world_size, precision, local_world_size)
        self.amp_dtype = AMP_DTYPES[precision]
        # [amp] fp16 has a narrow range: small gradients would round to zero. The scaler multiplies
        #    the loss before backward and divides the gradients before the step, skipping steps
        #    whose gradients overflowed. bf16 has fp32's range: no scaler (disabled = pass-through).
        self.scaler = torch.amp.GradScaler(device.type, enabled=precision == "fp16")

    def autocast(self):
        # [amp] Only the forward pass runs under autocast (the Trainer then computes the loss in fp32
        #    from the logits); backward and the optimizer step run outside it, on fp32 weights.
        return torch.autocast(self.device.type, dtype=self.amp_dtype, enabled=self.amp_dtype is not None)

    def backward(self, loss):
        self.scaler.scale(loss).backward()

    def step(self, model, optimizer):
        # Once per optimizer step, after all its micro-batches (--grad-accum): the scaler unscales the
        # summed gradients, skips the step if they overflowed, and adjusts the scale once.
        self.scaler.step(optimizer)
        self.scaler.update()
        optimizer.zero_grad(set_to_none=True)

    def extra_state(self):
        # [amp] The scale the scaler has learned is training state: --resume restores it rather
        #    than starting again at 65536 and skipping steps to find it.
        return {"scaler": self.scaler.state_dict()}

    def load_extra_state(self, state):
        self.scaler.load_state_dict(state["scaler"])

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
    options.add_precision_arg(parser, default=options.ByDevice(gpu="fp16", cpu="bf16"),
                              default_help="fp16 on GPUs, bf16 on CPU")
    args = options.parse(parser)

    # [amp] fp16 is the 16-bit format every CUDA GPU computes fast; CPUs emulate it, many times
    #    slower than fp32, and only some compute bf16 natively (the Trainer says when it is
    #    emulated). Refuse what a process's device cannot run before any process starts.
    for local_rank in range(args.nprocs):
        machine.check_precision(args.precision, machine.resolve_device(args.device, local_rank, args.backend == "gloo"))

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
    strategy = DDPWithAMP(device, rank, world_size, local_world_size=args.nprocs, precision=args.precision)

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
