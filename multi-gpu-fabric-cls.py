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
import importlib.util
import os
import warnings
from datetime import timedelta

import lightning_fabric
import torch
import torch.distributed as dist
from lightning_fabric import Fabric
from lightning_fabric.strategies import DDPStrategy, DeepSpeedStrategy, ModelParallelStrategy
from lightning_fabric.utilities.exceptions import MisconfigurationException
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict
from torch.distributed.fsdp import fully_shard

import checkpoints
import cli
import common
import machine
import models

# The suite's --precision and Fabric's names for it: "32-true" is Fabric's default, the mixed ones autocast.
FABRIC_PRECISION = {"fp32": "32-true", "bf16": "bf16-mixed", "fp16": "16-mixed"}
SUITE_PRECISION = {"32-true": "fp32", "32": "fp32", "bf16-mixed": "bf16", "bf16": "bf16", "16-mixed": "fp16",
                   "16": "fp16"}
FABRIC_STRATEGIES = ["ddp", "fsdp2", "deepspeed"]

# Fabric 2.6's all_gather calls a torch.distributed.nn function that torch 2.13 deprecates: a warning per rank.
warnings.filterwarnings("ignore", category=FutureWarning, message=r"torch\.distributed\.nn\.functional\.all_gather")


class FabricStrategy(common.Strategy):
    name = "fabric"

    def __init__(self, fabric, kind, launcher, precision):
        # Devices per machine (torchrun's LOCAL_WORLD_SIZE), which share its cores.
        super().__init__(fabric.device, fabric.global_rank, fabric.world_size, precision,
                         getattr(fabric.strategy, "num_processes", 1))
        self.fabric, self.kind, self.launcher = fabric, kind, launcher
        self.engine = None  # DeepSpeed's, once fabric.setup has built it

    @property
    def is_main(self):
        return self.fabric.is_global_zero

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

    def broadcast_object(self, value):
        return self.fabric.broadcast(value, src=0)

    def gather_objects(self, value):
        # Fabric gathers tensors only: each process broadcasts its object in turn (checkpoints only).
        return [self.fabric.broadcast(value, src=rank) for rank in range(self.world_size)]

    def unwrap(self, model):
        return model.module  # Fabric's wrapper keeps the model as it was given: no "module." prefixes

    def save_model(self, model, tokenizer, path):
        inner, state = self.unwrap(model), None
        if self.kind == "fsdp2":
            # Every weight whole: each process sends its shards, rank 0 alone receives them, in CPU
            # memory (collective: all must call it).
            state = get_model_state_dict(inner, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
        elif self.kind == "deepspeed":
            # ZeRO partitions the fp32 master weights over the processes; each one is assembled by an
            # all-reduce (collective, in the same order everywhere). Buffers come from the module.
            from deepspeed.utils import safe_get_full_fp32_param
            state = inner.state_dict()
            for name, param in inner.named_parameters():
                full = safe_get_full_fp32_param(param)
                state[name] = (param if full is None else full).detach().float().cpu()
        if self.is_main:
            checkpoints.save_model(inner, tokenizer, path, state_dict=state)

    def save_state(self, model, optimizer, path, state):
        # --save-steps: fabric.save writes what the strategy needs (DDP: one file from rank 0; FSDP2:
        # every process its shards; DeepSpeed: its own checkpoint), and ends with a barrier. Into a
        # staging folder that rank 0 swaps in once all of it is there.
        with checkpoints.staged_checkpoint(path, state, self.is_main, self.fabric.barrier) as staging:
            self.fabric.save(staging / "fabric", {"model": model, "optimizer": optimizer})

    def load_state(self, model, optimizer, path):
        self.fabric.load(path / "fabric", {"model": model, "optimizer": optimizer}, weights_only=True)
        return torch.load(path / checkpoints.CHECKPOINT_FILE, map_location="cpu", weights_only=True)

    def extra_state(self):
        # fp16's gradient scaler lives in Fabric's precision plugin (GPUs only); the others have none.
        return {"precision": self.fabric.strategy.precision.state_dict()}

    def load_extra_state(self, state):
        self.fabric.strategy.precision.load_state_dict(state["precision"])

    def versions(self):
        versions = {"lightning_fabric": lightning_fabric.__version__}
        if self.kind == "deepspeed":
            import deepspeed
            versions["deepspeed"] = deepspeed.__version__
        return versions

    def result_extras(self):
        return {"fabric_strategy": self.kind, "fabric_precision": self.fabric.strategy.precision.precision}


def add_fabric_args(parser):
    parser.add_argument("--fabric-strategy", choices=FABRIC_STRATEGIES, default="ddp",
                        help="ddp: a model copy per process; fsdp2: weights, gradients and optimizer state sharded "
                             "(Fabric's ModelParallelStrategy); deepspeed: ZeRO stage 2 (CUDA GPUs only)")
    cli.add_precision_arg(parser, default=None, default_help="fabric run's --precision, else fp32")


def launcher_name():
    """fabric run marks its processes with LT_CLI_USED=1; torchrun sets TORCHELASTIC_RUN_ID."""
    if os.environ.get("LT_CLI_USED") == "1":
        return "fabric run"
    return "torchrun" if dist.is_torchelastic_launched() else "python"


def resolve_launch(args):
    """This process's device and the precision, from the script's options and fabric run's, checked
    before Fabric starts: refused in one line, not warned about or silently changed.

    fabric run hands its --accelerator and --precision to Fabric() in LT_* variables that override
    Fabric's arguments; the script reads them here and passes Fabric the one answer instead."""
    if "LT_STRATEGY" in os.environ:
        raise cli.UserError(f"fabric run --strategy {os.environ['LT_STRATEGY']}: leave it out and give the script "
                            f"--fabric-strategy {'|'.join(FABRIC_STRATEGIES)}")
    accelerator = os.environ.pop("LT_ACCELERATOR", "auto")
    accelerator = {"gpu": "cuda"}.get(accelerator, accelerator)
    if accelerator not in ("auto", "cpu", "cuda"):
        raise cli.UserError(f"fabric run --accelerator {accelerator}: this script trains on cpu or cuda")
    if "auto" not in (accelerator, args.device) and accelerator != args.device:
        raise cli.UserError(f"--device {args.device} and fabric run --accelerator {accelerator} disagree: give one")
    device = machine.resolve_device(args.device if accelerator == "auto" else accelerator,
                                    int(os.environ.get("LOCAL_RANK", 0)))

    launched = os.environ.pop("LT_PRECISION", None)
    if launched is not None and launched not in SUITE_PRECISION:
        raise cli.UserError(f"fabric run --precision {launched}: this script trains in 32-true, bf16-mixed or "
                            "16-mixed (its --precision fp32, bf16 or fp16)")
    if launched is not None and args.precision not in (None, SUITE_PRECISION[launched]):
        raise cli.UserError(f"--precision {args.precision} and fabric run --precision {launched} disagree: give one")
    precision = args.precision or SUITE_PRECISION.get(launched, "fp32")
    # On CPU Fabric turns 16-mixed into bf16-mixed with a warning: refuse rather than mislabel.
    machine.check_precision(precision, device)
    if args.fabric_strategy == "fsdp2" and precision == "fp16":
        raise cli.UserError("--fabric-strategy fsdp2 has no fp16: Fabric's ModelParallelStrategy offers "
                            "bf16-mixed and 32-true (use --precision bf16 or fp32)")
    if args.fabric_strategy == "deepspeed" and device.type != "cuda":
        raise cli.UserError("--fabric-strategy deepspeed needs CUDA GPUs (Fabric's DeepSpeedStrategy refuses "
                            "the CPU); on CPU, multi-gpu-deepspeed-cls.py runs DeepSpeed over gloo")
    return device, precision


def fabric_strategy(args):
    """Fabric's strategy object for --fabric-strategy, with the suite's collective timeout."""
    timeout = timedelta(seconds=args.dist_timeout)
    if args.fabric_strategy == "ddp":
        return DDPStrategy(timeout=timeout)
    if args.fabric_strategy == "fsdp2":
        # FSDP2 (fully_shard) over all processes: a data-parallel mesh dimension as wide as the job,
        # tensor parallelism 1. Fabric's "fsdp" strategy is the older FSDP1, and GPU-only.
        def shard(model, mesh):
            for layer in model.bert.encoder.layer:  # each layer a unit: gathered just before its forward
                fully_shard(layer, mesh=mesh["data_parallel"])
            fully_shard(model, mesh=mesh["data_parallel"])  # the rest: embeddings, pooler, classifier
            return model
        return ModelParallelStrategy(shard, data_parallel_size=int(os.environ.get("WORLD_SIZE", 1)),
                                     tensor_parallel_size=1, timeout=timeout)
    os.environ["DS_ACCELERATOR"] = "cuda"  # DeepSpeed picks its accelerator when first imported
    if importlib.util.find_spec("deepspeed") is None:  # Fabric would import it: say what is missing in one line
        raise cli.UserError("--fabric-strategy deepspeed needs the deepspeed package")
    # ZeRO stage 2 with DDP's 25 MiB reduce bucket as in configs/deepspeed/ (DeepSpeed's own default
    # allocates 1.9 GB), the batch sizes the suite's loaders give, and no gradient clipping (no other
    # script clips). Fabric adds the precision section.
    world_size = int(os.environ.get("WORLD_SIZE", 1))
    config = {"zero_optimization": {"stage": 2, "reduce_bucket_size": 25 * 2**20 // 4},
              "gradient_clipping": 0.0,
              "train_micro_batch_size_per_gpu": args.batch_size, "gradient_accumulation_steps": args.grad_accum,
              "train_batch_size": args.batch_size * world_size * args.grad_accum}
    return DeepSpeedStrategy(config=config, timeout=timeout)


def main():
    parser = cli.build_parser(__file__, __doc__)
    cli.add_distributed_args(parser)
    add_fabric_args(parser)
    args = cli.check_args(parser.parse_args())
    common.set_seed(args.seed)

    # 1. What the launcher asked for, checked before anything starts: a precision or a strategy this
    #    device cannot run is refused in one line.
    device, precision = resolve_launch(args)
    launcher = launcher_name()

    # 2. Fabric reads the ranks from the launcher. fabric run tells it how many processes run on
    #    each machine (--devices, --num-nodes); under torchrun the script does, from torchrun's
    #    variables: Fabric's default (one CPU, or every visible GPU) must match WORLD_SIZE or it stops.
    if launcher == "fabric run":
        layout = {}
    elif launcher == "torchrun":
        per_machine = int(os.environ["LOCAL_WORLD_SIZE"])
        layout = {"devices": per_machine, "num_nodes": int(os.environ["WORLD_SIZE"]) // per_machine}
    else:
        layout = {"devices": 1}
    try:
        fabric = Fabric(accelerator=device.type, strategy=fabric_strategy(args),
                        precision=FABRIC_PRECISION[precision], **layout)
    except (ValueError, MisconfigurationException) as error:
        raise cli.UserError(f"Fabric: {str(error).strip().splitlines()[0]}") from None
    try:
        # 3. Join the processes (the group: gloo on CPU, NCCL on GPUs). Under fabric run Fabric()
        #    has joined them already and launch() is refused; from plain python with Fabric(devices=N)
        #    launch() would start the other N - 1 processes itself.
        if launcher != "fabric run":
            fabric.launch()
        strategy = FabricStrategy(fabric, args.fabric_strategy, launcher, precision)
        if strategy.is_main:
            print(f"fabric: {type(fabric.strategy).__name__}, {fabric.world_size} process(es), "
                  f"{fabric.device.type}, precision {fabric.strategy.precision.precision}")

        train_set, dev_set, tokenizer, model, model_name, lr = common.prepare_data(args, strategy)

        # 4. Fabric moves the model to this process's device and wraps it: in DDP (which broadcasts
        #    rank 0's weights, then averages the gradients during backward), or sharded by FSDP2, or
        #    in DeepSpeed's engine; its forward runs in the precision's autocast. The optimizer comes
        #    after the wrapping, so that under FSDP2 it holds the shards; DeepSpeed builds its engine
        #    from both at once.
        if args.fabric_strategy == "deepspeed":
            model, optimizer = fabric.setup(model, models.make_optimizer(model, lr, args.weight_decay))
            strategy.engine = fabric.strategy.model
        else:
            model = fabric.setup_module(model)
            optimizer = fabric.setup_optimizers(models.make_optimizer(model, lr, args.weight_decay))

        # 5. Each process reads a different 1/world_size of every global batch, by the suite's own
        #    samplers, as in the DDP script. Left to itself (use_distributed_sampler=True) Fabric
        #    would give a plain loader torch's DistributedSampler, which evens out an uneven epoch by
        #    repeating samples (trained twice, dev samples counted twice). The Trainer moves each
        #    batch to the device itself, after counting its tokens on the CPU: counted on a GPU
        #    (move_to_device=True), they would make the CPU wait for it at every micro-batch.
        train_loader, dev_loader = fabric.setup_dataloaders(
            common.make_loader(train_set, args, tokenizer, common.train_sampler(train_set, args, fabric.world_size,
                                                                                fabric.global_rank)),
            common.make_loader(dev_set, args, tokenizer, common.eval_sampler(dev_set, args, fabric.world_size,
                                                                             fabric.global_rank)),
            use_distributed_sampler=False, move_to_device=False)

        trainer = common.Trainer(args, strategy, model, optimizer, tokenizer, train_loader, dev_loader, model_name, lr)
        trainer.fit()
    finally:
        # 6. Leave the group on every exit path, failures included, so no process is left waiting.
        #    (Fabric destroys only an NCCL group itself, at the interpreter's exit.)
        if dist.is_initialized():
            dist.destroy_process_group()


if __name__ == "__main__":
    cli.run(main)
