"""How fast this device multiplies matrices in a precision: the achievable peak that MFU is measured
against where no published one applies (a CPU, a GPU missing from flops.PEAK_TFLOPS), and a check of
the published one where it does.

    python microbenchmarks/matmul_peak.py --device cpu --precision fp32                # all the usable cores
    python microbenchmarks/matmul_peak.py --device cuda --precision bf16 --json

As the MAMF finder (maximum achievable matmul FLOPS) of Stas Bekman's Machine Learning Engineering
book: for each size n, torch.matmul of two random n x n matrices in the precision, --warmup products,
then --repeats timed one by one; a size's rate is 2 n^3 FLOPs over the median time, and the result is
the fastest size's rate. A product nears the hardware's rate only once it is large enough to keep every
core busy, and the rate also varies with how a size divides into the kernels' tiles: hence several
sizes. fp32 is IEEE fp32; tf32 is fp32 with its products on the TF32 tensor cores of an NVIDIA GPU, set
only while measuring. Measure on a quiet machine: where another process shares the cores, each product
waits for its slowest thread, and the rate falls far below what the cores can do.
With --json the last line is one JSON object: device, precision, tflops, size, threads.
"""
import argparse
import contextlib
import json
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from support import cli, machine, options  # noqa: E402

DTYPES = {"fp32": torch.float32, "tf32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}
# CPU: on 2 cores the fp32 rate is flat from 256 on, and all four sizes take under a second (1536: some
# 35 ms a product). CUDA: sizes that fill a large GPU; 8192 in fp32 takes some 20 ms a product on an H100.
DEFAULT_SIZES = {"cpu": (256, 512, 1024, 1536), "cuda": (2048, 4096, 8192)}
REPEATS, WARMUP = 10, 3


def resolve(device, precision):
    """The torch.device, once the device can compute `precision`; a UserError, in one line, if not."""
    device = torch.device(device)
    if precision not in DTYPES:
        raise cli.UserError(f"--precision {precision} is none of {', '.join(DTYPES)}")
    if device.type == "cuda" and not torch.cuda.is_available():
        raise cli.UserError("--device cuda was asked for, but torch sees no CUDA GPU")
    if precision == "tf32" and device.type != "cuda":
        raise cli.UserError("--precision tf32 needs an NVIDIA GPU's tensor cores; a CPU computes fp32 products "
                            "in IEEE fp32: use --precision fp32")
    machine.check_precision(precision, device)
    return device


@contextlib.contextmanager
def matmul_settings(device, precision, threads):
    """The thread count (CPU) and the fp32 product precision (CUDA) for the measurement, restored after it."""
    saved_threads, saved_fp32 = torch.get_num_threads(), torch.backends.cuda.matmul.fp32_precision
    try:
        if device.type == "cpu":
            torch.set_num_threads(cpu_threads(threads))
        else:
            torch.backends.cuda.matmul.fp32_precision = "tf32" if precision == "tf32" else "ieee"
        yield
    finally:
        torch.set_num_threads(saved_threads)
        torch.backends.cuda.matmul.fp32_precision = saved_fp32


def cpu_threads(threads):
    """--threads, else every core this process may use (its affinity and the container's quota)."""
    return threads or machine.usable_cores()


def seconds_per_product(a, b, device, repeats, warmup):
    """The median seconds of one a @ b, each timed alone after `warmup` untimed ones."""
    out = torch.empty_like(a)
    for _ in range(warmup):
        torch.matmul(a, b, out=out)
    times = []
    for _ in range(repeats):
        if device.type == "cuda":
            # Events time the kernel on the GPU, not the host's launch.
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            torch.matmul(a, b, out=out)
            end.record()
            end.synchronize()
            times.append(start.elapsed_time(end) / 1000)
        else:
            start = time.perf_counter()
            torch.matmul(a, b, out=out)
            times.append(time.perf_counter() - start)
    return statistics.median(times)


def rates_by_size(device, precision, sizes=None, repeats=REPEATS, threads=None, warmup=WARMUP):
    """{n: TFLOP/s} of n x n products for each size (the device's default sizes without `sizes`)."""
    device = resolve(device, precision)
    rates = {}
    with matmul_settings(device, precision, threads):
        for size in sizes or DEFAULT_SIZES[device.type]:
            a, b = (torch.randn(size, size, device=device, dtype=DTYPES[precision]) for _ in range(2))
            rates[size] = 2 * size**3 / seconds_per_product(a, b, device, repeats, warmup) / 1e12
            del a, b  # free them before the next size's
    return rates


def measure(device, precision, sizes=None, repeats=REPEATS, threads=None):
    """TFLOP/s: the fastest rate over the sizes of square products in `precision` on `device` ("cpu",
    "cuda" or a torch.device), on `threads` or all the usable cores of a CPU."""
    return max(rates_by_size(device, precision, sizes, repeats, threads).values())


def parse_sizes(text):
    try:
        sizes = sorted({int(item) for item in text.split(",")})
    except ValueError:
        sizes = []
    if not sizes or sizes[0] < 1:
        raise cli.UserError(f"--sizes {text}: give positive matrix sizes separated by commas, like 512,1024")
    return sizes


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=options.HelpFormatter)
    parser.add_argument("--device", choices=["cpu", "cuda"], default="cpu", help="cuda: the first GPU")
    parser.add_argument("--precision", choices=list(DTYPES), default="fp32",
                        help="fp32: IEEE; tf32: fp32 on the TF32 tensor cores of an NVIDIA GPU; bf16, fp16: 16-bit")
    parser.add_argument("--threads", type=int, help="CPU threads; None = every core this process may use")
    parser.add_argument("--sizes", help="matrix sizes n, comma-separated; None = " + "; ".join(
        f"{device} {','.join(map(str, sizes))}" for device, sizes in DEFAULT_SIZES.items()))
    parser.add_argument("--repeats", type=int, default=REPEATS, help="timed products per size; the median counts")
    parser.add_argument("--warmup", type=int, default=WARMUP, help="untimed products per size before them")
    parser.add_argument("--json", action="store_true", help="end with the result as one JSON object")
    args = parser.parse_args()
    sizes = parse_sizes(args.sizes) if args.sizes else None
    if args.threads is not None and args.threads < 1:
        raise cli.UserError(f"--threads must be at least 1, got {args.threads}")
    if args.repeats < 1 or args.warmup < 0:
        raise cli.UserError(f"--repeats must be at least 1 and --warmup 0 or more, got {args.repeats} and "
                            f"{args.warmup}")

    device = resolve(args.device, args.precision)
    threads = cpu_threads(args.threads) if device.type == "cpu" else None
    rates = rates_by_size(device, args.precision, sizes, args.repeats, threads, args.warmup)
    best = max(rates, key=rates.get)
    description = machine.device_description(device)
    print(f"matmul {args.precision} | {description}" + (f" | threads {threads}" if threads else "")
          + f" | torch {torch.__version__} | median of {args.repeats} after {args.warmup} warm-up products")
    for size, tflops in rates.items():
        print(f"{size:>6} x {size:<6} {tflops:10.3f} TFLOP/s" + ("  <- the peak" if size == best else ""))
    print(f"achievable peak: {rates[best]:.3f} TFLOP/s ({args.precision}, {description})")
    if args.json:
        print(json.dumps({"device": description, "precision": args.precision, "tflops": rates[best],
                          "size": best, "threads": threads}))


if __name__ == "__main__":
    cli.run(main)
