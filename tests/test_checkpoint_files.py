"""Checkpoint files on one process: atomic save, keep-last, async save, bad files giving one clear
error naming the path and the problem, with nothing already saved overwritten, and a checkpoint that
an earlier modelpar wrote (``tests/data/ckpt-v1``, `tests/data/make_checkpoint_fixture.py`) still
loading, exporting and resuming to the same tensors."""

from __future__ import annotations

import json
import warnings
from pathlib import Path

import pytest
import torch

from modelpar.parallel.mesh import MeshInfo
from modelpar.models import build_gpt
from modelpar.train.checkpoint import (CheckpointError, Checkpointer, checkpoint_module, export_checkpoint,
                                       list_checkpoints, load_checkpoint, read_checkpoint_meta, step_dir)

warnings.filterwarnings("ignore", message="torch.distributed is disabled")


def _trained(n_layer=2, steps=2):
    m = build_gpt("gpt-nano", seq_len=16, n_layer=n_layer, seed=0)
    opt = torch.optim.AdamW(m.parameters(), lr=1e-2)
    g = torch.Generator().manual_seed(0)
    for _ in range(steps):
        x = torch.randint(0, 256, (2, 16), generator=g)
        m(x).float().logsumexp(-1).mean().backward()
        opt.step()
        opt.zero_grad()
    return m, opt


@pytest.fixture(scope="module")
def _saved_once(tmp_path_factory):
    m, opt = _trained()
    folder = tmp_path_factory.mktemp("ck-once") / "ck"
    ck = Checkpointer(folder, keep_last=2)
    for s in (2, 4, 6):
        ck.save(checkpoint_module([m]), opt, s, meta={"model": "gpt-nano"})
    return folder, m, opt


@pytest.fixture
def saved(tmp_path, _saved_once):
    """(a folder with the checkpoints of steps 4 and 6 (keep-last 2), the model, its optimizer): saved
    once per module, copied for each test (tests damage their copy)."""
    import shutil

    src, m, opt = _saved_once
    shutil.copytree(src, tmp_path / "ck")
    return tmp_path / "ck", m, opt


def test_keep_last_and_round_trip(saved):
    ck, m, opt = saved
    assert [s for s, _ in list_checkpoints(ck)] == [4, 6]
    m2 = build_gpt("gpt-nano", seq_len=16, seed=1)
    opt2 = torch.optim.AdamW(m2.parameters(), lr=1e-2)
    meta = load_checkpoint(checkpoint_module([m2]), opt2, ck)          # the folder: its latest
    assert meta["step"] == 6
    for (n, a), b in zip(m.state_dict().items(), m2.state_dict().values()):
        assert torch.equal(a, b), n
    s1, s2 = opt.state_dict()["state"], opt2.state_dict()["state"]
    assert all(torch.equal(s1[i]["exp_avg_sq"], s2[i]["exp_avg_sq"]) for i in s1)


def test_async_save_equals_sync_save(tmp_path):
    m, opt = _trained()
    a, s = Checkpointer(tmp_path / "a", async_save=True), Checkpointer(tmp_path / "s")
    a.save(checkpoint_module([m]), opt, 2)
    s.save(checkpoint_module([m]), opt, 2)
    with torch.no_grad():
        for p in m.parameters():
            p.add_(1.0)                    # training goes on while the async write runs
    assert not step_dir(tmp_path / "a", 2).exists() or (step_dir(tmp_path / "a", 2) / "COMPLETE").exists()
    a.close()
    ea, es = export_checkpoint(tmp_path / "a", tmp_path / "a.st"), export_checkpoint(tmp_path / "s", tmp_path / "s.st")
    assert ea.keys() == es.keys() and all(torch.equal(ea[k], es[k]) for k in ea)


def _load(path, n_layer=2):
    m = build_gpt("gpt-nano", seq_len=16, n_layer=n_layer)
    return load_checkpoint(checkpoint_module([m]), torch.optim.AdamW(m.parameters()), path)


def test_missing_folder(tmp_path):
    with pytest.raises(CheckpointError, match=r"checkpoint '.*nowhere' does not exist"):
        _load(tmp_path / "nowhere")


def test_truncated_file(saved):
    ck = saved[0]
    f = next(step_dir(ck, 6).glob("*.distcp"))
    f.write_bytes(f.read_bytes()[:100])
    with pytest.raises(CheckpointError, match=r"step-00000006' is truncated: file __0_0.distcp has 100 bytes"):
        _load(step_dir(ck, 6))


