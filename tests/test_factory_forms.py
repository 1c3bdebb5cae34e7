"""Factory models in the forms a user tries first with a Hugging Face model (tests/helpers/hf_factories.py):
``train --strategy auto`` profiles a wrapped HF model as ``plan`` does (`factory_check.factory_profile`)."""

import pytest

pytest.importorskip("transformers")

M = "helpers.hf_factories:"


def test_strategy_auto_picks_a_plan_for_a_factory_wrapped_hf_llama():
    """Before: auto profiled the factory's model moved to the meta device, where Llama's causal mask
    calls .item(), and stopped with "needs the planner's profile ... failed (RuntimeError: Tensor.item()
    cannot be called on meta tensors)"; `plan` (CPU weights under FakeTensorMode) ranked 10 plans."""
    from modelpar.train.config import TrainConfig
    from modelpar.train.resolve import resolve

    cfg = TrainConfig(model=M + "llama", strategy="auto", global_batch_size=4, seq_len=32, hardware="cpu")
    r = resolve(cfg, 2)
    assert r.plan.world_size == 2 and r.reason.startswith("auto: the fastest feasible plan"), r


C = ["--nproc", "2", "--global-batch-size", "4", "--seq-len", "32"]
NOT_LOGITS = "the model's forward returns CausalLMOutputWithPast, not a tensor: wrap it so forward returns .logits"
EMBEDDING = "is an embedding that needs integer token ids, but a factory that returns a module"
MORE_INPUTS = ("the model's forward needs more inputs than the batch gives it (TypeError: NeedsMask.forward() missing "
               "1 required positional argument: 'attention_mask')")
# (command, factory, strategy, message): before, train and verify launched the ranks, which each printed a
# traceback (~140-200 lines); plan / estimate printed a traceback (llama_raw, needs_kwargs) or ranked plans
# for a model train cannot run (llama_dict)
REFUSED = [
    ("train", "llama_raw", "fsdp", EMBEDDING), ("train", "llama_dict", "ddp", NOT_LOGITS),
    ("train", "bert_cls", "ddp", EMBEDDING), ("train", "needs_kwargs", "fsdp", MORE_INPUTS),
    ("train", "needs_kwargs", "pp", MORE_INPUTS), ("train", "llama_dict", "auto", NOT_LOGITS),
    ("verify", "bert_cls", "ddp", EMBEDDING), ("verify", "llama_dict", "pp", NOT_LOGITS),
    ("plan", "llama_raw", "", EMBEDDING), ("plan", "llama_dict", "", NOT_LOGITS), ("plan", "needs_kwargs", "", MORE_INPUTS),
    ("estimate", "llama_dict", "", NOT_LOGITS),
]


@pytest.mark.parametrize("cmd,factory,strategy,msg", REFUSED, ids=["-".join(r[:3]).strip("-") for r in REFUSED])
def test_a_factory_forward_of_the_wrong_form_is_one_line_before_launch(tmp_path, capsys, cmd, factory, strategy, msg):
    """The pre-launch forward (`factory_check.check_forward`) refuses the form in one line, exit code 2, no
    traceback, no run folder; no process starts (the pure tier's guard would fail the test)."""
    from modelpar.cli import main

    argv = [cmd, "--model", M + factory, *C] + (["--strategy", strategy] if strategy else [])
    if cmd == "train":
        argv += ["--steps", "2", "--eval-samples", "8", "--out-dir", str(tmp_path / "runs")]
    if cmd == "verify":
        argv += ["--steps", "2"]
    if cmd in ("plan", "estimate"):
        argv += ["--hardware", "A100-80GB"]     # no note on an uncalibrated CPU first
    rc = main(argv)
    err = capsys.readouterr().err
    assert rc == 2 and err.startswith(f"modelpar {cmd}: error: --model '{M}{factory}': ") and err.count("\n") == 1, err
    assert msg in err and "docs/your-model.md" in err and "Traceback" not in err, err
    assert not (tmp_path / "runs").exists()


def test_the_forms_that_train_pass_the_forward_check():
    """The wrapped llama (its forward returns .logits), the docs' factory LM and a classifier whose batch norm
    a batch of one would fail in training mode (the check runs in eval mode and gives the modes back)."""
    import torch
    import torch.nn as nn

    from modelpar.models.factory_check import check_forward
    from modelpar.train.config import TrainConfig
    from modelpar.train.loop import check_factory_forward

    for m in (M + "llama", "helpers.lm_factory:lm", "helpers.lm_factory:classifier"):
        check_factory_forward(TrainConfig(model=m, seq_len=32))
    net = nn.Sequential(nn.Linear(4, 8), nn.BatchNorm1d(8), nn.Linear(8, 3))
    net[0].eval()
    check_forward("m:f", net, torch.zeros(1, 4), form="classify")
    assert [m.training for m in net.modules()] == [True, False, True, True]
    assert torch.equal(net[1].running_mean, torch.zeros(8))
    with pytest.raises(ValueError, match=r"returns a tensor of shape \(1, 3\) for token ids of shape \(1, 4\): a "
                                         r"language model returns logits \(batch, seq, vocab_size=8\)"):
        check_forward("m:f", net, torch.zeros(1, 4), form="lm", vocab=8)


def test_a_factory_holding_a_transformers_type_hf_does_not_train_is_planned_as_any_module(tmp_path, capsys):
    """A fresh user's trial: a factory wrapping T5 (encoder-decoder; `hf:t5` is refused) trained under
    --strategy ddp, but plan / estimate / auto refused it with the `hf:` message ("model type 't5': modelpar
    trains Hugging Face causal language models ..."), naming a type the user never asked modelpar to load."""
    from modelpar.cli import main

    (tmp_path / "t5f.py").write_text(
        "import torch, torch.nn as nn\n"
        "from transformers import T5Config, T5ForConditionalGeneration\n"
        "class T5Wrap(nn.Module):\n"
        "    def __init__(self, m):\n"
        "        super().__init__(); self.hf = m\n"
        "    def forward(self, ids):\n"
        "        return self.hf(input_ids=ids, decoder_input_ids=ids).logits\n"
        "def t5():\n"
        "    torch.manual_seed(0)\n"
        "    cfg = T5Config(d_model=32, d_kv=8, d_ff=64, num_layers=2, num_decoder_layers=2, num_heads=4,\n"
        "                   vocab_size=256, decoder_start_token_id=0, pad_token_id=0, eos_token_id=1)\n"
        "    return {'model': T5Wrap(T5ForConditionalGeneration(cfg)), 'task': 'lm', 'vocab_size': 256}\n")
    m = f"{tmp_path / 't5f.py'}:t5"
    assert main(["plan", "--model", m, "--nproc", "2", "--seq-len", "16", "--hardware", "A100-80GB", "--top", "2"]) == 0
    out = capsys.readouterr().out
    assert "T5Wrap from" in out and " 1 " in out, out
    assert main(["estimate", "--model", m, "--nproc", "2", "--seq-len", "16", "--strategy", "ddp",
                 "--hardware", "A100-80GB"]) == 0
    assert "; ddp2 [bf16] on 2 x A100-80GB" in capsys.readouterr().out
