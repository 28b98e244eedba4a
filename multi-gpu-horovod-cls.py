"""Fine-tune Chinese BERT with Horovod: one process per GPU, started by horovodrun.

    horovodrun -np 2 -H localhost:2 --gloo python multi-gpu-horovod-cls.py
    horovodrun -np 2 -H localhost:2 --gloo python multi-gpu-horovod-cls.py --fp16-allreduce

    # two machines, 2 GPUs each, from host1 (over ssh, same paths on both; Slurm: slurm/horovod.sbatch):
    horovodrun -np 4 -H host1:2,host2:2 --gloo python multi-gpu-horovod-cls.py

Each process holds a full copy of the model and trains on its own shard of every batch. Horovod's
DistributedOptimizer all-reduces (averages) each gradient as soon as backward() has produced it,
and step() waits for those all-reduces before updating, so all copies take the same step: the
same maths as DDP, from a different library. Without GPUs the processes talk over Gloo on the CPU.
Horovod is built from source by scripts/build-horovod.sh (see the README).
"""
import os

import horovod
import horovod.torch as hvd
import torch

import common
import instruments
from support import cli, launch, machine, models, options


class Horovod(common.Strategy):
    name = "horovod"
    launcher = "horovodrun"

    def __init__(self, device, gradient_compression):
        super().__init__(device, hvd.rank(), hvd.size(), local_world_size=hvd.local_size())
        self.gradient_compression = gradient_compression

    def step(self, model, optimizer):
        # Wait for this step's gradient all-reduces (step() would, first), in a range of its own: they
        # run on Horovod's thread, which --profile cannot see, and the wait is what it can show.
        with torch.profiler.record_function("horovod:synchronize"):
            optimizer.synchronize()
        with optimizer.skip_synchronize():
            optimizer.step()
        optimizer.zero_grad()  # Horovod's takes no set_to_none argument; None is torch's default anyway

    def reduce_mean(self, tensor):
        # hvd.allreduce returns a new tensor, the average, and leaves its input unchanged.
        return hvd.allreduce(tensor, op=hvd.Average)

    def gather(self, tensor):
        return hvd.allgather(tensor)

    def broadcast_object(self, value):
        # Horovod matches collectives across processes by name, by default the value's type name:
        # rank 0's value and the others' placeholder (None) differ, so name it.
        return hvd.broadcast_object(value, root_rank=0, name="broadcast_object")

    def gather_objects(self, value):
        return hvd.allgather_object(value, name="gather_objects")

    def result_extras(self):
        return {"gradient_compression": self.gradient_compression}

    def versions(self):
        return {"horovod": horovod.__version__}


def check_launched():
    """Started without horovodrun, hvd.init() quietly makes a world of one process: refuse instead."""
    if hvd.size() == 1 and "HOROVOD_RANK" not in os.environ:
        raise cli.UserError("this script runs under horovodrun: horovodrun -np N -H localhost:N --gloo "
                            "python multi-gpu-horovod-cls.py (see the README)")


def main():
    parser = options.build_parser(__file__, __doc__)
    parser.add_argument("--fp16-allreduce", action="store_true",
                        help="send gradients as fp16 (half the traffic, about 3 significant digits)")
    args = options.parse(parser)
    common.set_seed(args.seed)

    # [ranks] Join the job horovodrun started. The global rank decides who prints and saves; the local
    #    rank (the process's index on its machine) decides which GPU it uses.
    launch.use_slurm_for_horovod()  # one srun task per process (slurm/horovod.sbatch): ranks from Slurm
    hvd.init()
    check_launched()
    device = machine.resolve_device(args.device, hvd.local_rank())
    if device.type == "cuda":
        torch.cuda.set_device(device)
    strategy = Horovod(device, "fp16" if args.fp16_allreduce else "none")

    data = common.load_data_and_model(args, strategy)
    model = data.model.to(device)
    if args.compile:  # in place, so the weights keep their names; a graph per step shape (--compile-dynamic)
        model.compile(**models.compile_options(args, strategy))
    # [wrap] Horovod does not wrap the model, so nothing else makes the copies start equal: send rank 0's
    #    weights to every process (the seed already agrees here; the broadcast makes it certain).
    hvd.broadcast_parameters(model.state_dict(), root_rank=0)

    # [data] Each process reads a different 1/size of every global batch, so the global batch is
    #    batch size x processes. The learning rate is NOT multiplied by the process count (Horovod's
    #    examples do that): the same global batch then takes the same step as DDP and one device.
    loaders = common.make_loaders(data, args, hvd.size(), hvd.rank())
    optimizer = models.make_optimizer(model, data.lr, args.weight_decay)

    # [optimizer] The DistributedOptimizer hooks every named parameter and averages its gradient across
    #    processes during backward(). fp16 compression halves the bytes sent but rounds each gradient.
    #    With --grad-accum N, backward_passes_per_step=N all-reduces a gradient only at its N-th
    #    backward, once per optimizer step; a step of fewer micro-batches (the last of an epoch)
    #    all-reduces what is left in step(). It averages over processes only, not over the N passes.
    compression = hvd.Compression.fp16 if args.fp16_allreduce else hvd.Compression.none
    optimizer = hvd.DistributedOptimizer(optimizer, named_parameters=model.named_parameters(),
                                         compression=compression, op=hvd.Average,
                                         backward_passes_per_step=args.grad_accum)

    # [broadcast] Give every process rank 0's optimizer. Fresh, it holds only its settings (learning rate,
    #    betas, weight decay), which every process has built alike from the command line: as with
    #    the weights, the broadcast makes it certain. (--resume then has every process load the same checkpoint
    #    file, weights and Adam moments, after checking that each one can read it.) Not with
    #    hvd.broadcast_optimizer_state: on a fresh optimizer it first runs a step on zero gradients,
    #    which for AdamW decays the weights once and makes the first real update about a quarter smaller.
    optimizer.load_state_dict(hvd.broadcast_object(optimizer.state_dict(), root_rank=0))

    common.Trainer(args, strategy, model, optimizer, data, loaders, instruments.callbacks_for(args)).fit()


if __name__ == "__main__":
    cli.run(main)