def test_missing_marker_is_incomplete(saved):
    ck = saved[0]
    (step_dir(ck, 6) / "COMPLETE").unlink()
    with pytest.raises(CheckpointError, match=r"step-00000006' is incomplete: no COMPLETE marker"):
        read_checkpoint_meta(step_dir(ck, 6))
    assert read_checkpoint_meta(ck)["step"] == 4          # the folder resolves to the latest complete one


def test_not_written_by_modelpar(tmp_path):
    import torch.distributed.checkpoint as dcp

    dcp.save({"w": torch.zeros(2)}, checkpoint_id=str(tmp_path / "plain"), no_dist=True)
    with pytest.raises(CheckpointError, match=r"'.*plain' was not written by modelpar: it is a "
                                              r"torch.distributed.checkpoint folder without modelpar.json"):
        _load(tmp_path / "plain")
    (tmp_path / "junk").mkdir()
    (tmp_path / "junk" / "modelpar.json").write_text('{"format": "other"')
    with pytest.raises(CheckpointError, match=r"junk': modelpar.json is unreadable or truncated"):
        _load(tmp_path / "junk")


def test_other_model(saved):
    with pytest.raises(CheckpointError, match=r"was written for another model: 16 parameter\(s\) of the model "
                                              r"are not in it \(blocks.2.attn.k.bias"):
        _load(saved[0], n_layer=3)


def test_failed_save_overwrites_nothing(saved, tmp_path):
    """A save that dies mid-way leaves a .tmp folder only: the complete checkpoints are untouched,
    never loaded from it, and the next save removes it."""
    ck, m, opt = saved
    before = {p.name: sorted(f.name for f in p.iterdir()) for _, p in list_checkpoints(ck)}
    tmp = ck / ".tmp-step-00000008"
    tmp.mkdir()
    (tmp / "__0_0.distcp").write_bytes(b"partial")
    assert read_checkpoint_meta(ck)["step"] == 6
    Checkpointer(ck, keep_last=2)                         # a new run: stale partial saves removed
    assert not tmp.exists()
    assert {p.name: sorted(f.name for f in p.iterdir()) for _, p in list_checkpoints(ck)} == before


def test_fresh_run_refuses_a_folder_with_checkpoints(saved):
    from modelpar.train.checkpoint import TrainCheckpoints
    from modelpar.train.config import TrainConfig

    cfg = TrainConfig(model="gpt-nano", ckpt_dir=str(saved[0]), ckpt_every=2)
    with pytest.raises(ValueError, match=r"already holds checkpoints \(step-00000006 and 1 older\); pass "
                                         r"--resume auto"):
        TrainCheckpoints(cfg, type("PM", (), {"modules": [saved[1]], "mesh": MeshInfo(mesh=None)})(), saved[2])


def test_meta_records_names_and_shapes(saved):
    meta = json.loads((step_dir(saved[0], 6) / "modelpar.json").read_text())
    assert meta["format"] == "modelpar-checkpoint" and meta["step"] == 6 and meta["world_size"] == 1
    assert meta["params"]["head.out.weight"] == [256, 64] and meta["optimizer"] == "AdamW"


# ---- a checkpoint written by an earlier modelpar (tests/data/make_checkpoint_fixture.py) -----------
FIXTURE = Path(__file__).resolve().parent / "data" / "ckpt-v1"
FIXTURE_MODEL = {"d_model": 8, "n_head": 1, "n_layer": 1, "tie_embeddings": True}
FIXTURE_TIE = [("embed.tok.weight", "head.out.weight")]


@pytest.fixture
def fixture_ckpt(tmp_path):
    """(a copy of the fixture's folder of checkpoints, the tensors the writing modelpar loaded back)."""
    import shutil

    from safetensors.torch import load_file

    shutil.copytree(FIXTURE / "checkpoints", tmp_path / "checkpoints")
    return tmp_path / "checkpoints", load_file(str(FIXTURE / "expected.safetensors"))


def _fresh_fixture_model():
    m = build_gpt("gpt-nano", seq_len=16, seed=7, **FIXTURE_MODEL)
    return m, torch.optim.AdamW(m.parameters())


def _assert_as_written(m, opt, expected):
    model = {k[len("model/"):]: v for k, v in expected.items() if k.startswith("model/")}
    sd = m.state_dict()
    assert set(model) == set(sd) - {"head.out.weight"} and m.head.out.weight is m.embed.tok.weight
    for n, v in model.items():
        assert torch.equal(sd[n], v), n
    names = {id(p): n for n, p in m.named_parameters()}
    got = {f"optim/{names[id(p)]}/{k}": torch.as_tensor(v) for p, st in opt.state.items() for k, v in st.items()}
    want = {k: v for k, v in expected.items() if k.startswith("optim/")}
    assert got.keys() == want.keys() and len(want) == 3 * len(model)
    for k, v in want.items():
        assert torch.equal(got[k], v), k


