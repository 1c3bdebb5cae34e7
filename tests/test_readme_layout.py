"""README's layout table matches the tree (issue 13, "Done when"): every path it lists exists, and
every package module / sub-package of `modelpar/` and every top-level folder of the repository has
a row (pure tier: files are read, nothing is imported)."""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def layout_rows(readme: str) -> list[str]:
    """The first-column paths of the table under README's ``## Layout`` heading."""
    section = readme.split("\n## Layout", 1)[1].split("\n## ", 1)[0]
    return [m.group(1) for m in re.finditer(r"^\| `([^`]+)` \|", section, re.M)]


def layout_gaps(root: Path = ROOT) -> tuple[list[str], list[str]]:
    """(rows naming a path that does not exist, entries of the tree with no row). The entries are
    `modelpar/`'s modules and sub-packages (``__init__.py`` is the package itself; ``__main__.py``
    counts when some row mentions it) and the top-level folders, hidden ones excluded."""
    readme = (root / "README.md").read_text()
    rows = layout_rows(readme)
    missing = [r for r in rows if not (root / r).exists()]
    listed = {r.rstrip("/") for r in rows}
    entries = [f"modelpar/{p.name}" for p in sorted((root / "modelpar").iterdir())
               if p.name not in ("__init__.py", "__pycache__") and (p.suffix == ".py" or (p / "__init__.py").exists())]
    # top-level folders holding code, and docs/ (run outputs such as runs/, bench-out/ hold none)
    entries += [p.name for p in sorted(root.iterdir())
                if p.is_dir() and not p.name.startswith(".") and p.name != "modelpar"
                and (p.name == "docs" or any(p.rglob("*.py")))]
    section = readme.split("\n## Layout", 1)[1].split("\n## ", 1)[0]
    unlisted = [e for e in entries if e not in listed and not (e.endswith("__main__.py") and e in section)]
    return missing, unlisted


def test_readme_layout_table_matches_the_tree():
    missing, unlisted = layout_gaps()
    assert not missing, f"README's layout table lists paths that do not exist: {missing}"
    assert not unlisted, f"README's layout table has no row for: {unlisted}"


def test_layout_check_sees_a_stale_and_a_missing_row(tmp_path):
    (tmp_path / "modelpar" / "sub").mkdir(parents=True)
    (tmp_path / "modelpar" / "sub" / "__init__.py").write_text("")
    (tmp_path / "modelpar" / "new.py").write_text("")
    (tmp_path / "modelpar" / "__init__.py").write_text("")
    (tmp_path / "docs").mkdir()
    (tmp_path / "README.md").write_text("# x\n\n## Layout\n\n| path | what |\n|---|---|\n"
                                        "| `modelpar/sub/` | a |\n| `modelpar/gone.py` | b |\n\n## Next\n"
                                        "| `modelpar/new.py` | not in the layout section |\n")
    assert layout_gaps(tmp_path) == (["modelpar/gone.py"], ["modelpar/new.py", "docs"])
