"""Cases C13 (tied parameters) and C14 (non-contiguous stage boundaries), tier 1: no processes.

The multi-rank halves are parity rows in tests/helpers/parity_cases.py (``gpt-tied-*``, ``c14-*``) and the
refusal ``c13-tied-pp2xfsdp2-zbv`` (every rank raises the same error), asserted below.
"""

from __future__ import annotations

import json
import warnings

import pytest
import torch
import torch.nn as nn
from helpers.parity_cases import CASES, StridedNet

from modelpar.models import build_gpt
from modelpar.models.gpt import GPTConfig
from modelpar.parallel import ties
from modelpar.parallel.parts import get_model_parts
from modelpar.parallel.pipeline import StageModule, check_stage_boundaries
from modelpar.parallel.tensor import ROWWISE_VOCAB, default_tp_plan, validate_tp_plan
from modelpar.plan import ParallelPlan

warnings.filterwarnings("ignore", message="torch.distributed is disabled")


def tied_gpt(n_layer=2, **kw):
    return build_gpt("gpt-nano", seq_len=16, n_layer=n_layer, seed=0, tie_embeddings=True, **kw)


# ---- C13: the built-in option and generic detection -------------------------------------------------
def test_tie_embeddings_is_one_parameter_counted_once():
    m = tied_gpt()
    assert m.head.out.weight is m.embed.tok.weight
    assert sum(p.numel() for p in m.parameters()) == m.cfg.num_params()
    untied = build_gpt("gpt-nano", seq_len=16, n_layer=2, seed=0)
    assert untied.cfg.num_params() - m.cfg.num_params() == 256 * 64
    assert not GPTConfig().tie_embeddings                       # default unchanged
    # the default model's initial weights are unchanged by the new option
    ref = build_gpt("gpt-nano", seq_len=16, n_layer=2, seed=0, tie_embeddings=False)
    assert all(torch.equal(a, b) for a, b in zip(untied.state_dict().values(), ref.state_dict().values()))


def test_ties_found_by_identity_in_any_model():
    class Shared(nn.Module):
        def __init__(self):
            super().__init__()
            self.a, self.b, self.c = nn.Linear(4, 4), nn.Linear(4, 4), nn.Linear(4, 4)
            self.c.weight = self.a.weight

    assert ties.find_ties(Shared()) == [("a.weight", "c.weight")]
    assert ties.find_ties(tied_gpt()) == [("embed.tok.weight", "head.out.weight")]
    assert ties.find_ties(build_gpt("gpt-nano", seq_len=16)) == []


def test_kept_layouts_are_accepted():
    m = tied_gpt(4)
    parts = get_model_parts(m)
    for fields in (dict(dp_replicate=2), dict(dp_shard=2), dict(pp=2), dict(pp=2, dp_shard=2),
                   dict(pp=2, virtual_stages=2, pp_schedule="zbvzerobubble"),
                   dict(pp=2, tp=2, virtual_stages=2, pp_schedule="zbvzerobubble")):
        plan = ParallelPlan(**fields)
        tp_plan = default_tp_plan(m)[0] if plan.tp > 1 else None
        ties.check_ties(m, plan, parts, tp_plan=tp_plan)


def test_v_schedule_with_fsdp_is_refused_naming_the_tie():
    m = tied_gpt(4)
    plan = ParallelPlan(pp=2, dp_shard=2, virtual_stages=2, pp_schedule="zbvzerobubble")
    with pytest.raises(ValueError, match=r"tied parameters embed.tok.weight = head.out.weight would be managed "
                                         r"by 2 separate FSDP units .*pipeline rank 0 holds 2 stages"):
        ties.check_ties(m, plan, get_model_parts(m))


