"""How fast this machine all-reduces: the collective DDP runs on the gradients, over a sweep of sizes
and at the size of the model's gradients.

    torchrun --standalone --nproc_per_node 2 microbenchmarks/allreduce.py          # --model auto, 4 KiB .. 64 MiB
    torchrun --standalone --nproc_per_node 2 microbenchmarks/allreduce.py --model tiny --sizes 4K,1M --json out.json

Each process all-reduces (SUM) an fp32 tensor of each size: --warmup calls, then --iters timed calls
after a barrier. A size's time is the slowest process's mean per call. Gloo between CPU processes,
NCCL between GPUs (--device auto takes the GPUs when there is one for every process on the machine).
The bandwidths are those of the NCCL tests (nccl-tests, doc/PERFORMANCE.md), in GB/s of 1e9 bytes:
  algbw  bytes / time
  busbw  algbw * 2 (n - 1) / n for n processes: what each link carries in a ring all-reduce,
         comparable across process counts and with the hardware's peak bandwidth
The row marked "model gradients" has the size of the model's trainable parameters in fp32, --model
resolved as the training scripts resolve it. The tiny model's vocabulary, hence its size, comes from
the training split: --data, --max-samples, --dev-ratio and --seed, as in the training scripts.
"""
import argparse
import re
import sys
import time
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist
import transformers

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import common  # noqa: E402
from support import cli, files, launch, machine, models, options  # noqa: E402

LAUNCH = "torchrun --standalone --nproc_per_node 2 microbenchmarks/allreduce.py"
UNITS = {"": 1, "K": 2**10, "M": 2**20}
FP32_BYTES = 4


def parse_sizes(text):
    """'4K,1M' -> [4096, 1048576]: bytes (K = KiB, M = MiB) of whole fp32 elements, sorted, each once."""
    sizes = set()
    for item in text.split(","):
        match = re.fullmatch(r"\s*(\d+)\s*([KkMm]?)\s*", item)
        if not match:
            raise cli.UserError(f"--sizes: {item.strip()!r} is not a size in bytes like 4096, 4K or 64M")
        size = int(match[1]) * UNITS[match[2].upper()]
        if size == 0 or size % FP32_BYTES:
            raise cli.UserError(f"--sizes: {item.strip()} is not a positive multiple of {FP32_BYTES} bytes "
                                "(whole fp32 elements)")
        sizes.add(size)
    return sorted(sizes)


def pick_device(choice, local_rank, local_world_size):
    """This local rank's GPU when every process on the machine has one (or --device cuda), else the CPU."""
    gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
    if choice == "cuda" and gpus < local_world_size:
        raise cli.UserError(f"--device cuda needs a GPU per process: {local_world_size} process(es) on this "
                            f"machine, {gpus} GPU(s) visible")
    if choice == "cuda" or (choice == "auto" and gpus >= local_world_size):
        return torch.device("cuda", local_rank)
    return torch.device("cpu")


def gradient_elements(name, args):
    """The trainable parameters of the model the training scripts would train (`name` resolved):
    DDP all-reduces one fp32 gradient per parameter."""
    if name == "tiny":
        records = common.load_records(args.data)
        train_records, _ = common.split_records(records, args.max_samples, args.dev_ratio, args.seed)
    elif name == "base-shape":
        config = transformers.BertConfig(**models.base_shape_config(), num_labels=len(common.LABELS))
    else:
        models.check_model_source(name)  # the test load_pretrained makes: no minute of the hub's retries
        try:
            config = transformers.AutoConfig.from_pretrained(name, num_labels=len(common.LABELS))
        except (OSError, ValueError) as error:
            first_line = str(error).strip().splitlines()[0] if str(error).strip() else type(error).__name__
            raise cli.UserError(f"could not read the config of model {name}: {first_line}") from None
    # On the meta device: shapes only, no weights read or initialised.
    with torch.device("meta"):
        if name == "tiny":
            _, model = models.build_tiny_model([text for text, _ in train_records], args.seed,
                                               {"num_labels": len(common.LABELS)})
        else:
            model = transformers.AutoModelForSequenceClassification.from_config(config)
    return sum(parameter.numel() for parameter in model.parameters() if parameter.requires_grad)


def time_allreduce(elements, device, iters, warmup):
    """The slowest process's mean seconds per all-reduce of `elements` fp32 values."""
    # Zeros stay zeros under SUM: no overflow to inf and no slow denormals on CPU, however many calls.
    tensor = torch.zeros(elements, dtype=torch.float32, device=device)
    for _ in range(warmup):
        dist.all_reduce(tensor)
    # Start together, so that no process times its wait for the last one to arrive.
    dist.barrier()
    machine.synchronize(device)
    start = time.perf_counter()
    for _ in range(iters):
        dist.all_reduce(tensor)
    machine.synchronize(device)  # NCCL calls only enqueue work on the GPU
    seconds = torch.tensor((time.perf_counter() - start) / iters, dtype=torch.float64, device=device)
    dist.all_reduce(seconds, op=dist.ReduceOp.MAX)
    return seconds.item()


def row(size, seconds, world_size, model_gradients):
    algbw = size / seconds / 1e9
    return {"bytes": size, "elements": size // FP32_BYTES, "time_ms": seconds * 1e3, "algbw": algbw,
            "busbw": algbw * 2 * (world_size - 1) / world_size, "model_gradients": model_gradients}


