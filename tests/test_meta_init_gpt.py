"""``--meta-init`` on the built-in GPT presets: built on the meta device, laid out, and each rank's
shards and stages materialised from (seed, parameter name) by the GPT's own rule
(`modelpar.models.gpt.init_std`), so the values are the same on every layout: FSDP x2, TP x2 (the
vocabulary-parallel embedding and head), PP x2 with the head tied to the embedding across the two
stages, and PP x2 x TP x2 tied each train like one process with ``--meta-init``. The launched part rides the session's first
2-rank scenario launch (`helpers.workers`); the rest runs here."""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch

from helpers import workers
from helpers.ckpt_worker import base_cfg

LOSS_RTOL = 1e-5
TIED = {"tie_embeddings": True}
LAUNCHED = {"fsdp": dict(strategy="fsdp"), "tp": dict(strategy="tp"),
            "pp_tied": dict(strategy="pp", model_config=TIED)}


def _specs(work: Path) -> list[dict]:
    return [{"name": f"gpt_meta_{k}", "kind": "train", "run_dir": str(work / k),
             "cfg": base_cfg(meta_init=True, out_dir=str(work / "out"), **kw)} for k, kw in LAUNCHED.items()]


workers.ride("gpt_meta2", 2, _specs, module=__file__)
# pipeline x TP with the head tied across the stages: the last stage's stub of the embedding reads through to
# the unlaid-out original until released, and re-tying after TP must not take that copy for the head's
workers.ride("gpt_meta4", 4, lambda work: [
    {"name": "gpt_meta_pp_tp_tied", "kind": "train", "run_dir": str(work / "pp_tp_tied"),
     "cfg": base_cfg(meta_init=True, out_dir=str(work / "out"), strategy="custom", pp=2, tp=2,
                     model_config=TIED)}], module=__file__)


def _train_here(tmp: Path, name: str, **kw) -> dict:
    from modelpar.train.config import TrainConfig
    from modelpar.train.runner import train

    return train(TrainConfig(**base_cfg(out_dir=str(tmp / "out"), **kw)), run_dir=tmp / name, quiet=True)


def _max_rel(a, b) -> float:
    assert len(a) == len(b) and a
    return max(abs(x - y) / max(abs(x), 1e-12) for x, y in zip(a, b))


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_meta_init_gpt_trains_alike_on_every_layout(tmp_path):
    res = workers.rider_results("gpt_meta2")
    ref = _train_here(tmp_path, "ref", strategy="single", meta_init=True, sample_bytes=20)
    assert ref["sample"].startswith("def ")      # the end-of-run sample builds its model on meta, assigns the weights
    ref_tied = _train_here(tmp_path, "ref_tied", strategy="single", meta_init=True, model_config=TIED)
    plain = _train_here(tmp_path, "plain", strategy="single")
    assert ref["losses"] != plain["losses"]      # drawn per name, not in the model's construction order
    for k in LAUNCHED:
        r = res[f"gpt_meta_{k}"]
        assert not r["errors"], (k, r["errors"])
        got, want = r["result"], (ref_tied if k == "pp_tied" else ref)
        assert got["world_size"] == 2
        assert _max_rel(want["losses"], got["losses"]) <= LOSS_RTOL, (k, want["losses"], got["losses"])
    assert res["gpt_meta_pp_tied"]["result"]["plan"]["pp"] == 2
    assert res["gpt_meta_tp"]["result"]["plan"]["tp"] == 2
    r4 = workers.rider_results("gpt_meta4")["gpt_meta_pp_tp_tied"]
    assert not r4["errors"], r4["errors"]
    assert r4["result"]["plan"]["pp"] == 2 and r4["result"]["plan"]["tp"] == 2
    assert _max_rel(ref_tied["losses"], r4["result"]["losses"]) <= LOSS_RTOL, (ref_tied["losses"], r4["result"]["losses"])


def test_meta_init_gpt_draws_the_gpts_own_rule_and_keeps_its_tie():
    """One process: nothing is allocated before `materialise`; then matrices and embeddings have std
    0.02 (the residual projections 0.02 / sqrt(2 n_layer)), norm weights are 1, biases 0, and the tied
    head is the embedding's tensor."""
    from modelpar.train.config import TrainConfig
    from modelpar.train.materialise import materialise
    from modelpar.train.task import build_task

    n_layer = 4
    cfg = TrainConfig(model="gpt-nano", model_config={"n_layer": n_layer, "d_model": 128, **TIED}, meta_init=True,
                      seq_len=16)
    model = build_task(cfg, load_data=False).model
    assert all(p.is_meta for p in model.parameters())
    materialise([model], cfg, torch.device("cpu"))
    assert model.head.out.weight is model.embed.tok.weight
    seen = set()
    for name, p in model.named_parameters():
        seen.add(name.rsplit(".", 1)[-1])
        if name.endswith("bias"):
            assert torch.count_nonzero(p) == 0, name
        elif p.dim() == 1:
            assert torch.equal(p, torch.ones_like(p)), name
        else:
            want = 0.02 / math.sqrt(2 * n_layer) if name.endswith(("o.weight", "down.weight")) else 0.02
            assert abs(p.std().item() / want - 1) < 0.1, (name, p.std().item(), want)
    assert {"weight", "bias"} <= seen


def test_meta_init_refuses_a_builtin_mlp_before_launch():
    from modelpar.plan import ParallelPlan
    from modelpar.train.config import TrainConfig
    from modelpar.train.materialise import check_meta_init

    with pytest.raises(ValueError, match="mlp-small is neither"):
        check_meta_init(TrainConfig(model="mlp-small", meta_init=True), ParallelPlan(dp_shard=2))
    check_meta_init(TrainConfig(model="gpt-nano", meta_init=True), ParallelPlan(dp_shard=2))


def test_auto_and_rules_pick_a_layout_meta_init_takes(monkeypatch):
    """--meta-init with --strategy rules or the default auto: the choice shards the parameters (no DDP,
    which --meta-init refuses). Rules pick DDP for this small model without it; auto's search leaves
    every DDP layout out (`search_plans(allow_ddp=False)`), whatever it would pick on this host."""
    from modelpar.planner import search
    from modelpar.train.config import TrainConfig
    from modelpar.train.loop import preflight

    base = dict(model="gpt-nano", seq_len=16, global_batch_size=8)
    plain = preflight(TrainConfig(**base, strategy="rules"), 2)[0]
    assert plain.dp_replicate == 2 and plain.dp_shard == 1, plain.describe()
    meta = preflight(TrainConfig(**base, strategy="rules", meta_init=True), 2)[0]
    assert meta.dp_replicate == 1, meta.describe()          # here: model parallel (tp2), the rules' next
    seen = []
    real = search.search_plans

    def spy(*a, **kw):
        rep = real(*a, **kw)
        seen.append((kw.get("allow_ddp", True), rep))
        return rep

    monkeypatch.setattr(search, "search_plans", spy)
    meta = preflight(TrainConfig(**base, strategy="auto", meta_init=True), 2)[0]
    assert not (meta.dp_replicate > 1 and meta.dp_shard == 1), meta.describe()
    (allow, rep), = seen
    assert allow is False and rep.pruned["replicated data parallel (DDP) excluded"] > 0