def test_checkpoint_from_an_earlier_modelpar_loads(fixture_ckpt):
    ck, expected = fixture_ckpt
    m, opt = _fresh_fixture_model()
    assert not torch.equal(m.embed.tok.weight, expected["model/embed.tok.weight"])      # another init
    meta = load_checkpoint(checkpoint_module([m], FIXTURE_TIE), opt, ck)
    assert meta["step"] == 2 and meta["version"] == 1 and meta["tied_parameters"] == [list(FIXTURE_TIE[0])]
    _assert_as_written(m, opt, expected)


def test_checkpoint_from_an_earlier_modelpar_exports(fixture_ckpt, tmp_path):
    from safetensors import safe_open

    ck, expected = fixture_ckpt
    sd = export_checkpoint(ck, tmp_path / "m.safetensors")
    assert sd.keys() == {k[len("model/"):] for k in expected if k.startswith("model/")} | {"head.out.weight"}
    assert all(torch.equal(v, expected[f"model/{k}"]) for k, v in sd.items() if k != "head.out.weight")
    assert torch.equal(sd["head.out.weight"], sd["embed.tok.weight"])       # the tie, under both names
    with safe_open(str(tmp_path / "m.safetensors"), "pt") as f:
        assert json.loads(f.metadata()["modelpar_tied"]) == {"head.out.weight": "embed.tok.weight"}


def test_checkpoint_from_an_earlier_modelpar_resumes(fixture_ckpt):
    """The training loop's resume: the saved run's config matches, the layout is the same (so this
    rank's RNG state is restored too), and the start step is the saved one."""
    from types import SimpleNamespace

    from modelpar.plan import ParallelPlan
    from modelpar.train.checkpoint import TrainCheckpoints
    from modelpar.train.config import TrainConfig

    ck, expected = fixture_ckpt
    m, opt = _fresh_fixture_model()
    said = []
    cfg = TrainConfig(model="gpt-nano", model_config=dict(FIXTURE_MODEL), seq_len=16, global_batch_size=4, steps=4,
                      data="fixture-text", resume=str(ck), ckpt_dir=str(ck))
    pm = SimpleNamespace(modules=[m], ties=FIXTURE_TIE, plan=ParallelPlan(), mesh=MeshInfo(mesh=None))
    torch.manual_seed(123)
    tc = TrainCheckpoints(cfg, pm, opt, say=said.append)
    assert tc.start_step == tc.loaded_step == 2 and tc.saver is None
    assert said and "resumed from" in said[0] and "at step 2" in said[0]
    rng = torch.load(ck / "step-00000002" / "rng" / "rank-0.pt", weights_only=True)["cpu"]
    assert torch.equal(torch.get_rng_state(), rng)
    _assert_as_written(m, opt, expected)
    with pytest.raises(CheckpointError, match=r"differs in what fixes the model and the sample order: seed: "
                                              r"checkpoint 0 vs now 1"):
        TrainCheckpoints(TrainConfig(**{**cfg.to_dict(), "seed": 1}), pm, _fresh_fixture_model()[1])


def test_checkpoint_refusals_come_before_launch(saved, fixture_ckpt, tmp_path):
    """A user's report: a fresh run into a folder of checkpoints, or a resume of another run's, was
    refused by every rank ~11 s after launch (the run folder made); now once, before any process."""
    from modelpar.cli.train import main as train_main
    from modelpar.train.checkpoint.resume import check_checkpoints_before_launch
    from modelpar.train.config import TrainConfig

    argv = ["--model", "gpt-nano", "--strategy", "ddp", "--nproc", "2", "--steps", "4", "--ckpt-every", "2",
            "--ckpt-dir", str(saved[0]), "--out-dir", str(tmp_path / "runs")]
    with pytest.raises(ValueError, match=r"already holds checkpoints \(step-00000006 and 1 older\)"):
        train_main(argv)
    assert not (tmp_path / "runs").exists()
    ck, _ = fixture_ckpt
    cfg = TrainConfig(model="gpt-nano", model_config=dict(FIXTURE_MODEL), seq_len=16, global_batch_size=4, steps=4,
                      data="fixture-text", resume=str(ck), ckpt_dir=str(ck))
    check_checkpoints_before_launch(cfg)                    # the same run: nothing to refuse
    with pytest.raises(CheckpointError, match=r"differs in what fixes the model and the sample order: seed: "
                                              r"checkpoint 0 vs now 1"):
        check_checkpoints_before_launch(TrainConfig(**{**cfg.to_dict(), "seed": 1}))
    with pytest.raises(ValueError, match=r"is at step 2, past steps=1"):
        check_checkpoints_before_launch(TrainConfig(**{**cfg.to_dict(), "steps": 1}))


