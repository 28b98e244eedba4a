"""Fine-tune Chinese BERT for Weibo emotion classification on one device: the baseline.

    python single-gpu-cls.py                 # GPU 0 if there is one, else the CPU
    python single-gpu-cls.py --model tiny    # the offline tiny BERT, a minute on a laptop CPU

Every other script in this suite is this one plus its strategy's steps: compare them with
`diff single-gpu-cls.py multi-gpu-distributed-cls.py`. Shared code: common.py, and the modules of docs/architecture.md.
"""
import common
from support import cli, machine, models


def main():
    args = cli.check_args(cli.build_parser(__file__, __doc__).parse_args())
    common.set_seed(args.seed)

    # [device] One process on one device: no ranks, nothing to synchronise.
    device = machine.resolve_device(args.device)
    strategy = common.Strategy(device)

    train_set, dev_set, tokenizer, model, model_name, lr = common.prepare_data(args, strategy)
    model.to(device)
    if args.compile:  # in place, so the weights keep their names; a graph per step shape (--compile-dynamic)
        model.compile(**models.compile_options(args, strategy))

    train_loader = common.make_loader(train_set, args, tokenizer, common.train_sampler(train_set, args))
    dev_loader = common.make_loader(dev_set, args, tokenizer, common.eval_sampler(dev_set, args))
    optimizer = models.make_optimizer(model, lr, args.weight_decay)

    # [grad-accum] With --grad-accum N the Trainer runs N micro-batches through forward and backward, whose
    #    gradients add up in each parameter's .grad, then steps once: a batch N times larger than
    #    the device holds, for N times the compute per step.
    trainer = common.Trainer(args, strategy, model, optimizer, tokenizer, train_loader, dev_loader, model_name, lr)
    trainer.fit()


if __name__ == "__main__":
    cli.run(main)
