"""Fine-tune Chinese BERT with Hugging Face's `transformers.Trainer`: DDP, with the library's training loop.

    python multi-gpu-transformers-cls.py                                        # one device
    torchrun --nproc_per_node 2 multi-gpu-transformers-cls.py                   # one process per GPU (or CPU share)
    torchrun --standalone --nproc_per_node 2 multi-gpu-transformers-cls.py      # a free port, not 29500

    # two machines, the same line on each (under Slurm: SCRIPT=multi-gpu-transformers-cls.py
    # sbatch slurm/torchrun.sbatch; see docs/several-machines.md):
    torchrun --nnodes 2 --nproc_per_node 2 --rdzv-backend c10d --rdzv-endpoint HEAD:29500 --rdzv-id JOB \\
        multi-gpu-transformers-cls.py

    # DeepSpeed ZeRO through TrainingArguments(deepspeed=...): any config of configs/deepspeed/
    deepspeed --num_gpus 2 multi-gpu-transformers-cls.py --deepspeed configs/deepspeed/zero2.json
    torchrun --nproc_per_node 2 multi-gpu-transformers-cls.py --deepspeed configs/deepspeed/zero2.json

    # FSDP2 through TrainingArguments(fsdp=True) (GPUs only, see below)
    torchrun --nproc_per_node 2 multi-gpu-transformers-cls.py --fsdp

The `Trainer` runs the loop that every other script of the suite takes from common.Trainer; the
numbered comments say what it does for you. The suite's options map to TrainingArguments:
--batch-size to per_device_train_batch_size, --grad-accum to gradient_accumulation_steps,
--precision to bf16 / fp16, --epochs, --seed, --log-steps, --dist-timeout to theirs.

Where the Trainer's defaults differ from the suite's they are set back, each where it is set: its
linear learning-rate decay, gradient clipping at 1.0, fused AdamW, random sampler and loaders, loss
and loss averaging. With that it is the DDP script run by a library: 3 processes x 11 end with the
weights of single-gpu-cls.py at 33 (fp32, no shuffling or dropout, tests/test_hf_trainer.py), and
with shuffling and dropout on, 2 processes end with the DDP script's weights, bit for bit.

DeepSpeed and FSDP come through TrainingArguments too. DeepSpeed runs on CPU processes as well
(after join_group_on_cpu), fp32 ending with the single-device weights. FSDP needs GPUs: on CPU
processes Accelerate (state.py) drops its plugin and would train plain DDP while the run says FSDP,
so --fsdp on a CPU is refused (multi-gpu-fsdp-cls.py runs FSDP2 on CPUs). Also refused, in one line:
  --resume, --save-steps: the Trainer's checkpoints (checkpoint-N folders, resumed by skipping
      batches) do not carry the suite's meaning checks, atomic folder and sampler position;
  --profile: the suite's phase ranges wrap common.Trainer's own methods, which do not run here;
  python on a machine with several GPUs: the Trainer would drive them all with DataParallel;
  --deepspeed --device cpu on a GPU machine: Accelerate would still put each process on a GPU.
"""
import argparse
import functools
import os
import time
from datetime import timedelta
from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist
import torch.nn.functional as F
from accelerate import PartialState
from sklearn.metrics import accuracy_score, classification_report, f1_score
from transformers import ProgressCallback, Trainer, TrainerCallback, TrainingArguments

import checkpoints
import cli
import common
import files
import machine
import measure
import models
import results

SCRIPT = Path(__file__).name