def test_placement_over_two_devices_is_refused():
    m = tied_gpt()
    with pytest.raises(ValueError, match=r"embed.tok.weight = head.out.weight would live on two devices"):
        ties.check_ties(m, ParallelPlan(placement_devices=("cuda:0", "cuda:1")), get_model_parts(m))
    ties.check_ties(m, ParallelPlan(placement_devices=("cpu", "cpu")), get_model_parts(m))


def test_tie_across_fsdp_blocks_is_refused():
    m = build_gpt("gpt-nano", seq_len=16, n_layer=2, seed=0)
    m.blocks[1].mlp.up.weight = m.blocks[0].mlp.up.weight
    with pytest.raises(ValueError, match=r"blocks.0.mlp.up.weight = blocks.1.mlp.up.weight would be managed by "
                                         r"2 separate FSDP units"):
        ties.check_ties(m, ParallelPlan(dp_shard=2), get_model_parts(m))
    ties.check_ties(m, ParallelPlan(dp_replicate=2), get_model_parts(m))     # DDP: one module, fine


def test_tp_plan_that_splits_copies_differently_is_refused():
    m = tied_gpt()
    plan, shard = default_tp_plan(m)
    assert shard and plan["embed.tok"] == ROWWISE_VOCAB
    ties.check_ties(m, ParallelPlan(tp=2), get_model_parts(m), tp_plan=plan)
    del plan["embed.tok"]
    with pytest.raises(ValueError, match=r"would be split differently by tensor parallel \(embed.tok.weight: "
                                         r"replicated, head.out.weight: Shard\(0\)\)"):
        ties.check_ties(m, ParallelPlan(tp=2), get_model_parts(m), tp_plan=plan)


def test_vocab_not_divisible_by_tp_is_refused_before_launch(tmp_path, monkeypatch, capsys):
    m = build_gpt("gpt-nano", seq_len=16, vocab_size=251)
    with pytest.raises(ValueError, match=r"degree 2 does not divide GPTConfig.vocab_size=251: the token "
                                         r"embedding and output head are split over the vocabulary"):
        validate_tp_plan(m, default_tp_plan(m)[0], 2)
    # `modelpar verify` refuses it (exit 2) before starting any process; so does a V schedule x FSDP tie
    (tmp_path / "c13models.py").write_text(
        "from modelpar.models import build_gpt\n"
        "def odd_vocab():\n    return build_gpt('gpt-nano', seq_len=16, vocab_size=251)\n"
        "def tied():\n    return build_gpt('gpt-nano', seq_len=16, n_layer=4, tie_embeddings=True)\n")
    monkeypatch.chdir(tmp_path)
    for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "TORCHELASTIC_RUN_ID"):
        monkeypatch.delenv(k, raising=False)
    from modelpar.cli.verify import verify_main

    assert verify_main(["--model", "c13models:odd_vocab", "--strategy", "tp", "--nproc", "2"]) == 2
    assert "does not divide GPTConfig.vocab_size=251" in capsys.readouterr().err
    plan = json.dumps({"pp": 2, "dp_shard": 2, "pp_schedule": "zbvzerobubble", "virtual_stages": 2,
                       "n_microbatches": 4})
    assert verify_main(["--model", "c13models:tied", "--plan", plan]) == 2
    assert "tied parameters embed.tok.weight = head.out.weight" in capsys.readouterr().err


def test_retie_points_copies_at_one_parameter():
    m = tied_gpt()
    m.head.out.weight = nn.Parameter(m.embed.tok.weight.detach().clone())   # what TP does to each copy
    assert ties.retie([m], [("embed.tok.weight", "head.out.weight")]) == 1
    assert m.head.out.weight is m.embed.tok.weight


def test_tied_gradient_sync_groups_and_norm_skip_on_one_process():
    """Without a pipeline there is nothing to sum across ranks."""
    m = tied_gpt()
    assert ties.build_tied_grad_sync(ties.find_ties(m), get_model_parts(m), [], ParallelPlan(), None, [m]) is None