def test_resume_keeps_this_layouts_optimizer_implementation(tmp_path):
    """A checkpoint of fused AdamW resumed where the optimizer runs torch's single-tensor loop (plain TP:
    its groups mix plain tensors and DTensors, which the fused kernel refuses): the checkpoint's moments
    and hyper-parameters are loaded, the implementation flags stay this run's (they were the checkpoint's:
    every rank of a plain-TP resume from an FSDP checkpoint failed at its first step)."""
    torch.manual_seed(0)
    m = build_gpt("gpt-nano", seq_len=16)
    opt = torch.optim.AdamW(m.parameters(), lr=1e-3, fused=True)
    m(torch.randint(0, 256, (2, 16))).sum().backward()
    opt.step()
    path = Checkpointer(tmp_path / "ck").save(checkpoint_module([m]), opt, 1)
    m2 = build_gpt("gpt-nano", seq_len=16)
    opt2 = torch.optim.AdamW(m2.parameters(), lr=5e-4, foreach=False)
    load_checkpoint(checkpoint_module([m2]), opt2, path)
    g = opt2.param_groups[0]
    assert g["foreach"] is False and not g["fused"], g
    assert g["lr"] == 1e-3                          # the checkpoint's hyper-parameters
    p, p2 = next(m.parameters()), next(m2.parameters())
    assert torch.equal(opt2.state[p2]["exp_avg"], opt.state[p]["exp_avg"])


def _llama_config(path: Path, heads: int, kv_heads: int) -> None:
    path.write_text(json.dumps({"model_type": "llama", "hidden_size": 32, "intermediate_size": 64,
                                "num_hidden_layers": 1, "num_attention_heads": heads,
                                "num_key_value_heads": kv_heads, "vocab_size": 256,
                                "max_position_embeddings": 64}))


def test_resume_refuses_an_edited_hf_config(tmp_path):
    """A Hugging Face model named by a config.json edited since the checkpoint, to fewer heads of twice
    the width (every parameter keeps its shape), was loaded silently and trained on as another model;
    now refused before launch (and by every rank, the same function), naming the fields. A changed
    --dropout (no model field) still resumes."""
    pytest.importorskip("transformers")
    from modelpar.train.checkpoint.resume import check_checkpoints_before_launch
    from modelpar.train.config import TrainConfig
    from modelpar.train.task import model_spec

    conf = tmp_path / "config.json"
    _llama_config(conf, heads=4, kv_heads=2)
    cfg = TrainConfig(model=str(conf), seq_len=16, global_batch_size=4, steps=4, data="text",
                      resume=str(tmp_path / "ck"), ckpt_dir=str(tmp_path / "ck"))
    Checkpointer(tmp_path / "ck").save(checkpoint_module([torch.nn.Linear(2, 2)]), None, 2,
                                       meta={"train_config": cfg.to_dict(), "model_spec": model_spec(cfg)})
    check_checkpoints_before_launch(cfg)                                         # the same model
    check_checkpoints_before_launch(TrainConfig(**{**cfg.to_dict(), "dropout": 0.1}))
    _llama_config(conf, heads=2, kv_heads=1)
    with pytest.raises(CheckpointError, match=r"hf_config\.num_attention_heads: checkpoint 4 vs now 2") as e:
        check_checkpoints_before_launch(cfg)
    assert "hf_config.num_key_value_heads: checkpoint 2 vs now 1" in str(e.value)
    meta_file = tmp_path / "ck" / "step-00000002" / "modelpar.json"      # another transformers version wrote
    meta = json.loads(meta_file.read_text())                             # it: fields may be spelt otherwise,
    meta["model_spec"]["hf_config"]["transformers_version"] = "4.0.0"   # so only the parameters are checked
    meta_file.write_text(json.dumps(meta))
    check_checkpoints_before_launch(cfg)


