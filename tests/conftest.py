"""Shared fixtures.

- ``dist_results(world)``: one launch (`modelpar.launch`) per world size runs every parity case of that size
  (process groups are shared across cases; an 8-rank launch costs ~15 s here), with a hard timeout
  so a hang fails instead of blocking CI.
- An autouse fixture restores environment variables and fails a test that leaks a process group or a
  thread, or that starts a process without being marked ``slow`` (markers: ``slow`` = spawns
  processes, ``gpu`` = needs CUDA, skipped without it).
- The parity report (largest differences of every case) is written to ``parity-report.md`` and shown
  in the terminal summary.
"""

from __future__ import annotations

import contextlib
import json
import os
import sys
import tempfile
from pathlib import Path

import pytest

# `--strategy auto` measures an uncalibrated machine on the fly (~20 s) and keeps the result in the
# user's cache; tests must neither wait for that nor write there (one test enables it on a temp path)
os.environ.setdefault("MODELPAR_AUTO_CALIBRATE", "0")
# and the planner must not read this machine's calibration either, so `--strategy auto` decides the
# same on every machine (tests that need a calibration point this variable at their own file)
os.environ["MODELPAR_CALIBRATION"] = os.path.join(tempfile.mkdtemp(prefix="modelpar-test-"), "calibration.json")

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(Path(__file__).parent))

from helpers.guards import leaked_threads, left_process_group, refuse_processes  # noqa: E402
LAUNCH_TIMEOUT_S = {2: 600, 4: 420, 8: 600}
# inductor compiles in this process rather than in a pool of worker processes, each of which imports
# torch (the compile row: ~2-5 s per rank on 2 cores; the kernels are the same, and the C++ compiler
# still runs as a child process whose output the ranks share through inductor's cache and its locks)
LAUNCH_ENV = {"TORCHINDUCTOR_COMPILE_THREADS": "1"}
LAUNCH_TIMES: dict[int, dict] = {}                  # world -> case -> rank 0's wall / CPU seconds   # 2: the HF rows (issue 12) made that launch longer


def run_ranks(nproc: int, target: list[str], result_path: Path, timeout: float, env: dict | None = None):
    """Run ``target`` on ``nproc`` ranks (`modelpar.launch.run_workers`); a launch past ``timeout`` is
    killed and the test fails with its output."""
    from modelpar.launch import run_workers

    run = run_workers(target, nproc, result_path, timeout_s=timeout, env=env, cwd=ROOT)
    if run.timed_out:
        pytest.fail(f"torchrun with {nproc} ranks did not finish in {timeout} s (hang?)\n{run.output[-6000:]}")
    return run


@pytest.fixture(scope="session")
def dist_results(tmp_path_factory):
    """world size -> {case name: result dict}; each world size launched once, on first use."""
    from helpers import parity_cases

    cache: dict[int, dict] = {}

    def get(world: int) -> dict:
        if world not in cache:
            names = [n for n, c in parity_cases.CASES.items() if c[0] == world]
            out = tmp_path_factory.mktemp(f"parity{world}") / "results.json"
            run = run_ranks(world, [str(ROOT / "tests" / "helpers" / "dist_worker.py"), str(out), *names], out,
                            LAUNCH_TIMEOUT_S[world], env=LAUNCH_ENV)
            res = run.result or {}
            if run.returncode != 0 and not res:
                pytest.fail(f"parity launch with {world} ranks failed (rc {run.returncode}):\n{run.output[-4000:]}")
            cache[world] = res
            times = Path(f"{out}.times.json")
            if times.is_file():
                LAUNCH_TIMES[world] = json.loads(times.read_text())
        return cache[world]
    return get


@pytest.fixture
def shared_profile_for(monkeypatch):
    """`plan` and `estimate` read `profile_for` results from one memo for the process
    (`helpers.profiles.shared_profile_for`, keyed by the arguments; profiles are frozen dataclasses): the
    profile is the costly part of those commands (~0.2 s for gpt-1m) and the same input wherever the
    arguments are; each command's parsing, checks, planning and printing still run. Returns the list
    of the arguments of every call the commands made in this test."""
    import modelpar.cli.estimate as estimate_mod
    import modelpar.cli.plan as plan_mod
    from helpers.profiles import shared_profile_for as memo
    asked = []

    def shared(*args):
        asked.append(args)
        return memo(*args)

    monkeypatch.setattr(plan_mod, "profile_for", shared)
    monkeypatch.setattr(estimate_mod, "profile_for", shared)
    return asked


