"""Tensor parallel on factory models (`modelpar.parallel.tp_factory`): a transformers model inside a user's
wrapper gets the plan of ``hf:`` models under its own path (sequence parallel where ``hf:`` has it); a
Linear pairing guessed in module order is checked (widths, the forward's data flow) and refused before
launch where it is not the forward's; the planner prunes tp layouts of a model train refuses under TP, and
``estimate``'s per-strategy list says which strategies train would refuse, with train's reason."""

import pytest
import torch
import torch.nn as nn
from helpers.hf_tiny import build
from helpers.pure_fixtures import requires

from modelpar.parallel import tp_factory
from modelpar.parallel.tensor import COLWISE, ROWWISE, default_tp_plan, validate_tp_plan


def _factory(name):
    pytest.importorskip("transformers")
    from helpers import hf_factory

    return getattr(hf_factory, name)()["model"]


@requires("transformers")
def test_factory_wrapped_llama_gets_the_hf_plan_under_its_path():
    """Before: the Linears were paired in module order (q with k, v with o, ...), which crashed inside the
    ranks ("Sharding propagation failed for aten.mm"), and sequence parallel was refused as GPT-only."""
    m = _factory("llama")
    plan, vocab = default_tp_plan(m, tp_degree=2)
    ref, _ = default_tp_plan(build("llama"), tp_degree=2)
    assert vocab and plan == {"net." + k[len("hf."):]: s for k, s in ref.items()}
    assert plan["net.model.layers.0.self_attn.k_proj"] == COLWISE and plan["net.model.layers.0.self_attn.o_proj"] == ROWWISE
    validate_tp_plan(m, plan, 2, seq_len=16)
    with pytest.raises(ValueError, match=r"degree 4 does not divide LlamaConfig\.num_key_value_heads=2: the key/value "
                                         r"projections 'net\.model\.layers\.0\.self_attn\.k_proj'"):
        validate_tp_plan(m, default_tp_plan(m, tp_degree=4)[0], 4)
    sp = default_tp_plan(m, sequence_parallel=True, tp_degree=2)[0]       # llama: sequence parallel as hf:llama
    assert sp["net.model.norm"] == "sequence_parallel" and sp["net.model.layers.0"] == "shard_seq_input"
    with pytest.raises(ValueError, match=r"sequence parallel is supported for the Hugging Face families llama, gpt2; "
                                         r"GPTNeoXForCausalLM"):
        default_tp_plan(_factory("neox"), sequence_parallel=True, tp_degree=2)
    assert tp_factory.tp_refusal(_factory("gpt2"), torch.zeros(1, 8, dtype=torch.long)) == ""   # Conv1D: hf:gpt2's plan


def test_guessed_linear_pairing_is_checked_before_launch():
    """Before: any two Linears were paired in module order, whatever their widths or the forward."""
    with pytest.raises(ValueError, match=r"pairing its nn\.Linear layers in module order gives '0' \(out_features=8\) "
                                         r"colwise and '1' \(in_features=4\) rowwise, which do not chain; pass your own"):
        default_tp_plan(nn.Sequential(nn.Linear(4, 8), nn.Linear(4, 8)))
    mlp = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 4), nn.Linear(4, 6), nn.GELU(), nn.Dropout(0.1),
                        nn.Linear(6, 3))
    assert tp_factory.tp_refusal(mlp, torch.zeros(1, 4)) == ""         # an MLP chain: the guess is its data flow

    class Residual(nn.Module):
        def __init__(self):
            super().__init__()
            self.a, self.b = nn.Linear(8, 8), nn.Linear(8, 8)

        def forward(self, x):
            h = self.a(x)
            return self.b(torch.relu(h)) + h

    why = tp_factory.tp_refusal(Residual(), torch.zeros(1, 3, 8))
    assert "('a' colwise, 'b' rowwise) is not how its forward uses them: the colwise Linear's output is also read" in why
    from helpers.lm_factory import TinyLM        # widths chain (32 -> 32) but a LayerNorm and residual sit between
    why = tp_factory.tp_refusal(TinyLM(), torch.zeros(1, 8, dtype=torch.long))
    assert "comes through NativeLayerNorm" in why and "use --model hf:NAME" in why


