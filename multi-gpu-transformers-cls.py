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
marked comments ([data], [train], ...) say what it does for you. The suite's options map to TrainingArguments:
--batch-size to per_device_train_batch_size, --grad-accum to gradient_accumulation_steps,
--precision to bf16 / fp16, --epochs, --seed, --log-steps, --dist-timeout to theirs.

Where the Trainer's defaults differ from the suite's they are set back in libraries/transformers_setup.py: its
linear learning-rate decay, gradient clipping at 1.0, fused AdamW, random sampler and loaders, loss
and loss averaging. With that it is the DDP script run by a library: 3 processes x 11 end with the
weights of single-gpu-cls.py at 33 (fp32, no shuffling or dropout: the suite tests it), and
with shuffling and dropout on, 2 processes end with the DDP script's weights, bit for bit.

DeepSpeed and FSDP come through TrainingArguments too: DeepSpeed on CPU processes as well, FSDP on
GPUs only (on CPUs Accelerate would drop its plugin and train plain DDP). What the Trainer cannot do
the suite's way is refused in one line, each reason in transformers_setup: --resume, --save-steps,
--save-on-signal, --profile, --fsdp on a CPU, python on several GPUs.
"""
import functools

from transformers import TrainingArguments

import common
import instruments
from libraries import transformers_setup
from support import checkpoints, cli, launch, machine, models, options


def training_arguments(args, device, launched, own_group, deepspeed_config):
    # [config] TrainingArguments is the Trainer's whole configuration; creating it joins the process
    #    group (NCCL between GPUs) and picks this process's device. The suite's options map to
    #    its arguments; suite_defaults undoes the Trainer defaults that the suite does not have.
    return TrainingArguments(
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
        logging_steps=args.log_steps,
        ddp_timeout=round(args.dist_timeout),         # --dist-timeout (GPUs; CPUs: join_group_on_cpu)
        deepspeed=deepspeed_config,
        fsdp=args.fsdp or None,                       # the older fsdp="full_shard" still works, with a warning
        fsdp_config={"version": 2, "reshard_after_forward": True} if args.fsdp else None,
        **transformers_setup.suite_defaults(device, launched, own_group, deepspeed_config),
    )


def main():
    parser = options.build_parser(__file__, __doc__)
    transformers_setup.add_trainer_args(parser)  # the launchers' --local_rank, --precision, --deepspeed, --fsdp
    args = options.parse(parser)
    transformers_setup.refuse_what_the_trainer_cannot_do(args)

    # [ranks] One process alone (python), or one of several (torchrun, or srun's tasks): the Trainer reads
    #    the same RANK / WORLD_SIZE / LOCAL_RANK variables the DDP script reads.
    launched = launch.launched()
    rank, world_size, local_rank, local_world_size = launch.launch_environment_or_alone(
        f"torchrun --nproc_per_node N {transformers_setup.SCRIPT}")
    device = machine.resolve_device(args.device, local_rank)
    deepspeed_config = transformers_setup.read_deepspeed_config(args.deepspeed) if args.deepspeed else None
    transformers_setup.refuse_what_this_machine_cannot_do(args, device, launched, deepspeed_config)
    transformers_setup.name_deepspeed_accelerator(device)
    own_group = launched and device.type == "cpu"
    # [group] CPU processes join their gloo group here, GPU ones in TrainingArguments (join_group_on_cpu says why).
    if own_group:
        transformers_setup.join_group_on_cpu(args, deepspeed=deepspeed_config is not None)
    training_args = training_arguments(args, device, launched, own_group, deepspeed_config)
    # [leave] cli.run leaves the group on every exit path, failures included, so no process is left waiting.
    #    (As the Trainer's end() would.)
    strategy = transformers_setup.suite_strategy(args, training_args, device, launched, rank, world_size,
                                                 local_world_size)

    data = common.load_data_and_model(args, strategy)
    if args.compile:  # in place, then wrapped; dynamic shapes without DDP's graph split, which torch 2.11 breaks
        data.model.compile(**models.compile_options(args, strategy))
    training_args.learning_rate = data.lr  # for the Trainer's logs; the optimizer is ours (create_optimizer)

    # [data] The suite's loaders, sharded by rank as in the DDP script, in place of the Trainer's own
    #    (SuiteTrainer gives them to it, and tells the sampler each epoch, counting from 1 as every
    #    script does, where the Trainer would count from 0).
    loaders = common.make_loaders(data, args, world_size, rank)

    # What every script reports the same way (the thread policy, the printed lines, result.json)
    # comes from the suite's Run and instruments (the bar is the Trainer's); the Trainer trains.
    run = common.Run(args, strategy, data.model, data, loaders, instruments.callbacks_for(args, bar=False))
    run.announce()
    training_args.max_steps = run.total_steps() if args.max_steps else -1  # --max-steps (-1: the epochs decide)
    train_evaluate_save(run, training_args, data)


def train_evaluate_save(run, training_args, data):
    # [train] The Trainer does what the DDP script writes by hand or takes from common.Trainer: moves
    #    the model to the device and wraps it in DistributedDataParallel (or hands it to
    #    DeepSpeed or FSDP) through Accelerate, runs forward, backward and the optimizer step,
    #    skips the gradient all-reduce of a step's first N - 1 micro-batches, and averages the
    #    logged loss over the processes. Its callbacks print the suite's lines and measure.
    trainer = transformers_setup.SuiteTrainer(
        run, model=data.model, args=training_args, train_dataset=data.train_set, eval_dataset=data.dev_set,
        compute_metrics=functools.partial(transformers_setup.dev_metrics, run))
    trainer.train()

    # [evaluate] Trainer.evaluate runs the dev loader, gathers the logits (and our index and weight) from
    #    every process batch by batch, and hands them to compute_metrics (dev_metrics).
    metrics = {key.removeprefix("eval_"): value for key, value in trainer.evaluate().items()}
    metrics["loss"] = metrics["dev_loss"]  # its own eval_loss averages batch means, repeats included

    # [save] The whole weights (gathered by every process from DeepSpeed ZeRO-3 or FSDP shards), written
    #    by rank 0 with checkpoints.save_model: safetensors, config and tokenizer, swapped in whole.
    #    Trainer.save_model would write in place, and add training_args.bin (a pickle).
    if run.args.save_model:
        state_dict = trainer.accelerator.get_state_dict(trainer.model_wrapped)
        if run.strategy.is_main:
            checkpoints.save_model(trainer.accelerator.unwrap_model(trainer.model), data.tokenizer,
                                   run.output_dir / "model", state_dict=state_dict)
    run.notify("on_fit_end", metrics, trainer.measurements.last_loss)  # the instruments report


if __name__ == "__main__":
    cli.run(main)
