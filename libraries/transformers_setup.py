"""The helpers of multi-gpu-transformers-cls.py that are not the lesson: transformers.Trainer's
defaults set back to the suite's (its learning-rate decay, clipping, fused AdamW, sampler and loaders,
loss and loss averaging), the DeepSpeed config and the gloo group of CPU processes, the suite's
printed lines and measurements taken from the Trainer's callbacks, and what the Trainer cannot do,
refused in one line."""
import copy
import os
from datetime import timedelta

import torch
import torch.nn.functional as F
from accelerate import PartialState
from transformers import ProgressCallback, Trainer, TrainerCallback

import common
from instruments import measure
from support import cli, files, machine, models, options

from . import deepspeed_setup

SCRIPT = "multi-gpu-transformers-cls.py"


def add_trainer_args(parser):
    options.add_distributed_args(parser, local_rank=True)  # the legacy and deepspeed launchers pass --local_rank
    options.add_precision_arg(parser)
    parser.add_argument("--deepspeed", metavar="JSON",
                        help="train with DeepSpeed through TrainingArguments(deepspeed=...), e.g. "
                             "configs/deepspeed/zero2.json (batch sizes, clipping and precision come from the "
                             "command line)")
    parser.add_argument("--fsdp", action="store_true",
                        help="train with FSDP2 through TrainingArguments(fsdp=True) (GPUs only)")


def refuse_what_the_trainer_cannot_do(args):
    """The Trainer's checkpoints (checkpoint-N folders, resumed by skipping batches) lack the suite's
    meaning checks, atomic folder and sampler position; the phases of --profile wrap common.Trainer's
    loop, which does not run here."""
    if args.resume or args.save_steps or args.save_on_signal:
        raise cli.UserError(f"--resume, --save-steps and --save-on-signal are not available in {SCRIPT}: "
                            "the Trainer's own checkpoints lack the suite's meaning checks and sampler position")
    if args.profile:
        raise cli.UserError(f"--profile is not available in {SCRIPT}: its phases wrap common.Trainer's loop, "
                            "which transformers.Trainer replaces here")
    if args.deepspeed and args.fsdp:
        raise cli.UserError("--deepspeed and --fsdp exclude each other: pick one")


def refuse_what_this_machine_cannot_do(args, device, launched, deepspeed_config):
    machine.check_precision(args.precision, device)
    if device.type == "cuda" and not launched and torch.cuda.device_count() > 1:
        raise cli.UserError(f"python {SCRIPT} on a machine with {torch.cuda.device_count()} GPUs: the Trainer "
                            "would run DataParallel over all of them; use torchrun --nproc_per_node N, or "
                            "CUDA_VISIBLE_DEVICES=0 for one GPU")
    if args.fsdp and device.type == "cpu":
        raise cli.UserError("--fsdp needs GPUs: with CPU processes Accelerate drops the Trainer's FSDP plugin and "
                            "trains plain DDP instead; multi-gpu-fsdp-cls.py runs FSDP2 on CPUs")
    if deepspeed_config is not None and not launched:
        raise cli.UserError(f"--deepspeed runs under a launcher: deepspeed --num_gpus N {SCRIPT} or torchrun")
    if deepspeed_config is not None and device.type == "cpu" and torch.cuda.is_available():
        raise cli.UserError("--deepspeed with --device cpu on a GPU machine: Accelerate would still put each "
                            "process on a GPU; hide the GPUs instead: CUDA_VISIBLE_DEVICES=")