class SuiteTrainer(Trainer):
    """transformers.Trainer with the suite's data, optimizer and loss in place of its own defaults."""

    # training_step divides the loss by the number of micro-batches unless told it is already
    # scaled for accumulation (trainer.py, training_step). The suite's weights are: each sample
    # weighs 1 / (samples in its optimizer step), so the micro-batches' losses add up to the step's mean.
    loss_is_scaled_for_ga = True

    def __init__(self, *, train_loader, dev_loader, lr, weight_decay, **kwargs):
        self.train_loader, self.dev_loader = train_loader, dev_loader
        self.lr, self.weight_decay = lr, weight_decay
        self.torch_optimizer = self.measurements = None
        super().__init__(**kwargs)

    # The suite's loaders, not the Trainer's: its own (a random sampler, sharded by Accelerate's
    # prepare, which evens out the processes' last batches by training samples twice, and its
    # padding collator) would take other batches. GlobalBatchSampler deals each global batch out
    # exactly as DDP's script does, with repeats of weight 0.
    def get_train_dataloader(self):
        return self.train_loader

    def get_eval_dataloader(self, eval_dataset=None):
        return self.dev_loader

    def create_optimizer(self, model=None):
        # The suite's AdamW (torch's, not the fused one the Trainer defaults to on torch >= 2.8;
        # no decay on biases and LayerNorm weights). Built here rather than passed as
        # Trainer(optimizers=...): FSDP refuses a ready optimizer, and DeepSpeed discards it and
        # calls this method (integrations/deepspeed.py, deepspeed_optim_sched).
        if self.optimizer is None:
            self.optimizer = self.torch_optimizer = models.make_optimizer(model or self.model, self.lr,
                                                                          self.weight_decay)
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
        outputs = model(input_ids=inputs["input_ids"], attention_mask=inputs["attention_mask"])
        per_sample = F.cross_entropy(outputs.logits.float(), inputs["labels"], reduction="none")
        loss = (per_sample * inputs["weight"]).sum() * self.args.world_size
        if return_outputs:
            # Evaluation gathers these across processes; index and weight let compute_metrics
            # count each dev sample once.
            return loss, {"logits": outputs.logits, "index": inputs["index"], "weight": inputs["weight"]}
        return loss

    def training_step(self, model, inputs, num_items_in_batch=None):
        if self.measurements:
            self.measurements.count_tokens(inputs)  # beside the lesson: tokens per sample for result.json
        return super().training_step(model, inputs, num_items_in_batch)


def dev_metrics(prediction, dev_size):
    """compute_metrics: scikit-learn's metrics over every dev sample once.

    `prediction.predictions` holds every process's logits, dataset indices and weights, gathered by
    the Trainer batch by batch. Its gather_for_metrics drops the repeats only of loaders Accelerate
    prepared; ours are the suite's, so the repeats of weight 0 that even out the processes' last
    batches are dropped here, as common.Trainer.evaluate does."""
    logits, indices, weights = prediction.predictions
    losses = F.cross_entropy(torch.from_numpy(logits).float(), torch.from_numpy(prediction.label_ids),
                             reduction="none").numpy()
    indices, logits, labels, losses = common.each_sample_once(indices, weights, logits, prediction.label_ids, losses)
    if not np.array_equal(indices, np.arange(dev_size)):
        raise RuntimeError(f"evaluated {len(np.unique(indices))} distinct of {dev_size} dev samples in "
                           f"{len(indices)} predictions")
    predictions = logits.argmax(axis=-1)
    labels_range = range(len(common.LABELS))
    return {"samples": len(indices), "dev_loss": float(losses.mean()),
            "accuracy": float(accuracy_score(labels, predictions)),
            "macro_f1": float(f1_score(labels, predictions, average="macro", labels=labels_range, zero_division=0)),
            "report": classification_report(labels, predictions, labels=labels_range, target_names=common.LABELS,
                                            digits=4, zero_division=0)}


class TransformersTrainer(common.TorchDistributed):
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


