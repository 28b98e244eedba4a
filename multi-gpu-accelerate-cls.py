"""Fine-tune Chinese BERT with Hugging Face Accelerate: DDP, with the library doing the set-up.

    accelerate launch --multi_gpu --num_processes 2 multi-gpu-accelerate-cls.py
    accelerate launch --config_file configs/accelerate/multi-gpu.yaml multi-gpu-accelerate-cls.py
    torchrun --nproc_per_node 2 multi-gpu-accelerate-cls.py
    python multi-gpu-accelerate-cls.py          # one process: the same script, no launcher

    # two machines, 2 GPUs each (run on each; --machine_rank 1 on the second):
    accelerate launch --config_file configs/accelerate/two-machines.yaml --machine_rank 0 \\
        --main_process_ip MAIN_MACHINE_IP multi-gpu-accelerate-cls.py

The Accelerator reads the ranks the launcher gives, picks each process's device, wraps the model
in DistributedDataParallel, shards the data loaders and applies mixed precision, so the training
loop is the single-device one. Without GPUs the same code runs CPU processes over gloo.
"""
import os
from datetime import timedelta

import accelerate
from accelerate import Accelerator
from accelerate.utils import InitProcessGroupKwargs

import common


class Accelerate(common.Strategy):
    name = "accelerate"

    def __init__(self, accelerator, launcher):
        precision = "fp32" if accelerator.mixed_precision == "no" else accelerator.mixed_precision
        super().__init__(accelerator.device, accelerator.process_index, accelerator.num_processes, precision)
        self.accelerator, self.launcher = accelerator, launcher

    @property
    def is_main(self):
        return self.accelerator.is_main_process  # rank 0 of all machines; accelerator.print prints once per machine

    def backward(self, loss):
        self.accelerator.backward(loss)  # scales the loss first when fp16 needs a gradient scaler

    def reduce_mean(self, tensor):
        return self.accelerator.reduce(tensor, "mean")

    def gather(self, tensor):
        # The Trainer gathers once, after the dev loop, and keeps each sample index once: that drops
        # the samples the prepared loader repeats to even out the last batch, as gather_for_metrics
        # would if it were called on every batch.
        return self.accelerator.gather(tensor)

    def unwrap(self, model):
        return self.accelerator.unwrap_model(model)

    def versions(self):
        return {"accelerate": accelerate.__version__}


def launcher_name():
    """accelerate launch hands its settings to the processes as ACCELERATE_* variables; torchrun does not."""
    if "ACCELERATE_MIXED_PRECISION" in os.environ:
        return "accelerate launch"
    return "torchrun" if "WORLD_SIZE" in os.environ else "python"


def main():
    parser = common.build_parser(__file__, __doc__)
    common.add_distributed_args(parser)
    parser.add_argument("--mixed-precision", choices=["no", "fp16", "bf16"],
                        help="overrides accelerate launch's --mixed_precision and its config file; "
                             "default: what those say, else 'no'")
    args = common.check_args(parser.parse_args())
    common.set_seed(args.seed)

    # 1. Accelerate joins the launched processes on GPUs by itself, on CPUs only when told cpu=True:
    #    without GPUs, Accelerator() alone leaves each process on its own, training on all the data.
    local_rank = int(os.environ.get("LOCAL_RANK", 0))
    on_cpu = common.resolve_device(args.device, local_rank).type == "cpu"
    accelerator = Accelerator(cpu=on_cpu, mixed_precision=args.mixed_precision,
                              kwargs_handlers=[InitProcessGroupKwargs(timeout=timedelta(seconds=args.dist_timeout))])
    try:
        # 2. On CPU Accelerate accepts fp16 but silently trains in fp32: refuse rather than mislabel.
        if accelerator.mixed_precision == "fp16" and accelerator.device.type == "cpu":
            raise common.UserError("fp16 mixed precision needs a GPU; on CPU use --mixed-precision bf16 or no")
        strategy = Accelerate(accelerator, launcher_name())
        accelerator.print(f"accelerate: {accelerator.distributed_type.value}, {accelerator.num_processes} process(es), "
                          f"mixed precision {accelerator.mixed_precision}")

        train_set, dev_set, tokenizer, model, model_name, lr = common.prepare_data(args)

        # 3. Every process builds the same loaders over all the data; prepare() then deals process i
        #    the batches i, i + N, i + 2N, ...: N consecutive batches form one global batch, the same
        #    samples DDP's DistributedSampler puts in it. Length grouping must group at that size.
        global_batch_size = args.batch_size * accelerator.num_processes
        train_loader = common.make_loader(train_set, args, tokenizer,
                                          common.train_sampler(train_set, args, global_batch_size=global_batch_size))
        dev_loader = common.make_loader(dev_set, args, tokenizer, common.eval_sampler(dev_set))
        optimizer = common.make_optimizer(model, lr, args.weight_decay)

        # 4. One call does the DDP script's set-up: moves the model to this process's device and wraps
        #    it in DDP (and in autocast for mixed precision), wraps the optimizer (fp16 loss scaling)
        #    and shards the loaders, which then put each batch on the device.
        model, optimizer, train_loader, dev_loader = accelerator.prepare(model, optimizer, train_loader, dev_loader)

        trainer = common.Trainer(args, strategy, model, optimizer, tokenizer, train_loader, dev_loader, model_name, lr)
        trainer.fit()
    finally:
        # 5. Leave the process group on every exit path, failures included.
        accelerator.end_training()


if __name__ == "__main__":
    common.run(main)