def read_deepspeed_config(path):
    """The DeepSpeed config file with what the suite decides left to the Trainer: "auto" makes
    TrainingArguments fill batch sizes, clipping and precision from the command line."""
    config = files.read_json_object(path, "DeepSpeed config")
    deepspeed_setup.refuse_optimizer_sections(config, path)
    for key in ("train_micro_batch_size_per_gpu", "gradient_accumulation_steps", "train_batch_size",
                "gradient_clipping"):
        if config.get(key, "auto") != "auto":
            raise cli.UserError(f"{path} sets {key}: leave it out (the command line sets it)")
        config[key] = "auto"
    for precision in ("fp16", "bf16"):
        config[precision] = {**config.get(precision, {}), "enabled": "auto"}
    zero = config.setdefault("zero_optimization", {})
    if zero.get("stage", 0) == 3:  # so that Accelerate gathers the whole weights for saving
        zero["stage3_gather_16bit_weights_on_model_save"] = True
    return config


def name_deepspeed_accelerator(device):
    """Accelerate imports DeepSpeed when it is installed (unwrap_model), and DeepSpeed picks its
    accelerator once, on import: name it (--device cpu on a GPU machine, and no detection warning
    on a CPU one)."""
    os.environ["DS_ACCELERATOR"] = device.type


def join_group_on_cpu(args, deepspeed):
    """Join the gloo group of CPU processes before TrainingArguments would, which the Trainer then
    uses (accelerator_config use_configured_state). TrainingArguments passes Accelerate no timeout
    for CPU processes (training_args.py, _setup_devices), so --dist-timeout would not apply; and for
    DeepSpeed it names no backend, for which Accelerate finds none without GPUs
    (accelerate/state.py, PartialState._prepare_backend): each process would take itself for the
    only one."""
    timeout = timedelta(seconds=args.dist_timeout)
    if not deepspeed:
        PartialState(cpu=True, backend="gloo", timeout=timeout)
        return
    os.environ["ACCELERATE_USE_DEEPSPEED"] = "true"  # how TrainingArguments asks Accelerate for DeepSpeed
    PartialState(backend="gloo", timeout=timeout)
    del os.environ["ACCELERATE_USE_DEEPSPEED"]


def suite_defaults(device, launched, own_group, deepspeed_config):
    """The TrainingArguments that set the Trainer's defaults back to the suite's, and those that
    follow from how the processes were started."""
    return dict(
        lr_scheduler_type="constant",                 # not its linear decay to 0: the suite's lr is constant
        max_grad_norm=0.0,                            # not its clipping at 1.0: no script of the suite clips
        logging_strategy="steps",
        disable_tqdm=False,                           # its progress bar (our lines replace its log dictionaries)
        eval_strategy="no",                           # --eval-steps: SuiteLines, never at the last step
        save_strategy="no", report_to="none",         # no checkpoint-N folders, no experiment trackers
        use_cache=True,                               # it writes this into the model's config: keep BERT's
        use_cpu=device.type == "cpu" and deepspeed_config is None,
        ddp_backend="nccl" if launched and device.type == "cuda" and deepspeed_config is None else None,
        ddp_find_unused_parameters=False,             # its default for a transformers model is True: a graph
                                                      # search after every forward, which BERT does not need
        average_tokens_across_devices=False,          # True all-gathers a label count every step, for a loss
                                                      # normalisation our compute_loss does not use
        accelerator_config={"use_configured_state": True} if own_group else None,  # join_group_on_cpu's group
    )


class TransformersStrategy(common.TorchDistributed):
    """The suite's view of this run: rank, device and collectives for loading data and the result file."""

    name = "hf-trainer"

    def __init__(self, device, rank, world_size, precision, local_world_size, launcher, deepspeed_config):
        super().__init__(device, rank, world_size, precision, local_world_size)
        self.launcher, self.deepspeed_config = launcher, deepspeed_config
        self.engine = None  # the DeepSpeed engine, for measure.py's model-state count

    def reduce_mean(self, tensor):
        return super().reduce_mean(tensor) if self.world_size > 1 else tensor

    def gather(self, tensor):
        return super().gather(tensor) if self.world_size > 1 else tensor

    def broadcast_object(self, value):
        return super().broadcast_object(value) if self.world_size > 1 else value

    def gather_objects(self, value):
        return super().gather_objects(value) if self.world_size > 1 else [value]

    def versions(self):
        import accelerate
        versions = {"accelerate": accelerate.__version__}
        if self.deepspeed_config:
            import deepspeed
            versions["deepspeed"] = deepspeed.__version__
        return versions

    def result_extras(self):
        if not self.deepspeed_config:
            return {}
        return {"zero_stage": self.deepspeed_config["zero_optimization"].get("stage", 0),
                "deepspeed_config": self.deepspeed_config}


