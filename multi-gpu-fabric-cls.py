"""Fine-tune Chinese BERT with Lightning Fabric: DDP (or FSDP2, DeepSpeed) with the library doing the set-up.

    fabric run --accelerator cpu --devices 2 multi-gpu-fabric-cls.py        # 2 CPU processes over gloo
    fabric run --accelerator cuda --devices 2 multi-gpu-fabric-cls.py       # 2 GPUs over NCCL
    fabric run --accelerator cuda --devices 2 multi-gpu-fabric-cls.py --fabric-strategy fsdp2
    fabric run --accelerator cuda --devices 2 multi-gpu-fabric-cls.py --fabric-strategy deepspeed  # GPUs only
    torchrun --nproc_per_node 2 multi-gpu-fabric-cls.py                     # Fabric reads torchrun's ranks too
    python multi-gpu-fabric-cls.py                                          # one process, no launcher

    # two machines, 2 GPUs each (run on each; --node-rank 1 on the second):
    fabric run --accelerator cuda --devices 2 --num-nodes 2 --node-rank 0 --main-address MASTER_IP \\
        --main-port 29400 multi-gpu-fabric-cls.py

`fabric run` is torchrun underneath (lightning_fabric/cli.py): it starts --devices processes (1 unless
told), on port 29400 unless --main-port says otherwise, and hands --accelerator, --devices, --num-nodes
and --precision to Fabric() in LT_* variables. This is multi-gpu-distributed-cls.py (compare them with
diff) with Fabric joining the processes, wrapping the model and running the collectives: the same
processes, the same DDP, the same global batches, the same weights. Without GPUs the same code runs CPU
processes over gloo.
"""
from lightning_fabric import Fabric

import common
import instruments
from libraries import fabric_setup
from support import cli, launch, models, options


class ThroughFabric(fabric_setup.FabricSupport):
    """The suite's Strategy, carried out by Fabric (whose own strategy, --fabric-strategy, is how it
    wraps the model)."""
    name = "fabric"

    def accumulating(self, model, last):
        if self.engine is not None:
            # DeepSpeed counts micro-batches itself and would step at every N-th, dropping the
            # gradients of an epoch's shorter last step: say where each step ends instead.
            self.engine.set_gradient_accumulation_boundary(last)
            return super().accumulating(model, last)
        # With --grad-accum N, the first N - 1 micro-batches of a step keep their gradients local
        # (DDP's no_sync(), FSDP2's set_requires_gradient_sync(False)); the last one syncs the sum.
        # Both forward and backward run inside, as DDP reads the flag in forward too.
        return self.fabric.no_backward_sync(model, enabled=not last)

    def backward(self, loss):
        # Scales the loss first where fp16 needs a gradient scaler (the precision plugin's). DeepSpeed's
        # engine would also divide it by N: the suite's weights already make a step's micro-batches add up.
        self.fabric.backward(loss, **({"scale_wrt_gas": False} if self.engine is not None else {}))

    def step(self, model, optimizer):
        optimizer.step()  # through the precision plugin: the fp16 scaler unscales, checks and steps
        if self.engine is None:  # DeepSpeed's engine zeroes the gradients in its step
            optimizer.zero_grad(set_to_none=True)

    def reduce_mean(self, tensor):
        # Fabric reduces in place (and averages by SUM then division on gloo, which has no AVG).
        return self.fabric.all_reduce(tensor.clone(), reduce_op="mean")

    def gather(self, tensor):
        # all_gather stacks the processes' tensors in a new first dimension: (processes, n, ...).
        return self.fabric.all_gather(tensor).reshape(-1, *tensor.shape[1:])


def main():
    parser = options.build_parser(__file__, __doc__)
    options.add_distributed_args(parser)
    fabric_setup.add_fabric_args(parser)
    args = options.parse(parser)
    common.set_seed(args.seed)

    # [launch] What the launcher asked for, checked before anything starts: a precision or a strategy this
    #    device cannot run is refused in one line.
    device, precision = fabric_setup.resolve_launch(args)
    launcher = launch.fabric_launcher()

    # [ranks] Fabric reads the ranks from the launcher; how many processes run on each machine comes
    #    from fabric run, or from the script under torchrun (layout). --fabric-strategy picks how
    #    Fabric wraps the model: DDP, FSDP2 or DeepSpeed.
    with fabric_setup.fabric_errors():
        fabric = Fabric(accelerator=device.type, strategy=fabric_setup.fabric_strategy(args),
                        precision=fabric_setup.FABRIC_PRECISION[precision], **fabric_setup.layout(launcher))
    # [group] Join the processes (the group: gloo on CPU, NCCL on GPUs). Under fabric run Fabric()
    #    has joined them already and launch() is refused; from plain python with Fabric(devices=N)
    #    launch() would start the other N - 1 processes itself.
    if launcher != "fabric run":
        fabric.launch()
    # [leave] cli.run leaves the group on every exit path, failures included, so no process is left waiting.
    #    Fabric destroys only an NCCL group itself, at the interpreter's exit.
    strategy = ThroughFabric(fabric, args.fabric_strategy, launcher, precision)
    fabric_setup.announce(fabric)

    data = common.load_data_and_model(args, strategy)
    model = data.model
    if args.compile:  # in place, then wrapped; dynamic shapes without DDP's graph split, which torch 2.11 breaks
        model.compile(**models.compile_options(args, strategy))

    # [wrap] Fabric moves the model to this process's device and wraps it: in DDP (which broadcasts
    #    rank 0's weights, then averages the gradients during backward), or sharded by FSDP2, or
    #    in DeepSpeed's engine; its forward runs in the precision's autocast. The optimizer comes
    #    after the wrapping, so that under FSDP2 it holds the shards; DeepSpeed builds its engine
    #    from both at once.
    if args.fabric_strategy == "deepspeed":
        model, optimizer = fabric.setup(model, models.make_optimizer(model, data.lr, args.weight_decay))
        strategy.engine = fabric.strategy.model
    else:
        model = fabric.setup_module(model)
        optimizer = fabric.setup_optimizers(models.make_optimizer(model, data.lr, args.weight_decay))

    # [data] Each process reads a different 1/world_size of every global batch, by the suite's own
    #    samplers, as in the DDP script. Left to itself (use_distributed_sampler=True) Fabric
    #    would give a plain loader torch's DistributedSampler, which evens out an uneven epoch by
    #    repeating samples (trained twice, dev samples counted twice). The Trainer moves each
    #    batch to the device itself, after counting its tokens on the CPU: counted on a GPU
    #    (move_to_device=True), they would make the CPU wait for it at every micro-batch.
    loaders = common.make_loaders(data, args, fabric.world_size, fabric.global_rank)
    loaders = common.Loaders(*fabric.setup_dataloaders(*loaders, use_distributed_sampler=False,
                                                       move_to_device=False))

    common.Trainer(args, strategy, model, optimizer, data, loaders, instruments.callbacks_for(args)).fit()


if __name__ == "__main__":
    cli.run(main)
