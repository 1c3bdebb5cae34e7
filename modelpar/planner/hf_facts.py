"""What the planner reads from a Hugging Face model (`modelpar.models.hf.HFModel`, ``--model hf:...``).

Pure: nothing here imports transformers; the model (already built, so transformers is loaded) is
read through its attributes, and its config's facts through `modelpar.models.hf.facts`.

`hf_arch` gives the shape facts legality and the memory model need (query heads, key/value heads,
hidden, FFN width, layers, vocabulary, sequence length, whether the vocabulary is split under TP).
Which modules a TP split shards is the runtime's own plan (`modelpar.parallel.hf_tp`, read by
`modelpar.planner.profile._tp_styles`), not a copy of it.
"""

from __future__ import annotations

import torch.nn as nn


def is_hf_model(model: nn.Module) -> bool:
    """True for a `modelpar.models.hf.HFModel` (a transformers model with a config at ``.hf``)."""
    return isinstance(getattr(model, "hf", None), nn.Module) and hasattr(model.hf, "config")


def hf_arch(model: nn.Module, tokens: int, vocab_parallel: bool | None = None) -> dict[str, int]:
    """The planner's ``arch`` of an HF model profiled at ``tokens`` per sample (see `ModelProfile`):
    ``n_head``, ``n_kv_head``, ``d_model``, ``ffn``, ``n_layer``, and for language models
    ``vocab_size``, ``seq_len``, ``max_positions``, ``tied`` (1: input and output embeddings are one
    tensor) and ``vocab_parallel`` (1: the TP split shards the vocabulary, so it must divide by the
    degree). {} for a family without attention heads."""
    from modelpar.models.hf import facts

    cfg = model.hf.config
    f = facts(cfg)
    if not f.heads:
        return {}
    ffn = (getattr(cfg, "intermediate_size", None) or getattr(cfg, "n_inner", None)
           or getattr(cfg, "ffn_dim", None) or 4 * f.hidden)
    arch = {"n_head": int(f.heads), "n_kv_head": int(f.kv_heads or f.heads), "d_model": int(f.hidden),
            "ffn": int(ffn), "n_layer": int(f.layers)}
    if f.task == "lm":
        arch.update(vocab_size=int(f.vocab), seq_len=int(tokens), tied=int(f.tied),
                    vocab_parallel=int(vocab_parallel is not False))
        if f.max_positions:
            arch["max_positions"] = int(f.max_positions)
    return arch
