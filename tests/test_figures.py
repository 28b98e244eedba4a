"""Figures quoted by hand are the committed runs': each test below reads a figure the README or a page
under docs/ quotes and compares it with docs/results/amd-epyc-2-cores/benchmark.json (the main run) or
docs/results/amd-epyc-2-cores-base-shape/benchmark.json (`./run.sh --real-size`). Each figure is written
once (the other pages link to it), so each has one check here. A figure measured by a command whose output is not
committed has no check: the page says so beside it ("measured by `COMMAND`, not checked")."""
import json
import re

import pytest

from conftest import ROOT

RUN = ROOT / "docs" / "results" / "amd-epyc-2-cores" / "benchmark.json"
REAL_SIZE_RUN = ROOT / "docs" / "results" / "amd-epyc-2-cores-base-shape" / "benchmark.json"
README = (ROOT / "README.md").read_text(encoding="utf-8")
ANATOMY = (ROOT / "docs" / "anatomy.md").read_text(encoding="utf-8")
RUNNING = (ROOT / "docs" / "running.md").read_text(encoding="utf-8")
MB = 2**20


@pytest.fixture(scope="module")
def run():
    return json.loads(RUN.read_text(encoding="utf-8"))


@pytest.fixture(scope="module")
def rows(run):
    return {row["row"]: row for row in run["rows"]}


@pytest.fixture(scope="module")
def real_size_rows():
    return {row["row"]: row for row in json.loads(REAL_SIZE_RUN.read_text(encoding="utf-8"))["rows"]}


REAL_SIZE_OUTPUT = json.loads(REAL_SIZE_RUN.read_text(encoding="utf-8"))["output_dir"]


def section(text, heading, end=None):
    start = text.index(heading)
    return text[start:text.index(end, start)] if end else text[start:]


def words(text):
    """The text with every run of white space one space: a quoted phrase may wrap."""
    return " ".join(text.split())


def table(text, header):
    """{first cell's first word: [the other cells]} of the markdown table under `header` in `text`."""
    lines = text.splitlines()
    found = {}
    for line in lines[lines.index(header) + 2:]:
        if not line.startswith("| "):
            break
        cells = [cell.strip() for cell in line.strip().strip("|").split("|")]
        found[cells[0].split(" ")[0]] = cells[1:]
    return found


def expected_results_row(row):
    return [str(row["processes"]), str(row["global_batch"]), f"{row['train_seconds']:.1f}",
            f"{row['speedup']:.2f}x", f"{row['dev_accuracy']:.4f}"]


def test_the_readme_results_table_is_the_committed_run(rows):
    shown = table(section(README, "## Measured"), "| row | processes | global batch | train s | speed-up | dev acc |")
    assert shown.keys() == rows.keys()
    for name, cells in shown.items():
        expected = expected_results_row(rows[name])
        assert cells == expected, f"README row {name}: {cells}, the committed run says {expected}"


PUBLISHED_RUN = re.compile(r"^\| \[(?P<folder>[\w-]+)\]\(results/(?P=folder)/benchmark\.md\) \|.*\| `(?P<command>[^`]+)` \|$", re.M)