@pytest.fixture(autouse=True)
def _clean_env(request):
    """Restore the environment; fail a test that leaves a process group initialised or a thread running
    (the session's shared launches run in their own processes, so nothing here is shared), and a test
    not marked ``slow`` that starts a process (``slow`` means exactly that: the pure tier,
    ``-m "not slow"``, starts none)."""
    import threading

    saved = dict(os.environ)
    threads = {t.ident for t in threading.enumerate()}
    pure = request.node.get_closest_marker("slow") is None
    with (refuse_processes(request.node.nodeid) if pure else contextlib.nullcontext([])) as started:
        yield
    leaked = left_process_group()
    os.environ.clear()
    os.environ.update(saved)
    call = getattr(request.node, "_modelpar_call_report", None)
    # the refusal raised inside the test; fail here only when the test swallowed it and passed
    assert not (started and call is not None and call.passed), (
        f"the test started a process ({', '.join(started)}) but is not marked slow "
        "(mark it @pytest.mark.slow, or keep it in-process)")
    assert not leaked, "the test left a process group initialised"
    stray = leaked_threads(threads)
    assert not stray, f"the test left thread(s) running: {', '.join(stray)}"


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    outcome = yield
    if call.when == "call":
        item._modelpar_call_report = outcome.get_result()


# every process the pytest process starts, by test (the terminal summary counts them: a torchrun
# launch costs ~5-15 s here, a Python process ~2-4 s of imports)
PROCESS_STARTS: list[tuple[str, str]] = []          # (test node id, kind)
_CURRENT_TEST: list[str] = ["(session)"]


def _kind_of(args) -> str:
    argv = [str(a) for a in (args if isinstance(args, (list, tuple)) else [args])]
    if "torch.distributed.run" in argv or any(a.endswith("torchrun") for a in argv):
        n = next((a.split("=", 1)[1] for a in argv if a.startswith("--nproc-per-node=")), "?")
        return f"torchrun {n} ranks"
    if "-m" in argv and argv[argv.index("-m") + 1:argv.index("-m") + 2] == ["modelpar"]:
        return "python -m modelpar " + (argv[argv.index("-m") + 2] if len(argv) > argv.index("-m") + 2 else "")
    if argv and "python" in Path(argv[0]).name:
        return "python " + (Path(argv[1]).name if len(argv) > 1 else "")
    return Path(argv[0]).name if argv else "?"


def pytest_configure(config):
    import subprocess

    orig = subprocess.Popen._execute_child

    def counted(self, args, *rest, **kw):
        PROCESS_STARTS.append((_CURRENT_TEST[0], _kind_of(args)))
        return orig(self, args, *rest, **kw)
    subprocess.Popen._execute_child = counted


TEST_CPU: dict[str, tuple[float, float, float]] = {}   # node id -> (wall, own CPU, children's CPU) seconds


def _cpu() -> tuple[float, float]:
    import resource

    own, kids = resource.getrusage(resource.RUSAGE_SELF), resource.getrusage(resource.RUSAGE_CHILDREN)
    return own.ru_utime + own.ru_stime, kids.ru_utime + kids.ru_stime


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_protocol(item, nextitem):
    """Per test (setup included): wall seconds and CPU seconds of this process and of the processes it
    started and waited for (ranks included): CPU is what a loaded machine does not inflate much."""
    import time

    _CURRENT_TEST[0] = item.nodeid
    t0, (own0, kids0) = time.perf_counter(), _cpu()
    yield
    own1, kids1 = _cpu()
    TEST_CPU[item.nodeid] = (time.perf_counter() - t0, own1 - own0, kids1 - kids0)
    _CURRENT_TEST[0] = "(session)"


def pytest_collection_finish(session):
    """Scenario groups of unselected modules do not ride in the shared launches (`helpers.workers`)."""
    from helpers import workers

    workers.activate({str(it.fspath) for it in session.items})


def pytest_collection_modifyitems(config, items):
    """``gpu`` means needs a CUDA device: such tests are skipped (with that reason) where there is none."""
    gpu = [it for it in items if it.get_closest_marker("gpu") is not None]
    if not gpu:
        return
    import torch

    if not torch.cuda.is_available():
        skip = pytest.mark.skip(reason="needs a CUDA GPU (marked gpu); torch.cuda.is_available() is False")
        for it in gpu:
            it.add_marker(skip)


