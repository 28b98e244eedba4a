"""The GPU check's plan (scripts/gpu_plan.py, run by scripts/gpu-check.sh): it measures the goals first,
fits the call's budget with a timeout per launch, drops the least valuable units first and names the
command that runs them, stops a launch at its limit, and brings back everything within the GPU
machine's return rules (one run on the CPU proves it), no weights among it."""
import json
import re
import shutil
import sys
import tarfile
from pathlib import Path

import pytest

from conftest import ROOT, run

sys.path.insert(0, str(ROOT / "scripts"))
import gpu_plan  # noqa: E402

RESERVE = gpu_plan.SETUP_SECONDS + gpu_plan.CLOSING_SECONDS


def default_plan(budget=gpu_plan.DEFAULT_BUDGET):
    return gpu_plan.plan(list(gpu_plan.GROUPS), budget, gpu_plan.measured_launches())


@pytest.mark.quick
def test_the_default_plan_measures_the_goals_first_within_8_minutes_even_when_one_launch_runs_to_its_timeout():
    plan = default_plan()
    assert gpu_plan.DEFAULT_BUDGET == 480
    assert gpu_plan.worst_case(plan.kept) + RESERVE <= 480
    for unit in plan.kept:  # each launch may overrun its estimate by half, at least 30 s, before its timeout
        assert unit.estimate > 0 and gpu_plan.timeout(unit.estimate) >= unit.estimate + 30
    # The peaks, then the goals: fp32 and bf16 eager and as CUDA graphs, compile against ddp's eager, the
    # fastest bf16 row at batch 512; the 32 of the sweep is the goals' own launches.
    kept = [unit.name for unit in plan.kept]
    assert kept[:7] == ["peaks", "ddp", "ddp-amp-bf16", "ddp+cudagraphs", "ddp-amp-bf16+cudagraphs", "ddp+compile",
                        "b512"]
    assert "b32" not in [unit.name for unit in plan.units]
    assert "ddp+compile-static" not in [unit.name for unit in plan.units]  # on a GPU, ddp+compile's row


@pytest.mark.quick
def test_every_launch_hanging_still_ends_the_call_within_its_budget_and_one_hang_drops_nothing():
    """The runner's rule, simulated: each unit launched if its estimate fits the time left, stopped at its limit."""
    plan = default_plan()

    def simulate(duration):  # duration(unit, its timeout) -> seconds its launch takes; -> (time left, launched)
        time_left, launched = 480 - RESERVE, []
        for unit in plan.kept:
            limit = gpu_plan.unit_limit(unit, time_left)
            if limit == 0:
                continue
            time_left -= min(gpu_plan.overhead(unit) + duration(unit, gpu_plan.timeout(unit.estimate)), limit)
            launched.append(unit.name)
        return time_left, launched

    every_launch_hangs = simulate(lambda unit, limit: limit)
    assert every_launch_hangs[0] >= 0 and every_launch_hangs[1][0] == "peaks"
    as_estimated = simulate(lambda unit, limit: unit.estimate)
    assert as_estimated[1] == [unit.name for unit in plan.kept]
    for hung in plan.kept:
        one_hang = simulate(lambda unit, limit: limit if unit is hung else unit.estimate)
        assert one_hang[1] == as_estimated[1], f"{hung.name} running to its timeout dropped a planned unit"


@pytest.mark.quick
@pytest.mark.parametrize("budget", [45, 90, 150, 240, 480, 900, 3000])
def test_a_budget_keeps_the_most_valuable_units_that_fit_and_drops_the_others(budget):
    plan = default_plan(budget)
    order = [unit.name for unit in plan.units]
    kept = [unit.name for unit in plan.kept]
    assert kept == [name for name in order if name in kept], "the kept units run in order of value"
    assert gpu_plan.worst_case(plan.kept) <= budget - RESERVE
    for unit in plan.dropped:  # dropped only because it did not fit beside the more valuable units kept
        before = [kept_unit for kept_unit in plan.kept if order.index(kept_unit.name) < order.index(unit.name)]
        assert gpu_plan.worst_case(before + [unit]) > budget - RESERVE
    if budget >= 150:
        assert kept[:3] == ["peaks", "ddp", "ddp-amp-bf16"]
    smaller = default_plan(budget / 2)
    assert gpu_plan.seconds(smaller.kept) <= gpu_plan.seconds(plan.kept)


@pytest.mark.quick
def test_the_dry_run_prints_the_plan_the_command_and_what_it_brings_back_as_docs_gpu_md_does():
    docs = (ROOT / "docs" / "gpu.md").read_text(encoding="utf-8")
    commands = [line.strip() for line in docs.splitlines() if "scripts/gpu-check.sh --wheels" in line]
    assert commands == [gpu_plan.THERE], "docs/gpu.md gives the command to run there once, as the plan prints it"
    out = run(["bash", "scripts/gpu-check.sh", "--dry-run"]).stdout
    assert f"\n  {gpu_plan.THERE}\n" in out and f"$OUT/{gpu_plan.ARCHIVE}" in out
    total = re.search(r"(\d+) s of the 480 s budget", out)
    assert total and int(total[1]) <= 480 and f"about {total[1]} s with one launch running to its timeout" in docs
    for goal in ["ddp", "ddp-amp-bf16", "ddp\\+cudagraphs", "ddp-amp-bf16\\+cudagraphs", "ddp\\+compile", "b512"]:
        assert re.search(rf"^  {goal} +\d+ +\d+s  ", out, re.M), goal  # kept, with its timeout
    dropped = re.search(r"^  b1024 +\d+ +dropped", out, re.M)
    second = re.search(rf"^  {re.escape(gpu_plan.THERE)} peaks (.+)$", out, re.M)
    assert dropped and second and "b1024" in second[1].split() and "more" in second[1].split()
    chosen = run(["bash", "scripts/gpu-check.sh", "--dry-run", "tests", "b1024", "--budget", "900"]).stdout
    assert re.findall(r"^  (\S+) +\d+ +\d+s", chosen, re.M) == ["tests", "b1024"]


