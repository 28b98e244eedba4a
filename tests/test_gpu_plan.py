"""The GPU check's plan (scripts/gpu_plan.py, run by scripts/gpu-check.sh) without a GPU or a launch: it
fits the call's budget with its per-launch timeouts, drops the least valuable units first, stops a launch
at its limit, brings back no weights, and its dry-run prints the command docs/gpu.md gives."""
import re
import sys
import time
from pathlib import Path

import pytest

from conftest import ROOT, run

sys.path.insert(0, str(ROOT / "scripts"))
import gpu_plan  # noqa: E402

pytestmark = pytest.mark.quick
RESERVE = gpu_plan.SETUP_SECONDS + gpu_plan.CLOSING_SECONDS


def default_plan(budget=gpu_plan.DEFAULT_BUDGET):
    return gpu_plan.plan(list(gpu_plan.GROUPS), budget, gpu_plan.h100_launches())


def test_the_default_plan_fits_8_minutes_even_when_one_launch_runs_to_its_timeout():
    plan = default_plan()
    launches = [launch for unit in plan.kept for launch in unit.launches]
    assert gpu_plan.DEFAULT_BUDGET == 480
    assert gpu_plan.worst_case(plan.kept) + RESERVE <= 480
    # Each launch may overrun its estimate by half, at least 30 s, before its timeout stops it.
    for unit in plan.kept:
        for launch in unit.launches:
            assert gpu_plan.group_timeout(plan.kept, unit.group) >= launch.estimate + 30
    # The most valuable come first and are all there: the peaks, every precision row, DDP compiled.
    assert [unit.name for unit in plan.kept][:8] == ["peaks", *gpu_plan.PRECISION_ROWS, "ddp+compile"]
    assert all(launch.estimate > 0 for launch in launches)


def test_every_launch_hanging_still_ends_the_call_within_its_budget_and_one_hang_drops_nothing():
    """The runner's rule, simulated: each group re-planned on the time left and stopped at its limit."""
    plan = default_plan()

    def simulate(duration):  # duration(launch, group timeout) -> seconds that launch takes
        time_left, ran = 480 - RESERVE, []
        for group in gpu_plan.GROUPS:
            units, limit = gpu_plan.fit_group([unit for unit in plan.kept if unit.group == group], time_left)
            if not units:
                continue
            assert limit <= time_left
            overhead = gpu_plan.seconds(units) - sum(launch.estimate for unit in units for launch in unit.launches)
            took = overhead + sum(duration(launch, gpu_plan.group_timeout(units, group))
                                  for unit in units for launch in unit.launches)
            time_left -= min(took, limit)
            ran += [unit.name for unit in units if took <= limit + 1e-6]
        return time_left, ran

    every_launch_hangs = simulate(lambda launch, limit: limit)
    assert every_launch_hangs[0] >= 0 and every_launch_hangs[1][0] == "peaks"
    as_estimated = simulate(lambda launch, limit: launch.estimate)
    assert as_estimated[1] == [unit.name for unit in plan.kept]
    for hung in [launch.name for unit in plan.kept for launch in unit.launches]:
        one_hang = simulate(lambda launch, limit: limit if launch.name == hung else launch.estimate)
        assert one_hang[1] == as_estimated[1], f"{hung} running to its timeout dropped a planned unit"


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
        assert kept[:2] == ["peaks", "ddp"]
    smaller = default_plan(budget / 2)
    assert gpu_plan.seconds(smaller.kept) <= gpu_plan.seconds(plan.kept)


def test_no_budget_keeps_every_unit_and_the_sweep_leaves_out_the_precision_rows_batch():
    plan = gpu_plan.plan(list(gpu_plan.GROUPS), None, gpu_plan.h100_launches())
    assert not plan.dropped and [unit.name for unit in plan.kept if unit.group == "sweep"] == ["b128", "b512"]
    alone = gpu_plan.plan(["sweep"], None, gpu_plan.h100_launches())
    assert [unit.name for unit in alone.kept] == ["b128", "b512", "b32"]


def test_the_dry_run_prints_the_plan_and_the_exact_command_docs_gpu_md_gives():
    docs = (ROOT / "docs" / "gpu.md").read_text(encoding="utf-8")
    commands = [line.strip() for line in docs.splitlines() if "scripts/gpu-check.sh --wheels" in line]
    assert commands == [gpu_plan.THERE], "docs/gpu.md gives the command to run there once, as the plan prints it"
    out = run(["bash", "scripts/gpu-check.sh", "--dry-run"]).stdout
    assert f"\n  {gpu_plan.THERE}\n" in out
    total = re.search(r"(\d+) s of the 480 s budget", out)
    assert total and int(total[1]) <= 480
    assert re.search(r"^  ddp-amp-bf16\+compile +\d+ +dropped", out, re.M)
    chosen = run(["bash", "scripts/gpu-check.sh", "--dry-run", "tests", "compiled", "--budget", "900"]).stdout
    assert [name for name in re.findall(r"^(\w+): ", chosen, re.M) if name in gpu_plan.GROUPS] == ["tests", "compiled"]


@pytest.mark.parametrize("arguments, message", [
    (["bogus"], "unknown group 'bogus'"),
    (["--budget", "-5"], "--budget -5: give seconds"),
    (["--sweep", "32,x"], "--sweep"),
    (["--max-steps", "0"], "--max-steps must be at least 1"),
])
def test_bad_input_gets_one_line_and_status_2(arguments, message):
    done = run(["bash", "scripts/gpu-check.sh", "--dry-run", *arguments], check=False)
    assert done.returncode == 2 and done.stderr.count("\n") == 1 and message in done.stderr, done.stderr


def test_a_launch_is_stopped_at_its_limit_with_what_it_started(tmp_path):
    """A hang costs its limit, not the call: the launch and the processes it started are stopped."""
    child = tmp_path / "child.pid"
    command = [sys.executable, "-c", "import signal, subprocess, sys, time; signal.signal(signal.SIGTERM, signal.SIG_IGN); "
               f"open({str(child)!r}, 'w').write(str(subprocess.Popen(['sleep', '60']).pid)); time.sleep(60)"]
    started = time.monotonic()
    status, took = gpu_plan.launch(command, tmp_path / "hang.log", 1, None, grace=1)
    assert status is None and took < 10 and time.monotonic() - started < 10
    assert "stopped after 1 s" in (tmp_path / "hang.log").read_text(encoding="utf-8")
    pid = int(child.read_text())
    for _ in range(50):
        state = Path(f"/proc/{pid}/stat")
        if not state.exists() or state.read_text().split()[2] == "Z":
            break
        time.sleep(0.1)
    else:
        pytest.fail(f"the launch's child {pid} still runs")


def test_what_comes_back_is_small_and_never_a_models_weights(tmp_path):
    work, out = tmp_path / "work", tmp_path / "out"
    for name, size in [("benchmark.md", 10), ("benchmark.png", 10), ("ddp.log", 10), ("ddp/result.json", 10),
                       ("ddp/model/model.safetensors", 10), ("ddp/model/config.json", 10),
                       ("ddp/checkpoint-step2/state.json", 10), ("ddp/trace.json", 3 * 2**20)]:
        (work / name).parent.mkdir(parents=True, exist_ok=True)
        (work / name).write_bytes(b"x" * size)
    gpu_plan.sync(work, out)
    assert sorted(str(path.relative_to(out)) for path in out.rglob("*") if path.is_file()) == [
        "benchmark.md", "benchmark.png", "ddp.log", "ddp/result.json"]
    assert not gpu_plan.WORK.is_relative_to(ROOT / "output" / "gpu-check")
