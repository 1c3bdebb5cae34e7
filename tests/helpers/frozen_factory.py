"""Factory models with frozen parameters (``requires_grad=False``), for the planner's frozen-parameter
tests and `benchmarks/planner_frozen_memory.py`: ``lora`` (a language model whose every weight is frozen
but low-rank adapters on each block's two Linears: a LoRA-style fine-tune, Hu et al. 2021), ``lora_full``
(the same model with every parameter trainable: the all-trainable reference), ``frozen_backbone`` (every
block frozen, the head trained) and ``llama_frozen_embed`` (a Hugging Face Llama built from its config
with frozen token embeddings)."""

import torch
import torch.nn as nn

from helpers.hf_factory import Logits     # a transformers causal LM whose forward returns its logits

V, P = 256, 64          # byte tokens (train draws ids < 256)


class LoRALinear(nn.Module):
    """``base(x) + (x @ A^T) @ B^T * scale``: a frozen ``base`` Linear and a trainable rank-``r`` update
    (B starts at zero, as LoRA's)."""

    def __init__(self, d_in: int, d_out: int, r: int = 8, freeze: bool = True):
        super().__init__()
        self.base = nn.Linear(d_in, d_out)
        self.base.requires_grad_(not freeze)
        self.lora_a = nn.Linear(d_in, r, bias=False)
        self.lora_b = nn.Linear(r, d_out, bias=False)
        nn.init.zeros_(self.lora_b.weight)
        self.scale = 2.0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.base(x) + self.lora_b(self.lora_a(x)) * self.scale


class Block(nn.Module):
    def __init__(self, width: int, freeze: bool):
        super().__init__()
        self.norm = nn.LayerNorm(width)
        self.up = LoRALinear(width, 4 * width, freeze=freeze)
        self.down = LoRALinear(4 * width, width, freeze=freeze)
        self.norm.requires_grad_(not freeze)

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        return h + self.down(torch.nn.functional.gelu(self.up(self.norm(h))))


class LoRALM(nn.Module):
    """Token ids (batch, seq) -> logits (batch, seq, V); ``freeze``: embeddings, norms, base Linears and
    head frozen (only the adapters train)."""

    def __init__(self, width: int = 256, layers: int = 4, freeze: bool = True):
        super().__init__()
        self.tok = nn.Embedding(V, width)
        self.pos = nn.Embedding(P, width)
        self.blocks = nn.ModuleList(Block(width, freeze) for _ in range(layers))
        self.norm = nn.LayerNorm(width)
        self.head = nn.Linear(width, V)
        for m in (self.tok, self.pos, self.norm, self.head):
            m.requires_grad_(not freeze)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        h = self.tok(ids) + self.pos(torch.arange(ids.shape[1], device=ids.device))
        for b in self.blocks:
            h = b(h)
        return self.head(self.norm(h))


def _lm(model: nn.Module) -> dict:
    return {"model": model, "task": "lm", "vocab_size": V, "max_positions": P}


def lora():
    torch.manual_seed(0)
    return _lm(LoRALM())


def lora_full():
    torch.manual_seed(0)
    return _lm(LoRALM(freeze=False))


def frozen_backbone():
    """`LoRALM` without adapters' effect on the split: every block and embedding frozen, adapters
    included; the final norm and head train."""
    torch.manual_seed(0)
    m = LoRALM(freeze=False)
    m.requires_grad_(False)
    m.norm.requires_grad_(True)
    m.head.requires_grad_(True)
    return _lm(m)


def llama_frozen_embed(freeze: bool = True):
    """A 2-layer Llama (width 128, grouped-query attention) with a 4096-token vocabulary, untied head;
    ``freeze``: its token embeddings frozen (a quarter of its parameters)."""
    import transformers

    torch.manual_seed(0)
    conf = transformers.LlamaConfig(vocab_size=4096, hidden_size=128, intermediate_size=256, num_hidden_layers=2,
                                    num_attention_heads=4, num_key_value_heads=2, head_dim=32,
                                    max_position_embeddings=P, tie_word_embeddings=False,
                                    bos_token_id=0, eos_token_id=0, pad_token_id=0)
    m = transformers.LlamaForCausalLM(conf)
    m.model.embed_tokens.requires_grad_(not freeze)
    return {"model": Logits(m), "task": "lm", "vocab_size": 4096, "max_positions": P}


def llama_full():
    return llama_frozen_embed(freeze=False)
