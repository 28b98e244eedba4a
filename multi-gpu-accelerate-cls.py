"""Fine-tune Chinese BERT with Hugging Face Accelerate: DDP, with the library doing the set-up.

    accelerate launch --multi_gpu --num_processes 2 multi-gpu-accelerate-cls.py
    accelerate launch --config_file configs/accelerate/multi-gpu.yaml multi-gpu-accelerate-cls.py
    torchrun --nproc_per_node 2 multi-gpu-accelerate-cls.py
    python multi-gpu-accelerate-cls.py          # one process: the same script, no launcher

    # two machines, 2 GPUs each (run on each; --machine_rank 1 on the second):
    accelerate launch --config_file configs/accelerate/two-machines.yaml --machine_rank 0 \\
        --main_process_ip MAIN_MACHINE_IP multi-gpu-accelerate-cls.py

The Accelerator reads the ranks the launcher gives, picks each process's device, wraps the model
in DistributedDataParallel and applies mixed precision, so the training loop is the single-device
one. The data loaders are sharded as in the DDP script ([data] says why not by Accelerate).
Without GPUs the same code runs CPU processes over gloo.
"""
import contextlib
from datetime import timedelta

import accelerate
import torch
from accelerate import Accelerator
from accelerate.utils import InitProcessGroupKwargs, broadcast_object_list, gather_object

import common
import instruments
from support import checkpoints, cli, launch, machine, models, options


class Accelerate(common.Strategy):
    name = "accelerate"

    def __init__(self, accelerator, launcher, precision):
        # The launchers (accelerate launch, torchrun) tell each process how many share its machine.
        local_world_size = launch.local_world_size(accelerator.num_processes)
        super().__init__(accelerator.device, accelerator.process_index, accelerator.num_processes, precision,
                         local_world_size)
        self.accelerator, self.launcher = accelerator, launcher
        if accelerator.gradient_accumulation_steps != 1:  # backward() would divide the loss by it
            raise cli.UserError(f"the accelerate config sets gradient_accumulation_steps "
                                f"{accelerator.gradient_accumulation_steps}: use --grad-accum instead")

    @property
    def is_main(self):
        return self.accelerator.is_main_process  # rank 0 of all machines; accelerator.print prints once per machine

    def accumulating(self, model, last):
        # With --grad-accum N, no_sync() lets the gradients of a step's first micro-batches add up
        # without all-reducing them, as DDP's does. Not accumulate(): it counts N micro-batches
        # itself, and has no public way to be told that an epoch's short last step has fewer.
        return contextlib.nullcontext() if last else self.accelerator.no_sync(model)

    def backward(self, loss):
        self.accelerator.backward(loss)  # scales the loss first when fp16 needs a gradient scaler

    def reduce_mean(self, tensor):
        return self.accelerator.reduce(tensor, "mean")

    def gather(self, tensor):
        # The Trainer gathers once, after the dev loop, and drops the repeats of weight 0. Not
        # gather_for_metrics: it drops repeats only inside the loop of a loader Accelerate prepared.
        return self.accelerator.gather(tensor)

    def broadcast_object(self, value):
        return broadcast_object_list([value])[0]

    def gather_objects(self, value):
        return gather_object([value])

    def unwrap(self, model):
        return self.accelerator.unwrap_model(model)

    def save_model(self, model, tokenizer, path):
        # get_state_dict gathers the weights however Accelerate wrapped the model (FSDP, ZeRO-3: every
        # process must call it). accelerator.save_model would write them alone, in place: save_pretrained
        # adds the config and tokenizer predict.py and pipeline() need, in a folder swapped in whole.
        state = self.accelerator.get_state_dict(model)
        if self.is_main:
            checkpoints.save_model(self.unwrap(model), tokenizer, path, state_dict=state)

    def save_state(self, model, optimizer, path, state):
        # --save-steps: save_state writes the model, the optimizer, fp16's gradient scaler and each
        # process's random states, in place: into a staging folder that rank 0 swaps in, the suite's
        # state beside, once every process has written its part (save_state itself does not wait).
        with checkpoints.staged_checkpoint(path, state, self.is_main, self.accelerator.wait_for_everyone) as staging:
            self.accelerator.save_state(staging)
            self.accelerator.wait_for_everyone()

    def load_state(self, model, optimizer, path):
        # load_state only logs random states it cannot restore: the Trainer sets the suite's copy after.
        self.accelerator.load_state(path)
        return torch.load(path / checkpoints.CHECKPOINT_FILE, map_location="cpu", weights_only=True)

    def versions(self):
        return {"accelerate": accelerate.__version__}


def main():
    parser = options.build_parser(__file__, __doc__)
    options.add_distributed_args(parser)
    options.add_precision_arg(parser, default=None,
                          default_help="accelerate launch's --mixed_precision or config file, else fp32")
    args = options.parse(parser)
    common.set_seed(args.seed)

    # [group] Accelerate joins the launched processes on GPUs by itself, on CPUs only when told cpu=True:
    #    without GPUs, Accelerator() alone leaves each process on its own, training on all the data.
    on_cpu = machine.resolve_device(args.device, launch.local_rank()).type == "cpu"
    mixed_precision = {"fp32": "no"}.get(args.precision, args.precision)
    accelerator = Accelerator(cpu=on_cpu, mixed_precision=mixed_precision,
                              kwargs_handlers=[InitProcessGroupKwargs(timeout=timedelta(seconds=args.dist_timeout))])
    # [leave] cli.run leaves the group on every exit path, failures included, so no process is left waiting.
    #    That is all accelerator.end_training() would do: this script starts no trackers.
    # [precision] On CPU Accelerate accepts fp16 but silently trains in fp32: refuse rather than mislabel.
    precision = {"no": "fp32"}.get(accelerator.mixed_precision, accelerator.mixed_precision)
    machine.check_precision(precision, accelerator.device)
    strategy = Accelerate(accelerator, launch.accelerate_launcher(), precision)
    accelerator.print(f"accelerate: {accelerator.distributed_type.value}, {accelerator.num_processes} process(es), "
                      f"mixed precision {accelerator.mixed_precision}")

    data = common.load_data_and_model(args, strategy)
    model = data.model
    if args.compile:  # in place, then wrapped; dynamic shapes without DDP's graph split, which torch 2.11 breaks
        model.compile(**models.compile_options(args, strategy))

    # [data] The loaders are sharded as in the DDP script, by this process's index, not by prepare():
    #    to give every process as many batches, prepare() fills a short last global batch with
    #    samples from the start of the epoch, which train twice (even_batches=True); with
    #    even_batches=False the process with more batches waits forever in the all-reduce. Our
    #    sampler evens them out with repeats that weigh nothing.
    loaders = common.make_loaders(data, args, accelerator.num_processes, accelerator.process_index)
    optimizer = models.make_optimizer(model, data.lr, args.weight_decay)

    # [wrap] One call does the rest of the DDP script's set-up: moves the model to this process's
    #    device and wraps it in DDP (and in autocast for mixed precision), and wraps the
    #    optimizer (fp16 loss scaling).
    model, optimizer = accelerator.prepare(model, optimizer)

    common.Trainer(args, strategy, model, optimizer, data, loaders, instruments.callbacks_for(args)).fit()


if __name__ == "__main__":
    cli.run(main)
