"""Factory models wrapping a transformers model (what a user writes: ``--model helpers.hf_factory:llama``):
the `tests/helpers/hf_tiny.py` configs built from config (never downloaded) inside a user's module whose
forward returns the logits, held at ``.net`` (so a TP plan's paths are ``net.*``, not `HFModel`'s ``hf.*``)."""

import torch
import torch.nn as nn

from helpers.hf_tiny import TINY

V, P = 256, 64          # byte-level tokens (train draws them) need a vocabulary of 256


class Logits(nn.Module):
    def __init__(self, net: nn.Module):
        super().__init__()
        self.net = net

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.net(input_ids=ids, use_cache=False).logits


def _lm(model_type: str, **cfg):
    import transformers

    torch.manual_seed(0)
    cfg = {**cfg, "vocab_size": V}
    conf = transformers.AutoConfig.for_model(model_type, **cfg, bos_token_id=0, eos_token_id=0, pad_token_id=0)
    return {"model": Logits(transformers.AutoModelForCausalLM.from_config(conf)), "task": "lm",
            "vocab_size": V, "max_positions": P}


def llama():
    return _lm("llama", **TINY["llama"][1], tie_word_embeddings=False)


def qwen2():
    return _lm("qwen2", **TINY["llama"][1], tie_word_embeddings=True)


def gpt2():
    cfg = {k: v for k, v in TINY["gpt2"][1].items() if not k.endswith("token_id")}
    return _lm("gpt2", **cfg, resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)


def neox():
    return _lm("gpt_neox", hidden_size=32, intermediate_size=64, num_hidden_layers=4, num_attention_heads=4,
               max_position_embeddings=P)