@pytest.mark.slow
def test_refusal_is_the_same_on_every_rank(dist_results):
    res = dist_results(4)["c13-tied-pp2xfsdp2-zbv"]
    assert "error" not in res, res.get("trace")
    assert res["passed"], res["failures"]
    assert "embed.tok.weight = head.out.weight" in res["messages"][0]


# ---- C13: checkpoints and export keep / save the tie once ---------------------------------------------
def test_checkpoint_round_trip_keeps_the_tie_and_export_loads_strictly(tmp_path):
    """The exported file holds the tie under both names (it held it once, so the docs' strict
    ``load_state_dict(load_file(...))`` failed on the missing head of a tied GPT-2: a user's report) and
    loads into a tied model keeping the tie, and into an untied one."""
    from safetensors import safe_open
    from safetensors.torch import load_file

    from modelpar.train.checkpoint import Checkpointer, checkpoint_module, export_checkpoint, load_checkpoint

    m = tied_gpt()
    opt = torch.optim.AdamW(m.parameters(), lr=1e-2)
    x = torch.randint(0, 256, (2, 16), generator=torch.Generator().manual_seed(0))
    m(x).logsumexp(-1).mean().backward()
    opt.step()
    tie = [["embed.tok.weight", "head.out.weight"]]
    Checkpointer(tmp_path / "ck").save(checkpoint_module([m]), opt, 1, meta={"tied_parameters": tie})
    m2 = build_gpt("gpt-nano", seq_len=16, n_layer=2, seed=5, tie_embeddings=True)
    load_checkpoint(checkpoint_module([m2]), torch.optim.AdamW(m2.parameters(), lr=1e-2), tmp_path / "ck")
    assert m2.head.out.weight is m2.embed.tok.weight
    torch.testing.assert_close(m2.embed.tok.weight, m.embed.tok.weight, rtol=0, atol=0)
    out = tmp_path / "model.safetensors"
    sd = export_checkpoint(tmp_path / "ck" / "step-00000001", out)
    assert torch.equal(sd["head.out.weight"], sd["embed.tok.weight"])
    with safe_open(str(out), "pt") as f:
        assert json.loads(f.metadata()["modelpar_tied"]) == {"head.out.weight": "embed.tok.weight"}
    m3 = build_gpt("gpt-nano", seq_len=16, n_layer=2, seed=7, tie_embeddings=True)
    m3.load_state_dict(load_file(str(out)))
    assert m3.head.out.weight is m3.embed.tok.weight
    torch.testing.assert_close(m3(x), m(x), rtol=0, atol=0)
    m4 = build_gpt("gpt-nano", seq_len=16, n_layer=2, seed=7, tie_embeddings=False)
    m4.load_state_dict(load_file(str(out)))
    torch.testing.assert_close(m4(x), m(x), rtol=0, atol=0)


def test_export_command_counts_a_tie_once(tmp_path, capsys):
    """`modelpar export` of a tied GPT: its line counts the model's parameters (the tie once: it counted the
    copy written under the second name too) and says how many tied names were written as copies."""
    from modelpar.cli import main
    from modelpar.train.checkpoint import Checkpointer, checkpoint_module

    m = tied_gpt()
    Checkpointer(tmp_path / "ck").save(checkpoint_module([m]), None, 1,
                                       meta={"tied_parameters": [["embed.tok.weight", "head.out.weight"]]})
    assert main(["export", str(tmp_path / "ck"), "--out", str(tmp_path / "m.safetensors")]) == 0
    n = sum(p.numel() for p in m.parameters())          # each Parameter once
    line = capsys.readouterr().out
    n += sum(b.numel() for b in m.buffers())            # a buffer is written too, and counted as what it is
    assert (f"{len(m.state_dict())} tensors, {n:,} elements (parameters and buffers, a tie once); 1 tied name(s) "
            f"written as copies") in line, line
    # --out naming an existing folder: one line (was IsADirectoryError from the rename, and a stray .tmp)
    (tmp_path / "outdir").mkdir()
    assert main(["export", str(tmp_path / "ck"), "--out", str(tmp_path / "outdir")]) == 2
    err = capsys.readouterr().err
    assert f"--out '{tmp_path / 'outdir'}' is a folder; safetensors export writes one file" in err, err
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ck", "m.safetensors", "outdir"]