def test_resume_keeps_this_runs_optimizer_settings(saved):
    """Loading the optimizer state put the checkpoint's param-group settings back, so a resume with
    another --weight-decay silently kept the old one; now this run's settings apply (the moments are
    the checkpoint's) and a note names every changed setting, the lr schedule's included."""
    from types import SimpleNamespace

    from modelpar.plan import ParallelPlan
    from modelpar.train.checkpoint import TrainCheckpoints
    from modelpar.train.config import TrainConfig

    ck, m, opt = saved
    meta = json.loads((ck / "step-00000006" / "modelpar.json").read_text())
    meta["lr_schedule"] = {"lr": 0.01, "min_lr": 0.001, "warmup_steps": 2, "steps": 8}
    (ck / "step-00000006" / "modelpar.json").write_text(json.dumps(meta))
    m2 = build_gpt("gpt-nano", seq_len=16, seed=1)
    opt2 = torch.optim.AdamW(m2.parameters(), lr=1e-2, weight_decay=0.0, betas=(0.8, 0.9))
    cfg = TrainConfig(model="gpt-nano", seq_len=16, global_batch_size=4, steps=12, lr=0.01, min_lr=0.001,
                      warmup_steps=2, resume=str(ck), ckpt_dir=str(ck))
    pm = SimpleNamespace(modules=[m2], ties=[], plan=ParallelPlan(), mesh=MeshInfo(mesh=None))
    said = []
    TrainCheckpoints(cfg, pm, opt2, say=said.append)
    g = opt2.param_groups[0]
    assert g["weight_decay"] == 0.0 and tuple(g["betas"]) == (0.8, 0.9), g
    p, p2 = next(m.parameters()), next(m2.parameters())
    assert torch.equal(opt2.state[p2]["exp_avg"], opt.state[p]["exp_avg"])
    note = [s for s in said if "settings differ" in s]
    assert len(note) == 1 and "weight_decay 0.01 -> 0.0" in note[0] and "steps 8 -> 12" in note[0], said
    assert "betas" in note[0] and "lr " not in note[0].split("on: ")[1].replace("min_lr", ""), note


_FACTORY = """import torch
import torch.nn as nn


class LM(nn.Module):
    def __init__(self):
        super().__init__()
        self.tok = nn.Embedding(256, {width})
        self.head = nn.Linear({width}, 256, bias=False)
        self.head.weight = self.tok.weight

    def forward(self, ids):
        return self.head(self.tok(ids))


def lm():
    torch.manual_seed(0)
    return {{"model": LM(), "task": "lm", "vocab_size": 256, "max_positions": 16}}
"""


def test_resume_of_another_model_under_the_same_name_is_refused_before_launch(tmp_path, fixture_ckpt):
    """A factory file edited since the save keeps its --model, so only the parameters tell: their shapes
    were compared by every rank after launch (the run folder made, the message once per rank); now once,
    before launch. A tied model that matches passes (a tie named once, under the name the checkpoint
    holds)."""
    from modelpar.cli.train import main as train_main
    from modelpar.train.checkpoint.resume import check_checkpoints_before_launch
    from modelpar.train.config import TrainConfig

    src = tmp_path / "mylm.py"
    src.write_text(_FACTORY.format(width=16))
    import importlib.util
    spec = importlib.util.spec_from_file_location("mylm_saved", src)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    model = mod.lm()["model"]
    argv = ["--model", f"{src}:lm", "--strategy", "single", "--seq-len", "16", "--global-batch-size", "4",
            "--steps", "4", "--ckpt-dir", str(tmp_path / "ck"), "--resume", "auto", "--out-dir", str(tmp_path / "runs")]
    opt = torch.optim.AdamW(model.parameters())
    Checkpointer(tmp_path / "ck").save(checkpoint_module([model]), opt, 2, meta={"model": f"{src}:lm"})
    src.write_text(_FACTORY.format(width=24))
    with pytest.raises(CheckpointError, match=r"written for another model: 1 shape\(s\) differ \(tok\.weight: "
                                              r"checkpoint \[256, 16\] vs model \[256, 24\]\)"):
        train_main(argv)
    assert not (tmp_path / "runs").exists()
    check_checkpoints_before_launch(TrainConfig(model=f"{src}:lm", resume="auto", ckpt_dir=str(tmp_path / "ck")),
                                    model)                         # the saved model, its tie included
    ck, _ = fixture_ckpt                                           # tied under the head's name in a pipeline
    cfg = TrainConfig(model="gpt-nano", model_config=dict(FIXTURE_MODEL), seq_len=16, global_batch_size=4, steps=4,
                      data="fixture-text", resume=str(ck), ckpt_dir=str(ck))
    check_checkpoints_before_launch(cfg, _fresh_fixture_model()[0])
    with pytest.raises(CheckpointError, match=r"1 parameter\(s\) of the model are not in it"):
        check_checkpoints_before_launch(cfg, build_gpt("gpt-nano", seq_len=16, seed=7,
                                                       **{**FIXTURE_MODEL, "tie_embeddings": False}))


