"""Figures quoted by hand are the committed runs': the README's results table and the emulated-bf16
slowdown docs/native.md gives are read back from docs/results/amd-epyc-2-cores/benchmark.json, the
model state the README's strategy guide quotes from the real-size run's. (docs/benchmark.md shows the
main run's table verbatim: tests/test_benchmark.py checks it.)"""
import json
import re

import pytest

from conftest import ROOT

RUN = ROOT / "docs" / "results" / "amd-epyc-2-cores" / "benchmark.json"
REAL_SIZE_RUN = ROOT / "docs" / "results" / "amd-epyc-2-cores-base-shape" / "benchmark.json"
README = (ROOT / "README.md").read_text(encoding="utf-8")


@pytest.fixture(scope="module")
def rows():
    return {row["row"]: row for row in json.loads(RUN.read_text(encoding="utf-8"))["rows"]}


def results_table(text):
    """{row name: [cells]} of the table under the README's "## Measured" heading."""
    section = text[text.index("## Measured"):]
    table = {}
    for line in section.splitlines()[section.splitlines().index("| row | processes | global batch | train s | "
                                                                  "speed-up | dev acc |") + 2:]:
        if not line.startswith("| "):
            break
        cells = [cell.strip() for cell in line.strip("|").split("|")]
        table[cells[0].split(" ")[0]] = cells[1:]
    return table


def test_the_readme_results_table_is_the_committed_run(rows):
    table = results_table(README)
    assert table.keys() == rows.keys()
    for name, cells in table.items():
        row = rows[name]
        expected = [str(row["processes"]), str(row["global_batch"]), f"{row['train_seconds']:.1f}",
                    f"{row['speedup']:.2f}x", f"{row['dev_accuracy']:.4f}"]
        assert cells == expected, f"README row {name}: {cells}, the committed run says {expected}"


def test_the_model_state_the_strategy_guide_quotes_is_the_real_size_runs():
    """The README's guide (and its 中文) quote BERT-base's model state per process, measured by
    ./run.sh --real-size: DDP, ZeRO-2 and ZeRO-3 and FSDP2 at 2 and 4 processes."""
    measured = {row["row"]: f"{row['model_state_bytes']['total'] / 2**20:,.2f}"
                for row in json.loads(REAL_SIZE_RUN.read_text(encoding="utf-8"))["rows"]}
    guide = README[README.index("## Which strategy should I use?"):README.index("## Getting the real weights")]
    assert f"holds the whole model state: {measured['ddp']} MB for BERT-base" in guide
    assert f"{measured['deepspeed-n2']} MB per process at 2 processes, {measured['deepspeed-n4']} at 4" in guide
    assert f"{measured['deepspeed-zero3-n2']} MB per process at 2, {measured['deepspeed-zero3-n4']} at 4" in guide
    assert f"{measured['fsdp-n2']} MB per process at 2 processes, {measured['fsdp-n4']} at 4" in guide
    chinese = README[README.index("## 中文说明"):]
    for figure in measured.values():
        assert figure in chinese, figure


def test_the_emulated_bf16_slowdown_is_the_committed_runs(rows):
    amp, fp32 = rows["ddp-amp"], rows["ddp-spawn"]
    native = (ROOT / "docs" / "native.md").read_text(encoding="utf-8")
    quoted = re.search(r"trained in ([\d.]+) s where `ddp-spawn`,\s+the same script in fp32, took ([\d.]+) s: "
                       r"([\d.]+)x slower, and ([\d.]+)x the single-device throughput", native)
    assert quoted, "docs/native.md no longer quotes the emulated bf16 run"
    assert quoted.groups() == (f"{amp['train_seconds']:.1f}", f"{fp32['train_seconds']:.1f}",
                               f"{amp['train_seconds'] / fp32['train_seconds']:.1f}", f"{amp['speedup']:.2f}")