def main():
    parser = cli.build_parser(__file__, __doc__)
    cli.add_distributed_args(parser)
    cli.add_precision_arg(parser)
    parser.add_argument("--deepspeed", metavar="JSON",
                        help="train with DeepSpeed through TrainingArguments(deepspeed=...), e.g. "
                             "configs/deepspeed/zero2.json (batch sizes, clipping and precision come from the "
                             "command line)")
    parser.add_argument("--fsdp", action="store_true",
                        help="train with FSDP2 through TrainingArguments(fsdp=True) (GPUs only)")
    # The legacy torch.distributed.launch and the deepspeed launcher pass --local_rank; LOCAL_RANK is read.
    parser.add_argument("--local-rank", "--local_rank", type=int, help=argparse.SUPPRESS)
    args = cli.check_args(parser.parse_args())
    refuse_what_the_trainer_cannot_do(args)

    # 1. One process alone (python), or one of several (torchrun, or srun's tasks): the Trainer reads
    #    the same RANK / WORLD_SIZE / LOCAL_RANK variables the DDP script reads.
    launched = "RANK" in os.environ or "WORLD_SIZE" in os.environ or cli.started_by_srun()
    rank, world_size, local_rank, local_world_size = (
        cli.launch_environment(f"torchrun --nproc_per_node N {SCRIPT}") if launched else (0, 1, 0, 1))
    device = machine.resolve_device(args.device, local_rank)
    deepspeed_config = read_deepspeed_config(args.deepspeed) if args.deepspeed else None
    refuse_what_this_machine_cannot_do(args, device, launched, deepspeed_config)
    # Accelerate imports DeepSpeed when it is installed (unwrap_model), and DeepSpeed picks its accelerator once, on
    # import: name it (--device cpu on a GPU machine, and no detection warning on a CPU one).
    os.environ["DS_ACCELERATOR"] = device.type
    own_group = launched and device.type == "cpu"
    try:
        # 2. CPU processes join their gloo group here, GPU ones in TrainingArguments (join_group_on_cpu says why).
        if own_group:
            join_group_on_cpu(args, deepspeed=deepspeed_config is not None)

        # 3. TrainingArguments is the Trainer's whole configuration; creating it joins the process
        #    group (NCCL between GPUs) and picks this process's device. The suite's options map to
        #    its arguments; the rest undo Trainer defaults that the suite does not have.
        training_args = TrainingArguments(
            output_dir=args.output_dir,
            per_device_train_batch_size=args.batch_size,  # --batch-size: per process and micro-batch
            per_device_eval_batch_size=args.batch_size,
            gradient_accumulation_steps=args.grad_accum,  # --grad-accum: no_sync on a step's first N - 1 micro-batches
            num_train_epochs=args.epochs,
            weight_decay=args.weight_decay,
            bf16=args.precision == "bf16",                # --precision: Accelerate's autocast around the model's
            fp16=args.precision == "fp16",                # forward (fp16: and its gradient scaler)
            seed=args.seed,                               # it seeds random, numpy and torch with it, as
                                                          # common.set_seed does: the same dropout masks as DDP's
            lr_scheduler_type="constant",                 # not its linear decay to 0: the suite's lr is constant
            max_grad_norm=0.0,                            # not its clipping at 1.0: no script of the suite clips
            logging_strategy="steps", logging_steps=args.log_steps,
            disable_tqdm=False,                           # its progress bar (our lines replace its log dictionaries)
            eval_strategy="no",                           # --eval-steps: SuiteLines, never at the last step
            save_strategy="no", report_to="none",         # no checkpoint-N folders, no experiment trackers
            use_cache=True,                               # it writes this into the model's config: keep BERT's
            use_cpu=device.type == "cpu" and deepspeed_config is None,
            ddp_backend="nccl" if launched and device.type == "cuda" and deepspeed_config is None else None,
            ddp_timeout=round(args.dist_timeout),         # --dist-timeout (GPUs; CPUs: join_group_on_cpu)
            ddp_find_unused_parameters=False,             # its default for a transformers model is True: a graph
                                                          # search after every forward, which BERT does not need
            average_tokens_across_devices=False,          # True all-gathers a label count every step, for a loss
                                                          # normalisation our compute_loss does not use
            deepspeed=deepspeed_config,
            fsdp=args.fsdp or None,                       # the older fsdp="full_shard" still works, with a warning
            fsdp_config={"version": 2, "reshard_after_forward": True} if args.fsdp else None,
            accelerator_config={"use_configured_state": True} if own_group else None,  # the group joined above
        )
        if training_args.world_size != world_size:
            raise cli.UserError(f"the launcher started {world_size} process(es) but the Trainer sees "
                                f"{training_args.world_size}")
        launcher = "torchrun" if launched else "python"
        if args.local_rank is not None:
            launcher = "deepspeed" if deepspeed_config is not None else "torch.distributed.launch"
        if deepspeed_config is not None:  # with its "auto" values filled in
            deepspeed_config = training_args.hf_deepspeed_config.config
        strategy = TransformersTrainer(device, rank, world_size, args.precision, local_world_size, launcher,
                                       deepspeed_config)

        train_set, dev_set, tokenizer, model, model_name, lr = common.prepare_data(args, strategy)
        training_args.learning_rate = lr  # for the Trainer's logs; the optimizer is ours (create_optimizer)

        # 4. The suite's loaders, sharded by rank as in the DDP script. The Trainer calls set_epoch
        #    on its loader before each epoch, counting from 0; the suite's sampler counts from 1
        #    (each epoch shuffles with seed + epoch, as in every other script).
        train_loader = common.make_loader(train_set, args, tokenizer,
                                          common.train_sampler(train_set, args, world_size, rank))
        train_loader.set_epoch = lambda epoch: train_loader.batch_sampler.set_epoch(epoch + 1)
        dev_loader = common.make_loader(dev_set, args, tokenizer, common.eval_sampler(dev_set, args, world_size, rank))

        # The suite's own Trainer, used only for what every script reports the same way: the thread
        # policy, result.json and the printed lines.
        suite = common.Trainer(args, strategy, model, None, tokenizer, train_loader, dev_loader, model_name, lr)
        results.announce(suite)
        training_args.max_steps = suite.total_steps() if args.max_steps else -1  # --max-steps (-1: the epochs decide)

        # 5. The Trainer does what the DDP script writes by hand or takes from common.Trainer: moves
        #    the model to the device and wraps it in DistributedDataParallel (or hands it to
        #    DeepSpeed or FSDP) through Accelerate, runs forward, backward and the optimizer step,
        #    skips the gradient all-reduce of a step's first N - 1 micro-batches, and averages the
        #    logged loss over the processes.
        trainer = SuiteTrainer(model=model, args=training_args, train_dataset=train_set, eval_dataset=dev_set,
                               compute_metrics=functools.partial(dev_metrics, dev_size=len(dev_set)),
                               train_loader=train_loader, dev_loader=dev_loader, lr=lr,
                               weight_decay=args.weight_decay)
        trainer.remove_callback(ProgressCallback)  # SuiteLines keeps its bar and prints the suite's lines
        trainer.add_callback(SuiteLines(args, train_loader))
        trainer.measurements = Measurements(trainer, strategy, train_loader)
        trainer.add_callback(trainer.measurements)
        trainer.train()
        progress = trainer.measurements.progress()

        # 6. Trainer.evaluate runs the dev loader, gathers the logits (and our index and weight) from
        #    every process batch by batch, and hands them to compute_metrics (dev_metrics).
        metrics = {key.removeprefix("eval_"): value for key, value in trainer.evaluate().items()}
        metrics["loss"] = metrics["dev_loss"]  # its own eval_loss averages batch means, repeats included

        # 7. The whole weights (gathered by every process from DeepSpeed ZeRO-3 or FSDP shards), written
        #    by rank 0 with checkpoints.save_model: safetensors, config and tokenizer, swapped in whole.
        #    Trainer.save_model would write in place, and add training_args.bin (a pickle).
        state_dict = trainer.accelerator.get_state_dict(trainer.model_wrapped)
        if strategy.is_main:
            checkpoints.save_model(trainer.accelerator.unwrap_model(trainer.model), tokenizer,
                                   suite.output_dir / "model", state_dict=state_dict)
        write_result(suite, trainer.measurements, progress, metrics)
    finally:
        # 8. Leave the process group on every exit path, failures included (what trainer.end() does).
        if dist.is_initialized():
            dist.destroy_process_group()


