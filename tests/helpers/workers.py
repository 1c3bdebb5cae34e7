"""Launch `tests/helpers/ckpt_worker.py` scenarios on N ranks and read their results; scenario groups of
other test modules ride along in the first launch of their world size (one torchrun launch fewer each).

Riding: a test module registers a group of independent scenarios at import with `ride(tag, nproc,
build, module=__file__)`; ``build(work)`` prepares what the scenarios read (files under ``work``) and
returns their specs. The first `launch` of ``nproc`` ranks in the session appends the specs of every
registered group of that size whose module has selected tests (`activate`, from the conftest after
collection) and that has not run yet; `rider_results(tag)` returns the group's results from there, or,
where no launch carried it (that module selected alone, or it runs first), launches the group by itself.
A group's scenarios must not depend on the host's: they run after the host's, in the same process group.
"""

from __future__ import annotations

import json
import os
import subprocess
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import pytest

ROOT = Path(__file__).resolve().parents[2]
LAUNCH_TIMEOUT_S = 300
RIDER_TIMEOUT_S = 240                   # added to a launch's limit per group it carries


@dataclass
class _Group:
    nproc: int
    build: Callable[[Path], list[dict]]
    module: str
    limit_s: float = 0.0                 # added to a launch's limit where it rides (RIDER_TIMEOUT_S by default)
    work: Path | None = None
    results: dict | None = None          # once some launch ran it


GROUPS: dict[str, _Group] = {}
_ACTIVE: set[str] | None = None          # module files with selected tests; None: not told (all active)
_BASE: list[Path] = []
LAUNCHES: list[dict] = []                # one row per launch: tag, ranks, scenarios, groups carried, rank 0's
                                         # {scenario: {"wall_s", "cpu_s"}} ("times")


def ride(tag: str, nproc: int, build: Callable[[Path], list[dict]], *, module: str,
         limit_s: float = RIDER_TIMEOUT_S) -> None:
    """Register scenario group ``tag`` (``build(work) -> specs``) to ride in the first ``nproc``-rank
    launch; ``limit_s``: the seconds it adds to that launch's limit (and to `LAUNCH_TIMEOUT_S` where
    it is launched alone)."""
    if tag in GROUPS and GROUPS[tag].module != str(Path(module).resolve()):
        raise ValueError(f"scenario group {tag!r} is registered by two modules")
    GROUPS[tag] = _Group(nproc, build, str(Path(module).resolve()), limit_s)


def activate(modules: set[str]) -> None:
    """Only groups of these module files (those with selected tests) ride; called after collection."""
    global _ACTIVE
    _ACTIVE = {str(Path(m).resolve()) for m in modules}


def group_dir(tag: str) -> Path:
    """The work folder of group ``tag`` (created on first use, the same for the whole session)."""
    g = GROUPS[tag]
    if g.work is None:
        if not _BASE:
            _BASE.append(Path(tempfile.mkdtemp(prefix="modelpar-shared-launch-")))
        g.work = _BASE[0] / tag
        g.work.mkdir(parents=True, exist_ok=True)
    return g.work


def _riders(nproc: int, host: str) -> dict[str, list[dict]]:
    out = {}
    # the groups that asked for the most time run last: a slow or stuck one then holds up no other group
    for tag, g in sorted(GROUPS.items(), key=lambda kv: kv[1].limit_s):
        if tag == host or g.nproc != nproc or g.results is not None or (_ACTIVE is not None and g.module not in _ACTIVE):
            continue
        out[tag] = [{**s, "name": f"{tag}/{s['name']}"} for s in g.build(group_dir(tag))]
    return out


def launch(nproc: int, specs: list[dict], work: Path, tag: str, *, carry: bool = True, extra_s: float = 0.0) -> dict:
    """Run the scenarios ``specs`` (see `ckpt_worker.py`) on ``nproc`` ranks, with the registered groups
    of that size that have not run yet (``carry``); returns ``specs``' results by name. The test fails
    with the ranks' output on a non-zero exit or a run past its limit (`LAUNCH_TIMEOUT_S` plus
    ``extra_s``, plus each carried group's ``limit_s``, `RIDER_TIMEOUT_S` unless it said otherwise)."""
    from modelpar.launch import torchrun_cmd

    riders = _riders(nproc, tag) if carry else {}
    every = [*specs, *(s for group in riders.values() for s in group)]
    spec_file, out = work / f"{tag}.spec.json", work / f"{tag}.out.json"
    spec_file.write_text(json.dumps(every))
    limit = LAUNCH_TIMEOUT_S + extra_s + sum(GROUPS[t].limit_s for t in riders)
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONWARNINGS": "ignore"}
    cmd = ["timeout", "-k", "10", str(limit),
           *torchrun_cmd(nproc, [str(ROOT / "tests" / "helpers" / "ckpt_worker.py"), str(out), str(spec_file)])]
    proc = subprocess.run(cmd, capture_output=True, text=True, cwd=ROOT, env=env, timeout=limit + 30)
    times = Path(f"{out}.times.json")
    LAUNCHES.append({"tag": tag, "nproc": nproc, "scenarios": len(every), "carried": sorted(riders),
                     "times": json.loads(times.read_text()) if times.is_file() else {}})
    if proc.returncode != 0 or not out.exists():
        pytest.fail(f"launch {tag} ({nproc} ranks, carrying {sorted(riders) or 'no other group'}) failed, "
                    f"rc {proc.returncode}:\n{proc.stderr[-4000:]}")
    res = json.loads(out.read_text())
    for rtag, group in riders.items():
        GROUPS[rtag].results = {s["name"].split("/", 1)[1]: res.pop(s["name"]) for s in group if s["name"] in res}
    return res


def rider_results(tag: str) -> dict:
    """The results of group ``tag`` by scenario name: from the launch that carried it, else from a
    launch of the group alone (which carries nothing else)."""
    g = GROUPS[tag]
    if g.results is None:
        g.results = launch(g.nproc, g.build(group_dir(tag)), group_dir(tag), tag, carry=False, extra_s=g.limit_s)
    return g.results
