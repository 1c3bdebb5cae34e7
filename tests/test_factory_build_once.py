"""A factory model is built once in the launcher (`modelpar.models.spec.one_factory_build`).

Before, ``modelpar train`` called the factory up to five times before any rank started, each a whole
CPU build of the model: the forward check, ``--strategy auto`` / ``rules`` (the meta-device task and
the planner's profile), the preflight's meta-device task and, under a pipeline, the cut on real weights.
"""

import gc
import importlib
import sys

import pytest

M = "counted_factory:lm"
COUNTED = '''
import weakref

import torch

from helpers.lm_factory import PipelinedLM

CALLS = []              # a weak reference to each model built, one per call


def lm():
    torch.manual_seed(0)
    m = PipelinedLM()
    m.blocks[1].eval()  # mixed modes: a check that switches the whole model to eval / train must not pass that on
    CALLS.append(weakref.ref(m))
    return {"model": m, "task": "lm", "vocab_size": 256, "max_positions": 32}
'''


@pytest.fixture
def counted(tmp_path, monkeypatch):
    """The module of a factory (``counted_factory:lm``) that counts its calls."""
    (tmp_path / "counted_factory.py").write_text(COUNTED)
    monkeypatch.syspath_prepend(str(tmp_path))
    sys.modules.pop("counted_factory", None)
    yield importlib.import_module("counted_factory")
    sys.modules.pop("counted_factory", None)


COMMANDS = [["train", "--strategy", "auto"], ["train", "--strategy", "rules"], ["train", "--strategy", "pp"],
            ["train", "--strategy", "fsdp"], ["plan", "--hardware", "cpu"],
            ["estimate", "--hardware", "cpu", "--strategy", "pp"]]


@pytest.mark.parametrize("cmd", COMMANDS, ids=[c[0] + "-" + c[-1] if "--strategy" in c else c[0] for c in COMMANDS])
def test_a_command_calls_a_factory_once_before_launch_and_holds_no_model_while_the_ranks_run(
        counted, tmp_path, monkeypatch, capsys, cmd):
    """Before: train --strategy auto 5 calls (the plan it picks is a pipeline), rules 4, pp 3, fsdp 2
    (the forward check and the preflight's meta-device task); plan and estimate 1."""
    from modelpar.cli import main

    launched = []

    class Ranks:
        def report(self, name):
            return 0, ""

    def run_command(target, world, **kw):       # the ranks would start here: no process in this test
        launched.append((len(counted.CALLS), sum(r() is not None for r in counted.CALLS)))
        return Ranks()

    monkeypatch.setattr("modelpar.launch.run_command", run_command)
    argv = cmd + ["--model", M, "--nproc", "2", "--global-batch-size", "4", "--seq-len", "32"]
    if cmd[0] == "train":
        argv += ["--steps", "1", "--eval-samples", "8", "--out-dir", str(tmp_path / "runs")]
    rc = main(argv)
    assert rc == 0, capsys.readouterr()
    assert len(counted.CALLS) == 1, (cmd, len(counted.CALLS))
    if cmd[0] == "train":
        assert launched == [(1, 0)]             # called once, and no model alive once the ranks start


def test_the_checks_share_one_build_and_leave_it_as_the_factory_built_it(counted):
    """Inside the scope: the forward check, ``--strategy auto``'s resolution and a pipeline's preflight
    (its meta-device task, the cut on real weights) use one build; what they switch (the modes) is given
    back, the meta-device task is a copy (the build stays on CPU), the declared fields are each caller's
    own. On exit the build is dropped; outside a scope every call builds anew."""
    import torch

    from modelpar.models.spec import build_factory, one_factory_build
    from modelpar.train.config import TrainConfig
    from modelpar.train.loop import check_factory_forward, preflight
    from modelpar.train.resolve import resolve
    from modelpar.train.task import build_task

    fresh = build_factory(M)
    cfg = dict(model=M, nproc=2, global_batch_size=4, seq_len=32, eval_samples=8)
    with one_factory_build():
        check_factory_forward(TrainConfig(**cfg, strategy="auto"))
        resolve(TrainConfig(**cfg, strategy="auto"), 2)
        preflight(TrainConfig(**cfg, strategy="pp"), 2)         # its own scope, nested: the outer one's build
        meta = build_task(TrainConfig(**cfg), device="meta", load_data=False).model
        um = build_factory(M)
        um.extra["task"] = "changed"
        again = build_factory(M)
    assert len(counted.CALLS) == 2                              # `fresh`, and the scope's one
    assert again.model is um.model and again.extra["task"] == "lm"
    assert all(p.is_meta for p in meta.parameters()) and all(p.device.type == "cpu" for p in um.model.parameters())
    assert [m.training for m in um.model.modules()] == [m.training for m in fresh.model.modules()]
    got, ref = um.model.state_dict(), fresh.model.state_dict()
    assert got.keys() == ref.keys() and all(torch.equal(got[k], ref[k]) for k in ref)
    del um, again, meta, got
    gc.collect()
    assert counted.CALLS[1]() is None                           # the scope held it; nothing else does
    assert build_factory(M).model is not fresh.model and len(counted.CALLS) == 3


def test_a_rank_builds_a_factory_model_once(counted, tmp_path):
    """A rank's preflight (its meta-device task and, under a pipeline, the cut on real weights) and the model it
    trains share one build (before: two calls per rank, each a whole CPU build); one process here."""
    from modelpar.train.config import TrainConfig
    from modelpar.train.runner import train

    from helpers.ckpt_worker import data_dir

    cfg = TrainConfig(model=M, strategy="single", steps=1, global_batch_size=4, seq_len=16, eval_samples=4,
                      eval_every=0, sample_bytes=0, data=data_dir(), out_dir=str(tmp_path / "out"))
    summary = train(cfg, run_dir=tmp_path / "run", quiet=True)
    assert summary["losses"] and len(counted.CALLS) == 1, len(counted.CALLS)