def refuse_what_the_trainer_cannot_do(args):
    if args.resume or args.save_steps:
        raise cli.UserError(f"--resume and --save-steps are not available in {SCRIPT}: the Trainer's own "
                            "checkpoints lack the suite's meaning checks and sampler position (see its docstring)")
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
    if "optimizer" in config or "scheduler" in config:
        raise cli.UserError(f"{path}: remove its optimizer/scheduler section: the suite builds AdamW from --lr "
                            "and --weight-decay, with a constant learning rate")
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


def write_result(suite, measurements, progress, metrics):
    """result.json and the printed report, by the suite's own code (common.Trainer.write_result), with
    what the measurements of the Trainer's loop counted."""
    suite.callbacks = [callback for callback in (measurements.model_state, measurements.allreduces) if callback]
    suite.write_result(progress, metrics, first_step=0)


# ----------------------------------------------------------------------------- beside the lesson

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
    """What common.Trainer measures in its own loop, taken from the Trainer's callbacks: the training
    loop's seconds (evaluations excluded), samples and tokens, peak memory, the model state before
    the second optimizer step, DDP's all-reduces (SUITE_COUNT_ALLREDUCES), and the failure the
    tests inject (SUITE_FAIL_AT="rank:step")."""

    def __init__(self, trainer, strategy, train_loader):
        self.trainer, self.strategy = trainer, strategy
        self.global_batch_sizes = train_loader.batch_sampler.global_batch_sizes()
        self.test_hooks = measure.load_test_hooks()  # SUITE_FAIL_AT, SUITE_COUNT_ALLREDUCES: tests/hooks.py
        self.tokens = torch.zeros(2, dtype=torch.float64)
        self.samples, self.paused, self.seconds, self.last_loss = 0, 0.0, None, float("nan")
        self.model_state = self.allreduces = None
        self.start = None

    def count_tokens(self, batch):
        self.tokens += common.count_tokens(batch)

    def on_train_begin(self, args, state, control, **kwargs):
        # After the Trainer has wrapped the model and built the optimizer: what follows is the loop.
        if self.trainer.is_deepspeed_enabled:
            self.strategy.engine = self.trainer.model_wrapped
        self.model_state = measure.ModelStateCount(self.strategy, self.trainer.model_wrapped,
                                                   self.trainer.torch_optimizer)
        if self.trainer.is_deepspeed_enabled:
            # Accelerate steps the DeepSpeed engine inside backward (DeepSpeedEngineWrapper), before
            # on_pre_optimizer_step, and the engine frees the gradient partitions as it steps.
            engine = self.strategy.engine
            engine_step = engine.step

            def count_then_step(*step_args, **step_kwargs):
                if self.trainer.state.global_step == 1:
                    self.model_state.count()
                return engine_step(*step_args, **step_kwargs)
            engine.step = count_then_step
        self.allreduces = self.test_hooks and self.test_hooks.gradient_allreduce_count(self.trainer.model_wrapped)
        machine.reset_peak_memory(self.strategy.device)
        machine.synchronize(self.strategy.device)
        self.start = time.perf_counter()

    def on_pre_optimizer_step(self, args, state, control, **kwargs):
        if state.global_step == 1 and not self.trainer.is_deepspeed_enabled:
            self.model_state.count()  # before the second step: weights, gradients and Adam moments all exist

    def on_step_end(self, args, state, control, **kwargs):
        self.samples += self.global_batch_sizes[(state.global_step - 1) % len(self.global_batch_sizes)]
        if self.test_hooks:
            self.test_hooks.fail_if_asked(self.strategy.rank, state.global_step)

    def on_log(self, args, state, control, logs=None, **kwargs):
        if "loss" in logs:
            self.last_loss = logs["loss"]

    def on_evaluate(self, args, state, control, **kwargs):
        if self.seconds is None and "eval_runtime" in kwargs.get("metrics", {}):
            self.paused += kwargs["metrics"]["eval_runtime"]  # --eval-steps: not training time

    def on_epoch_end(self, args, state, control, **kwargs):
        if state.global_step == state.max_steps:
            machine.synchronize(self.strategy.device)
            self.seconds = time.perf_counter() - self.start - self.paused

    def progress(self):
        """What common.Trainer.train returns, for common.Trainer.result."""
        tokens = self.strategy.reduce_mean(self.tokens.to(self.strategy.device)).cpu() * self.strategy.world_size
        return {"seconds": self.seconds, "steps": self.trainer.state.global_step, "samples": self.samples,
                "last_loss": self.last_loss, "real_tokens": tokens[0].item(), "computed_tokens": tokens[1].item()}


if __name__ == "__main__":
    cli.run(main)
