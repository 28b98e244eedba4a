"""Fine-tune Chinese BERT for Weibo emotion classification on one device: the baseline.

    python single-gpu-cls.py                 # GPU 0 if there is one, else the CPU
    python single-gpu-cls.py --model tiny    # the offline tiny BERT, a minute on a laptop CPU

Every other script in this suite is this one plus its strategy's steps: compare them with
`diff single-gpu-cls.py multi-gpu-distributed-cls.py`. Shared code: common.py, and the modules of docs/architecture.md.
"""
import common
import instruments
from support import cli, machine, models, options


def main():
    parser = options.build_parser(__file__, __doc__)
    args = options.parse(parser)
    common.set_seed(args.seed)

    # [device] One process on one device: no ranks, nothing to synchronise.
    device = machine.resolve_device(args.device)
    strategy = common.Strategy(device)

    data = common.load_data_and_model(args, strategy)
    model = data.model.to(device)
    if args.compile:  # in place, so the weights keep their names; a graph per step shape (--compile-dynamic)
        model.compile(**models.compile_options(args, strategy))

    loaders = common.make_loaders(data, args)
    optimizer = models.make_optimizer(model, data.lr, args.weight_decay)

    # [grad-accum] With --grad-accum N the Trainer runs N micro-batches through forward and backward, whose
    #    gradients add up in .grad, then steps once: a batch N times what the device holds, for N times the compute.
    common.Trainer(args, strategy, model, optimizer, data, loaders, instruments.callbacks_for(args)).fit()


if __name__ == "__main__":
    cli.run(main)
