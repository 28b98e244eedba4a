"""The helpers of multi-gpu-fabric-cls.py that are not the lesson: --fabric-strategy and --precision
reconciled with what fabric run passes in LT_* variables, Fabric's strategy objects (FSDP2's sharding,
DeepSpeed's config), the process layout under torchrun, Fabric's errors in one line, and the parts of
the suite's Strategy that save the model and checkpoints through Fabric."""
import contextlib
import importlib.util
import os
import warnings
from datetime import timedelta

import lightning_fabric
from lightning_fabric.strategies import DDPStrategy, DeepSpeedStrategy, ModelParallelStrategy
from lightning_fabric.utilities.exceptions import MisconfigurationException
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict
from torch.distributed.fsdp import fully_shard

import common
from support import checkpoints, cli, launch, machine, options

from . import deepspeed_setup

# The suite's --precision and Fabric's names for it: "32-true" is Fabric's default, the mixed ones autocast.
FABRIC_PRECISION = {"fp32": "32-true", "bf16": "bf16-mixed", "fp16": "16-mixed"}
SUITE_PRECISION = {"32-true": "fp32", "32": "fp32", "bf16-mixed": "bf16", "bf16": "bf16", "16-mixed": "fp16",
                   "16": "fp16"}
FABRIC_STRATEGIES = ["ddp", "fsdp2", "deepspeed"]

# Fabric 2.6's all_gather calls a torch.distributed.nn function that torch 2.13 deprecates: a warning per rank.
warnings.filterwarnings("ignore", category=FutureWarning, message=r"torch\.distributed\.nn\.functional\.all_gather")


def add_fabric_args(parser):
    parser.add_argument("--fabric-strategy", choices=FABRIC_STRATEGIES, default="ddp",
                        help="ddp: a model copy per process; fsdp2: weights, gradients and optimizer state sharded "
                             "(Fabric's ModelParallelStrategy); deepspeed: ZeRO stage 2 (CUDA GPUs only)")
    options.add_precision_arg(parser, default=None, default_help="fabric run's --precision, else fp32")


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
                                    launch.local_rank())

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
        return ModelParallelStrategy(shard, data_parallel_size=launch.world_size(),
                                     tensor_parallel_size=1, timeout=timeout)
    os.environ["DS_ACCELERATOR"] = "cuda"  # DeepSpeed picks its accelerator when first imported
    if importlib.util.find_spec("deepspeed") is None:  # Fabric would import it: say what is missing in one line
        raise cli.UserError("--fabric-strategy deepspeed needs the deepspeed package")
    # ZeRO stage 2 with the suite's reduce bucket (deepspeed_setup says why), the batch sizes the
    # suite's loaders give, and no gradient clipping (no other script clips). Fabric adds the
    # precision section.
    world_size = launch.world_size()
    config = {"zero_optimization": {"stage": 2, "reduce_bucket_size": deepspeed_setup.REDUCE_BUCKET_ELEMENTS},
              "gradient_clipping": 0.0,
              "train_micro_batch_size_per_gpu": args.batch_size, "gradient_accumulation_steps": args.grad_accum,
              "train_batch_size": common.global_batch_size(args.batch_size, world_size, args.grad_accum)}
    return DeepSpeedStrategy(config=config, timeout=timeout)


def layout(launcher):
    """Fabric() arguments for the processes per machine. fabric run tells Fabric itself (--devices,
    --num-nodes); under torchrun the script does, from torchrun's variables: Fabric's default (one
    CPU, or every visible GPU) must match WORLD_SIZE or it stops."""
    if launcher == "fabric run":
        return {}
    if launcher == "torchrun":
        per_machine = int(os.environ["LOCAL_WORLD_SIZE"])
        return {"devices": per_machine, "num_nodes": int(os.environ["WORLD_SIZE"]) // per_machine}
    return {"devices": 1}


@contextlib.contextmanager
def fabric_errors():
    """A configuration Fabric() refuses becomes one line instead of a traceback."""
    try:
        yield
    except (ValueError, MisconfigurationException) as error:
        raise cli.UserError(f"Fabric: {str(error).strip().splitlines()[0]}") from None


def announce(fabric):
    """Rank 0's line: how Fabric runs (its strategy, processes, device and precision)."""
    if fabric.is_global_zero:
        print(f"fabric: {type(fabric.strategy).__name__}, {fabric.world_size} process(es), "
              f"{fabric.device.type}, precision {fabric.strategy.precision.precision}")


class FabricSupport(common.Strategy):
    """What the suite's Strategy needs from Fabric beside the training step: rank and device, objects
    shared between processes, the whole model and checkpoints saved through Fabric, the precision
    plugin's state, versions and result fields. multi-gpu-fabric-cls.py adds the step itself."""

    def __init__(self, fabric, kind, launcher, precision):
        # Devices per machine (torchrun's LOCAL_WORLD_SIZE), which share its cores.
        super().__init__(fabric.device, fabric.global_rank, fabric.world_size, precision,
                         getattr(fabric.strategy, "num_processes", 1))
        self.fabric, self.kind, self.launcher = fabric, kind, launcher
        self.engine = None  # DeepSpeed's, once fabric.setup has built it

    @property
    def is_main(self):
        return self.fabric.is_global_zero

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
        return checkpoints.read_training_state(path)

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

    def checkpoint_layout(self):
        return {"fabric_strategy": self.kind}  # fabric.save's files: one (DDP), shards (FSDP2), DeepSpeed's

    def result_extras(self):
        return {**self.checkpoint_layout(), "fabric_precision": self.fabric.strategy.precision.precision}