def test_resume_into_a_folder_of_another_runs_checkpoints_is_refused(fixture_ckpt, tmp_path):
    """A resume from a checkpoint elsewhere, saving into a --ckpt-dir that held another run's
    checkpoints, pruned them (keep_last) and mixed its own in, silently; now refused before launch and
    by every rank (`TrainCheckpoints`), naming the folder's run's differing fields. The same run's
    folder, or no saving, is fine."""
    from types import SimpleNamespace

    from modelpar.plan import ParallelPlan
    from modelpar.train.checkpoint import TrainCheckpoints
    from modelpar.train.checkpoint.resume import check_checkpoints_before_launch
    from modelpar.train.config import TrainConfig

    ck, _ = fixture_ckpt
    other = tmp_path / "other"
    cfg = TrainConfig(model="gpt-nano", model_config=dict(FIXTURE_MODEL), seq_len=16, global_batch_size=4, steps=4,
                      data="fixture-text", resume=str(ck), ckpt_dir=str(other), ckpt_every=1, keep_last=1)
    Checkpointer(other).save(checkpoint_module([torch.nn.Linear(2, 2)]), None, 3,
                             meta={"train_config": {**cfg.to_dict(), "seed": 1}})
    msg = (r"ckpt_dir '.*other' holds checkpoints of another run \(step-00000003: seed: checkpoint 1 vs now 0\); "
           r".*pass another --ckpt-dir")
    with pytest.raises(CheckpointError, match=msg):
        check_checkpoints_before_launch(cfg)
    pm = SimpleNamespace(modules=[_fresh_fixture_model()[0]], ties=FIXTURE_TIE, plan=ParallelPlan(),
                         mesh=MeshInfo(mesh=None))
    with pytest.raises(CheckpointError, match=msg):
        TrainCheckpoints(cfg, pm, None)
    assert [s for s, _ in list_checkpoints(other)] == [3]
    check_checkpoints_before_launch(TrainConfig(**{**cfg.to_dict(), "ckpt_every": 0}))      # nothing saved
    Checkpointer(other).save(checkpoint_module([torch.nn.Linear(2, 2)]), None, 5,
                             meta={"train_config": cfg.to_dict()})                            # this run's
    check_checkpoints_before_launch(cfg)


def test_export_auto_of_a_hf_model_to_a_safetensors_name_writes_that_file(tmp_path, capsys):
    """`modelpar export CKPT --out model.safetensors` (the README's line) of a Hugging Face model wrote a
    transformers *folder* named model.safetensors; now --out ending in .safetensors asks for the one
    file (its names load strictly into the model, the tie's both names present); other names still
    get the folder."""
    from safetensors.torch import load_file

    from helpers.hf_tiny import TINY, build
    from modelpar.cli.export import main as export_main
    from modelpar.train.config import TrainConfig
    from modelpar.train.task import model_spec

    m = build("gpt2")
    spec, overrides = TINY["gpt2"]
    tie = [["hf.transformer.wte.weight", "hf.lm_head.weight"]]
    meta = {"model": spec, "model_spec": model_spec(TrainConfig(model=spec, model_config=overrides)),
            "tied_parameters": tie}
    Checkpointer(tmp_path / "ck").save(checkpoint_module([m], [tuple(tie[0])]), None, 1, meta=meta)
    assert export_main([str(tmp_path / "ck"), "--out", str(tmp_path / "model.safetensors")]) == 0
    assert (tmp_path / "model.safetensors").is_file(), "a folder was written"
    fresh = build("gpt2", seed=1)
    fresh.load_state_dict(load_file(str(tmp_path / "model.safetensors")))        # strict
    assert torch.equal(fresh.hf.lm_head.weight, m.hf.lm_head.weight)
    assert fresh.hf.lm_head.weight is fresh.hf.transformer.wte.weight
    assert export_main([str(tmp_path / "ck"), "--out", str(tmp_path / "my-gpt2")]) == 0
    assert (tmp_path / "my-gpt2" / "config.json").is_file()


