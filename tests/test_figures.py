"""Figures quoted by hand are the committed run's: the README's results table and the model state its
strategy guide quotes, and the emulated-bf16 slowdown docs/native.md gives, are read back from
docs/results/amd-epyc-2-cores/benchmark.json. (docs/benchmark.md shows that run's table verbatim:
tests/test_benchmark.py checks it.)"""
import json
import re

import pytest

from conftest import ROOT

RUN = ROOT / "docs" / "results" / "amd-epyc-2-cores" / "benchmark.json"
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


def test_the_model_state_the_strategy_guide_quotes_is_the_committed_runs(rows):
    """DDP's, ZeRO-2's and FSDP2's model state per process, as the README's guide (and its 中文) quote them."""
    megabytes = {name: f"{rows[name]['model_state_bytes']['total'] / 2**20:.2f} MB" for name in ("ddp", "deepspeed",
                                                                                               "fsdp")}
    guide = README[README.index("## Which strategy should I use?"):README.index("## Getting the real weights")]
    assert f"holds the whole model state ({megabytes['ddp']} for the tiny model" in guide
    assert f"{megabytes['deepspeed']} per process against DDP's {megabytes['ddp'][:-3]}" in guide
    assert f"exactly 1/N of everything, {megabytes['fsdp']} per process" in guide
    chinese = README[README.index("## 中文说明"):]
    for figure in megabytes.values():
        assert figure in chinese, figure


def test_the_emulated_bf16_slowdown_is_the_committed_runs(rows):
    amp, fp32 = rows["ddp-amp"], rows["ddp-spawn"]
    native = (ROOT / "docs" / "native.md").read_text(encoding="utf-8")
    quoted = re.search(r"trained in ([\d.]+) s where `ddp-spawn`,\s+the same script in fp32, took ([\d.]+) s: "
                       r"([\d.]+)x slower, and ([\d.]+)x the single-device throughput", native)
    assert quoted, "docs/native.md no longer quotes the emulated bf16 run"
    assert quoted.groups() == (f"{amp['train_seconds']:.1f}", f"{fp32['train_seconds']:.1f}",
                               f"{amp['train_seconds'] / fp32['train_seconds']:.1f}", f"{amp['speedup']:.2f}")
