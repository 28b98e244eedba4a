"""Each script is a lesson read as a diff of the one before it: keep each diff small.

`diff single-gpu-cls.py multi-gpu-distributed-cls.py` should show what DDP changes and little else:
a step keeps its mark ([ranks], [group], [wrap], [data], [leave], ...) from script to script, so
that only what the strategy changes shows. A change that buries a lesson (machinery pasted into a
script instead of common.py or support/) grows its diff past the budget here, and CI says so. Raise
a budget only when the lesson itself grew.
"""
import ast
import pickle
import subprocess

import pytest

from conftest import ROOT

# (predecessor, script, budget): at most `budget` lines added or removed between the two.
LESSONS = [
    ("single-gpu-cls.py", "multi-gpu-dataparallel-cls.py", 95),
    ("single-gpu-cls.py", "multi-gpu-distributed-cls.py", 90),
    ("multi-gpu-distributed-cls.py", "multi-gpu-distributed-mp-cls.py", 70),
    ("multi-gpu-distributed-mp-cls.py", "multi-gpu-distributed-mp-amp-cls.py", 65),
    ("multi-gpu-distributed-cls.py", "multi-gpu-horovod-cls.py", 165),
    ("multi-gpu-distributed-cls.py", "multi-gpu-deepspeed-cls.py", 185),
    ("multi-gpu-distributed-cls.py", "multi-gpu-accelerate-cls.py", 160),
    ("multi-gpu-distributed-cls.py", "multi-gpu-fsdp-cls.py", 170),
    ("multi-gpu-distributed-cls.py", "multi-gpu-fabric-cls.py", 155),
    ("multi-gpu-distributed-cls.py", "multi-gpu-transformers-cls.py", 175),
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


# The house, one floor per duty: a module imports only from its own floor or those below it. The
# instruments sit above the loop: the scripts hand them to it, and it knows only the callback points.
FLOORS = {"lessons": 4, "predict": 4, "benchmark": 4, "libraries": 3, "bench": 3, "microbenchmarks": 3,
          "scripts": 4, "instruments": 3, "common": 2, "support": 1}
# The runner's entry file: the command line's help and main; the rest is in bench/.
MAX_ENTRY_LINES = 200
MAX_FUNCTION_LINES = 60


def product_files():
    """Every Python file outside tests/ and the virtual environment, by its path from the root."""
    return sorted(path.relative_to(ROOT) for path in ROOT.rglob("*.py")
                  if path.relative_to(ROOT).parts[0] not in (".venv", "tests", "output"))


def module_name(path):
    return ".".join(path.with_suffix("").parts)


def floor(module):
    top = module.split(".")[0]
    return FLOORS["lessons"] if top.endswith("-cls") else FLOORS[top]


def imported_modules(path, known):
    """The project's modules `path` imports, at the top or inside a function."""
    tree = ast.parse((ROOT / path).read_text(encoding="utf-8"))
    package = module_name(path).rsplit(".", 1)[0] if len(path.parts) > 1 else ""
    found = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found |= {alias.name for alias in node.names}
        elif isinstance(node, ast.ImportFrom):
            base = package if node.level else (node.module or "")
            base = f"{base}.{node.module}" if node.level and node.module else base
            found |= {base} | {f"{base}.{alias.name}" for alias in node.names}
    return {name for name in found if name in known}


def test_imports_run_one_way_down_the_floors_and_never_in_a_circle():
    paths = product_files()
    known = {module_name(path) for path in paths}
    graph = {module_name(path): imported_modules(path, known) - {module_name(path)} for path in paths}
    upward = [(module, target) for module, targets in graph.items() for target in targets
              if floor(target) > floor(module)]
    assert not upward, f"imports from a lower floor to a higher one: {upward}"
    loop, reached = set(), ["common"]  # the loop's room: common.py and all it imports
    while reached:
        loop.add(module := reached.pop())
        reached += graph[module] - loop
    assert {"common", "support.callbacks"} <= loop and not any(m.startswith("instruments") for m in loop), loop
    done, visiting = set(), []

    def visit(module):
        if module in visiting:
            raise AssertionError(f"imports in a circle: {' -> '.join(visiting[visiting.index(module):] + [module])}")
        if module not in done:
            visiting.append(module)
            for target in sorted(graph[module]):
                visit(target)
            visiting.pop()
            done.add(module)

    for module in sorted(graph):
        visit(module)


def test_the_runners_entry_file_is_short():
    lines = len((ROOT / "benchmark.py").read_text(encoding="utf-8").splitlines())
    assert lines < MAX_ENTRY_LINES, f"benchmark.py has {lines} lines: move what is not its main into bench/"


def test_no_function_outside_the_tests_is_past_a_screen():
    too_long = {}
    for path in product_files():
        for node in ast.walk(ast.parse((ROOT / path).read_text(encoding="utf-8"))):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                length = node.end_lineno - node.lineno + 1
                if length > MAX_FUNCTION_LINES:
                    too_long[f"{path}: {node.name}"] = length
    assert not too_long, f"functions over {MAX_FUNCTION_LINES} lines: {too_long}"


# Where a parsed option may be written: the runner's and the GPU check's own parsers decide their
# defaults in their parse step (bench/options.py, scripts/gpu_plan.py); the scripts' options are written
# nowhere: support/options.resolve builds a new record, which refuses writes.
RESOLVE_STEPS = {"bench/options.py": {"parse_args", "check_runner_args", "apply_real_size"},
                 "scripts/gpu_plan.py": {"parse", "check_numbers"}}


def holds_options(node):
    """Whether `node` names a record of parsed options: `args`, or `something.args`."""
    return (isinstance(node, ast.Name) and node.id == "args") or (isinstance(node, ast.Attribute)
                                                                   and node.attr == "args")


def option_writes(tree):
    """(line, function) of every write to a parsed option in `tree`: `args.x = ...` (augmented, annotated,
    in a tuple, deleted), setattr/delattr(args, ...), and writes through vars(args) or args.__dict__."""
    writes = []

    def targets(node):
        if isinstance(node, (ast.Assign, ast.Delete)):
            return node.targets
        return [node.target] if isinstance(node, (ast.AugAssign, ast.AnnAssign)) else []

    def written(target):
        if isinstance(target, (ast.Tuple, ast.List)):
            return any(written(element) for element in target.elts)
        if isinstance(target, ast.Starred):
            return written(target.value)
        if isinstance(target, ast.Subscript):  # vars(args)[name] = ..., args.__dict__[name] = ...
            inner = target.value
            return (isinstance(inner, ast.Call) and getattr(inner.func, "id", None) == "vars" and inner.args
                    and holds_options(inner.args[0])) or (isinstance(inner, ast.Attribute)
                                                          and inner.attr == "__dict__" and holds_options(inner.value))
        return isinstance(target, ast.Attribute) and holds_options(target.value)

    def visit(node, function):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            function = node.name
        calls_setattr = (isinstance(node, ast.Call) and getattr(node.func, "id", None) in ("setattr", "delattr")
                         and node.args and holds_options(node.args[0]))
        if calls_setattr or any(written(target) for target in targets(node)):
            writes.append((node.lineno, function))
        for child in ast.iter_child_nodes(node):
            visit(child, function)

    visit(tree, None)
    return writes


def test_no_option_is_written_after_it_is_resolved():
    """What a run did is what options.resolve decided, before any work: no module writes an option."""
    found = [f"{path}:{line} in {function}" for path in product_files()
             for line, function in option_writes(ast.parse((ROOT / path).read_text(encoding="utf-8")))
             if function not in RESOLVE_STEPS.get(str(path), ())]
    assert not found, f"options written after they are resolved: {found}"
    planted = "def f(args, run):\n    args.a = 1\n    args.b += 1\n    run.args.c, d = 1, 2\n    " \
              "setattr(args, 'e', 1)\n    vars(args)['f'] = 1\n    del args.g\n    args.h.append(1)\n"
    assert [line for line, _ in option_writes(ast.parse(planted))] == [2, 3, 4, 5, 6, 7]


def test_the_resolved_options_refuse_writes():
    """The record options.resolve returns (the runner's too) cannot be written, even by mistake, and
    crosses to spawned processes as it is."""
    from bench import options as runner_options
    from support import options
    args = options.resolve(options.build_parser("single-gpu-cls.py", "").parse_args(["--device", "cpu"]))
    assert (args.pad_to_multiple_of, args.compile_dynamic, args.compile) == (1, "dynamic", False)
    with pytest.raises(AttributeError, match="--pad-to-multiple-of is resolved once"):
        args.pad_to_multiple_of = 16
    with pytest.raises(AttributeError, match="--lr is resolved once"):
        setattr(args, "lr", 1.0)
    with pytest.raises(AttributeError):
        del args.seed
    assert pickle.loads(pickle.dumps(args)) == args
    with pytest.raises(AttributeError, match="--repeat is resolved once"):
        runner_options.parse_args([], gpus=0).repeat = 2