def test_resume_compares_the_sequence_length_meant(fixture_ckpt):
    """--seq-len 0 means the model's own length: a run saved with 0 and resumed with that length given
    (the same samples) was refused as 'seq_len: checkpoint 0 vs now 64'; now accepted, and a real change
    is named with what 0 meant."""
    from modelpar.train.checkpoint.resume import check_checkpoints_before_launch
    from modelpar.train.config import TrainConfig

    ck, _ = fixture_ckpt
    meta_file = ck / "step-00000002" / "modelpar.json"
    meta = json.loads(meta_file.read_text())
    meta["train_config"]["seq_len"] = 0                          # gpt-nano's own: 64
    meta_file.write_text(json.dumps(meta))
    cfg = TrainConfig(model="gpt-nano", model_config=dict(FIXTURE_MODEL), seq_len=64, global_batch_size=4, steps=4,
                      data="fixture-text", resume=str(ck), ckpt_dir=str(ck))
    check_checkpoints_before_launch(cfg)
    check_checkpoints_before_launch(TrainConfig(**{**cfg.to_dict(), "seq_len": 0}))
    with pytest.raises(CheckpointError, match=r"seq_len: checkpoint 0 \(= 64\) vs now 32$"):
        check_checkpoints_before_launch(TrainConfig(**{**cfg.to_dict(), "seq_len": 32}))
    meta["train_config"]["seq_len"] = 16
    meta_file.write_text(json.dumps(meta))
    with pytest.raises(CheckpointError, match=r"seq_len: checkpoint 16 vs now 0 \(= 64\)$"):
        check_checkpoints_before_launch(TrainConfig(**{**cfg.to_dict(), "seq_len": 0}))


def test_resume_auto_without_a_checkpoint_says_it_starts_fresh(tmp_path):
    """--resume auto in a folder without a complete checkpoint (a first attempt, or a mistyped
    --ckpt-dir) started at step 0 without a word; now one line names the folder."""
    from types import SimpleNamespace

    from modelpar.plan import ParallelPlan
    from modelpar.train.checkpoint import TrainCheckpoints
    from modelpar.train.config import TrainConfig

    m = build_gpt("gpt-nano", seq_len=16)
    pm = SimpleNamespace(modules=[m], ties=[], plan=ParallelPlan(), mesh=MeshInfo(mesh=None))
    said = []
    tc = TrainCheckpoints(TrainConfig(model="gpt-nano", resume="auto", ckpt_dir=str(tmp_path / "ck-typo")), pm,
                          torch.optim.AdamW(m.parameters()), say=said.append)
    assert tc.start_step == 0
    assert said == [f"  --resume auto: no complete checkpoint in {tmp_path / 'ck-typo'}, so starting at step 0"]


def test_resume_notes_data_that_changed_since_the_checkpoint(tmp_path):
    """The same --data path holding other bytes (a text file appended to, a token file rewritten) gave
    other samples from the resumed step on without a word; a checkpoint now records the data's
    fingerprint and a resume names what changed (the path itself is `data`, compared as before)."""
    from types import SimpleNamespace

    from modelpar.plan import ParallelPlan
    from modelpar.train.checkpoint import TrainCheckpoints
    from modelpar.train.config import TrainConfig

    m = build_gpt("gpt-nano", seq_len=16)
    pm = SimpleNamespace(modules=[m], ties=[], plan=ParallelPlan(), mesh=MeshInfo(mesh=None))
    info = {"source": "a.txt", "num_files": 1, "num_bytes": 100, "files_sha256": "ab", "description": "d"}
    cfg = TrainConfig(model="gpt-nano", seq_len=16, steps=4, ckpt_every=2, ckpt_dir=str(tmp_path / "ck"))
    tc = TrainCheckpoints(cfg, pm, torch.optim.AdamW(m.parameters()), say=lambda *a: None, data_info=info)
    tc.after_step(2)
    tc.close()
    assert read_checkpoint_meta(step_dir(tmp_path / "ck", 2))["data_info"] == info
    resume = TrainConfig(**{**cfg.to_dict(), "resume": "auto"})
    for now, expected in (({**info, "description": "other words", "source": "b.txt"}, []),
                          ({**info, "num_bytes": 120}, ["num_bytes 100 -> 120"])):
        said = []
        TrainCheckpoints(resume, pm, torch.optim.AdamW(m.parameters()), say=said.append, data_info=now)
        notes = [s for s in said if "the data differs" in s]
        assert [s.split("(")[1].split(")")[0] for s in notes] == expected, said


