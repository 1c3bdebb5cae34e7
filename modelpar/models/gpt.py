"""A GPT-style decoder-only transformer with a byte-level vocabulary.

Layout (the form modelpar's parallelisms rely on, see `modelpar.parallel.parts`):
``embed`` (token + position embeddings) -> ``blocks`` (an ``nn.ModuleList`` of pre-norm transformer
blocks) -> ``head`` (final LayerNorm + vocabulary projection). Attention and MLP use separate ``q``,
``k``, ``v``, ``o`` and ``up``, ``down`` Linears so tensor parallel can split them (Megatron-LM,
Shoeybi et al. 2019, Sec. 3): q/k/v/up colwise, o/down rowwise. Attention derives its local head
count from the local width, so a TP-sharded block needs no other change.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn as nn
import torch.nn.functional as F


@dataclass(frozen=True)
class GPTConfig:
    """Shape of the GPT. ``d_ff`` None means 4 x d_model. Units: counts.

    ``tie_embeddings``: the output layer reuses the token embedding's (vocab, d_model) weight
    (``head.out.weight is embed.tok.weight``, as GPT-2 does; Press & Wolf 2017); one tensor, counted,
    trained and saved once, kept tied by every strategy (case C13, `modelpar.parallel.ties`).
    """

    vocab_size: int = 256
    seq_len: int = 128
    n_layer: int = 4
    n_head: int = 4
    d_model: int = 256
    d_ff: int | None = None
    dropout: float = 0.0
    tie_embeddings: bool = False

    @property
    def ffn(self) -> int:
        return self.d_ff or 4 * self.d_model

    def num_params(self) -> int:
        """Exact parameter count (weights + biases + LayerNorms + both embeddings + head; a tied
        head counted once)."""
        d, f, L = self.d_model, self.ffn, self.n_layer
        block = 4 * (d * d + d) + (d * f + f) + (f * d + d) + 4 * d
        head = 0 if self.tie_embeddings else d * self.vocab_size
        return L * block + self.vocab_size * d + self.seq_len * d + 2 * d + head


# Presets: name -> config. The small ones train here; the large ones are for planning on the meta
# device (their vocab is the byte vocab, so parameter counts are dominated by the blocks).
PRESETS: dict[str, GPTConfig] = {
    "gpt-nano": GPTConfig(seq_len=64, n_layer=2, n_head=2, d_model=64),           # ~0.1M
    "gpt-1m": GPTConfig(seq_len=128, n_layer=4, n_head=4, d_model=128),           # ~0.9M
    "gpt-3m": GPTConfig(seq_len=128, n_layer=4, n_head=4, d_model=256),           # ~3.3M
    "gpt-10m": GPTConfig(seq_len=256, n_layer=6, n_head=6, d_model=384),          # ~10.8M
    "gpt-100m": GPTConfig(seq_len=1024, n_layer=12, n_head=12, d_model=768),      # ~86M
    "gpt-500m": GPTConfig(seq_len=1024, n_layer=24, n_head=16, d_model=1280),     # ~472M
    "gpt-1b": GPTConfig(seq_len=2048, n_layer=24, n_head=16, d_model=1792),       # ~0.93B
    "gpt-2b": GPTConfig(seq_len=2048, n_layer=32, n_head=18, d_model=2304),       # ~2.0B
    "gpt-10b": GPTConfig(seq_len=2048, n_layer=48, n_head=32, d_model=4096),      # ~9.7B
    "gpt-70b": GPTConfig(seq_len=4096, n_layer=88, n_head=64, d_model=8192),      # ~71B
}


class Embedding(nn.Module):
    """tokens (batch, seq) int64 -> hidden (batch, seq, d_model)."""

    def __init__(self, cfg: GPTConfig):
        super().__init__()
        self.tok = nn.Embedding(cfg.vocab_size, cfg.d_model)
        self.pos = nn.Embedding(cfg.seq_len, cfg.d_model)
        self.drop = nn.Dropout(cfg.dropout)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        t = idx.shape[1]
        pos = torch.arange(t, device=idx.device)
        return self.drop(self.tok(idx) + self.pos(pos))


class AttentionCore(nn.Module):
    """softmax(q k^T / sqrt(d) + causal mask) v with dropout on the probabilities: the region
    selective activation checkpointing recomputes (Korthikanti et al. 2022, Sec. 5;
    `modelpar.parallel.checkpointing`). Inputs and output ``(batch, heads, seq, head_dim)``.

    It calls ``F.scaled_dot_product_attention``, a fused kernel (flash / memory-efficient) wherever
    torch has one for the inputs: that kernel saves only q, k, v, its output and a (batch, heads,
    seq) log-sum-exp for backward, no (seq x seq) scores or probabilities; the output is also what
    the output projection saves, so recomputing this region frees only the log-sum-exp. With torch's
    unfused math path (attention dropout on CPU, for instance) it frees the (seq x seq) tensors.
    No parameters."""

    modelpar_attention_core = True

    def __init__(self, dropout: float = 0.0):
        super().__init__()
        self.dropout = dropout

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        return F.scaled_dot_product_attention(q, k, v, is_causal=True,
                                              dropout_p=self.dropout if self.training else 0.0)


class Attention(nn.Module):
    def __init__(self, cfg: GPTConfig):
        super().__init__()
        if cfg.d_model % cfg.n_head:
            raise ValueError(f"GPTConfig.d_model={cfg.d_model} is not divisible by n_head={cfg.n_head}")
        self.head_dim = cfg.d_model // cfg.n_head
        self.q = nn.Linear(cfg.d_model, cfg.d_model)
        self.k = nn.Linear(cfg.d_model, cfg.d_model)
        self.v = nn.Linear(cfg.d_model, cfg.d_model)
        self.o = nn.Linear(cfg.d_model, cfg.d_model)
        self.core = AttentionCore(cfg.dropout)
        self.resid_drop = nn.Dropout(cfg.dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, _ = x.shape
        # -1: the local number of heads (all of them, or n_head / tp under tensor parallel)
        q, k, v = (p(x).view(b, t, -1, self.head_dim).transpose(1, 2) for p in (self.q, self.k, self.v))
        y = self.core(q, k, v).transpose(1, 2).reshape(b, t, -1)
        return self.resid_drop(self.o(y))


class MLP(nn.Module):
    def __init__(self, cfg: GPTConfig):
        super().__init__()
        self.up = nn.Linear(cfg.d_model, cfg.ffn)
        self.down = nn.Linear(cfg.ffn, cfg.d_model)
        self.drop = nn.Dropout(cfg.dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.drop(self.down(F.gelu(self.up(x))))


class Block(nn.Module):
    """Pre-norm transformer block: (batch, seq, d_model) -> (batch, seq, d_model)."""

    def __init__(self, cfg: GPTConfig):
        super().__init__()
        self.ln1 = nn.LayerNorm(cfg.d_model)
        self.attn = Attention(cfg)
        self.ln2 = nn.LayerNorm(cfg.d_model)
        self.mlp = MLP(cfg)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln1(x))
        return x + self.mlp(self.ln2(x))


class Head(nn.Module):
    """hidden (batch, seq, d_model) -> logits (batch, seq, vocab)."""

    def __init__(self, cfg: GPTConfig):
        super().__init__()
        self.ln_f = nn.LayerNorm(cfg.d_model)
        self.out = nn.Linear(cfg.d_model, cfg.vocab_size, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.out(self.ln_f(x))


def init_std(name: str, n_layer: int) -> float:
    """Standard deviation of the normal initialisation of matrix or embedding ``name`` of a GPT of
    ``n_layer`` blocks: 0.02, and 0.02 / sqrt(2 n_layer) for the projections that write into the
    residual stream (attention output ``o``, MLP ``down``): GPT-2 (Radford et al. 2019, Section 2.3)."""
    return 0.02 / math.sqrt(2 * n_layer) if name.endswith(("o.weight", "down.weight")) else 0.02


class GPT(nn.Module):
    """Decoder-only transformer. ``forward(idx: (batch, seq) int64) -> logits (batch, seq, vocab)``."""

    def __init__(self, cfg: GPTConfig):
        super().__init__()
        self.cfg = cfg
        self.embed = Embedding(cfg)
        self.blocks = nn.ModuleList(Block(cfg) for _ in range(cfg.n_layer))
        self.head = Head(cfg)
        if cfg.tie_embeddings:              # one Parameter under two names (initialised once, below)
            self.head.out.weight = self.embed.tok.weight
        self.reset_parameters()

    def reset_parameters(self) -> None:
        """GPT-2 initialisation (`init_std`); biases 0, norm weights 1 (their own default)."""
        for name, p in self.named_parameters():
            if p.dim() >= 2:
                nn.init.normal_(p, 0.0, init_std(name, self.cfg.n_layer))
            elif name.endswith("bias"):
                nn.init.zeros_(p)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        x = self.embed(idx)
        for block in self.blocks:
            x = block(x)
        return self.head(x)

    @torch.no_grad()
    def generate(self, idx: torch.Tensor, max_new_tokens: int, temperature: float = 0.8,
                 top_k: int | None = 40, generator: torch.Generator | None = None) -> torch.Tensor:
        """Sample ``max_new_tokens`` bytes after ``idx: (batch, t)``; returns (batch, t + new)."""
        self.eval()
        for _ in range(max_new_tokens):
            ctx = idx[:, -self.cfg.seq_len:]
            logits = self(ctx)[:, -1, :] / max(temperature, 1e-6)
            if top_k is not None:
                kth = torch.topk(logits, min(top_k, logits.shape[-1])).values[:, -1:]
                logits = logits.masked_fill(logits < kth, float("-inf"))
            nxt = torch.multinomial(F.softmax(logits, dim=-1), 1, generator=generator)
            idx = torch.cat([idx, nxt], dim=1)
        return idx


def build_gpt(preset_or_cfg: str | GPTConfig = "gpt-3m", *, device: str | torch.device = "cpu",
              seed: int | None = 0, **overrides) -> GPT:
    """Build a GPT from a preset name or config; ``device="meta"`` allocates no weights.

    Raises:
        ValueError: unknown preset (the valid ones are listed).
    """
    if isinstance(preset_or_cfg, str):
        if preset_or_cfg not in PRESETS:
            raise ValueError(f"unknown GPT preset {preset_or_cfg!r}; valid: {', '.join(PRESETS)}")
        cfg = PRESETS[preset_or_cfg]
    else:
        cfg = preset_or_cfg
    if overrides:
        cfg = GPTConfig(**{**cfg.__dict__, **overrides})
    if seed is not None and str(device) != "meta":
        torch.manual_seed(seed)
    with torch.device(device):
        return GPT(cfg)
