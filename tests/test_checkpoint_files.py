"""Checkpoint files on one process: atomic save, keep-last, async save, and bad files giving one
clear error naming the path and the problem, with nothing already saved overwritten."""

from __future__ import annotations

import json
import warnings

import pytest
import torch

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
        TrainCheckpoints(cfg, type("PM", (), {"modules": [saved[1]]})(), saved[2])


def test_meta_records_names_and_shapes(saved):
    meta = json.loads((step_dir(saved[0], 6) / "modelpar.json").read_text())
    assert meta["format"] == "modelpar-checkpoint" and meta["step"] == 6 and meta["world_size"] == 1
    assert meta["params"]["head.out.weight"] == [256, 64] and meta["optimizer"] == "AdamW"
