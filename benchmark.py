"""Run every strategy with its own launcher on the same model and data, and compare them in one table.

    python benchmark.py                                  # one row per strategy: a process per GPU, or 2 on CPU
    python benchmark.py --only single,ddp,deepspeed --repeat 3     # interleaved repeats and a noise floor
    python benchmark.py --only single,deepspeed-zero2,deepspeed-zero3   # variants side by side (--list)
    python benchmark.py --only single,ddp,horovod --nprocs 1,2,4   # a scaling sweep
    python benchmark.py --strategy-args deepspeed="--zero-stage 3"  # options for one strategy only
    python benchmark.py --variant zero3-adam-cpu=deepspeed:"--zero-stage 3 --offload optimizer"
    python benchmark.py --precision bf16                 # mixed precision wherever a strategy offers it
    python benchmark.py --grad-accum 4 --batch-size 8    # gradient accumulation, each library its own way
    python benchmark.py --profile 5                      # where a step's time goes, phase by phase
    python benchmark.py --max-samples 2000 --lr 5e-4     # options it does not know go to every script
    python benchmark.py --real-size                      # the real model's architecture, a few steps per row
    sbatch slurm/benchmark.sbatch --nnodes 1,2           # on a Slurm cluster: each row across the job's nodes

Each strategy trains with the same model, data, seed, learning rate, epochs and batch per device
(per process; DataParallel's one process gets it times its GPUs), so the global batch grows with
the devices (weak scaling), unless --global-batch asks for the same global batch for all (strong
scaling). Every row trains in fp32 except ddp-amp, whose point is mixed precision, unless
--precision asks for another for every strategy that offers one. Each process takes an equal
share of the machine's cores (the scripts' thread policy), whatever its launcher sets.

A row is a variant: a strategy plus options (`--list` shows the built-in ones; the default rows are
the strategies themselves). With --repeat N the launches go round-robin over the rows, so a slow
minute of a shared machine does not land on one row, and the table states the noise floor. Every
launch writes its result.json under <output-dir>/<row>/ and its output to <output-dir>/<row>.log;
the runner writes the comparison as benchmark.md, benchmark.json and benchmark.png in <output-dir>.
Every row also reports the model state each process holds (weights, gradients, optimizer state,
counted from its tensors) beside the ZeRO formula's prediction; --profile adds each step's time by
phase (data loading, forward, backward, optimizer step, exposed communication).

A row whose script or dependency is missing, or whose launch fails or times out, is listed with its
reason and the others still run. A row whose optional library is not installed (Horovod's build can
fail) is listed as not run; the exit status is 0 when every other row succeeded and some row ran.
"""
import datetime
import signal
import sys
from pathlib import Path

from bench import report as benchmark_report
from bench import traffic as bench_traffic
from bench.estimate import announce_real_size, check_batches_fit, expected_duration, few_steps_warning
from bench.options import list_rows, parse_args, plan
from bench.provenance import choose_model, describe_machine, git_state, gpu_count, library_versions
from bench.rows import STRATEGIES, relative
from bench.run import add_figures, measure_matmul_peaks, read_matmul_peaks, run_all, summarize
from support import cli, files, folder


def write_report(report, output_dir, final):
    """The figures, benchmark.json, and benchmark_report's table and chart."""
    add_figures(report)
    files.write_json(output_dir / "benchmark.json", report)
    benchmark_report.write(report, output_dir, final)