def test_the_published_runs_were_made_by_the_commands_the_pages_show():
    """docs/benchmark.md names the command behind each folder of docs/results/, and the README the one
    behind its table: each, parsed as benchmark.py parses it, plans the rows and settings its JSON
    records, and publishes into that folder."""
    import shlex
    from bench import options, rows
    from bench import report as bench_report
    page = (ROOT / "docs" / "benchmark.md").read_text(encoding="utf-8")
    shown = {match["folder"]: match["command"] for match in PUBLISHED_RUN.finditer(page)}
    assert shown.keys() == {path.name for path in (ROOT / "docs" / "results").iterdir() if path.is_dir()}
    for folder, command in shown.items():
        recorded = json.loads((ROOT / "docs" / "results" / folder / "benchmark.json").read_text(encoding="utf-8"))
        argv = shlex.split(command)
        assert argv[:2] == ["python", "benchmark.py"] or argv[0] == "./run.sh", command
        argv = argv[1:] if argv[0] == "./run.sh" else argv[2:]
        gpus = len(recorded["machine"]["gpus"])
        args = options.parse_args(argv, gpus=gpus)
        # --output-dir as typed, or the default as benchmark.py records it
        output_dir = argv[argv.index("--output-dir") + 1] if "--output-dir" in argv else rows.relative(args.output_dir)
        assert args.publish is not None and output_dir == recorded["output_dir"], folder
        assert bench_report.results_folder(recorded, args.publish) == folder, f"{command} publishes elsewhere"
        assert (args.repeat, args.nprocs, args.max_steps, args.passthrough, args.model or "tiny") == (
            recorded["repeat"], recorded["nprocs"], recorded["max_steps"], recorded["passthrough"], recorded["model"]), folder
        assert [cell["row"] for cell in options.plan(args, gpus=gpus)] == [row["row"] for row in recorded["rows"]], folder
    measured = words(section(README, "## Measured", "## The strategies"))
    assert f"`{shown['amd-epyc-2-cores']}` on 2 cores" in measured


def test_the_readme_notes_under_the_results_table_are_the_committed_runs(run, rows):
    notes = words(section(README, "## Measured", "## The strategies"))
    assert f"With a noise floor of {run['noise_floor']:.0%}" in notes
    deepspeed = rows["deepspeed"]
    assert f"(wall {deepspeed['wall_seconds']:.1f} s, training {deepspeed['train_seconds']:.1f} s)" in notes


def test_the_choice_guide_quotes_the_committed_runs(rows, real_size_rows):
    """The README's "Which to use": DDP's and FSDP2's speed-ups from the CPU table, and the model state
    FSDP2 and ZeRO-3 hold at 4 processes against DDP's, from the real-size run."""
    guide = words(section(README, "## Which to use", "## The strategies"))
    assert f"({rows['ddp']['speedup']:.2f}x `single` at 2 processes" in guide
    assert f"FSDP2 {rows['fsdp']['speedup']:.2f}x" in guide
    held = {name: real_size_rows[name]["model_state_bytes"]["total"] / MB for name in ("fsdp-n4", "deepspeed-zero3-n4")}
    ddp = real_size_rows["ddp"]["model_state_bytes"]["total"] / MB
    assert f"{held['fsdp-n4']:.0f} and {held['deepspeed-zero3-n4']:.0f} MB of DDP's {ddp:,.0f} MB" in guide
    assert all(size < ddp / 3 for size in held.values())


def test_the_tiny_models_accuracy_range_is_the_committed_runs(rows):
    """The README's "about 0.41-0.44" (the one place it is written) spans every row's dev accuracy."""
    quoted = re.findall(r"dev accuracy of about (\d\.\d\d)-(\d\.\d\d) with the tiny model", words(README))
    assert len(quoted) == 1, "the README should give the tiny model's accuracy range once"
    low, high = (float(bound) for bound in quoted[0])
    accuracies = [row["dev_accuracy"] for row in rows.values()]
    # The range holds every row, and neither end is more than a hundredth beyond the rows.
    assert low <= min(accuracies) < low + 0.01 - 1e-9 and high - 0.01 + 1e-9 < max(accuracies) <= high, (
        f"the README says {low}-{high}; the committed run's rows range over {min(accuracies)}-{max(accuracies)}")


