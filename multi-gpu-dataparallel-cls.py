"""Fine-tune Chinese BERT with nn.DataParallel: one process drives several GPUs.

    python multi-gpu-dataparallel-cls.py                  # every GPU torch sees
    python multi-gpu-dataparallel-cls.py --gpu-ids 0,1    # only these, e.g. the free cards of a shared machine

Every step, DataParallel copies the model from the first GPU to the others, splits the batch
between them, runs the copies in threads and gathers their outputs back on the first GPU, where
backward sums the gradients. One Python process drives all the GPUs and the first one does the
extra work, so it scales worse than DDP (multi-gpu-distributed-cls.py), which PyTorch recommends
instead. Its appeal: wrapping the model is the whole change to single-gpu-cls.py (compare them with diff).
Without GPUs it runs as one CPU process, the same as single-gpu-cls.py.
"""
import sys

import torch
from torch.nn import DataParallel

import common
import instruments
from support import cli, machine, models, options


class DataParallelStrategy(common.Strategy):
    name = "dataparallel"

    def __init__(self, device, gpu_ids):
        super().__init__(device)
        self.gpu_ids = gpu_ids

    def gpus_in_use(self):
        # The copies on the other GPUs draw their dropout from those GPUs' generators: a checkpoint
        # saves and --resume restores every one of them, not only the first GPU's.
        return self.gpu_ids


def choose_gpus(args):
    """The GPU indices to use: --gpu-ids, else all; none on a machine without GPUs."""
    if machine.resolve_device(args.device).type == "cpu":
        print("note: DataParallel needs GPUs and none is in use here: training as one process on the CPU",
              file=sys.stderr)
        return []
    available = torch.cuda.device_count()
    if args.gpu_ids is None:
        gpu_ids = list(range(available))
    else:
        try:
            gpu_ids = [int(part) for part in args.gpu_ids.split(",")]
        except ValueError:
            raise cli.UserError(f"--gpu-ids takes GPU indices separated by commas, like 0,1; "
                                f"got {args.gpu_ids!r}") from None
        if len(set(gpu_ids)) != len(gpu_ids) or not all(0 <= i < available for i in gpu_ids):
            raise cli.UserError(f"--gpu-ids {args.gpu_ids}: name each GPU once, from 0 to {available - 1} "
                                f"(this machine has {available})")
    print(f"DataParallel over GPUs {','.join(map(str, gpu_ids))}: {torch.cuda.get_device_name(gpu_ids[0])}")
    return gpu_ids


def main():
    parser = options.build_parser(__file__, __doc__)
    parser.add_argument("--gpu-ids", help="GPUs to use, comma-separated, e.g. 0,1 (default: all)")
    args = options.parse(parser)
    if args.compile:  # refused before any work: DataParallel copies the model anew at every forward
        raise cli.UserError("--compile: nn.DataParallel replicates the model at every forward, which "
                            "torch.compile does not support; compile with DDP (multi-gpu-distributed-cls.py)")
    common.set_seed(args.seed)

    # [device] One process for all the GPUs: the first GPU named holds the model, receives every batch and
    #    the gathered outputs, and runs the optimizer. Other processes on the machine may use the rest.
    #    Make it the current GPU before anything uses CUDA: pinned memory, the default stream and
    #    the GPU random state a checkpoint saves follow the current GPU, else GPU 0, which
    #    --gpu-ids 2,3 leaves to others.
    gpu_ids = choose_gpus(args)
    device = torch.device("cuda", gpu_ids[0]) if gpu_ids else torch.device("cpu")
    if gpu_ids:
        torch.cuda.set_device(device)
    strategy = DataParallelStrategy(device, gpu_ids)

    data = common.load_data_and_model(args, strategy)
    model = data.model.to(device)
    # [batch] Each forward pass splits the batch over the GPUs (--batch-size is the whole batch: pass
    #    32 x GPUs to give each GPU what DDP gives each process), runs a copy of the model on each and
    #    gathers the logits on the first GPU.
    # [loss] The Trainer gives the model no labels, so the copies compute no loss of their own (given
    #    labels, each would return its split's mean, one loss per GPU). It computes one loss from the
    #    gathered logits, a mean over the whole batch, as the reference tutorial does; backward runs
    #    through the gather back into each copy, and DataParallel sums the copies' gradients into the
    #    first GPU's weights.
    if gpu_ids:
        model = DataParallel(model, device_ids=gpu_ids)

    loaders = common.make_loaders(data, args)
    optimizer = models.make_optimizer(model, data.lr, args.weight_decay)

    # [grad-accum] --grad-accum N works as on one device: the gradients of N micro-batches add up on the first
    #    GPU, where DataParallel gathers them anyway, and the optimizer steps once.
    common.Trainer(args, strategy, model, optimizer, data, loaders, instruments.callbacks_for(args)).fit()


if __name__ == "__main__":
    cli.run(main)
