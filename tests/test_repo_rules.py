"""Two of issue 13's rules read from the tree (pure tier): no file in `modelpar/` over 500 lines, and
every failure case a file names ("case C12", "C1-C11") is described in `docs/cases.md` (a table row
``| Cn |`` or a heading ``## Cn``)."""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
MAX_LINES = 500
CASE = re.compile(r"\bC(\d{1,3})\b")


def long_files(root: Path = ROOT) -> dict[str, int]:
    """{path: lines} of the `modelpar/` Python files over `MAX_LINES` lines."""
    out = {}
    for p in sorted((root / "modelpar").rglob("*.py")):
        n = len(p.read_text().splitlines())
        if n > MAX_LINES:
            out[p.relative_to(root).as_posix()] = n
    return out


def unresolved_cases(root: Path = ROOT) -> dict[str, list[str]]:
    """{"Cn": [files naming it]} for the cases named in the repository's code and docs that
    `docs/cases.md` does not describe."""
    cases_md = (root / "docs" / "cases.md").read_text()
    defined = set(re.findall(r"^\| C(\d+) \|", cases_md, re.M)) | set(re.findall(r"^#+ C(\d+)\b", cases_md, re.M))
    named: dict[str, set[str]] = {}
    files = [p for d in ("modelpar", "tests", "benchmarks", "examples", "docs") if (root / d).is_dir()
             for p in (root / d).rglob("*") if p.suffix in (".py", ".md", ".sh")]
    for p in files + [root / "README.md"]:
        if p.is_file():
            for n in CASE.findall(p.read_text()):
                named.setdefault(n, set()).add(p.relative_to(root).as_posix())
    return {f"C{n}": sorted(v) for n, v in sorted(named.items(), key=lambda kv: int(kv[0])) if n not in defined}


def test_no_file_in_modelpar_over_500_lines():
    assert not long_files(), f"split these (issue 13, item 5): {long_files()}"


def test_every_case_named_resolves_in_docs_cases_md():
    missing = unresolved_cases()
    assert not missing, f"docs/cases.md does not describe: {missing}"


def test_the_rules_see_a_long_file_and_an_undescribed_case(tmp_path):
    (tmp_path / "modelpar").mkdir()
    (tmp_path / "docs").mkdir()
    (tmp_path / "modelpar" / "big.py").write_text("x = 1\n" * 501)
    (tmp_path / "modelpar" / "ok.py").write_text('"""See case C1 and C2; C3 is not described."""\n')
    (tmp_path / "docs" / "cases.md").write_text("| case | x |\n|---|---|\n| C1 | a |\n\n## C2\n")
    (tmp_path / "README.md").write_text("C4-C1 in short\n")
    assert long_files(tmp_path) == {"modelpar/big.py": 501}
    assert unresolved_cases(tmp_path) == {"C3": ["modelpar/ok.py"], "C4": ["README.md"]}