def test_the_sample_output_is_the_committed_single_row(run, rows):
    """docs/running.md shows the end of the committed `single` row's output: each line as results.py
    and the Trainer print it from that launch's result.json (the row's median run)."""
    from instruments import results
    single = rows["single"]
    folder = f"{run['output_dir']}/single"
    run = next(run for run in single["runs"] if run["train_seconds"] == single["train_seconds"])
    held, formula = run["model_state_bytes"], run["model_state_formula_bytes"]
    assert f"--output-dir {folder} " in run["command"]
    lines = [
        f"【train】 epoch：{run['epochs']}/{run['epochs']} step：{run['steps']}/{run['steps']} loss：{run['final_train_loss']:.6f}",
        f"【dev】 loss：{run['dev_loss']:.6f} accuracy：{run['dev_accuracy']:.4f} macro-F1：{run['dev_macro_f1']:.4f}",
        f"耗时：{run['train_seconds'] / 60:.2f}分钟",
        f"strategy {run['strategy']} ({run['launcher']}, {run['world_size']} process(es) x "
        f"{run['threads_per_process']} thread(s), {run['device']}, {run['precision']}) | model {run['model']}",
        f"training loop only: {run['train_seconds']:.1f} s, {run['samples_per_second']:.1f} samples/s, "
        f"{run['tokens_per_sample']:.1f} tokens + {run['padded_tokens_per_sample']:.1f} padding per sample, "
        f"peak memory {run['peak_memory_mb']:.0f} MB (rank 0)",
        results.throughput_line(run),
        "model state held by rank 0: " + ", ".join(f"{name.replace('_', ' ')} {held[name] / MB:.2f} MB"
                                                  for name in ("parameters", "gradients", "optimizer_state"))
        + f"; the ZeRO formula for stage {formula['zero_stage']} over {formula['processes']} process(es): "
        + f"{formula['total'] / MB:.2f} MB in all (measured {held['total'] / MB:.2f} MB)",
        f"dev: {run['dev_samples']} samples, accuracy {run['dev_accuracy']:.4f}, "
        f"macro-F1 {run['dev_macro_f1']:.4f}, loss {run['dev_loss']:.4f}",
        f"saved: {folder}/model and {folder}/result.json",
    ]
    sample = section(RUNNING, "## What a run prints", "## What a run writes")
    shown = [line for line in sample.splitlines() if line.strip()]
    for line in lines:
        assert line in shown, f"docs/running.md should show: {line}"


def test_the_anatomy_peak_memory_note_is_the_real_size_runs(real_size_rows):
    """Sharding saves model state, not the host's peak: FSDP2's model state and peak at 4 processes, DDP's peak."""
    fsdp, ddp = real_size_rows["fsdp-n4"], real_size_rows["ddp"]
    note = (f"at 4 processes FSDP2 held {fsdp['model_state_bytes']['total'] / MB:.2f} MB and peaked at "
            f"{fsdp['peak_memory_mb']:,.0f} MB resident, DDP at {ddp['peak_memory_mb']:,.0f} MB")
    assert note in words(section(ANATOMY, "## At real size: BERT-base")), f"docs/anatomy.md should say: {note}"
    assert fsdp["model_state_bytes"]["total"] < ddp["model_state_bytes"]["total"] / 3
    assert fsdp["peak_memory_mb"] > ddp["peak_memory_mb"]


def test_the_native_bf16_speed_up_is_the_committed_runs(rows):
    amp, fp32 = rows["ddp-amp"], rows["ddp-spawn"]
    assert amp["precision"] == "bf16" and amp["precision_native"]
    native = words((ROOT / "docs" / "native.md").read_text(encoding="utf-8"))
    quoted = re.search(r"trained in ([\d.]+) s where `ddp-spawn`, the same script in fp32, took ([\d.]+) s: "
                       r"([\d.]+)x faster, and ([\d.]+)x the single-device throughput", native)
    assert quoted, "docs/native.md no longer quotes the committed bf16 run"
    assert quoted.groups() == (f"{amp['train_seconds']:.1f}", f"{fp32['train_seconds']:.1f}",
                               f"{fp32['train_seconds'] / amp['train_seconds']:.2f}", f"{amp['speedup']:.2f}")