@pytest.mark.quick
@pytest.mark.parametrize("arguments, message", [
    (["bogus"], "unknown group 'bogus'"),
    (["--budget", "-5"], "--budget -5: give seconds"),
    (["--sweep", "32,x"], "--sweep"),
    (["--max-steps", "0"], "--max-steps must be at least 1"),
    (["--out", "README.md"], "--out README.md is a file: name a folder"),
])
def test_bad_input_gets_one_line_and_status_2(arguments, message):
    for mode in (["--dry-run"], []):  # the call refuses it before any launch, as its dry run does
        done = run(["bash", "scripts/gpu-check.sh", *mode, *arguments], check=False)
        assert done.returncode == 2 and done.stderr.count("\n") == 1 and message in done.stderr, done.stderr


@pytest.mark.quick
def test_the_launches_after_a_stopped_one_compile_into_a_new_cache(tmp_path, monkeypatch):
    """A hang costs its limit, not the call (tests/test_launching.py stops it at its timeout with what it
    started); the launches after it compile into a new inductor cache (a kernel it left half-written fails
    every compile)."""
    monkeypatch.setattr(gpu_plan, "WORK_ROOT", tmp_path)
    monkeypatch.setattr(gpu_plan, "WORK", tmp_path / "OUT-1234")
    env = {}
    caches = []
    for first in (True, False, False, True):
        gpu_plan.fresh_compile_cache(env, first)
        caches.append(Path(env["TORCHINDUCTOR_CACHE_DIR"]).name)
    assert caches == ["OUT-1234-inductor-1", "OUT-1234-inductor-2", "OUT-1234-inductor-3", "OUT-1234-inductor-1"]
    assert sorted(path.name for path in tmp_path.iterdir()) == ["OUT-1234-inductor-1"]


RETURNED_NAME = re.compile(r"[A-Za-z0-9._-]+")


def test_the_check_on_a_cpu_brings_back_every_row_within_the_gpu_machines_return_rules(tmp_path, request):
    """Two groups' units (a goal row and a default row) on the CPU into an empty folder standing for $OUT:
    at most 8 files, 2 folders down, plain names, 16 MiB each; the archive holds every row's
    benchmark.json, table and result.json and no weights; the peaks are not measured again per launch;
    the output's last 12,000 characters hold every row's table with its overhead."""
    out = tmp_path / "OUT"
    out.mkdir()
    request.addfinalizer(lambda: [shutil.rmtree(folder) for folder in  # the launches' folder, outside $OUT
                                  gpu_plan.WORK_ROOT.glob(f"{gpu_plan.work_folder(out.resolve()).name}*")])
    done = run(["bash", "scripts/gpu-check.sh", "ddp", "single", "--device", "cpu", "--budget", "0", "--out", str(out),
                "--model", "tiny", "--max-steps", "3", "--", "--nprocs", "1", "--max-samples", "120",
                "--dev-ratio", "0.1", "--batch-size", "8"], timeout=600)
    returned = [path for path in out.rglob("*") if path.is_file()]
    assert 0 < len(returned) <= 8
    for path in returned:
        parts = path.relative_to(out).parts
        assert len(parts) <= 3 and all(RETURNED_NAME.fullmatch(part) for part in parts), parts
        assert path.stat().st_size <= 16 * 2**20
    with tarfile.open(out / gpu_plan.ARCHIVE) as archive:
        archive.extractall(tmp_path / "back", filter="data")
    back = tmp_path / "back" / "gpu-check"
    assert not [path for path in back.rglob("*") if path.name == "model" or path.suffix == ".safetensors"]
    tail = done.stdout[-12000:]
    every_row = tail[tail.index("== every row"):]
    for unit in ("ddp", "single"):
        report = json.loads((back / unit / "benchmark.json").read_text(encoding="utf-8"))
        (row,) = report["rows"]
        assert row["row"] == unit and row["status"] == "ok" and (back / unit / unit / "result.json").is_file()
        assert f"| {unit} " in (back / unit / "benchmark.md").read_text(encoding="utf-8")
        assert report["matmul_peaks"] == {"cpu fp32": {"error": "not in --matmul-peaks"}}
        assert row["steady_steps"] == 2 and row["dev_samples"] == 12
        overhead = f"{row['wall_seconds'] - row['train_seconds']:.1f}"
        assert re.search(rf"^\| {unit} +\| {unit} +\| 8 +\| ok +\| [\d.]+ +\| [\d.]+ +\| {overhead} ", every_row, re.M)
    summary = json.loads((out / gpu_plan.SUMMARY_JSON).read_text(encoding="utf-8"))
    assert [(unit["unit"], unit["group"], unit["status"]) for unit in summary["units"]] == [
        ("ddp", "goals", "ok"), ("single", "default", "ok")]