def print_table(rows, model_name):
    print(f"{'bytes':>12} {'elements':>12} {'time (ms)':>10} {'algbw (GB/s)':>13} {'busbw (GB/s)':>13}")
    for r in rows:
        mark = f"  <- model gradients ({model_name})" if r["model_gradients"] else ""
        print(f"{r['bytes']:>12,} {r['elements']:>12,} {r['time_ms']:>10.3f} {r['algbw']:>13.3f} "
              f"{r['busbw']:>13.3f}{mark}")


def parse_args():
    """The command line, its values checked."""
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=options.HelpFormatter)
    parser.add_argument("--model", default="auto",
                        help="whose gradient size to time: 'auto' (as the training scripts resolve it), 'tiny', "
                             "'base-shape', a folder or a hub id")
    parser.add_argument("--data", default=str(options.ROOT / "data" / "train.json"),
                        help="the tiny model's vocabulary comes from this data's training split")
    parser.add_argument("--max-samples", type=int, default=10000, help="as the training scripts' option")
    parser.add_argument("--dev-ratio", type=float, default=0.08, help="as the training scripts' option")
    parser.add_argument("--seed", type=int, default=123, help="as the training scripts' option")
    parser.add_argument("--sizes", default="4K,16K,64K,256K,1M,4M,16M,64M",
                        help="comma-separated sizes in bytes; K = 1024 bytes, M = 1024 K")
    parser.add_argument("--iters", type=int, default=20, help="timed all-reduces per size")
    parser.add_argument("--warmup", type=int, default=5, help="untimed all-reduces per size before them")
    parser.add_argument("--device", choices=["auto", "cpu", "cuda"], default="auto",
                        help="auto: the GPUs when this machine has one for each of its processes, else the CPU")
    parser.add_argument("--json", metavar="PATH", help="also write the results here (rank 0)")
    options.add_distributed_args(parser)
    args = parser.parse_args()
    sizes = parse_sizes(args.sizes)
    if args.max_samples < 2 or not 0 < args.dev_ratio < 1:
        raise cli.UserError(f"--max-samples must be at least 2 and --dev-ratio between 0 and 1, got "
                            f"{args.max_samples} and {args.dev_ratio:g}")
    if args.iters < 1:
        raise cli.UserError(f"--iters must be at least 1, got {args.iters}")
    if args.warmup < 0:
        raise cli.UserError(f"--warmup must be 0 or more, got {args.warmup}")
    if args.json and Path(args.json).is_dir():
        raise cli.UserError(f"--json {args.json} is a folder, not a file")
    return args, sizes


def main():
    args, sizes = parse_args()
    rank, world_size, local_rank, local_world_size = launch.launch_environment(LAUNCH)
    device = pick_device(args.device, local_rank, local_world_size)
    # Pin the GPU before joining the group, so NCCL sets up its communicator on the right card.
    if device.type == "cuda":
        torch.cuda.set_device(device)
    backend = machine.backend_for(device)
    dist.init_process_group(backend, timeout=timedelta(seconds=args.dist_timeout))
    try:
        # Rank 0 resolves 'auto' for all: processes that probe the hub each on their own may disagree.
        names = [models.resolve_model(args.model) if rank == 0 else None]
        dist.broadcast_object_list(names, src=0)
        model_name = names[0]
        elements = gradient_elements(model_name, args)
        model_bytes = elements * FP32_BYTES

        rows = [row(size, time_allreduce(size // FP32_BYTES, device, args.iters, args.warmup), world_size,
                    size == model_bytes)
                for size in sorted(set(sizes) | {model_bytes})]
        if rank == 0:
            report(args, rows, backend, world_size, device, model_name, elements)
    finally:
        # Leave the group on every exit path, failures included, so no process is left waiting.
        dist.destroy_process_group()


def report(args, rows, backend, world_size, device, model_name, elements):
    """Rank 0's table and conclusion, and the --json file."""
    model_bytes = elements * FP32_BYTES
    model_row = next(r for r in rows if r["model_gradients"])
    print(f"all_reduce SUM fp32 | backend {backend} | world size {world_size} | "
          f"device {machine.device_description(device)} | torch {torch.__version__} | "
          f"{args.iters} timed after {args.warmup} warm-up calls per size")
    print_table(rows, model_name)
    print(f"A DDP step of {model_name} all-reduces its {elements:,} gradients ({model_bytes / 1e6:.2f} MB "
          f"fp32) once per optimizer step, cut into buckets of up to 25 MiB overlapped with backward: "
          f"{model_row['time_ms']:.3f} ms, the marked row, is the lower bound of its communication per "
          f"step on this machine.")
    if args.json:
        files.write_json(args.json, {
            "operation": "all_reduce", "op": "sum", "dtype": "float32", "backend": backend,
            "world_size": world_size, "device": machine.device_description(device),
            "torch": torch.__version__, "iters": args.iters, "warmup": args.warmup,
            "model": model_name, "model_parameters": elements, "bandwidth_unit": "GB/s (1e9 bytes/s)",
            "rows": rows})


if __name__ == "__main__":
    cli.run(main)