def test_the_anatomy_sample_profile_line_is_the_real_size_ddp_runs(real_size_rows):
    """The `step anatomy` line docs/anatomy.md shows is what results.py prints for the real-size ddp row."""
    profile = real_size_rows["ddp"]["profile"]
    line = (f"step anatomy (rank 0, {profile['steps']} steps recorded): {profile['step_ms']:.1f} ms per step = "
            + " + ".join(f"{name} {ms:.1f}" for name, ms in profile["phases_ms"].items())
            + f" (+ {profile['unaccounted_ms']:.1f} elsewhere); communication overlapped with computing: "
            + f"{profile['overlapped_communication_ms']:.1f} ms; trace: {REAL_SIZE_OUTPUT}/ddp/trace.json")
    assert line in section(ANATOMY, "## A step, phase by phase"), f"docs/anatomy.md should show: {line}"


def test_the_anatomy_per_gpu_table_follows_the_real_size_formula(real_size_rows):
    """Each row's formula is a + b/N: a and b from the run's formula at 2 and 4 processes, then 8 and 64."""
    formula = {name: row["model_state_formula_bytes"]["total"] / MB for name, row in real_size_rows.items()}
    rows = {"DDP": ("ddp", "ddp"), "ZeRO-1/2": ("deepspeed-n2", "deepspeed-n4"),
            "ZeRO-3": ("deepspeed-zero3-n2", "deepspeed-zero3-n4"), "FSDP2": ("fsdp-n2", "fsdp-n4")}
    lines = section(ANATOMY, "| strategy (fp32 weights, Adam)").splitlines()[2:6]
    assert len(lines) == 4
    for line in lines:
        cells = [cell.strip() for cell in line.strip().strip("|").split("|")]
        key = next(key for key in rows if key in cells[0])
        at2, at4 = formula[rows[key][0]], formula[rows[key][1]]
        b = (at2 - at4) * 4
        a = at2 - b / 2
        expected = [f"{a + b / n:,.1f}" for n in (2, 4, 8, 64)]
        assert cells[1:] == expected, f"docs/anatomy.md per-GPU row {cells[0]}: {cells[1:]}, the formula says {expected}"


def test_the_anatomy_real_size_notes_are_the_real_size_runs(real_size_rows):
    text = words(section(ANATOMY, "## At real size: BERT-base"))
    minutes = sum(row["wall_seconds"] for row in real_size_rows.values()) / 60
    assert f"It took {minutes:.0f} minutes of launches" in text
    padding = max((row["model_state_bytes"]["total"] - row["model_state_formula_bytes"]["total"])
                  / row["model_state_formula_bytes"]["total"] for row in real_size_rows.values())
    assert f"within DeepSpeed's gradient padding ({padding:.1%})" in text
    held = {name: row["model_state_bytes"]["total"] / MB for name, row in real_size_rows.items()}
    assert f"every unsharded row DDP's {held['ddp']:,.2f} MB, ZeRO-1 what ZeRO-2 holds" in text
    assert all(f"{mb:.2f}" == f"{held['ddp']:.2f}" for name, mb in held.items() if not name.startswith(("deepspeed", "fsdp")))
    assert all(f"{held[f'deepspeed-zero1-n{n}']:.2f}" == f"{held[f'deepspeed-n{n}']:.2f}" for n in (2, 4))

    def allreduce(name):
        return real_size_rows[name]["profile"]["collectives"]["gloo:all_reduce"]
    ddp = real_size_rows["ddp"]["profile"]
    assert f"only {allreduce('ddp')['exposed_ms'] / 1000:.2f} s of it is exposed" in text
    hidden = allreduce("ddp")["ms"] - allreduce("ddp")["exposed_ms"]
    assert f"of {allreduce('ddp')['ms'] / 1000:.2f} s per step, {hidden / 1000:.2f} s run while" in text
    assert f"backward ({ddp['phases_ms']['backward'] / 1000:.1f} s)" in text
    exposed = [f"{allreduce(name)['exposed_ms']:.0f}" for name in ("ddp-spawn", "accelerate", "fabric")]
    assert "{} ms under spawn, {} under Accelerate, {} under Fabric".format(*exposed) in text
    waited = real_size_rows["horovod"]["profile"]["collectives"]["horovod:synchronize"]["exposed_ms"]
    assert f"Horovod's optimizer step waits {waited:.0f} ms" in text
    assert waited < allreduce("ddp")["exposed_ms"], "the page says Horovod waits less than DDP's exposed all-reduce"
    tiny = json.loads(RUN.read_text(encoding="utf-8"))["rows"]
    assert f"its {next(row for row in tiny if row['row'] == 'horovod')['speedup']:.2f}x on the tiny model" in text
    amp, fp32 = real_size_rows["ddp-amp"], real_size_rows["ddp-spawn"]
    assert amp["precision"] == "bf16" and amp["precision_native"]
    amp_ms, fp32_ms = amp["profile"]["step_ms"], fp32["profile"]["step_ms"]
    assert amp_ms < fp32_ms and f"ddp-amp's step took {amp_ms / 1000:.1f} s where ddp-spawn's took {fp32_ms / 1000:.1f} s" in text
    assert real_size_rows["hf-trainer"]["profile"] is None and "its row has no anatomy" in text