def test_checkpoint_refusal_comes_before_the_planner(fixture_ckpt, tmp_path, monkeypatch):
    """--strategy auto on an uncalibrated machine measures it first (~2 min): a resume of another run's
    checkpoint was refused only after that; now before the planner runs."""
    import modelpar.train.resolve as resolve_mod
    from modelpar.cli.train import main as train_main

    def planner(*a, **k):
        raise AssertionError("the planner ran before the checkpoint was checked")

    monkeypatch.setattr(resolve_mod, "resolve", planner)
    ck, _ = fixture_ckpt
    argv = ["--model", "gpt-nano", "--model-config", json.dumps(FIXTURE_MODEL), "--seq-len", "16",
            "--global-batch-size", "4", "--steps", "4", "--data", "fixture-text", "--seed", "1", "--resume", str(ck),
            "--out-dir", str(tmp_path / "runs")]
    with pytest.raises(CheckpointError, match=r"seed: checkpoint 0 vs now 1"):
        train_main(argv)


def test_a_save_cut_off_before_its_rename_is_kept(tmp_path):
    """A save killed after its marker but before the folder's rename left a complete ``.tmp-step-*``,
    which the next writer deleted (the checkpoint lost), and the ``.old-*`` copy of a replaced one was
    never removed; now the complete one is renamed into place, the incomplete and old ones removed."""
    import shutil

    from modelpar.train.checkpoint.storage import CheckpointWriter

    m, opt = _trained(steps=1)
    ck, other = tmp_path / "ck", tmp_path / "other"
    Checkpointer(ck).save(checkpoint_module([m]), opt, 2)
    for s in (4, 6):
        Checkpointer(other).save(checkpoint_module([m]), opt, s)
        shutil.move(str(step_dir(other, s)), str(ck / f".tmp-step-{s:08d}"))
    (ck / ".tmp-step-00000006" / "COMPLETE").unlink()              # cut off while writing
    shutil.copytree(step_dir(ck, 2), ck / ".old-step-00000002-123")
    CheckpointWriter(ck)
    assert [s for s, _ in list_checkpoints(ck)] == [2, 4]
    assert read_checkpoint_meta(step_dir(ck, 4))["step"] == 4
    assert sorted(p.name for p in ck.iterdir()) == ["step-00000002", "step-00000004"]


def test_resume_names_a_file_from_another_directory(tmp_path, monkeypatch):
    """A user's report: a run started with ``--data data.txt`` in its folder, resumed from another
    working directory with ``--data ../run/data.txt`` (or the absolute path), was refused ("data:
    checkpoint 'data.txt' vs now '../run/data.txt'"): the fields naming files were compared as
    written. A checkpoint now records the file each names (`resume._where`) and a resume compares that;
    another file is still refused, and a checkpoint without the record compares as written."""
    from types import SimpleNamespace

    from modelpar.plan import ParallelPlan
    from modelpar.train.checkpoint import TrainCheckpoints
    from modelpar.train.checkpoint.resume import _run_diffs, check_checkpoints_before_launch
    from modelpar.train.config import TrainConfig

    run, other = tmp_path / "run", tmp_path / "elsewhere"
    run.mkdir(), other.mkdir()
    for name in ("data.txt", "more.txt"):
        (run / name).write_text("some text to train on\n" * 20)
    monkeypatch.chdir(run)
    m = build_gpt("gpt-nano", seq_len=16)
    pm = SimpleNamespace(modules=[m], ties=[], plan=ParallelPlan(), mesh=MeshInfo(mesh=None))
    cfg = TrainConfig(model="gpt-nano", seq_len=16, steps=4, ckpt_every=2, ckpt_dir=str(tmp_path / "ck"),
                      data="data.txt")
    tc = TrainCheckpoints(cfg, pm, torch.optim.AdamW(m.parameters()), say=lambda *a: None)
    tc.after_step(2)
    tc.close()
    meta = read_checkpoint_meta(step_dir(tmp_path / "ck", 2))
    assert meta["paths"] == {"data": str((run / "data.txt").resolve())}        # gpt-nano names no file
    monkeypatch.chdir(other)
    for data in ("../run/data.txt", str(run / "data.txt")):
        resume = TrainConfig(**{**cfg.to_dict(), "resume": "auto", "data": data})
        assert _run_diffs(meta, resume) == []
        check_checkpoints_before_launch(resume)
    moved = TrainConfig(**{**cfg.to_dict(), "resume": "auto", "data": "../run/more.txt"})
    assert _run_diffs(meta, moved) == ["data: checkpoint 'data.txt' vs now '../run/more.txt'"]
    with pytest.raises(CheckpointError, match=r"sample order: data: checkpoint 'data.txt' vs now '../run/more.txt'"):
        check_checkpoints_before_launch(moved)
    older = {k: v for k, v in meta.items() if k != "paths"}
    assert _run_diffs(older, TrainConfig(**{**cfg.to_dict(), "data": "../run/data.txt"})) == [
        "data: checkpoint 'data.txt' vs now '../run/data.txt'"]
