"""The result of a run: result.json's fields, and the report every script prints at the end, the
same whichever strategy ran, built by the last of its instruments (Report)."""
import sys
from pathlib import Path

import torch
import transformers

from support import launch
from support.callbacks import Callback
from support.files import write_json
from support.machine import device_description, peak_memory_mb
from support.models import parameter_count

from . import traffic


# measure.count_tokens' sums, in its order: flops.py's three over the real samples at their own lengths,
# then over what the model computed (padding and repeats included), then the tokens computed in the real
# samples' rows (their padding, not the rows of weight 0 that fill a short batch): padding per sample.
REAL_COUNTS = ("real_tokens", "real_sequences", "real_attended_pairs")
COMPUTED_COUNTS = ("computed_tokens", "computed_sequences", "attended_pairs")
TOKEN_COUNTS = REAL_COUNTS + COMPUTED_COUNTS + ("real_rows_tokens",)
COMPUTED_SUMS = slice(len(REAL_COUNTS), len(REAL_COUNTS + COMPUTED_COUNTS))  # the sums flops.py reads, computed


class Report(Callback):
    """result.json, built here for every script once it has trained, evaluated and saved: the run's
    fields, then each callback's own (on_result); rank 0 prints the report and writes the file."""

    def __init__(self, progress):
        self.progress = progress

    def on_train_begin(self, trainer, first_step):
        self.first_step = first_step

    def on_fit_end(self, trainer, metrics, last_loss):
        summary = {**self.progress.summary(), "last_loss": last_loss}  # every process: a collective
        result = {**fields(trainer, summary, metrics), "resumed_from_step": self.first_step}
        for callback in trainer.callbacks:
            callback.on_result(trainer, result)
        if trainer.strategy.is_main:
            report(trainer, result, metrics)
            write_json(trainer.output_dir / "result.json", result)


def fields(trainer, progress, metrics):
    """result.json's common fields: what ran, how fast, what it reached; the Trainer's callbacks add
    their own (on_result)."""
    args, strategy = trainer.args, trainer.strategy
    samples = max(progress["samples"], 1)
    return {
        "strategy": strategy.name,
        "launcher": "srun" if launch.srun_started_this_process else strategy.launcher,
        "world_size": strategy.world_size,
        "device": device_description(strategy.device),
        "threads_per_process": trainer.threads,
        "model": trainer.model_name,
        "parameters": parameter_count(trainer.model),
        "precision": strategy.precision,
        "compiled": args.compile,
        "compile_mode": (args.compile_mode or "default") if args.compile else None,
        "compile_dynamic": args.compile_dynamic if args.compile else None,
        "precision_native": trainer.native_precision,
        "batch_size_per_process": args.batch_size,
        "global_batch_size": trainer.global_batch_size,
        "gradient_accumulation_steps": args.grad_accum,
        "epochs": args.epochs,
        "steps": progress["steps"],
        "max_steps": args.max_steps or None,
        "stopped_early": progress["steps"] < trainer.epoch_steps(),  # by --max-steps, before the last epoch's end
        "learning_rate": trainer.lr,
        "train_samples": len(trainer.train_loader.dataset),
        "samples_trained": progress["samples"],
        "train_seconds": round(progress["seconds"], 3),
        "samples_per_second": round(progress["samples"] / progress["seconds"], 2),
        "tokens_per_sample": round(progress["real_tokens"] / samples, 2),
        "padded_tokens_per_sample": round(padding_per_sample(progress), 2),
        # The job's sums (measure.count_tokens): what the throughput and FLOPs are counted from.
        **{name: progress[name] for name in TOKEN_COUNTS},
        "pad_to_multiple_of": args.pad_to_multiple_of,
        "step_shapes": progress["step_shapes"],  # distinct (batch, length) shapes of the training micro-batches
        "peak_memory_mb": round(peak_memory_mb(strategy.device), 1),
        "final_train_loss": progress["last_loss"],
        "dev_loss": metrics["loss"],
        "dev_accuracy": metrics["accuracy"],
        "dev_macro_f1": metrics["macro_f1"],
        "dev_samples": metrics["samples"],
        "command": " ".join([Path(sys.argv[0]).name] + sys.argv[1:]),
        "versions": {"python": sys.version.split()[0], "torch": torch.__version__,
                     "transformers": transformers.__version__, **strategy.versions()},
        **strategy.result_extras(),
    }


def padding_per_sample(sums):
    """The padding tokens a real sample was computed with, on average (count_tokens' sums): its batch's
    length less its own. The rows of weight 0 that fill a short batch are no sample's padding."""
    return (sums["real_rows_tokens"] - sums["real_tokens"]) / max(sums["real_sequences"], 1)