def test_the_compile_note_is_the_committed_compiled_run():
    run = json.loads((ROOT / "docs" / "results" / "amd-epyc-2-cores-base-shape-compile" / "benchmark.json").read_text())
    rows = {row["row"]: row for row in run["rows"]}
    note = words(section((ROOT / "docs" / "benchmark.md").read_text(encoding="utf-8"), "**`--compile`**", "- **`--real-size`**"))
    assert "compiled steps were slower" in note
    assert all(rows[f"{name}+compile"]["steady_step_seconds"] > rows[name]["steady_step_seconds"] for name in ("single", "ddp"))


def test_the_fp32_rows_at_one_global_batch_end_alike(rows):
    """The README says the fp32 rows at global batch 64 end with identical metrics: that is a figure of
    the committed run too."""
    assert "The fp32 rows at global batch 64 end with identical metrics" in words(README)
    alike = {(row["dev_accuracy"], row["dev_macro_f1"]) for row in rows.values()
             if row["precision"] == "fp32" and row["global_batch"] == 64}
    assert len(alike) == 1, f"the fp32 rows at global batch 64 end with {alike}"


def test_the_data_page_quotes_the_committed_runs(rows, real_size_rows):
    """docs/data.md: the padding every row computed, and the two models' parameter counts."""
    data = words((ROOT / "docs" / "data.md").read_text(encoding="utf-8"))
    shown = {f"{row['tokens_per_sample']:.1f} tokens + {row['padded_tokens_per_sample']:.1f} padding" for row in rows.values()}
    assert len(shown) == 1 and f"every row computed {shown.pop()} per training sample" in data
    tiny = rows["single"]["model_state_formula_bytes"]["parameter_count"]
    assert f"about {tiny / 1e6:.2f}M parameters" in data
    base = real_size_rows["ddp"]["model_state_formula_bytes"]["parameter_count"]
    assert f"{base:,} parameters with the head" in data


def test_the_readme_duration_of_the_benchmark_is_the_committed_runs(rows):
    """`./run.sh` without a GPU launches each row once: the committed run's walls, added up."""
    minutes = f"{sum(row['wall_seconds'] for row in rows.values()) / 60:.0f}"
    assert f"It then takes about {minutes} minutes on 2 cores" in words(README)
    assert f"2 核上约 {minutes} 分钟" in README