def new_report(args, cells, model, model_note):
    """benchmark.json before the first launch: the machine, the code, the plan, its rows pending."""
    # The distributed rows' process counts (--real-size adds 4 for the sharded rows; --nnodes multiplies).
    counts = ({cell["nnodes"] * cell["nprocs"] for cell in cells if STRATEGIES[cell["strategy"]].distributed}
              or set(args.counts))
    return {
        "machine": describe_machine(),
        "versions": library_versions(),
        "git": git_state(),
        "model": relative(model) if Path(model).is_dir() else model,
        "model_note": model_note,
        "nprocs": args.nprocs,
        "nnodes": args.nnodes,
        "counts": sorted(counts),
        "max_steps": args.max_steps,
        "repeat": args.repeat,
        "spread": "min-max over the repeats; the row is the run with the median training time",
        "noise_floor": None,
        "global_batch": args.global_batch,
        "batch_sizes": args.batch_sizes,
        "precision": args.precision,
        "strategy_args": args.strategy_options,
        "passthrough": args.passthrough,
        "output_dir": relative(args.output_dir),
        "started": datetime.datetime.now().isoformat(timespec="seconds"),
        "finished": None,
        "all_succeeded": None,
        "rows": cells,
    }


def main():
    # A launch runs in its own session, out of reach of signals sent to this one: on SIGTERM, as on
    # Ctrl-C, unwind so that launch_once stops the launch before this process exits.
    signal.signal(signal.SIGTERM, lambda signum, frame: sys.exit(128 + signum))
    gpus = gpu_count()
    args = parse_args(sys.argv[1:], gpus, __doc__)
    if args.list:
        list_rows(args.variants)
        return
    measured = read_matmul_peaks(args.matmul_peaks) if args.matmul_peaks else None  # before any launch: one line
    model, model_note = choose_model(args.model, gpus)
    cells = plan(args, gpus)
    check_batches_fit(args, cells, gpus)
    # The folder is this run's as a script's is its own (locked, no links, nothing of anyone else's touched).
    folder.check_output_dir(str(args.output_dir))
    folder.claim_output_dir(args.output_dir)
    if args.real_size:
        announce_real_size(args, cells)
    report = new_report(args, cells, model, model_note)
    for line in benchmark_report.header_lines(report)[:4]:
        print(line, flush=True)
    for line in (benchmark_report.oversubscription_note(report), few_steps_warning(args, cells, gpus),
                 expected_duration(args, cells, model, gpus)):
        if line:
            print(line, flush=True)

    def after_each():  # what finished so far survives an interruption
        report["rows"] = [summarize(cell) for cell in cells]
        report["finished"] = datetime.datetime.now().isoformat(timespec="seconds")
        write_report(report, args.output_dir, final=False)

    run_all(args, cells, model, gpus, after_each)
    report["rows"] = [summarize(cell) for cell in cells]
    if measured is None:
        print("measuring the matrix-product peak of each precision the rows computed in "
              "(microbenchmarks/matmul_peak.py)", flush=True)
    report["matmul_peaks"] = measure_matmul_peaks(report["rows"], measured)
    print("measuring this machine's all-reduce for the projection of the bytes sent (microbenchmarks/allreduce.py)",
          flush=True)
    report["interconnect"] = bench_traffic.measure_interconnect(report, args.max_samples, args.output_dir)
    bench_traffic.project(report)
    report["all_succeeded"] = all(row["status"] == "ok" for row in report["rows"])
    write_report(report, args.output_dir, final=True)
    print("\n" + benchmark_report.terminal_report(report))
    print(f"\nwritten: {relative(args.output_dir)}/benchmark.md, benchmark.json, benchmark.png and a log per row")
    if args.publish is not None:
        print(f"published: {benchmark_report.publish(report, args.output_dir, args.publish)}")
    problem = unsuccessful(report["rows"])
    if problem:
        print(problem, file=sys.stderr)
        sys.exit(1)


def unsuccessful(rows):
    """Why the run failed, or None: a row that could run did not succeed, or no row ran at all."""
    failed = [row["row"] for row in rows if row["status"] not in ("ok", "not run")]
    if failed:
        return f"not all rows succeeded: {', '.join(failed)} (the table and their logs say why)"
    if not any(row["status"] == "ok" for row in rows):
        return "no row ran: their libraries are not installed (the table says which)"
    return None


if __name__ == "__main__":
    cli.run(main)
