"""Each script is a lesson read as a diff of the one before it: keep each diff small.

`diff single-gpu-cls.py multi-gpu-distributed-cls.py` should show what DDP changes and little else:
a step keeps its mark ([ranks], [group], [wrap], [data], [leave], ...) from script to script, so
that only what the strategy changes shows. A change that buries a lesson (machinery pasted into a
script instead of common.py or support/) grows its diff past the budget here, and CI says so. Raise
a budget only when the lesson itself grew.
"""
import subprocess

import pytest

from conftest import ROOT

# (predecessor, script, budget): at most `budget` lines added or removed between the two.
LESSONS = [
    ("single-gpu-cls.py", "multi-gpu-dataparallel-cls.py", 95),
    ("single-gpu-cls.py", "multi-gpu-distributed-cls.py", 100),
    ("multi-gpu-distributed-cls.py", "multi-gpu-distributed-mp-cls.py", 70),
    ("multi-gpu-distributed-mp-cls.py", "multi-gpu-distributed-mp-amp-cls.py", 65),
    ("multi-gpu-distributed-cls.py", "multi-gpu-horovod-cls.py", 170),
    ("multi-gpu-distributed-cls.py", "multi-gpu-deepspeed-cls.py", 185),
    ("multi-gpu-distributed-cls.py", "multi-gpu-accelerate-cls.py", 170),
    ("multi-gpu-distributed-cls.py", "multi-gpu-fsdp-cls.py", 170),
    ("multi-gpu-distributed-cls.py", "multi-gpu-fabric-cls.py", 160),
    ("multi-gpu-distributed-cls.py", "multi-gpu-transformers-cls.py", 180),
]
# No script is longer than this, docstring and comments included.
MAX_SCRIPT_LINES = 200


def changed_lines(before, after):
    """Lines added plus lines removed: `diff before after | grep -c '^[<>]'`."""
    diff = subprocess.run(["diff", str(before), str(after)], capture_output=True, text=True, check=False).stdout
    return sum(1 for line in diff.splitlines() if line[:1] in "<>")


def test_changed_lines_counts_additions_and_removals(tmp_path):
    (tmp_path / "a").write_text("a\nb\nc\n")
    (tmp_path / "b").write_text("a\nB\nc\nd\n")
    assert changed_lines(tmp_path / "a", tmp_path / "b") == 3  # b removed, B and d added
    assert changed_lines(tmp_path / "a", tmp_path / "a") == 0


@pytest.mark.parametrize("before, after, budget", LESSONS, ids=[after for _, after, _ in LESSONS])
def test_each_lesson_is_a_small_diff_of_its_predecessor(before, after, budget):
    changed = changed_lines(ROOT / before, ROOT / after)
    assert changed <= budget, (f"diff {before} {after} changes {changed} lines, over its budget of {budget}: "
                               "move what is not the strategy's lesson into common.py or a helper module")


def test_every_script_is_a_lesson_with_a_budget():
    scripts = {path.name for path in ROOT.glob("*-cls.py")}
    assert scripts == {"single-gpu-cls.py"} | {after for _, after, _ in LESSONS}
    for name in scripts:
        lines = len((ROOT / name).read_text(encoding="utf-8").splitlines())
        assert lines <= MAX_SCRIPT_LINES, f"{name} has {lines} lines, over {MAX_SCRIPT_LINES}"