def test_the_gpu_page_quotes_the_committed_h100_run():
    """docs/gpu.md's figures of the one-H100 run at real size: steps, first steps, MFU and the peak."""
    run = json.loads((ROOT / "docs" / "results" / "1x-nvidia-h100-80gb-hbm3-base-shape" / "benchmark.json").read_text())
    gpu_rows = {row["row"]: row for row in run["rows"]}
    page = words(section((ROOT / "docs" / "gpu.md").read_text(encoding="utf-8"), "## One H100 at real size"))

    def ms(row):
        return round(gpu_rows[row]["steady_step_seconds"] * 1000)

    assert f"took {ms('ddp')} ms in fp32 (`single`, `ddp`)" in page and ms("single") == ms("ddp")
    quoted = ("single", "ddp", "dataparallel", "accelerate", "fabric")
    fast = sorted(ms(row) for row in quoted[2:])
    assert f"{fast[0]}-{fast[-1]} ms under DataParallel, Accelerate and Fabric" in page
    for key, against in (("mfu", "the H100's published"), ("mfu_measured", "the")):
        mfus = [gpu_rows[row][key] * 100 for row in quoted]
        assert f"{min(mfus):.0f}-{max(mfus):.0f}% of {against}" in page
    assert f"the {run['matmul_peaks']['cuda fp32']['tflops']:.1f} TFLOP/s its matrix products" in page
    assert f"(`ddp-tf32`, {ms('ddp-tf32')} ms)" in page
    assert f"DeepSpeed ({ms('deepspeed')} ms) and FSDP2 ({ms('fsdp')} ms)" in page
    assert f"took {ms('ddp-amp')} and {ms('ddp-amp-bf16')} ms per step" in page
    assert f"({gpu_rows['ddp-amp']['first_step_seconds']:.2f} and {gpu_rows['ddp-amp-bf16']['first_step_seconds']:.2f} s)" in page
    assert f"fp32's {gpu_rows['ddp']['first_step_seconds']:.2f} s" in page
    assert f"were {ms('ddp-amp') / ms('ddp'):.0f}x slower than fp32" in page
    assert "For 768*s16, expected [s16] to have been codegen-ed" in gpu_rows["ddp+compile"]["reason"]


def test_the_gpu_page_reads_mfu_from_the_committed_h100_run():
    """docs/gpu.md's reading of MFU: the peaks per precision, why fp32 sits at 12%, TF32 at 1.6% and
    16-bit at 0.1% (the ratios of peaks and steps behind them), and the padding mfu_real leaves out."""
    run = json.loads((ROOT / "docs" / "results" / "1x-nvidia-h100-80gb-hbm3-base-shape" / "benchmark.json").read_text())
    gpu_rows = {row["row"]: row for row in run["rows"]}
    page = words(section((ROOT / "docs" / "gpu.md").read_text(encoding="utf-8"), "## Reading MFU", "## The check"))
    single, tf32, amp, bf16 = (gpu_rows[name] for name in ("single", "ddp-tf32", "ddp-amp", "ddp-amp-bf16"))
    peak = {row["compute_precision"]: row["peak_tflops"] for row in gpu_rows.values() if row.get("peak_tflops")}
    assert peak["bf16"] == peak["fp16"]
    assert f"(H100: {peak['fp32']:g} TFLOP/s fp32, {peak['tf32']:g} TF32, {peak['bf16']:g} bf16 and fp16)" in page

    def tflops(row):
        return row["steady_model_flops_per_second"] / 1e12
    assert f"({single['mfu']:.0%} in fp32)" in page
    assert (f"TF32's {peak['tf32'] / peak['fp32']:.0f}x higher peak gave {tflops(tf32):.1f} TFLOP/s against "
            f"`single`'s {tflops(single):.1f}, hence {tf32['mfu']:.1%}") in page
    slower = amp["steady_step_seconds"] / gpu_rows["ddp"]["steady_step_seconds"]
    assert f"{amp['mfu']:.1%}" == f"{bf16['mfu']:.1%}"
    assert f"16-bit's {peak['bf16'] / peak['fp32']:.0f}x, with steps {slower:.0f}x slower, {amp['mfu']:.1%}" in page
    padding, tokens = single["padded_tokens_per_sample"], single["tokens_per_sample"]
    assert f"({padding:.1f} tokens per text of {tokens + padding:.1f})" in page


