"""What the planner reads from a Hugging Face model (`modelpar.models.hf.HFModel`, ``--model hf:...``).

Pure: nothing here imports transformers; the model (already built, so transformers is loaded) is
read through its attributes, and its config's facts through `modelpar.models.hf.facts`.

- `hf_arch`: the shape facts legality and the memory model need (query heads, key/value heads,
  hidden, FFN width, layers, vocabulary, sequence length, whether the vocabulary is split under TP);
- `hf_tp_styles`: which modules a tensor-parallel split shards, the one hook the profile reads
  (`modelpar.planner.profile._tp_styles`). It models the runtime's plan for HF models: the plan
  transformers declares (``base_model_tp_plan`` of the config, ``_tp_plan`` of the model class, today
  on the Llama family) with its style names reduced to "colwise" (weight split on its output
  dimension) / "rowwise" (on its input dimension), else the attention / MLP projections found by
  name (GPT-2's fused ``c_attn`` and ``c_fc`` colwise, the two ``c_proj`` rowwise; ViT's
  query/key/value and intermediate colwise, its output projections rowwise); plus a vocabulary-parallel
  embedding (its rows split) and a colwise head, unless ``vocab_parallel=False``.
"""

from __future__ import annotations

import re

import torch.nn as nn

# transformers' style names (transformers.distributed.tensor_parallel) by which dimension they split
_COLWISE = {"colwise", "colwise_rep", "colwise_gather_output", "packed_colwise", "embedding_colwise"}
_ROWWISE = {"rowwise", "rowwise_rep", "rowwise_split_input", "packed_rowwise", "embedding_rowwise"}
# projections by module path suffix, for families that declare no plan
_NAMED = (("colwise", ("attn.c_attn", "mlp.c_fc", "q_proj", "k_proj", "v_proj", "gate_proj", "up_proj",
                       "attention.query", "attention.key", "attention.value", "intermediate.dense",
                       "query_key_value", "dense_h_to_4h", "fc1")),
          ("rowwise", ("attn.c_proj", "mlp.c_proj", "o_proj", "down_proj", "attention.output.dense",
                       "output.dense", "dense_4h_to_h", "out_proj", "fc2")))


def is_hf_model(model: nn.Module) -> bool:
    """True for a `modelpar.models.hf.HFModel` (a transformers model with a config at ``.hf``)."""
    return isinstance(getattr(model, "hf", None), nn.Module) and hasattr(model.hf, "config")


def _declared(model: nn.Module) -> dict[str, str]:
    """transformers' declared plan as ``{module path in model: style}`` (``*`` matched to indices)."""
    hf = model.hf
    plan: dict[str, str] = {}
    base = getattr(hf.config, "base_model_tp_plan", None) or {}
    prefix = getattr(hf, "base_model_prefix", "")
    for key, style in base.items():
        plan[f"hf.{prefix}.{key}" if prefix and hasattr(hf, prefix) else f"hf.{key}"] = style
    for key, style in (getattr(hf, "_tp_plan", None) or {}).items():
        plan[f"hf.{key}"] = style
    if not plan:
        return {}
    pats = [(re.compile(re.escape(k).replace(r"\*", r"\d+") + "$"), v) for k, v in plan.items()]
    out = {}
    for path, _ in model.named_modules():
        for pat, style in pats:
            if pat.match(path):
                out[path] = style
                break
    return out


def hf_tp_styles(model: nn.Module, vocab_parallel: bool | None = None) -> dict[str, str]:
    """``{module path: "colwise" | "rowwise"}`` a TP split shards (see the module docstring).

    ``vocab_parallel`` None or True: the input embedding "rowwise" (rows = vocabulary split) and the
    output projection "colwise" (vocabulary split) for language models; False: both replicated.
    Styles that split nothing (replicate, sequence_parallel, ...) or that are unknown are left out
    (the runtime refuses unknown ones by name)."""
    declared = _declared(model)
    styles: dict[str, str] = {}
    if declared:
        for path, style in declared.items():
            if style in _COLWISE:
                styles[path] = "colwise"
            elif style in _ROWWISE:
                styles[path] = "rowwise"
    else:
        for path, m in model.named_modules():
            if not path.startswith("hf.") or not any(p.dim() == 2 for p in m.parameters(recurse=False)):
                continue
            for kind, suffixes in _NAMED:
                if any(path == s or path.endswith("." + s) for s in suffixes):
                    styles[path] = kind
                    break
    fqn = {m: n for n, m in model.named_modules()}
    emb_in = model.hf.get_input_embeddings() if hasattr(model.hf, "get_input_embeddings") else None
    emb_out = model.hf.get_output_embeddings() if hasattr(model.hf, "get_output_embeddings") else None
    lm = getattr(model, "task", "lm") == "lm" and emb_out is not None
    for m, kind in ((emb_in, "rowwise"), (emb_out, "colwise")):
        path = fqn.get(m) if m is not None else None
        if path is None:
            continue
        if lm and vocab_parallel is not False:
            styles[path] = kind
        else:
            styles.pop(path, None)
    return styles


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
