"""`modelpar/launch.py` is the only module that spells torchrun (issue 13, item 2): commands,
benchmarks, examples and the tests' fixtures start ranks through it (pure tier: the source is read,
nothing is imported or run).
"""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
LAUNCHER_MODULES = ("torch.distributed.run", "torch.distributed.launch", "torch.distributed.launcher",
                    "torch.distributed.elastic")
TORCHRUN_WORDS = ("torch.distributed.run", "torchrun")
NPROC_FLAGS = ("--nproc-per-node", "--nproc_per_node")


def _text(node: ast.AST) -> str | None:
    """A string constant's value; an f-string's literal parts joined; else None."""
    if isinstance(node, ast.Constant) and isinstance(node.value, str):
        return node.value
    if isinstance(node, ast.JoinedStr):
        return "".join(v.value for v in node.values if isinstance(v, ast.Constant) and isinstance(v.value, str))
    return None


def torchrun_spellings(root: Path = ROOT, dirs=("modelpar", "benchmarks", "examples", "tests"),
                       launcher: str = "modelpar/launch.py") -> set[tuple[str, int, str]]:
    """{(file, line, what)} for every place outside ``launcher`` that builds a torchrun launch itself:
    an import of torch's launcher modules, an argv list holding ``torch.distributed.run`` /
    ``torchrun`` or a ``--nproc-per-node`` element, or ``runpy.run_module("torch.distributed.run")``.
    Docstrings, comments and checks that only *recognise* a torchrun argv are not launches."""
    out = set()
    for d in dirs:
        for path in sorted((root / d).rglob("*.py")):
            rel = path.relative_to(root).as_posix()
            if rel == launcher or "__pycache__" in path.parts:
                continue
            for n in ast.walk(ast.parse(path.read_text())):
                if isinstance(n, ast.Import):
                    out |= {(rel, n.lineno, a.name) for a in n.names if a.name.startswith(LAUNCHER_MODULES)}
                elif isinstance(n, ast.ImportFrom) and n.module and n.module.startswith(LAUNCHER_MODULES):
                    out.add((rel, n.lineno, n.module))
                elif isinstance(n, ast.List):
                    for e in n.elts:
                        s = _text(e)
                        if s is not None and (s in TORCHRUN_WORDS or s.startswith(NPROC_FLAGS)):
                            out.add((rel, n.lineno, f"argv {s!r}"))
                elif (isinstance(n, ast.Call) and isinstance(n.func, ast.Attribute) and n.func.attr == "run_module"
                      and n.args and _text(n.args[0]) in TORCHRUN_WORDS):
                    out.add((rel, n.lineno, "run_module"))
    return out


def test_only_the_launcher_spells_torchrun():
    found = torchrun_spellings()
    assert not found, f"start ranks through modelpar.launch (torchrun_cmd / run_local / run_workers): {sorted(found)}"


def test_the_check_sees_each_way_to_spell_a_launch(tmp_path):
    (tmp_path / "modelpar").mkdir()
    (tmp_path / "benchmarks").mkdir()
    (tmp_path / "modelpar" / "launch.py").write_text('CMD = ["-m", "torch.distributed.run"]\n')
    (tmp_path / "benchmarks" / "b.py").write_text(
        "import sys, runpy\nfrom torch.distributed.run import main\n"
        "def f(n):\n"
        "    cmd = [sys.executable, '-m', 'torch.distributed.run', f'--nproc-per-node={n}', 'x.py']\n"
        "    runpy.run_module('torch.distributed.run')\n"
        "    return ['torchrun', 'x.py']\n"
        "def recognise(argv):\n"
        "    '''torchrun --nproc-per-node N (a docstring)'''\n"
        "    return 'torch.distributed.run' in argv or argv[0].startswith('--nproc-per-node=')\n")
    found = torchrun_spellings(tmp_path, dirs=("modelpar", "benchmarks"))
    assert found == {("benchmarks/b.py", 2, "torch.distributed.run"),
                     ("benchmarks/b.py", 4, "argv 'torch.distributed.run'"),
                     ("benchmarks/b.py", 4, "argv '--nproc-per-node='"),
                     ("benchmarks/b.py", 5, "run_module"),
                     ("benchmarks/b.py", 6, "argv 'torchrun'")}, found