def suite_strategy(args, training_args, device, launched, rank, world_size, local_world_size):
    """The suite's Strategy, once TrainingArguments has joined the processes: which launcher started
    them, and DeepSpeed's config with its "auto" values filled in."""
    if training_args.world_size != world_size:
        raise cli.UserError(f"the launcher started {world_size} process(es) but the Trainer sees "
                            f"{training_args.world_size}")
    launcher = "torchrun" if launched else "python"
    if args.local_rank is not None:
        launcher = "deepspeed" if args.deepspeed else "torch.distributed.launch"
    deepspeed_config = training_args.hf_deepspeed_config.config if args.deepspeed else None
    return TransformersStrategy(device, rank, world_size, args.precision, local_world_size, launcher,
                               deepspeed_config)


class SuiteTrainer(Trainer):
    """transformers.Trainer with the suite's data, optimizer and loss in place of its own defaults, and
    the suite's printed lines and measurements as callbacks. `run` is the common.Run that reports it,
    which holds the loaders and reports."""

    # training_step divides the loss by the number of micro-batches unless told it is already
    # scaled for accumulation (trainer.py, training_step). The suite's weights are: each sample
    # weighs 1 / (samples in its optimizer step), so the micro-batches' losses add up to the step's mean.
    loss_is_scaled_for_ga = True

    def __init__(self, run, **kwargs):
        self.run, self.torch_optimizer = run, None
        super().__init__(**kwargs)
        self.remove_callback(ProgressCallback)  # SuiteLines keeps its bar and prints the suite's lines
        self.add_callback(SuiteLines(run.args, run.train_loader))
        self.measurements = Measurements(self)
        self.add_callback(self.measurements)
        self.add_callback(SuiteEpochs(run.train_loader.batch_sampler))

    # The suite's loaders, not the Trainer's: its own (a random sampler, sharded by Accelerate's
    # prepare, which evens out the processes' last batches by training samples twice, and its
    # padding collator) would take other batches. GlobalBatchSampler deals each global batch out
    # exactly as DDP's script does, with repeats of weight 0.
    def get_train_dataloader(self):
        return self.run.train_loader

    def get_eval_dataloader(self, eval_dataset=None):
        return self.run.dev_loader

    def create_optimizer(self, model=None):
        # The suite's AdamW (models.make_optimizer: fused where every weight is a plain CUDA tensor;
        # no decay on biases and LayerNorm weights). Built here rather than passed as
        # Trainer(optimizers=...): FSDP refuses a ready optimizer, and DeepSpeed discards it and
        # calls this method (integrations/deepspeed.py, deepspeed_optim_sched).
        if self.optimizer is None:
            self.optimizer = self.torch_optimizer = models.make_optimizer(model or self.model, self.run.lr,
                                                                          self.run.args.weight_decay)
        return self.optimizer

    def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
        # The suite's loss-weighting rule, exactly as common.Trainer.forward: the model gets only
        # its inputs (the collate's `index` and `weight` are ours, and without `labels` it computes
        # no loss of its own, which would average this process's batch alone); each sample weighs
        # 1 / (samples in the global batch), and x processes turns DDP's (or DeepSpeed's) gradient
        # average into the sum over processes: the single-device mean. num_items_in_batch, the
        # Trainer's token count for its own averaging, is not needed. (Under DeepSpeed in bf16/fp16
        # the Trainer casts every float input to that type, the weights too (trainer.py,
        # _prepare_input): 1/33 moves by up to 0.2%, the same factor for the whole step, which
        # Adam's update does not see. In fp32 they stay exact.)
        logits = common.model_logits(model, inputs)
        loss = common.weighted_loss(logits, inputs, self.args.world_size)
        if return_outputs:
            # Evaluation gathers these across processes; index and weight let compute_metrics
            # count each dev sample once.
            return loss, {"logits": logits, "index": inputs["index"], "weight": inputs["weight"]}
        return loss

    def training_step(self, model, inputs, num_items_in_batch=None):
        self.measurements.hooked.notify("on_batch_loaded", inputs)  # beside the lesson: tokens per sample
        loss = super().training_step(model, inputs, num_items_in_batch)
        self.measurements.add_loss(loss)  # the micro-batch's part of the step's loss, for the curves
        return loss