def throughput_line(result):
    """The first step apart, then the steady steps: their pace and how close to the device's limit."""
    mfu = (f"MFU {result['mfu_real']:.1%} on the real tokens, {result['mfu']:.1%} on those computed, of "
           f"{result['peak_tflops']:g} TFLOP/s ({result['compute_precision']}, {result['peak_source']})"
           if result.get("mfu") is not None else f"MFU: {result['mfu_note']}")
    steady = result["steady_model_flops_per_second"]
    graphs, cuda_graphs, shapes = result["compiled_graphs"], result.get("cuda_graphs"), result.get("step_shapes")
    return (f"first step {result['first_step_seconds']:.2f} s"
            + (f" (compiled while training: {graphs} graph{'s' * (graphs != 1)}" if result["compiled"] else "")
            + (f" in {result['compile_seconds']:.1f} s" if result.get("compile_seconds") is not None else "")
            + (f", {cuda_graphs} CUDA graphs" if cuda_graphs is not None else "")
            + (")" if result["compiled"] else "")
            + (f", then {result['steady_step_seconds'] * 1000:.1f} ms per step (median), "
               f"{result['steady_samples_per_second']:.1f} samples/s" if result["steady_step_seconds"] else "")
            + (f" | {shapes} step shape{'s' * (shapes != 1)}" if shapes else "")
            + f" | {result['real_tokens_per_second']:.0f} tokens/s ({result['computed_tokens_per_second']:.0f} "
            + f"computed) | model {(steady or result['model_flops_per_second']) / 1e12:.3g} TFLOP/s | {mfu}")


def report(trainer, result, metrics):
    """The lines every script prints at the end (rank 0)."""
    print(f"【dev】 loss：{metrics['loss']:.6f} accuracy：{metrics['accuracy']:.4f} "
          f"macro-F1：{metrics['macro_f1']:.4f}")
    print(metrics["report"])
    print(f"耗时：{result['train_seconds'] / 60:.2f}分钟")
    precision = result["precision"]
    if not result["precision_native"]:
        precision += f" (emulated on this {trainer.strategy.device.type})"
    print(f"strategy {result['strategy']} ({result['launcher']}, {result['world_size']} process(es) x "
          f"{result['threads_per_process']} thread(s), {result['device']}, {precision}) | model {result['model']}")
    print(f"training loop only: {result['train_seconds']:.1f} s, {result['samples_per_second']:.1f} samples/s, "
          f"{result['tokens_per_sample']:.1f} tokens + {result['padded_tokens_per_sample']:.1f} padding "
          f"per sample, peak memory {result['peak_memory_mb']:.0f} MB (rank 0)")
    if "first_step_seconds" in result:
        print(throughput_line(result))
    if result["stopped_early"]:
        print(f"stopped by --max-steps after {result['steps']} optimizer steps, before the end of "
              f"{result['epochs']} epoch(s): {result['samples_trained']} samples trained")
    if result["model_state_bytes"]:
        held, formula = result["model_state_bytes"], result["model_state_formula_bytes"]
        print("model state held by rank 0: " + ", ".join(f"{name.replace('_', ' ')} {held[name] / 2**20:.2f} MB"
                                                        for name in ("parameters", "gradients", "optimizer_state"))
              + f"; the ZeRO formula for stage {formula['zero_stage']} over {formula['processes']} process(es): "
              + f"{formula['total'] / 2**20:.2f} MB in all (measured {held['total'] / 2**20:.2f} MB)")
    if result.get("collective_bytes"):
        print(traffic.summary_line(result))
    if "peak_memory_beyond_model_state_mb" in result:
        offloaded = result["model_state_bytes_by_device"].get("cpu", 0)
        bucket = result.get("reduce_bucket_bytes")
        print("peak GPU memory beyond the model state on the GPU (activations, buffers"
              + (f", DeepSpeed's reduce bucket {bucket / 2**20:.0f} MB" if bucket else "")
              + f"): {result['peak_memory_beyond_model_state_mb']:.0f} MB"
              + (f"; model state offloaded to CPU memory: {offloaded / 2**20:.2f} MB" if offloaded else ""))
    if "profile" in result:
        profile = result["profile"]
        print(f"step anatomy (rank 0, {profile['steps']} steps recorded): {profile['step_ms']:.1f} ms per step = "
              + " + ".join(f"{name} {ms:.1f}" for name, ms in profile["phases_ms"].items())
              + f" (+ {profile['unaccounted_ms']:.1f} elsewhere); communication overlapped with computing: "
              + f"{profile['overlapped_communication_ms']:.1f} ms; trace: {trainer.output_dir / 'trace.json'}")
    print(f"dev: {result['dev_samples']} samples, accuracy {result['dev_accuracy']:.4f}, "
          f"macro-F1 {result['dev_macro_f1']:.4f}, loss {result['dev_loss']:.4f}")
    saved = f"{trainer.output_dir / 'model'} and " if trainer.args.save_model else ""
    print(f"saved: {saved}{trainer.output_dir / 'result.json'}")
