"""Checkpoints across layouts (case C10), exact resume, no side effect of saving, export.

One uninterrupted run on one process is the reference (8 steps of gpt-nano, seq 16, global batch 8).
Two chains save and resume across layouts, optimizer state included:

    FSDP x4 --(step 2)--> DDP x TP (2x2) --(step 4)--> PP x2 --(step 6)--> 1 process
    1 process --(step 2)--> PP x2 --(step 4)--> DDP x TP (2x2) --(step 6)--> FSDP x4

Every resumed segment's losses must match the reference's at the same steps within the parity
tolerance (1e-5 relative); on the same plan, a resumed run must be bit-identical. Launches: 2 ranks
(the second chain's pp2 segments), 4 ranks (every 4-rank segment of both chains, in chain order), 2 ranks
(the first chain's pp2 segment); the 1-process runs in this process. The pairs and
their largest loss difference are printed in the terminal summary.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from helpers.ckpt_worker import base_cfg
from helpers.workers import launch

ROOT = Path(__file__).resolve().parent.parent
LOSS_RTOL = 1e-5


class _ReshardReport:
    """Registered as a pytest plugin by the fixture, so it adds a section to the terminal summary."""

    def __init__(self):
        self.rows: list[tuple[str, int, float, bool]] = []

    def pytest_terminal_summary(self, terminalreporter):
        if not self.rows:
            return
        terminalreporter.section("checkpoint resharding: resumed losses against an uninterrupted run")
        terminalreporter.write_line("| saved under -> resumed under | steps compared | max loss rel diff | pass |")
        terminalreporter.write_line("|---|---|---|---|")
        for pair, n, d, ok in self.rows:
            terminalreporter.write_line(f"| {pair} | {n} | {d:.2e} | {'yes' if ok else 'NO'} |")


REPORT = _ReshardReport()


def run_local(spec: dict) -> dict:
    from modelpar.train.config import TrainConfig
    from modelpar.train.runner import train

    s = train(TrainConfig(**spec["cfg"]), run_dir=Path(spec["run_dir"]), quiet=True)
    return {"result": {"losses": s["losses"], "start_step": s["start_step"], "val_loss_after": s["val_loss_after"]},
            "errors": {}}


def step_of(d: Path, step: int) -> str:
    return str(d / f"step-{step:08d}")


@pytest.fixture(scope="module")
def runs(tmp_path_factory, request):
    """The resharding runs. Its first 4-rank and its 2-rank launch also carry the scenario groups other
    modules register (`helpers.workers.ride`), so this setup holds their launch time too (hence the
    tests' 1800 s limit; each launch has its own, `helpers.workers`)."""
    request.config.pluginmanager.register(REPORT, "modelpar-reshard-report")
    w = tmp_path_factory.mktemp("reshard")
    D = {k: w / f"ckpt-{k}" for k in ("A", "B", "C", "E", "F", "G", "Et", "Ft")}

    def spec(name, ckpt=None, resume="", **kw):
        # gradient clipping on (base_cfg: 1.0): the global norm is the whole model's on every layout
        # (modelpar.train.grads), so the clipped steps must match across the chains too
        cfg = base_cfg(out_dir=str(w / "out"), keep_last=0, **kw)
        if ckpt:
            cfg.update(ckpt_every=2, ckpt_dir=str(D[ckpt]))
        if resume:
            cfg["resume"] = resume
        return {"name": name, "kind": "train", "cfg": cfg, "run_dir": str(w / "runs" / name)}

    fsdp4 = dict(strategy="fsdp")
    ddptp4 = dict(strategy="ddp+tp", dp_replicate=2, tp=2)
    pp2 = dict(strategy="pp")
    single = dict(strategy="single")
    res: dict[str, dict] = {}
    # 1 process: the reference (never saves), the same run saving every 2 steps (and at step 0), and a
    # resume of it from step 4 (same plan: bit-identical)
    res["ref"] = run_local(spec("ref", **single))
    res["E"] = run_local(spec("E", ckpt="E", **single))
    res["E_resume4"] = run_local(spec("E_resume4", resume=step_of(D["E"], 4), **single))
    # case C13: a GPT with a tied head, 1 process -> pp2 (the copies on two ranks) -> 1 process
    tied = dict(model_config={"tie_embeddings": True})
    res["ref_t"] = run_local(spec("ref_t", **single, **tied))
    res["E_t"] = run_local(spec("E_t", ckpt="Et", **single, **tied))
    # one 4-rank launch between two 2-rank ones (2 rank processes fewer than 4-2-4): the second chain's
    # 2-rank segment first, then every 4-rank segment of both chains, then the first chain's 2-rank one
    res.update(launch(2, [spec("F", ckpt="F", resume=step_of(D["E"], 2), **pp2),
                          spec("F_t", ckpt="Ft", resume=step_of(D["Et"], 2), **pp2, **tied)], w, "l2"))
    res.update(launch(4, [spec("A", ckpt="A", **fsdp4), spec("A_nosave", **fsdp4),
                          spec("A_resume4", resume=step_of(D["A"], 4), **fsdp4),
                          spec("B", ckpt="B", resume=step_of(D["A"], 2), **ddptp4),
                          spec("G", ckpt="G", resume=step_of(D["F"], 4), **ddptp4),
                          spec("H", resume=step_of(D["G"], 6), **fsdp4)], w, "l4a"))
    res.update(launch(2, [spec("C", ckpt="C", resume=step_of(D["B"], 4), **pp2)], w, "l2b"))
    res["D"] = run_local(spec("D", resume=step_of(D["C"], 6), **single))
    res["D_t"] = run_local(spec("D_t", resume=step_of(D["Ft"], 4), **single, **tied))
    return {"res": res, "dirs": D, "work": w}


def _losses(runs, name) -> tuple[int, list[float]]:
    r = runs["res"][name]
    assert not r["errors"], f"{name} failed: {r['errors']}"
    return r["result"]["start_step"], r["result"]["losses"]


def max_rel(a: list[float], b: list[float]) -> float:
    assert len(a) == len(b) and a
    return max(abs(x - y) / max(abs(x), 1e-12) for x, y in zip(a, b))


PAIRS = [("fsdp4 -> ddp2xtp2 (from step 2)", "B", 2), ("ddp2xtp2 -> pp2 (from step 4)", "C", 4),
         ("pp2 -> 1 process (from step 6)", "D", 6), ("1 process -> pp2 (from step 2)", "F", 2),
         ("pp2 -> ddp2xtp2 (from step 4)", "G", 4), ("ddp2xtp2 -> fsdp4 (from step 6)", "H", 6)]


@pytest.mark.slow
@pytest.mark.timeout(1800)
@pytest.mark.parametrize("pair,name,start", PAIRS, ids=[p[1] for p in PAIRS])
def test_resume_on_another_layout_matches_uninterrupted(runs, pair, name, start):
    _, ref = _losses(runs, "ref")
    s, got = _losses(runs, name)
    assert s == start
    assert len(got) == 8 - start
    d = max_rel(ref[start:], got)
    REPORT.rows.append((pair, len(got), d, d <= LOSS_RTOL))
    assert d <= LOSS_RTOL, f"{pair}: losses differ by {d:.2e} relative: {ref[start:]} vs {got}"


@pytest.mark.slow
@pytest.mark.timeout(1800)
def test_first_segment_fsdp4_matches_reference(runs):
    _, ref = _losses(runs, "ref")
    _, got = _losses(runs, "A")
    d = max_rel(ref, got)
    REPORT.rows.append(("fsdp4 from scratch (no resume)", 8, d, d <= LOSS_RTOL))
    assert d <= LOSS_RTOL


@pytest.mark.slow
@pytest.mark.timeout(1800)
def test_same_plan_resume_is_bit_identical(runs):
    for full, resumed in (("E", "E_resume4"), ("A", "A_resume4")):
        _, a = _losses(runs, full)
        s, b = _losses(runs, resumed)
        assert s == 4 and b == a[4:], f"{resumed}: {b} != {a[4:]}"
        assert runs["res"][resumed]["result"]["val_loss_after"] == runs["res"][full]["result"]["val_loss_after"]


@pytest.mark.slow
@pytest.mark.timeout(1800)
def test_saving_has_no_side_effect(runs):
    """Saving every 2 steps, at step 0 too, gives bit-identical losses to never saving."""
    assert _losses(runs, "E")[1] == _losses(runs, "ref")[1]
    assert _losses(runs, "A")[1] == _losses(runs, "A_nosave")[1]
    assert sorted(p.name for p in runs["dirs"]["E"].iterdir()) == [f"step-{s:08d}" for s in (0, 2, 4, 6, 8)]


@pytest.mark.slow
@pytest.mark.timeout(1800)
def test_checkpoint_records_layout_and_position(runs):
    from modelpar.train.checkpoint import read_checkpoint_meta

    m = read_checkpoint_meta(step_of(runs["dirs"]["B"], 4))
    assert m["step"] == 4 and m["world_size"] == 4
    assert (m["plan"]["dp_replicate"], m["plan"]["tp"]) == (2, 2)
    assert m["data_position"] == {"seed": 0, "next_step": 4, "global_batch_size": 8}
    assert m["optimizer_state"] is True and m["lr_schedule"]["warmup_steps"] == 2
    assert m["params"]["blocks.0.attn.q.weight"] == [64, 64]
    assert read_checkpoint_meta(step_of(runs["dirs"]["E"], 0))["optimizer_state"] is False


@pytest.mark.slow
@pytest.mark.timeout(1800)
def test_export_consolidates_sharded_checkpoint(runs, tmp_path):
    """`modelpar export` of the DDP x TP checkpoint at step 8 loads into the plain model (strict), whose
    validation loss equals the one the 4-rank run measured at the end."""
    import torch
    from safetensors.torch import load_file

    from modelpar.cli import main
    from modelpar.train.config import TrainConfig
    from modelpar.train.task import build_task, lm_loss

    out = tmp_path / "m.safetensors"
    assert main(["export", step_of(runs["dirs"]["B"], 8), "--out", str(out)]) == 0
    cfg = TrainConfig(**base_cfg(strategy="single", grad_clip=0.0))
    task = build_task(cfg)
    task.model.load_state_dict(load_file(str(out)))        # strict: every name and shape
    with torch.no_grad():
        val = lm_loss(task.model(task.val[0]), task.val[1]).item()
    want = runs["res"]["B"]["result"]["val_loss_after"]
    assert abs(val - want) / want <= LOSS_RTOL, (val, want)
    assert main(["export", str(runs["dirs"]["B"])]) == 0   # a folder of checkpoints: its latest, next to it
    assert (runs["dirs"]["B"] / "step-00000008.safetensors").exists()


@pytest.mark.slow
@pytest.mark.timeout(1800)
def test_tied_head_resumes_across_layouts_and_exports_under_both_names(runs, tmp_path):
    """Case C13: a tied GPT saved on 1 process resumes under pp2 (the two copies on two ranks, one
    checkpoint name) and back on 1 process, matching an uninterrupted tied run; the export holds the
    tie under both names and loads strictly into the tied model, which stays tied."""
    import torch
    from safetensors import safe_open
    from safetensors.torch import load_file

    from modelpar.cli import main
    from modelpar.train.config import TrainConfig
    from modelpar.train.task import build_task, lm_loss

    _, ref = _losses(runs, "ref_t")
    assert _losses(runs, "E_t")[1] == ref
    assert ref != _losses(runs, "ref")[1]                    # the tie changes the model
    for name, start in (("F_t", 2), ("D_t", 4)):
        s, got = _losses(runs, name)
        d = max_rel(ref[start:], got)
        REPORT.rows.append((f"tied head: {'1 process -> pp2' if name == 'F_t' else 'pp2 -> 1 process'} "
                            f"(from step {start})", len(got), d, d <= LOSS_RTOL))
        assert s == start and d <= LOSS_RTOL, (name, ref[start:], got)
    out = tmp_path / "tied.safetensors"
    assert main(["export", step_of(runs["dirs"]["Ft"], 8), "--out", str(out)]) == 0
    with safe_open(str(out), "pt") as f:      # the tie under both names: the strict load_state_dict loads it
        assert "head.out.weight" in f.keys() and "embed.tok.weight" in f.keys()
    task = build_task(TrainConfig(**base_cfg(strategy="single", grad_clip=0.0, model_config={"tie_embeddings": True})))
    task.model.load_state_dict(load_file(str(out)))
    assert task.model.head.out.weight is task.model.embed.tok.weight
    with torch.no_grad():
        val = lm_loss(task.model(task.val[0]), task.val[1]).item()
    want = runs["res"]["F_t"]["result"]["val_loss_after"]
    assert abs(val - want) / want <= LOSS_RTOL, (val, want)
