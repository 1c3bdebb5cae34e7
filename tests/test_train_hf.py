"""`modelpar train`, checkpoints, resume and `modelpar export` on Hugging Face causal LMs and image
classifiers, and on factory language models and classifiers (issue 12, item 5).

The launched part: one reference run on one process (tiny GPT-2 from config, tied head, byte-level
tokens, 6 steps), and 2-rank scenarios that ride in the session's first 2-rank scenario launch
(`helpers.workers`; alone when this module runs by itself): DDP saving every 2 steps, a DDP resume of it from step 4
(bit-identical to the uninterrupted run), and an FSDP resume from step 2 (another layout: within the
parity tolerance). The export of the DDP run's last checkpoint (no --model) loads in
``transformers.AutoModelForCausalLM.from_pretrained`` with logits within 1e-6 of the trained model's.
The rest runs in this process: the token-file and tokenizer.json data paths, a pretrained folder's
weights, a factory language model, and every refusal before launch.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch

from helpers.ckpt_worker import data_dir
from helpers import workers
from helpers.hf_tiny import TINY
from helpers.pure_fixtures import requires

pytestmark = requires("transformers", "tokenizers")  # checks they are installed without importing them at collection

GPT2 = {**TINY["gpt2"][1], "vocab_size": 256}          # byte-level tokens need a vocabulary of 256
BASE = dict(model="hf:gpt2", model_config=GPT2, seq_len=16, global_batch_size=8, steps=6, warmup_steps=2,
            eval_every=0, eval_samples=8, sample_bytes=0, track_memory=False, log_every=1, threads=1)
LOSS_RTOL = 1e-5
# an HF image classifier from config: trains on synthetic 3x8x8 images with 5 labels (its own shape)
VIT = dict(model="hf:vit", model_config=TINY["vit"][1])
# a factory classifier (an nn.Module: shapes from its first and last nn.Linear): synthetic inputs
CLS = dict(model="helpers.lm_factory:classifier", model_config={})


def cfg_of(**kw):
    from modelpar.train.config import TrainConfig

    return TrainConfig(**{**BASE, "data": data_dir(), **kw})


def train_here(tmp: Path, name: str, **kw) -> dict:
    from modelpar.train.runner import train

    return train(cfg_of(out_dir=str(tmp / "out"), **kw), run_dir=tmp / "runs" / name, quiet=True)


def max_rel(a, b) -> float:
    assert len(a) == len(b) and a
    return max(abs(x - y) / max(abs(x), 1e-12) for x, y in zip(a, b))


# ---- launched: DDP x2, same-plan resume, resume under FSDP, export ----------------------------------
def _launched(w: Path, write: bool = True) -> list[dict]:
    """The 2-rank scenarios; they ride in the session's first 2-rank scenario launch (`helpers.workers`).
    Writes the local pretrained folder they read first (``write``)."""
    from modelpar.models.hf import build_hf

    ck, pre, ck_vit = w / "ckpt-ddp", w / "pretrained", w / "ckpt-vit"
    if write:
        build_hf("hf:gpt2", GPT2, seed=5).hf.save_pretrained(str(pre))      # a local pretrained folder

    def spec(name, **kw):
        return {"name": name, "kind": "train", "cfg": {**BASE, "data": data_dir(), "out_dir": str(w / "out"), **kw},
                "run_dir": str(w / "runs" / name)}

    return [spec("ddp", strategy="ddp", ckpt_every=2, ckpt_dir=str(ck), keep_last=0),
            spec("ddp_resume4", strategy="ddp", resume=str(ck / "step-00000004")),
            spec("fsdp_resume2", strategy="fsdp", resume=str(ck / "step-00000002")),
            spec("fsdp_meta", strategy="fsdp", meta_init=True),
            spec("fsdp_meta_pre", strategy="fsdp", meta_init=True, model=str(pre), model_config={}),
            spec("tp_meta", strategy="tp", meta_init=True),
            spec("tp_meta_pre", strategy="tp", meta_init=True, model=str(pre), model_config={}),
            spec("pp_meta", strategy="pp", meta_init=True),
            spec("vit_ddp", **VIT, strategy="ddp", ckpt_every=2, ckpt_dir=str(ck_vit), keep_last=0),
            spec("vit_resume2", **VIT, strategy="ddp", resume=str(ck_vit / "step-00000002")),
            spec("cls_ddp", **CLS, strategy="ddp"),
            {"name": "verify_pp", "kind": "call", "fn": "helpers.verify_memory_case:verify_pp",
             "argv": ["--model", "hf:gpt2", "--model-config", json.dumps(TINY["gpt2"][1]), "--strategy", "pp",
                      "--nproc", "2", "--steps", "2", "--global-batch-size", "8", "--seq-len", "16"]}]


workers.ride("hf2", 2, _launched, module=__file__)


@pytest.fixture(scope="module")
def runs():
    res = workers.rider_results("hf2")
    w = workers.group_dir("hf2")
    ck, pre = w / "ckpt-ddp", w / "pretrained"
    ref = train_here(w, "ref", strategy="single")
    vit_ref = train_here(w, "vit_ref", **VIT, strategy="single")
    cls_ref = train_here(w, "cls_ref", **CLS, strategy="single")
    meta_ref = train_here(w, "meta_ref", strategy="single", meta_init=True)
    pre_ref = train_here(w, "pre_ref", strategy="single", model=str(pre), model_config={})
    assert set(res) == {s["name"] for s in _launched(w, write=False)}, sorted(res)
    for name, r in res.items():
        assert not r["errors"], f"{name} failed: {r['errors']}"
    return {"ref": ref, "vit_ref": vit_ref, "cls_ref": cls_ref, "meta_ref": meta_ref, "pre_ref": pre_ref, "res": {k: v["result"] for k, v in res.items()},
            "ckpt": ck, "work": w}


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_ddp2_trains_hf_gpt2_like_one_process(runs):
    ref, got = runs["ref"]["losses"], runs["res"]["ddp"]["losses"]
    assert len(got) == 6 and got[-1] < got[0]
    assert max_rel(ref, got) <= LOSS_RTOL, (ref, got)


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_same_plan_resume_is_bit_identical(runs):
    full, resumed = runs["res"]["ddp"], runs["res"]["ddp_resume4"]
    assert resumed["start_step"] == 4 and resumed["losses"] == full["losses"][4:]
    assert resumed["val_loss_after"] == full["val_loss_after"]
    rows = [json.loads(l) for l in (runs["work"] / "runs" / "ddp_resume4" / "metrics.jsonl").read_text().splitlines()]
    vals = [r["step"] for r in rows if "val_loss" in r]
    assert vals[0] == 4 and vals[-1] == 6, vals      # the evaluation before training: at the step resumed from


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_resume_under_fsdp_matches_uninterrupted(runs):
    got = runs["res"]["fsdp_resume2"]
    assert got["start_step"] == 2 and got["plan"]["dp_shard"] == 2
    assert max_rel(runs["ref"]["losses"][2:], got["losses"]) <= LOSS_RTOL


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_meta_init_under_fsdp_matches_one_process(runs):
    """meta_init: built on meta, each rank materialises its FSDP shards. From a config the values come
    from (seed, name), so FSDP x2 matches one process with meta_init; from a pretrained folder the
    shards are read from its safetensors file, so FSDP x2 matches the plain one-process load."""
    assert max_rel(runs["meta_ref"]["losses"], runs["res"]["fsdp_meta"]["losses"]) <= LOSS_RTOL
    assert runs["meta_ref"]["losses"] != runs["ref"]["losses"]          # not transformers' own init
    assert max_rel(runs["pre_ref"]["losses"], runs["res"]["fsdp_meta_pre"]["losses"]) <= LOSS_RTOL
    assert runs["pre_ref"]["losses"] != runs["ref"]["losses"]           # the folder's weights (seed 5)


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_meta_init_under_tp_and_pp_matches_one_process(runs):
    """meta_init under tp2 (each rank materialises its DTensor shards; GPT-2's c_attn in the TP-permuted
    column order, its vocab-parallel tied wte / lm_head) and pp2 (each rank its own stage; the tied
    wte on the first and lm_head on the last get the same values, from the tie's first name): the
    losses of one process with meta_init, and from a pretrained folder (the shards read as slices of
    its safetensors file) the plain one-process load's."""
    got = runs["res"]
    assert got["tp_meta"]["plan"]["tp"] == 2 and got["pp_meta"]["plan"]["pp"] == 2
    assert max_rel(runs["meta_ref"]["losses"], got["tp_meta"]["losses"]) <= LOSS_RTOL
    assert max_rel(runs["meta_ref"]["losses"], got["pp_meta"]["losses"]) <= LOSS_RTOL
    assert max_rel(runs["pre_ref"]["losses"], got["tp_meta_pre"]["losses"]) <= LOSS_RTOL


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_hf_image_classifier_trains_checkpoints_and_resumes(runs):
    """`train` on hf:vit (no causal LM): synthetic images of its num_channels / image_size / num_labels,
    the same loop; DDP x2 like one process, and a resume from its step-2 checkpoint bit-identical."""
    from modelpar.train.task import build_task

    task = build_task(cfg_of(**VIT, strategy="single"))
    x, y = task.train.global_batch(0, 0, 8)
    assert task.kind == "classify" and x.shape == (8, 3, 8, 8) and int(y.max()) < 5
    ref, got, res = runs["vit_ref"], runs["res"]["vit_ddp"], runs["res"]["vit_resume2"]
    assert len(got["losses"]) == 6 and max_rel(ref["losses"], got["losses"]) <= LOSS_RTOL, (ref, got)
    assert ref["val_loss_after"] < ref["val_loss_before"]                # it learns the teacher
    assert abs(got["val_loss_after"] - ref["val_loss_after"]) <= LOSS_RTOL * ref["val_loss_after"]
    assert res["start_step"] == 2 and res["losses"] == got["losses"][2:]
    assert res["val_loss_after"] == got["val_loss_after"]


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_factory_classifier_trains_under_ddp_like_one_process(runs):
    """`train --model module:factory` where the factory returns a classifier module (issue 12, item 5's
    classifier form): synthetic inputs of its first Linear's width, labels of its last Linear's classes
    from a fixed linear teacher; DDP x2 like one process and the validation loss falls. Before: refused
    ("modelpar train runs a factory model that is a language model ... got task=None")."""
    from modelpar.train.task import build_task

    task = build_task(cfg_of(**CLS, strategy="single"))
    x, y = task.train.global_batch(0, 0, 8)
    assert task.kind == "classify" and task.input_shape == (4,) and x.shape == (8, 4) and int(y.max()) < 3
    ref, got = runs["cls_ref"], runs["res"]["cls_ddp"]
    assert len(got["losses"]) == 6 and max_rel(ref["losses"], got["losses"]) <= LOSS_RTOL, (ref, got)
    assert ref["val_loss_after"] < ref["val_loss_before"]
    assert abs(got["val_loss_after"] - ref["val_loss_after"]) <= LOSS_RTOL * ref["val_loss_after"]


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_verify_under_pp_holds_no_copy_of_the_whole_model(runs):
    """`modelpar verify --strategy pp` (hf:gpt2, 2 stages): while the parallel run trains, each rank
    holds its own stages' parameters and no other (the one-process reference is built again on rank 0
    afterwards, from the same --model and seed, its initial weights checked bitwise); the run PASSes.
    Before: 82,496 / 84,480 other parameter elements alive on rank 0 / 1 (the whole model, 57,024,
    plus the rest of run_steps' deep copy), next to their own 31,552 / 29,568."""
    r = runs["res"]["verify_pp"]
    assert r["code"] == 0
    own = [x["own"] for x in r["ranks"]]
    assert all(0 < o < r["whole"] for o in own) and sum(own) >= r["whole"], r      # stages; the tie on both ends
    assert [x["other"] for x in r["ranks"]] == [0, 0], r


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_checkpoint_records_the_model_spec(runs):
    from modelpar.train.checkpoint import read_checkpoint_meta

    m = read_checkpoint_meta(runs["ckpt"] / "step-00000006")
    spec = m["model_spec"]
    assert spec["kind"] == "hf" and spec["model"] == "hf:gpt2" and spec["model_config"] == GPT2
    assert spec["hf_config"]["model_type"] == "gpt2" and spec["hf_config"]["n_embd"] == 32
    assert spec["tokenizer"] == "" and spec["token_dtype"] == ""
    assert ["hf.transformer.wte.weight", "hf.lm_head.weight"] in m["tied_parameters"]


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_export_loads_in_transformers_with_the_trained_logits(runs, tmp_path, capsys):
    """`modelpar export CKPT` (no --model) writes config.json + model.safetensors; from_pretrained gives
    the trained model's logits within 1e-6 (fp32), the tie held once in the file and kept on load."""
    import transformers
    from safetensors import safe_open
    from safetensors.torch import load_file

    from modelpar.cli import main
    from modelpar.train.task import build_task

    out = tmp_path / "exported"
    assert main(["export", str(runs["ckpt"]), "--out", str(out)]) == 0
    assert "a transformers folder" in capsys.readouterr().out
    assert (out / "config.json").is_file() and (out / "model.safetensors").is_file()
    with safe_open(str(out / "model.safetensors"), "pt") as f:
        keys = set(f.keys())
    assert "transformer.wte.weight" in keys and "lm_head.weight" not in keys      # the tie saved once
    assert not any(k.startswith("hf.") for k in keys)
    hf = transformers.AutoModelForCausalLM.from_pretrained(str(out)).eval()
    assert hf.lm_head.weight is hf.transformer.wte.weight
    task = build_task(cfg_of(strategy="single"))           # the trained model: the run's own final weights
    task.model.load_state_dict(load_file(str(runs["work"] / "runs" / "ddp" / "model.safetensors")))
    x = task.val[0]
    with torch.no_grad():
        want, got = task.model.eval()(x), hf(input_ids=x).logits
    assert want.dtype == torch.float32 and (want - got).abs().max().item() <= 1e-6
    # and the exported weights are the trained ones, not the initial ones
    init = build_task(cfg_of(strategy="single"), load_data=False).model
    assert not torch.equal(init.hf.transformer.wte.weight, hf.transformer.wte.weight)


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_export_of_an_image_classifier_loads_with_the_trained_logits(runs, tmp_path, capsys):
    """`modelpar export` of the ViT run's latest checkpoint (DDP x2, no --model): the folder loads in
    ``AutoModelForImageClassification.from_pretrained`` with the trained model's logits within 1e-6
    (fp32) on its validation images, its labels kept (num_labels 5) and the weights the trained ones."""
    import transformers
    from safetensors.torch import load_file

    from modelpar.cli import main
    from modelpar.train.task import build_task

    out = tmp_path / "vit-exported"
    assert main(["export", str(runs["work"] / "ckpt-vit"), "--out", str(out)]) == 0
    assert "a transformers folder" in capsys.readouterr().out
    hf = transformers.AutoModelForImageClassification.from_pretrained(str(out)).eval()
    assert type(hf).__name__ == "ViTForImageClassification" and hf.config.num_labels == 5
    task = build_task(cfg_of(**VIT, strategy="single"))
    task.model.load_state_dict(load_file(str(runs["work"] / "runs" / "vit_ddp" / "model.safetensors")))
    x, _ = task.val
    with torch.no_grad():
        want, got = task.model.eval()(x), hf(pixel_values=x).logits
    assert want.shape == got.shape == (x.shape[0], 5) and want.dtype == torch.float32
    assert (want - got).abs().max().item() <= 1e-6
    init = build_task(cfg_of(**VIT, strategy="single"), load_data=False).model
    assert not torch.equal(init.hf.classifier.weight, hf.classifier.weight)


# ---- in this process: data paths, pretrained folder, factory LM, refusals ---------------------------
def _tokenizer(path: Path, vocab: int = 300) -> Path:
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE(unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel()
    text = (Path(data_dir()) / "decoder.py").read_text()
    tok.train_from_iterator([text], trainers.BpeTrainer(vocab_size=vocab, special_tokens=["[UNK]"]))
    tok.save(str(path))
    return path


def test_token_file_folder_trains_on_its_ids(tmp_path):
    """A nanoGPT-style folder (train.bin, val.bin of uint16): the windows are the file's ids."""
    from modelpar.train.task import build_task

    g = np.random.default_rng(0)
    (tmp_path / "tok").mkdir()
    train_ids = g.integers(0, 200, 4000).astype(np.uint16)
    train_ids.tofile(tmp_path / "tok" / "train.bin")
    g.integers(0, 200, 400).astype(np.uint16).tofile(tmp_path / "tok" / "val.bin")
    kw = dict(data=str(tmp_path / "tok"), token_dtype="uint16", model_config={**GPT2, "vocab_size": 200})
    task = build_task(cfg_of(strategy="single", **kw))
    assert task.data_info["train_tokens"] == 4000 and task.data_info["max_id"] <= 199
    x, y = task.train.global_batch(0, 3, 4)
    for row_x, row_y in zip(x.tolist(), y.tolist()):     # each window is a slice of the file, y shifted
        s = next(i for i in range(len(train_ids)) if train_ids[i:i + 16].tolist() == row_x)
        assert train_ids[s + 1:s + 17].tolist() == row_y
    s = train_here(tmp_path, "tokfile", strategy="single", steps=2, **kw)
    assert len(s["losses"]) == 2 and all(np.isfinite(s["losses"]))


def test_tokenizer_json_through_the_cli(tmp_path):
    """`modelpar train --tokenizer tokenizer.json` on an HF GPT-2 (one process): the ids are the
    tokenizer's encoding of the text, and the run trains."""
    from tokenizers import Tokenizer

    from modelpar.cli import main
    from modelpar.train.tokens import encode_bytes

    tok = _tokenizer(tmp_path / "tokenizer.json")
    text = "def f(x):\n    return x + 1\n" * 3
    ids = encode_bytes(str(tok), torch.frombuffer(bytearray(text.encode()), dtype=torch.uint8)).tolist()
    assert ids == Tokenizer.from_file(str(tok)).encode(text, add_special_tokens=False).ids
    data = tmp_path / "text.txt"
    data.write_text((Path(data_dir()) / "decoder.py").read_text() + (Path(data_dir()) / "encoder.py").read_text())
    rc = main(["train", "--model", "hf:gpt2", "--model-config", json.dumps({**GPT2, "vocab_size": 320}),
               "--tokenizer", str(tok), "--data", str(data), "--strategy", "single", "--steps", "2",
               "--seq-len", "16", "--global-batch-size", "4", "--eval-samples", "4", "--eval-every", "0",
               "--no-track-memory", "--out-dir", str(tmp_path / "runs"), "--ckpt-every", "2",
               "--ckpt-dir", str(tmp_path / "ck"), "--threads", "1"])
    assert rc == 0
    run = next((tmp_path / "runs").iterdir())
    assert run.name.startswith("hf-gpt2-single-")
    info = json.loads((run / "data.json").read_text())
    assert info["format"] == f"tokenizer {tok}" and info["train_tokens"] > 0
    from modelpar.train.checkpoint import read_checkpoint_meta

    assert read_checkpoint_meta(tmp_path / "ck")["model_spec"]["tokenizer"] == str(tok.resolve())
    assert main(["export", str(tmp_path / "ck"), "--out", str(tmp_path / "exp")]) == 0
    assert (tmp_path / "exp" / "tokenizer.json").read_text() == tok.read_text()


def test_pretrained_folder_loads_its_weights_and_custom_code_is_refused(tmp_path):
    import transformers

    from modelpar.models.hf import build_hf
    from modelpar.train.task import build_model_for

    src = build_hf("hf:gpt2", GPT2, seed=123).hf
    src.save_pretrained(str(tmp_path / "pre"))
    model = build_model_for(cfg_of(model=str(tmp_path / "pre"), model_config={}, seed=0))
    for (n, a), (_, b) in zip(src.state_dict().items(), model.hf.state_dict().items()):
        assert torch.equal(a, b), n                      # the folder's weights, not a seed-0 init
    assert isinstance(model.hf, transformers.GPT2LMHeadModel)
    raw = json.loads((tmp_path / "pre" / "config.json").read_text())
    (tmp_path / "custom").mkdir()
    (tmp_path / "custom" / "config.json").write_text(json.dumps({**raw, "auto_map": {"AutoModelForCausalLM": "x.Y"}}))
    with pytest.raises(ValueError, match="custom model code"):
        build_model_for(cfg_of(model=str(tmp_path / "custom"), model_config={}))


def test_factory_language_model_trains(tmp_path):
    """A factory returning {"model", "task": "lm", "vocab_size", "max_positions"}: its first step's
    loss is the mean next-byte cross entropy of the factory's own model on that batch."""
    from helpers import lm_factory

    from modelpar.train.task import build_task, lm_loss

    cfg = cfg_of(model="helpers.lm_factory:lm", model_config={}, strategy="single", steps=2, seq_len=0)
    task = build_task(cfg)
    assert task.kind == "lm" and task.tokens_per_sample == 32         # seq_len 0: its max_positions
    x, y = task.train.global_batch(cfg.seed, 0, cfg.global_batch_size)
    with torch.no_grad():
        want = lm_loss(lm_factory.lm()["model"](x), y).item()
    s = train_here(tmp_path, "factory", model="helpers.lm_factory:lm", model_config={}, strategy="single", steps=2, seq_len=0)
    assert abs(s["losses"][0] - want) <= 1e-6 * abs(want)


def test_factory_classifier_dict_form_declares_its_shapes(tmp_path):
    """The dict form {"model", "task": "classify", "input_shape", "num_classes"} for a classifier no
    nn.Linear describes: inputs of that shape, its first step's loss the cross entropy of the factory's
    own model on that batch."""
    import torch.nn.functional as F
    from helpers import lm_factory

    from modelpar.train.task import build_task

    kw = dict(model="helpers.lm_factory:conv_classifier", model_config={}, strategy="single", steps=2)
    task = build_task(cfg_of(**kw))
    x, y = task.train.global_batch(0, 0, 8)
    assert task.kind == "classify" and task.input_shape == (1, 6, 6) and x.shape == (8, 1, 6, 6)
    assert 0 <= int(y.min()) and int(y.max()) < 4
    with torch.no_grad():
        want = F.cross_entropy(lm_factory.conv_classifier()["model"](x), y).item()
    s = train_here(tmp_path, "conv", **kw)
    assert abs(s["losses"][0] - want) <= 1e-6 * abs(want)


REFUSALS = [
    ("bytes need 256", dict(model_config=TINY["gpt2"][1]),
     "byte-level tokens (ids 0..255, the default without --tokenizer or --token-dtype) need vocab_size >= 256, "
     "but --model hf:gpt2 has vocab_size=128"),
    ("positions", dict(seq_len=65),
     "seq_len=65 exceeds the positions of --model hf:gpt2 (max_position_embeddings / n_positions = 64); pass "
     "--seq-len <= 64"),
    ("llama positions", dict(model="hf:llama", model_config={**TINY["llama"][1], "vocab_size": 256}, seq_len=100),
     "seq_len=100 exceeds the positions of --model hf:llama (max_position_embeddings / n_positions = 64)"),
    ("factory positions", dict(model="helpers.lm_factory:lm", model_config={}, seq_len=33),
     "seq_len=33 exceeds the positions of --model helpers.lm_factory:lm"),
    ("token ids", dict(token_dtype="uint16", model_config={**GPT2, "vocab_size": 100}),
     "(token_dtype=uint16) holds token ids up to 199, but --model hf:gpt2 has vocab_size=100: every id must be "
     "< vocab_size"),
    ("tokenizer", dict(tokenizer="TOK", model_config={**GPT2, "vocab_size": 256}),
     "has a vocabulary of 300 tokens, more than the vocab_size=256 of --model hf:gpt2"),
    ("both", dict(tokenizer="TOK", token_dtype="uint16"), "were both given: a token file is already tokenized"),
    ("dtype", dict(token_dtype="int8"), "token_dtype='int8' is unknown; valid: uint16, uint32"),
    ("factory with batch_fn", dict(model="helpers.lm_factory:with_batch_fn", model_config={}),
     "modelpar train runs a factory language model or classifier; a factory with its own batch_fn / loss_fn is "
     "modelpar verify's form"),
    ("factory classifier without shapes", dict(model="helpers.lm_factory:undeclared_conv", model_config={}),
     "a factory classifier needs its input shape and classes: it has no nn.Linear to read them from"),
    ("factory classifier with token options", dict(model="helpers.lm_factory:classifier", model_config={},
                                                   token_dtype="uint16"),
     "tokenizer / token_dtype apply to language models; --model helpers.lm_factory:classifier is a classifier"),
    ("image model with token options", dict(model="hf:vit", model_config=TINY["vit"][1], token_dtype="uint16"),
     "tokenizer / token_dtype apply to language models; --model hf:vit is a classifier"),
    ("neither a causal LM nor an image classifier", dict(model="hf:distilbert", model_config={}),
     "modelpar trains Hugging Face causal language models (AutoModelForCausalLM) and image classifiers"),
]


@pytest.mark.parametrize("name,kw,msg", REFUSALS, ids=[r[0] for r in REFUSALS])
def test_refused_before_launch(tmp_path, name, kw, msg):
    """Each bad combination is one error from the launcher's preflight (no process, no run folder)."""
    from modelpar.train.loop import preflight

    np.arange(200, dtype=np.uint16).tofile(tmp_path / "tok.bin")
    kw = dict(kw)
    if kw.get("token_dtype") and kw["token_dtype"] != "int8":
        kw["data"] = str(tmp_path / "tok.bin")
    if kw.get("tokenizer") == "TOK":
        kw["tokenizer"] = str(_tokenizer(tmp_path / "tokenizer.json"))
    with pytest.raises(ValueError) as e:
        preflight(cfg_of(strategy="single", out_dir=str(tmp_path / "runs"), **kw), 1)
    assert msg in str(e.value), str(e.value)
    assert not (tmp_path / "runs").exists()


def test_cli_refusal_is_one_line(tmp_path, capsys):
    from modelpar.cli import main

    rc = main(["train", "--model", "hf:gpt2", "--model-config", json.dumps(TINY["gpt2"][1]), "--strategy", "ddp",
               "--nproc", "2", "--out-dir", str(tmp_path / "runs")])
    err = capsys.readouterr().err
    assert rc == 2 and err.startswith("modelpar train: error: byte-level tokens") and err.count("\n") == 1
    assert not (tmp_path / "runs").exists()


def test_verify_takes_the_factory_language_model_form():
    """`modelpar verify` draws token ids for a factory that declares "task": "lm" (not float inputs)."""
    from modelpar.cli.args import parse
    from modelpar.cli.verify import build_parser, load_task
    from modelpar.train.task import lm_loss

    args = parse(build_parser(), ["--model", "helpers.lm_factory:lm", "--strategy", "ddp", "--global-batch-size", "4"])
    model, batch_fn, loss_fn, reduction, _ = load_task(args)
    x, y = batch_fn(0)
    assert x.dtype == torch.long and x.shape == (4, 32) and int(x.max()) < 256 and torch.equal(x[:, 1:], y[:, :-1])
    assert loss_fn is lm_loss and model(x).shape == (4, 32, 256)


def test_verify_reference_is_rebuilt_and_checked_bitwise(capsys):
    """`verify` builds its one-process reference again (no copy of the model kept during the parallel
    run): the same --model and seed give the same initial weights, and a factory that does not seed
    itself (a different Conv2d init per call) FAILs by name instead of comparing unrelated runs."""
    from modelpar.cli.verify import main
    from modelpar.verify import weights_digest
    from helpers import lm_factory

    assert weights_digest(lm_factory.classifier()) == weights_digest(lm_factory.classifier())
    assert weights_digest(lm_factory.undeclared_conv()) != weights_digest(lm_factory.undeclared_conv())
    # 0-dim buffers (BatchNorm's num_batches_tracked) are hashed too, by value
    bn, bn2 = torch.nn.BatchNorm1d(3), torch.nn.BatchNorm1d(3)
    assert weights_digest(bn) == weights_digest(bn2)
    bn2.num_batches_tracked += 1
    assert weights_digest(bn) != weights_digest(bn2)
    common = ["--strategy", "single", "--steps", "1", "--global-batch-size", "4"]
    assert main(["--model", "helpers.lm_factory:classifier", *common]) == 0
    assert "PASS" in capsys.readouterr().out
    assert main(["--model", "helpers.lm_factory:undeclared_conv", "--input-shape", "1,6,6", "--num-classes", "4",
                 *common]) == 1
    out = capsys.readouterr().out
    assert "FAIL" in out and "built different initial weights on its second call" in out, out


def test_llama_trains_checkpoints_and_exports_untied(tmp_path):
    """A tiny GQA Llama (untied head, RoPE) on one process: trains, exports without --model, and
    from_pretrained gives its logits; a resume with other --model-config is refused by name."""
    import transformers
    from safetensors.torch import load_file

    from modelpar.cli import main
    from modelpar.train.task import build_task

    llama = {**TINY["llama"][1], "vocab_size": 256}
    kw = dict(model="hf:llama", model_config=llama, strategy="single", steps=2, ckpt_every=2,
              ckpt_dir=str(tmp_path / "ck"))
    s = train_here(tmp_path, "llama", **kw)
    assert len(s["losses"]) == 2 and all(np.isfinite(s["losses"]))
    assert main(["export", str(tmp_path / "ck"), "--out", str(tmp_path / "exp")]) == 0
    hf = transformers.AutoModelForCausalLM.from_pretrained(str(tmp_path / "exp")).eval()
    assert isinstance(hf, transformers.LlamaForCausalLM) and hf.config.num_key_value_heads == 2
    task = build_task(cfg_of(**kw))
    task.model.load_state_dict(load_file(str(tmp_path / "runs" / "llama" / "model.safetensors")))
    with torch.no_grad():
        assert (task.model.eval()(task.val[0]) - hf(input_ids=task.val[0]).logits).abs().max().item() <= 1e-6
    from modelpar.train.checkpoint import CheckpointError

    # the field that differs, by name (a fresh user's trial: both whole dicts, in different key orders)
    with pytest.raises(CheckpointError, match=r"model_config\.rms_norm_eps: checkpoint 'unset' vs now 1e-05$"):
        train_here(tmp_path, "llama2", **{**kw, "model_config": {**llama, "rms_norm_eps": 1e-5},
                                          "resume": str(tmp_path / "ck"), "steps": 3, "ckpt_every": 0})


def test_meta_init_refusals():
    from modelpar.train.loop import preflight

    with pytest.raises(ValueError, match=r"--meta-init builds Hugging Face models and the built-in GPT presets "
                                         r"on the meta device; --model helpers.lm_factory:lm is neither"):
        preflight(cfg_of(model="helpers.lm_factory:lm", model_config={}, strategy="single", meta_init=True), 1)
    with pytest.raises(ValueError, match=r"--meta-init materialises each rank's FSDP / TP shards and pipeline "
                                         r"stages; the plan .* has placement or replicas of unsharded parameters \(DDP\)"):
        preflight(cfg_of(strategy="ddp", meta_init=True), 2)
    for strategy in ("tp", "pp"):                       # each rank materialises its own shards / stages
        assert preflight(cfg_of(strategy=strategy, meta_init=True), 2)[0].describe()


def test_meta_init_one_process_reads_the_pretrained_folder(tmp_path):
    """Built on meta and materialised from the folder's safetensors: the same weights as from_pretrained
    (the tie kept), buffers real."""
    from modelpar.models.hf import build_hf
    from modelpar.parallel.compose import parallelize
    from modelpar.parallel.mesh import MeshInfo
    from modelpar.plan import ParallelPlan
    from modelpar.train.materialise import materialise
    from modelpar.train.task import build_model_for, lm_loss

    build_hf("hf:llama", {**TINY["llama"][1], "vocab_size": 256}, seed=7).hf.save_pretrained(str(tmp_path / "pre"))
    cfg = cfg_of(model=str(tmp_path / "pre"), model_config={}, meta_init=True)
    model = build_model_for(cfg)
    assert all(p.is_meta for p in model.parameters()) and not any(b.is_meta for b in model.buffers())
    pm = parallelize(model, ParallelPlan(), MeshInfo(mesh=None), loss_fn=lm_loss, device=torch.device("cpu"))
    materialise(pm.modules, cfg, torch.device("cpu"))
    want = build_model_for(cfg_of(model=str(tmp_path / "pre"), model_config={}))
    for (n, a), (_, b) in zip(want.state_dict().items(), model.state_dict().items()):
        assert torch.equal(a, b), n
    ids = torch.randint(0, 256, (2, 16))
    with torch.no_grad():
        assert torch.equal(want(ids), model(ids))