def test_train_preflight_takes_the_factory_plan_and_refuses_a_wrong_guess():
    from modelpar.train.config import TrainConfig
    from modelpar.train.loop import preflight

    kw = dict(strategy="tp", steps=2, global_batch_size=4, seq_len=16, eval_samples=8)
    with pytest.raises(ValueError, match=r"TinyLM has no TP plan modelpar knows.*not how its forward uses them"):
        preflight(TrainConfig(model="helpers.lm_factory:lm", **kw), 2)
    pytest.importorskip("transformers")
    assert preflight(TrainConfig(model="helpers.hf_factory:llama", sequence_parallel=True, **kw), 2)[0].tp == 2


def test_planner_prunes_tp_of_a_model_train_refuses_under_tp(capsys):
    """Before: `plan` ranked tp layouts of factory models that train then refused (GPT-2's Conv1D behind a
    wrapper: "needs at least two nn.Linear layers"; TinyLM: crashed in the ranks)."""
    from modelpar.cli.common import profile_for
    from modelpar.cli.estimate import main as estimate_main
    from modelpar.cli.plan import main as plan_main
    from modelpar.planner.hardware import get_hardware
    from modelpar.planner.search import search_plans

    prof, _ = profile_for("helpers.lm_factory:lm", {}, 16, "fp32")
    assert "not how its forward uses them" in prof.tp_refusal
    rep = search_plans(prof, 4, get_hardware("H100-80GB-SXM"), global_batch_size=8, top_k=50)
    assert rep.ranked and all(c.plan.tp == 1 for c in rep.ranked)
    with pytest.raises(ValueError, match=r"--strategy tp: tensor parallel: TinyLM has no TP plan"):
        plan_main(["--model", "helpers.lm_factory:lm", "--nproc", "2", "--strategy", "tp", "--seq-len", "16"])
    with pytest.raises(ValueError, match=r"tp2: tensor parallel: TinyLM"):
        estimate_main(["--model", "helpers.lm_factory:lm", "--nproc", "2", "--strategy", "tp", "--seq-len", "16"])
    pytest.importorskip("transformers")
    capsys.readouterr()
    assert estimate_main(["--model", "helpers.hf_factory:llama", "--nproc", "64", "--hardware", "H100-80GB-SXM",
                          "--seq-len", "16"]) == 0
    out = capsys.readouterr().out
    assert ("ddp    not applicable: global_batch_size=16 is not divisible by the data-parallel degree 64" in out
            and "tp     not applicable: tensor parallel degree tp=64 does not divide the model's attention" in out), out


@pytest.mark.slow
@pytest.mark.timeout(300)
@requires("transformers")
def test_factory_wrapped_llama_tp2_with_sequence_parallel_matches_one_process(monkeypatch, capfd):
    """The reported crash: tp2 of a factory-wrapped Llama (here with sequence parallel) now equals one process."""
    import os
    from pathlib import Path

    from modelpar.cli import main

    monkeypatch.setenv("PYTHONPATH", f"{Path(__file__).resolve().parent}{os.pathsep}{os.environ.get('PYTHONPATH', '')}")
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    monkeypatch.setenv("PYTHONWARNINGS", "ignore")
    capfd.readouterr()
    rc = main(["verify", "--model", "helpers.hf_factory:llama", "--strategy", "tp", "--sequence-parallel",
               "--nproc", "2", "--steps", "3"])
    out = capfd.readouterr()
    assert rc == 0 and "plan tp2" in out.out and "\nPASS" in out.out, out.out[-2000:] + out.err[-3000:]