def pytest_terminal_summary(terminalreporter, exitstatus, config):
    from helpers.parity_report import REPORT

    if LAUNCH_TIMES:
        terminalreporter.section("parity launches: rank 0's seconds (wall / CPU), slowest cases")
        for world, times in sorted(LAUNCH_TIMES.items()):
            wall, cpu = sum(t["wall_s"] for t in times.values()), sum(t["cpu_s"] for t in times.values())
            top = sorted(times.items(), key=lambda kv: -kv[1]["wall_s"])[:8]
            terminalreporter.write_line(f"{world} ranks: {len(times)} cases, {wall:.0f} s wall, {cpu:.0f} s CPU; "
                                        + ", ".join(f"{n} {t['wall_s']:.1f}/{t['cpu_s']:.1f}" for n, t in top))
    if TEST_CPU:
        wall, own, kids = (sum(v[i] for v in TEST_CPU.values()) for i in range(3))
        terminalreporter.section("CPU seconds per test (this process + the processes it waited for)")
        terminalreporter.write_line(f"{len(TEST_CPU)} tests: {wall:.0f} s wall, {own:.0f} s CPU here, {kids:.0f} s CPU "
                                    "in child processes")
        top = sorted(TEST_CPU.items(), key=lambda kv: -(kv[1][1] + kv[1][2]))[:int(os.getenv("MODELPAR_TOP_CPU", "25"))]
        for nodeid, (w, o, k) in top:
            terminalreporter.write_line(f"{o + k:7.1f} s CPU ({o:.1f} here + {k:.1f} children), {w:6.1f} s wall  {nodeid}")
    if PROCESS_STARTS:
        from collections import Counter

        from helpers import workers

        kinds = Counter(k for _, k in PROCESS_STARTS)
        terminalreporter.section("processes started by the pytest process")
        terminalreporter.write_line(f"{len(PROCESS_STARTS)} in all: " + ", ".join(f"{n} x {k}" for k, n in kinds.most_common()))
        by_test = Counter(t for t, _ in PROCESS_STARTS)
        terminalreporter.write_line("most: " + ", ".join(f"{t} {n}" for t, n in by_test.most_common(8)))
        for row in workers.LAUNCHES:
            if row["carried"]:
                terminalreporter.write_line(f"shared launch {row['tag']} ({row['nproc']} ranks, {row['scenarios']} "
                                            f"scenarios) carried {', '.join(row['carried'])}")
        if any(row.get("times") for row in workers.LAUNCHES):
            terminalreporter.section("scenario launches: rank 0's seconds (wall / CPU), slowest scenarios")
            for row in workers.LAUNCHES:
                t = row.get("times") or {}
                if not t:
                    continue
                wall, cpu = sum(v["wall_s"] for v in t.values()), sum(v["cpu_s"] for v in t.values())
                top = sorted(t.items(), key=lambda kv: -kv[1]["cpu_s"])[:8]
                terminalreporter.write_line(f"{row['tag']} ({row['nproc']} ranks): {len(t)} scenarios, {wall:.0f} s wall, "
                                            f"{cpu:.0f} s CPU; " + ", ".join(f"{n} {v['wall_s']:.1f}/{v['cpu_s']:.1f}" for n, v in top))
    if not REPORT:
        return
    lines = ["| case | pass | max loss rel diff | max param abs diff | param rel-norm diff | grad-norm rel diff |",
             "|---|---|---|---|---|---|"]
    for name in sorted(REPORT):
        r = REPORT[name]
        lines.append(f"| {name} | {'yes' if r['passed'] else 'NO'} | {r['max_loss_rel_diff']:.2e} | "
                     f"{r['max_param_abs_diff']:.2e} | {r['param_rel_norm_diff']:.2e} | {r['max_grad_norm_rel_diff']:.2e} |")
    text = "\n".join(lines)
    out = ROOT / "parity-report.md"
    out.write_text("# Parity report (largest differences against one process, 10 steps)\n\n" + text + "\n")
    terminalreporter.section("parity: largest differences against one process")
    terminalreporter.write_line(text)
    terminalreporter.write_line(f"(written to {out})")
