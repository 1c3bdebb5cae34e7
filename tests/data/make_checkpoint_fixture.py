"""Writes ``tests/data/ckpt-v1/``: a checkpoint fixture for `tests/test_checkpoint_files.py` (issue 13,
"a checkpoint written before loads after"). Run once, by the modelpar whose format it pins (it was
written at commit 3aa2648, before `modelpar.train.checkpoint` was split into modules); re-running it
with a later modelpar would no longer test anything.

usage: PYTHONPATH=. python tests/data/make_checkpoint_fixture.py

What it writes (about 100 KB):
- ``ckpt-v1/checkpoints/step-00000002``: `modelpar.train.runner.train` of a tied-embedding GPT
  (d_model 8, one block; 2 AdamW steps, one process), saved by the run's own checkpoint hooks;
- ``ckpt-v1/expected.safetensors``: what that modelpar loaded back from it: the model's tensors under
  ``model/NAME`` and the AdamW state under ``optim/NAME/{step,exp_avg,exp_avg_sq}``, read by loading the
  checkpoint into a fresh model and optimizer (`load_checkpoint`), then taken from them directly.
"""

from __future__ import annotations

import json
import os
import shutil
import sys
from pathlib import Path

import torch
from safetensors.torch import save_file

HERE = Path(__file__).resolve().parent
MODEL_CONFIG = {"d_model": 8, "n_head": 1, "n_layer": 1, "tie_embeddings": True}


def main() -> None:
    from modelpar.models import build_gpt
    from modelpar.train.checkpoint import checkpoint_module, load_checkpoint
    from modelpar.train.config import TrainConfig
    from modelpar.train.runner import train

    os.chdir(HERE)                       # relative paths only in the recorded train_config
    out, data = Path("ckpt-v1"), Path("fixture-text")
    shutil.rmtree(out, ignore_errors=True)
    data.mkdir(exist_ok=True)
    (data / "text.txt").write_text("a checkpoint written before loads after. " * 200)
    cfg = TrainConfig(model="gpt-nano", model_config=MODEL_CONFIG, seq_len=16, global_batch_size=4, steps=2,
                      warmup_steps=1, eval_every=0, eval_samples=4, sample_bytes=0, track_memory=False,
                      strategy="single", nproc=1, threads=1, ckpt_every=2, keep_last=1, data=str(data),
                      out_dir=str(out / "out"), ckpt_dir=str(out / "checkpoints"))
    train(cfg, run_dir=out / "run", quiet=True)
    shutil.rmtree(out / "run", ignore_errors=True)
    shutil.rmtree(out / "out", ignore_errors=True)
    shutil.rmtree(data)
    m = build_gpt("gpt-nano", seq_len=16, seed=1, **MODEL_CONFIG)
    opt = torch.optim.AdamW(m.parameters())
    meta = load_checkpoint(checkpoint_module([m], [("embed.tok.weight", "head.out.weight")]), opt,
                           out / "checkpoints")
    names = {id(p): n for n, p in m.named_parameters()}
    tensors = {f"model/{n}": t.detach().clone() for n, t in m.state_dict().items() if n != "head.out.weight"}
    for p, st in opt.state.items():
        for k, v in st.items():
            tensors[f"optim/{names[id(p)]}/{k}"] = torch.as_tensor(v).detach().clone()
    save_file(tensors, str(out / "expected.safetensors"),
              metadata={"step": str(meta["step"]), "tied": json.dumps({"head.out.weight": "embed.tok.weight"})})
    print(f"wrote {HERE / out}: step {meta['step']}, {len(tensors)} tensors", file=sys.stderr)


if __name__ == "__main__":
    main()
