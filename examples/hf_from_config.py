"""A Hugging Face GPT-2 built from a config (no download): train it with DDP on 2 ranks, checkpoint it,
export it as a transformers folder, and load that folder back with ``from_pretrained``.

    python examples/hf_from_config.py [--tiny]

It runs the same steps as these command lines (needs ``pip install 'modelpar[hf]'``):

    modelpar train --model hf:gpt2 --model-config '{"n_embd": 64, "n_layer": 4, "n_head": 4, "vocab_size": 256,
        "n_positions": 128}' --strategy ddp --nproc 2 --seq-len 64 --steps 60 --ckpt-every 20 --ckpt-dir CKPT
    modelpar export CKPT --out FOLDER        # config.json + model.safetensors, no --model needed

Byte-level tokens are the default (vocab_size >= 256); ``--tokenizer tokenizer.json`` or a token file
(``--token-dtype uint16``) change that (docs/your-model.md).
"""

import json
import sys
import tempfile
from pathlib import Path

import torch

from _launch import tiny

if tiny():
    shape = {"n_embd": 32, "n_layer": 2, "n_head": 4, "vocab_size": 256, "n_positions": 32}
    seq, steps, every = "32", "4", "2"
else:
    shape = {"n_embd": 64, "n_layer": 4, "n_head": 4, "vocab_size": 256, "n_positions": 128}
    seq, steps, every = "64", "60", "20"
shape.update(bos_token_id=0, eos_token_id=0)     # a byte vocabulary has no GPT-2 end-of-text id 50256
work = Path(tempfile.mkdtemp(prefix="modelpar-hf-example-"))
data = str(Path(json.__file__).parent)            # a small text corpus every Python has: the json package

from modelpar.cli import main  # noqa: E402

rc = main(["train", "--model", "hf:gpt2", "--model-config", json.dumps(shape), "--strategy", "ddp", "--nproc", "2",
           "--data", data, "--seq-len", seq, "--steps", steps, "--global-batch-size", "8", "--warmup-steps", "2",
           "--eval-every", "0", "--eval-samples", "16", "--ckpt-every", every, "--ckpt-dir", str(work / "ckpt"),
           "--out-dir", str(work / "runs"), "--no-track-memory"])
if rc != 0:
    sys.exit(rc)
if main(["export", str(work / "ckpt"), "--out", str(work / "gpt2-hf")]) != 0:
    sys.exit(1)

import transformers  # noqa: E402
from safetensors.torch import load_file  # noqa: E402

from modelpar.models.hf import build_hf  # noqa: E402

loaded = transformers.AutoModelForCausalLM.from_pretrained(str(work / "gpt2-hf")).eval()
trained = build_hf("hf:gpt2", shape, dropout=0.0)                 # the run's own final weights
run = next((work / "runs").iterdir())
trained.load_state_dict(load_file(str(run / "model.safetensors")))
ids = torch.tensor([list(b"def load(fp):\n    return json.loads(fp.read())\n"[:int(seq)])])
with torch.no_grad():
    diff = (trained.eval()(ids) - loaded(input_ids=ids).logits).abs().max().item()
print(f"from_pretrained({work / 'gpt2-hf'}) = {type(loaded).__name__}, head tied to the embedding: "
      f"{loaded.lm_head.weight is loaded.transformer.wte.weight}")
print(f"logits of the exported model vs the trained one: max |difference| {diff:.1e}")