def test_the_chinese_section_gives_the_quick_starts_durations():
    """The README's durations are written in its quick start and translated in its 中文 section: the two agree."""
    english = re.findall(r"about (\d+) minutes on 2 cores", words(section(README, "## Quick start", "## Prerequisites")))
    chinese = re.findall(r"2 核上约 (\d+) 分钟", section(README, "## 中文说明"))
    assert len(english) == 3 and sorted(english) == sorted(chinese), (english, chinese)


BYTES_RUN = ROOT / "docs" / "results" / "amd-epyc-2-cores-base-shape-bytes" / "benchmark.json"
TINY_BYTES_RUN = ROOT / "docs" / "results" / "amd-epyc-2-cores-bytes" / "benchmark.json"
SENT = ("all-reduce", "reduce-scatter", "all-gather", "broadcast")


def measured_rows(path):
    """{row: its benchmark.json row} of the run's rows that measured their bytes."""
    rows = json.loads(path.read_text(encoding="utf-8"))["rows"]
    return {row["row"]: row for row in rows if row["status"] == "ok" and row["collective_bytes"]["payload_bytes"]}


def test_the_bytes_table_is_the_committed_base_shape_run():
    """docs/anatomy.md's bytes per step at BERT-base's shape: the rows it quotes (the report links every
    row), each one's payload and calls by kind, the ring's bytes and the formula's, in MB of 2^20 bytes."""
    rows = measured_rows(BYTES_RUN)
    quoted = table(ANATOMY, "| row | precision | all-reduce | reduce-scatter | all-gather | broadcast | ring MB | "
                            "formula's ring MB |")
    assert quoted and set(quoted) <= set(rows)
    for name in quoted:
        row = rows[name]
        kinds = row["collective_bytes"]["kinds"]
        expected = [row["precision"], *(f"{kinds[kind]['bytes'] / MB:.2f} ({kinds[kind]['calls']:g})"
                                        if kind in kinds else "-" for kind in SENT),
                    f"{row['collective_bytes']['ring_bytes'] / MB:.2f}",
                    f"{row['collective_formula_bytes']['ring_bytes'] / MB:.2f}"]
        assert quoted[name] == expected, f"docs/anatomy.md's bytes of {name}: {quoted[name]}, the run's {expected}"


def test_the_bytes_notes_are_the_committed_runs():
    rows, tiny = measured_rows(BYTES_RUN), measured_rows(TINY_BYTES_RUN)
    text = words(section(ANATOMY, "## What each strategy sends"))
    parameters = rows["ddp"]["collective_formula_bytes"]["kinds"]["all-reduce"] // 4
    assert f"P = {parameters:,}, {4 * parameters / MB:.2f} MB in fp32" in text
    assert f"Horovod's {rows['horovod']['collective_bytes']['kinds']['all-reduce']['calls']:g} calls a step" in text
    ring = {name: row["collective_bytes"]["ring_bytes"] for name, row in rows.items()}
    assert ring["deepspeed-zero1"] == ring["deepspeed-zero2"]
    assert f"{ring['deepspeed-zero1'] / ring['ddp']:.1f} times DDP's" in text
    ethernet = {name: row["projection"]["published"][2]["efficiency_serial"] for name, row in rows.items()}
    fsdp = 1 - min(efficiency for name, efficiency in ethernet.items() if name.startswith("fsdp"))
    assert f"costs FSDP2 up to {fsdp:.0%} of its step and DDP {1 - ethernet['ddp']:.0%}" in text
    errors = [row["projection"]["here"]["error_serial"] for row in [*rows.values(), *tiny.values()]]
    within = sum(abs(error) <= 0.25 for error in errors)
    assert f"predicted the {len(rows)} base-shape rows' steps and the tiny model's {len(tiny)}" in text
    assert f"within 25% of the measured step for {within} of these {len(errors)} rows" in text
    latency = json.loads(TINY_BYTES_RUN.read_text(encoding="utf-8"))["interconnect"]["3"]["latency_s"]
    assert (f"(+{tiny['horovod-n3']['projection']['here']['error_serial']:.0%} at 3 processes, where a call takes "
            f"{latency * 1000:.0f} ms)") in text