def dev_metrics(run, prediction):
    """compute_metrics: the suite's dev metrics (common.dev_metrics) over every dev sample once, scored by
    rank 0 and shared, as common.Trainer.evaluate does.

    `prediction.predictions` holds every process's logits, dataset indices and weights, gathered by
    the Trainer batch by batch. Its gather_for_metrics drops the repeats only of loaders Accelerate
    prepared; ours are the suite's, so the repeats of weight 0 that even out the processes' last
    batches are dropped here, as common.Trainer.evaluate does."""
    logits, indices, weights = prediction.predictions
    losses = F.cross_entropy(torch.from_numpy(logits).float(), torch.from_numpy(prediction.label_ids),
                             reduction="none").numpy()
    indices, logits, labels, losses = common.each_sample_once(indices, weights, logits, prediction.label_ids, losses)
    common.check_every_dev_sample(indices, len(run.dev_loader.dataset))
    metrics = common.dev_metrics(logits.argmax(axis=-1), labels, losses) if run.strategy.is_main else None
    metrics = run.strategy.broadcast_object(metrics)
    metrics["dev_loss"] = metrics.pop("loss")  # the Trainer writes its own eval_loss over this one
    return metrics


class SuiteEpochs(TrainerCallback):
    """The Trainer calls set_epoch(epoch), counting from 0, on a loader that has the method; the
    suite's loader has none, and its sampler counts from 1 (each epoch shuffles with seed + epoch,
    as in every other script): it is told here, as each epoch begins."""

    def __init__(self, sampler):
        self.sampler, self.epoch = sampler, 0

    def on_epoch_begin(self, args, state, control, **kwargs):
        self.epoch += 1
        self.sampler.set_epoch(self.epoch)


class SuiteLines(ProgressCallback):
    """The Trainer's progress bar, printing the suite's training lines instead of its log dictionaries."""

    def __init__(self, args, train_loader):
        super().__init__()
        self.epochs, self.eval_steps = args.epochs, args.eval_steps
        self.steps_per_epoch = len(train_loader.batch_sampler.micro_batches_per_step())

    def on_step_end(self, args, state, control, **kwargs):
        super().on_step_end(args, state, control, **kwargs)
        if state.global_step == state.max_steps:
            control.should_log = True  # the loss since the last line, as every script prints at the end
        elif self.eval_steps and state.global_step % self.eval_steps == 0:
            control.should_evaluate = True  # --eval-steps; the final evaluation follows training
        return control

    def on_log(self, args, state, control, logs=None, **kwargs):
        if state.is_world_process_zero and self.training_bar is not None and "loss" in logs:
            epoch = (state.global_step - 1) // self.steps_per_epoch + 1
            self.training_bar.write(f"【train】 epoch：{epoch}/{self.epochs} step：{state.global_step}/{state.max_steps} "
                                    f"loss：{logs['loss']:.6f}")

    def on_evaluate(self, args, state, control, metrics=None, **kwargs):
        if state.is_world_process_zero and self.training_bar is not None:
            self.training_bar.write(f"【dev】 step：{state.global_step} loss：{metrics['eval_dev_loss']:.6f} "
                                    f"accuracy：{metrics['eval_accuracy']:.4f}")

    def on_prediction_step(self, args, state, control, **kwargs):
        pass  # no evaluation bar, as in the other scripts