# ---- C14: what crosses a stage boundary is contiguous both ways ----------------------------------------
@pytest.mark.parametrize("mode", ["out", "slice", "in"])
def test_stage_boundary_tensors_are_contiguous(mode):
    model = StridedNet(mode, 4)
    parts = get_model_parts(model)
    ranges = [(0, 2), (2, 4)]
    x = torch.randn(3, 32)
    check_stage_boundaries(parts, ranges, x)
    raw = model.blocks[1](model.blocks[0](model.embed(x)))
    s0 = StageModule(parts, 0, 2, is_first=True, is_last=False)
    s1 = StageModule(parts, 2, 4, is_first=False, is_last=True)
    sent = s0(x)
    assert sent.is_contiguous() and torch.equal(sent, raw)
    if mode in ("out", "slice"):
        assert not raw.is_contiguous()             # the case really is non-contiguous before the stage fix
    recv = sent.detach().requires_grad_(True)
    out = s1(recv)
    (g,) = torch.autograd.grad(out.sum(), recv)
    assert g.is_contiguous()
    if mode == "in":                               # without the guard the input gradient is a transposed view
        leaf = sent.detach().requires_grad_(True)
        (g_raw,) = torch.autograd.grad(model.head(model.blocks[3](model.blocks[2](leaf))).sum(), leaf)
        assert not g_raw.is_contiguous()
        torch.testing.assert_close(g, g_raw, rtol=0, atol=0)
    torch.testing.assert_close(out, model(x), rtol=1e-6, atol=1e-6)   # the same math, other memory layout


def test_c14_and_c13_parity_rows_exist():
    names = set(CASES)
    for n in ("c14-out-pp2-1f1b", "c14-slice-pp2-1f1b", "c14-in-pp2-1f1b", "c14-in-pp2-zbv", "gpt-tied-ddp2",
              "gpt-tied-fsdp2", "gpt-tied-tp2", "gpt-tied-pp2-1f1b", "gpt4-tied-pp2-zbvzerobubble",
              "gpt-tied-pp2xtp2"):
        assert n in names, n


def test_a_last_stage_holds_its_tied_copy_under_the_first_name(tmp_path):
    """Checkpoints name a tie once: a pipeline rank holding only the head's copy saves and loads it as
    ``embed.tok.weight``, so a checkpoint of one layout resumes on another (here: one process -> the
    last stage of a 2-stage pipeline)."""
    from modelpar.train.checkpoint import Checkpointer, checkpoint_module, load_checkpoint

    m = tied_gpt()
    tie = ties.find_ties(m)
    Checkpointer(tmp_path / "ck").save(checkpoint_module([m], tie), None, 1)
    fresh = tied_gpt()
    with torch.no_grad():
        fresh.embed.tok.weight.zero_()
    parts = get_model_parts(fresh)
    last = StageModule(parts, 1, 2, is_first=False, is_last=True)
    holder = checkpoint_module([last], tie)
    names = {n for n, _ in holder.named_parameters()}
    assert "embed.tok.weight" in names and "head.out.weight" not in names
    from modelpar.train.checkpoint import CheckpointError

    with pytest.raises(CheckpointError, match=r"of its parameter\(s\) are not in the model"):
        load_checkpoint(holder, None, tmp_path / "ck")   # one process with only the last stage: partial
    full = checkpoint_module([StageModule(parts, 0, 1, is_first=True, is_last=False), last], tie)
    load_checkpoint(full, None, tmp_path / "ck")
    torch.testing.assert_close(fresh.head.out.weight, m.embed.tok.weight, rtol=0, atol=0)
