"""The suite's and the planner's layout, read from the source (pure tier: nothing is imported or run).

- Test files import no other test module and load no benchmark script: shared code lives in
  `tests/helpers/` or in the package (issue 13, item 6).
- `modelpar.planner` is pure: the modules it imports, followed through every ``import`` statement
  (module level and inside functions), include no training runtime, CLI, launcher, calibration or
  measurement module and nothing that starts a process (issue 13, item 4). The fresh-interpreter
  version of this check is `tests/test_cli.py::test_planner_imports_no_runtime_cli_or_launcher`.
"""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
TESTS = ROOT / "tests"
BENCHMARKS = ROOT / "benchmarks"



def _walk(tree: ast.AST, functions: bool):
    """The nodes of ``tree``; without ``functions``, not those inside function bodies (what runs on import)."""
    if functions:
        yield from ast.walk(tree)
        return
    todo = [tree]
    while todo:
        node = todo.pop()
        yield node
        todo += [c for c in ast.iter_child_nodes(node) if not isinstance(c, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda))]


def _imports(tree: ast.AST, functions: bool = True) -> list[tuple[str, int]]:
    """(dotted module name, line) of every import in ``tree`` (without ``functions``: those run on
    import, not inside function bodies), relative ones excluded."""
    out = []
    for node in _walk(tree, functions):
        if isinstance(node, ast.Import):
            out += [(a.name, node.lineno) for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
            out.append((node.module, node.lineno))
            out += [(f"{node.module}.{a.name}", node.lineno) for a in node.names]
    return out


def _test_files() -> list[Path]:
    return sorted(p for p in TESTS.rglob("*.py") if "__pycache__" not in p.parts)


def suite_layout_offences(tests: Path = TESTS, benchmarks: Path = BENCHMARKS) -> set[tuple[str, str]]:
    """{(file under tests/, what it loads)}: an import of a module that is a file directly in
    ``tests/`` (a test module or conftest), an import of a benchmark script's name, or a string
    naming a ``benchmarks/*.py`` file passed to a loader (``spec_from_file_location``, ``run_path``,
    ``import_module``, ``sys.path`` edits). Running a benchmark as a command (its CLI) is allowed."""
    test_modules = {p.stem for p in tests.glob("*.py")}
    bench_modules = {p.stem for p in benchmarks.rglob("*.py")}
    loaders = {"spec_from_file_location", "run_path", "import_module", "insert", "append", "SourceFileLoader"}
    out = set()
    for path in sorted(p for p in tests.rglob("*.py") if "__pycache__" not in p.parts):
        rel = path.relative_to(tests).as_posix()
        tree = ast.parse(path.read_text(), filename=str(path))
        for name, _ in _imports(tree):
            top = name.split(".")[0]
            if top in test_modules and top != path.stem:
                out.add((rel, f"tests/{top}.py"))
            if top == "tests" and len(name.split(".")) > 1 and name.split(".")[1] in test_modules:
                out.add((rel, f"tests/{name.split('.')[1]}.py"))
            if top in bench_modules or top == "benchmarks":
                out.add((rel, f"benchmarks/{name.split('.')[1] if top == 'benchmarks' else top}.py"))
        for node in ast.walk(tree):
            if not isinstance(node, ast.Call):
                continue
            fn = node.func.attr if isinstance(node.func, ast.Attribute) else getattr(node.func, "id", "")
            if fn not in loaders:
                continue
            text = ast.unparse(node)
            if "benchmarks" in text:
                names = [m for m in bench_modules if m in text]
                out.add((rel, f"benchmarks/{names[0]}.py" if len(names) == 1 else "benchmarks/"))
    return out


def test_tests_import_no_test_module_and_no_benchmark():
    found = suite_layout_offences()
    assert not found, ("test files load other test modules or benchmark scripts (move the shared code to "
                       f"tests/helpers/ or the package): {sorted(found)}")


def test_layout_check_sees_each_kind_of_load(tmp_path):
    """The check above can fail: each forbidden form is reported, the allowed ones are not."""
    tests, bench = tmp_path / "tests", tmp_path / "benchmarks"
    (tests / "helpers").mkdir(parents=True)
    bench.mkdir()
    (bench / "speed.py").write_text("")
    (tests / "test_a.py").write_text("def f():\n    return 1\n")
    (tests / "conftest.py").write_text("")
    (tests / "helpers" / "shared.py").write_text("import os\n")
    (tests / "test_b.py").write_text(
        "import importlib.util\nfrom test_a import f\nfrom conftest import x\nimport speed\n"
        "from helpers.shared import os\nimport subprocess\n"
        "def g():\n    importlib.util.spec_from_file_location('s', ROOT / 'benchmarks' / 'speed.py')\n"
        "    subprocess.run(['python', 'benchmarks/speed.py'])\n")
    assert suite_layout_offences(tests, bench) == {
        ("test_b.py", "tests/test_a.py"), ("test_b.py", "tests/conftest.py"),
        ("test_b.py", "benchmarks/speed.py")}


# what the planner must never load (prefixes of dotted names): the runtime, the commands, the
# launcher, calibration and measurement (which start processes), and the process-starting modules
NOT_IN_PLANNER = ("modelpar.train", "modelpar.cli", "modelpar.launch", "modelpar.calibrate", "modelpar.measure",
                  "modelpar.bench", "modelpar.verify", "modelpar.__main__", "subprocess", "multiprocessing",
                  "torch.multiprocessing", "concurrent.futures", "torch.distributed.run",
                  "torch.distributed.elastic", "torch.distributed.launch", "torch.distributed.launcher")


def _module_file(name: str) -> Path | None:
    """The source file of the modelpar module ``name`` (a package's ``__init__.py``), None when
    ``name`` is not a modelpar module (an attribute imported ``from`` one, or another package)."""
    parts = name.split(".")
    if parts[0] != "modelpar":
        return None
    base = ROOT.joinpath(*parts)
    if (base / "__init__.py").is_file():
        return base / "__init__.py"
    if base.with_suffix(".py").is_file():
        return base.with_suffix(".py")
    return None


def import_closure(start: str) -> dict[str, tuple[str, int]]:
    """Every module name reachable from the modelpar module ``start`` through import statements, with
    the (module, line) that first imports it: in modules of ``start``'s own package every import
    counts (also inside functions: the lazy imports its code runs when called); in the modules they
    load, the imports that run on import. Importing ``a.b.c`` also runs the packages ``a`` and
    ``a.b``, which are followed too."""
    seen: dict[str, tuple[str, int]] = {start: ("", 0)}
    todo = [start]
    while todo:
        mod = todo.pop()
        path = _module_file(mod)
        if path is None:
            continue
        own = mod == start or mod.startswith(start + ".")
        for name, line in _imports(ast.parse(path.read_text(), filename=str(path)), functions=own):
            parts = name.split(".")
            for k in range(1, len(parts) + 1):
                sub = ".".join(parts[:k])
                if sub not in seen and (parts[0] != "modelpar" or _module_file(sub) is not None):
                    seen[sub] = (mod, line)
                    todo.append(sub)
    return seen


def test_planner_imports_nothing_that_runs_training_or_starts_a_process():
    closure = import_closure("modelpar.planner")
    assert "modelpar.planner.search" in closure and "modelpar.plan" in closure     # the walk follows imports
    bad = sorted(f"{m} (imported by {by}:{line})" for m, (by, line) in closure.items()
                 if any(m == p or m.startswith(p + ".") for p in NOT_IN_PLANNER))
    assert not bad, "modelpar.planner reaches: " + "; ".join(bad)


def test_import_closure_follows_lazy_imports():
    """The walk sees an import inside a function of the package (`modelpar.cli.train` starts ranks
    through `modelpar.launch`, which imports subprocess), so the purity check above can fail."""
    closure = import_closure("modelpar.cli.train")
    assert "modelpar.launch" in closure and "subprocess" in closure


def test_pure_tier_guard_refuses_every_way_to_start_a_process():
    """The guard tests/conftest.py puts around every test not marked ``slow`` (this one included):
    each way to start a process raises before anything starts, is recorded, and is restored after."""
    import multiprocessing
    import os
    import subprocess
    import sys

    import pytest

    from helpers.guards import ProcessInPureTest, refuse_processes

    before = subprocess.Popen._execute_child
    attempts = [lambda: subprocess.run([sys.executable, "-c", "pass"]),
                lambda: os.system("true"),
                lambda: multiprocessing.get_context("spawn").Process(target=print).start(),
                lambda: os.fork()]
    with refuse_processes("this test") as started:
        for attempt in attempts:
            with pytest.raises(ProcessInPureTest, match="this test starts a process"):
                attempt()
    assert started == ["Popen._execute_child", "os.system", "BaseProcess.start", "os.fork"]
    assert subprocess.Popen._execute_child is before