class Measurements(TrainerCallback):
    """The suite's instruments (the Run's callbacks, instruments.callbacks_for) called at the Trainer's
    events, as common.Trainer calls them from its loop; beside them, what only this Trainer needs: its
    logged loss, its evaluations' seconds (not training time), and DeepSpeed's gradient partitions for
    the model-state count."""

    def __init__(self, trainer):
        self.trainer, self.run = trainer, trainer.run
        self.last_loss, self.zero_partitions = float("nan"), []
        self.step_loss = 0.0  # this step's loss so far, kept on the device (the curves')
        self.model_state = next(c for c in self.run.callbacks if isinstance(c, measure.ModelStateCount))
        self.progress = next(c for c in self.run.callbacks if isinstance(c, measure.Progress))

    def add_loss(self, loss):
        self.step_loss = self.step_loss + loss  # a tensor from the step's first micro-batch on

    def on_train_begin(self, args, state, control, **kwargs):
        # After the Trainer has wrapped the model and built the optimizer: what follows is the loop.
        trainer = self.trainer
        if trainer.is_deepspeed_enabled:
            self.run.strategy.engine = trainer.model_wrapped
            # Accelerate steps the DeepSpeed engine inside backward, which frees the gradient partitions
            # before any Trainer callback runs. ZeRO hands them to the torch optimizer, one parameter
            # group at a time, as fp32 gradients: seen there, and counted with the rest after the step.
            trainer.torch_optimizer.register_step_pre_hook(self.collect_zero_partitions)
        # The instruments see the model as the Trainer wrapped it (DDP's, DeepSpeed's engine) and the torch
        # optimizer, in a copy of the Run (its callbacks are the Run's); the report, at the end, sees the Run.
        self.hooked = copy.copy(self.run)
        self.hooked.model, self.hooked.optimizer = trainer.model_wrapped, trainer.torch_optimizer
        self.hooked.notify("on_train_begin", 0)

    def collect_zero_partitions(self, optimizer, args, kwargs):
        if self.model_state.bytes is None:  # a step fp16 skips (its gradients overflowed) never gets here
            self.zero_partitions += [p.grad for group in optimizer.param_groups for p in group["params"]]

    def on_pre_optimizer_step(self, args, state, control, **kwargs):
        if not self.trainer.is_deepspeed_enabled:  # counted before the second step, as common.Trainer does
            self.hooked.notify("on_phase_begin", "optimizer step")
        elif self.zero_partitions and self.model_state.bytes is None:  # after the engine's first update
            self.model_state.count(gradients=self.zero_partitions)
            self.zero_partitions = []

    def on_optimizer_step(self, args, state, control, **kwargs):
        if not self.trainer.is_deepspeed_enabled:
            self.hooked.notify("on_phase_end", "optimizer step")

    def on_step_end(self, args, state, control, **kwargs):
        self.hooked.notify("on_step_end", state.global_step, self.step_loss)
        self.step_loss = 0.0

    def on_log(self, args, state, control, logs=None, **kwargs):
        if "loss" in logs:
            self.last_loss = logs["loss"]

    def on_evaluate(self, args, state, control, **kwargs):
        if self.progress.seconds is None and "eval_runtime" in kwargs.get("metrics", {}):
            self.progress.add_pause(kwargs["metrics"]["eval_runtime"])  # --eval-steps: not training time

    def on_epoch_end(self, args, state, control, **kwargs):
        if state.global_step == state.max_steps:  # before the Trainer's last log and clean-up
            self.hooked.notify("on_train_end")
