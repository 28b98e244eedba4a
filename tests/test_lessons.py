"""Each script is a lesson read as a diff of the one before it: keep each diff small.

`diff single-gpu-cls.py multi-gpu-distributed-cls.py` should show what DDP changes and little else.
A change that buries a lesson (machinery pasted into a script instead of common.py or a helper
module such as deepspeed_setup.py, spawn_setup.py, transformers_setup.py or fabric_setup.py) grows
its diff past the budget here, and CI says so. Raise a budget only when the lesson
itself grew.
"""
import difflib

import pytest

from conftest import ROOT

# (predecessor, script, budget): at most `budget` lines added or removed between the two.
LESSONS = [
    ("single-gpu-cls.py", "multi-gpu-dataparallel-cls.py", 95),  # 90, then its refusal of --compile
    ("single-gpu-cls.py", "multi-gpu-distributed-cls.py", 95),
    ("multi-gpu-distributed-cls.py", "multi-gpu-distributed-mp-cls.py", 80),
    ("multi-gpu-distributed-mp-cls.py", "multi-gpu-distributed-mp-amp-cls.py", 65),
    ("multi-gpu-distributed-cls.py", "multi-gpu-horovod-cls.py", 160),
    ("multi-gpu-distributed-cls.py", "multi-gpu-deepspeed-cls.py", 195),
    ("multi-gpu-distributed-cls.py", "multi-gpu-accelerate-cls.py", 175),
    ("multi-gpu-distributed-cls.py", "multi-gpu-fsdp-cls.py", 175),
    ("multi-gpu-distributed-cls.py", "multi-gpu-fabric-cls.py", 150),
    ("multi-gpu-distributed-cls.py", "multi-gpu-transformers-cls.py", 185),
]
# No script is longer than this, docstring and comments included.
MAX_SCRIPT_LINES = 200


def changed_lines(before, after):
    """Lines added plus lines removed, as `diff before after | grep -c '^[<>]'` counts them."""
    diff = difflib.unified_diff(before.splitlines(), after.splitlines(), lineterm="", n=0)
    return sum(1 for line in diff if line[:1] in "+-" and not line.startswith(("+++", "---")))


def test_changed_lines_counts_additions_and_removals():
    assert changed_lines("a\nb\nc\n", "a\nB\nc\nd\n") == 3  # b removed, B and d added
    assert changed_lines("same\n", "same\n") == 0


@pytest.mark.parametrize("before, after, budget", LESSONS, ids=[after for _, after, _ in LESSONS])
def test_each_lesson_is_a_small_diff_of_its_predecessor(before, after, budget):
    changed = changed_lines((ROOT / before).read_text(encoding="utf-8"), (ROOT / after).read_text(encoding="utf-8"))
    assert changed <= budget, (f"diff {before} {after} changes {changed} lines, over its budget of {budget}: "
                               "move what is not the strategy's lesson into common.py or a helper module")


def test_every_script_is_a_lesson_with_a_budget():
    scripts = {path.name for path in ROOT.glob("*-cls.py")}
    assert scripts == {"single-gpu-cls.py"} | {after for _, after, _ in LESSONS}
    for name in scripts:
        lines = len((ROOT / name).read_text(encoding="utf-8").splitlines())
        assert lines <= MAX_SCRIPT_LINES, f"{name} has {lines} lines, over {MAX_SCRIPT_LINES}"
