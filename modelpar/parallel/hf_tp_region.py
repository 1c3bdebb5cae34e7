"""Modules with parameters inside a tensor-parallel split region of a Hugging Face model.

Between a module's colwise projections (q, k, v) and its rowwise one (o), each TP rank holds only its
own heads. A child of that module that the TP plan does not name but that holds parameters sees those
local activations, e.g. a per-head query / key norm:

- 1-D parameters of the head width (Phi's ``q_layernorm`` / ``k_layernorm`` with ``qk_layernorm``:
  ``LayerNorm(head_dim)`` on ``(batch, seq, heads, head_dim)``) are right in forward on every rank, but
  each rank's gradient covers its own heads only: they take ``replicated_grad_sum``
  (`modelpar.parallel.hf_styles.ReplicatedGradSum`), which sums it over the TP ranks. Left plain
  replicated, `verify --strategy tp` of Phi with ``qk_layernorm`` was silently off (q_layernorm 20x the
  tolerance at step 2).
- any other parameters (Cohere's ``use_qk_norm`` norm of weight ``(heads, head_dim)``, StableLM's one
  ``LayerNorm`` per head, a norm over the whole width) do not fit a rank's heads (Cohere under tp2
  crashed in every rank: 'The size of tensor a (4) must match the size of tensor b (2)'): that module's
  projections stay whole (replicated) on every TP rank, as an attention that views by its global head
  count does (`modelpar.parallel.hf_tp._views_by_global_heads`).

A child with 1-D parameters of the input width of one of the module's colwise projections, where that
width is neither the hidden size nor the head width, works on a latent the module makes from its
replicated input and that projection reads, as MLA's ``q_a_layernorm`` / ``kv_a_layernorm``
(DeepSeek-V2/V3) do: its gradient is whole on every rank (the colwise backward sums its input's), so it
is left as it is. (A norm of the hidden size inside the module may sit on the heads' concatenation
before the rowwise projection, as BitNet's ``attn_sub_norm`` does: it keeps the module whole.) Projections (``nn.Linear``, transformers ``Conv1D``) the plan leaves out are not counted:
they read the module's (replicated) input, as MLA's ``q_a_proj`` does. Nor are the children of a block whose projections
are its own children (OPT's ``fc1`` / ``fc2`` beside ``self_attn_layer_norm``, ``self_attn`` and
``final_layer_norm``): they work on the replicated residual stream.
"""

from __future__ import annotations

import torch.nn as nn

from modelpar.parallel import tensor as T
from modelpar.parallel.hf_tp import CONV1D_COLWISE, CONV1D_COLWISE_QKV, CONV1D_ROWWISE, REPLICATED_GRAD_SUM

_COL = (T.COLWISE, CONV1D_COLWISE, CONV1D_COLWISE_QKV)
_ROW = (T.ROWWISE, CONV1D_ROWWISE)


def _is_projection(m: nn.Module) -> bool:
    return isinstance(m, nn.Linear) or type(m).__name__ == "Conv1D"


def _in_width(m: nn.Module | None) -> int | None:
    """Input features of an nn.Linear or a transformers Conv1D (weight (in, out)), else None."""
    if isinstance(m, nn.Linear):
        return m.in_features
    return getattr(m, "nx", None) if m is not None and type(m).__name__ == "Conv1D" else None


def head_dim_of(cfg) -> int | None:
    """The per-head width of a transformers config: ``head_dim`` where set, else hidden / heads (None
    when the config has neither)."""
    from modelpar.models.hf import facts

    hd = getattr(cfg, "head_dim", None)
    if isinstance(hd, int) and hd > 0:
        return hd
    f = facts(cfg)
    return f.hidden // f.heads if f.heads else None


def guard_split_regions(model: nn.Module, plan: dict[str, str]) -> dict[str, str]:
    """``plan`` with the children of every split module (one with colwise and rowwise children in the plan)
    that hold parameters and are not in the plan handled as the module docstring says: per-head 1-D
    parameters summed over the TP ranks, anything else leaves that module's projections whole.

    ``model`` is an `HFModel`; ``plan`` maps its module paths to modelpar styles. Returns a new dict.
    """
    from modelpar.parallel.parts import find_blocks

    from modelpar.models.hf import facts

    head_dim, hidden = head_dim_of(model.hf.config), facts(model.hf.config).hidden
    try:
        blocks = {p for p, _ in find_blocks(model)[1]}
    except ValueError:
        blocks = set()
    modules = dict(model.named_modules())
    by_parent: dict[str, list[str]] = {}
    for p in plan:
        if "." in p:
            by_parent.setdefault(p.rsplit(".", 1)[0], []).append(p)
    out = dict(plan)
    for parent_path, entries in by_parent.items():
        styles = {plan[p] for p in entries}
        if not (styles & set(_COL) and styles & set(_ROW)) or parent_path not in modules or parent_path in blocks:
            continue                    # a block's own children beside its projections: the residual stream
        per_head, misfit = [], False
        # widths the module's colwise projections read that are not the residual stream's: latents made
        # inside the module by a replicated projection (MLA's q_lora_rank / kv_lora_rank)
        col_in = {_in_width(modules.get(p)) for p in entries if plan[p] in _COL} - {hidden}
        for name, child in modules[parent_path].named_children():
            path = f"{parent_path}.{name}"
            if path in plan or _is_projection(child) or not any(True for _ in child.parameters()):
                continue
            own = list(child.parameters(recurse=False))
            nested = any(True for c in child.children() for _ in c.parameters())
            widths = {p.shape[0] for p in own} if own and not nested and all(p.dim() == 1 for p in own) else None
            if widths == {head_dim} and head_dim not in col_in:
                per_head.append(path)
            elif widths and widths <= col_in and head_dim not in widths:
                continue        # on a colwise projection's replicated input (MLA's q_a_ / kv_a_layernorm)
            else:
                misfit = True
        if misfit:              # the whole module replicated: nothing of it split, nothing summed
            for p in entries:
                del out[p]
        else:
            out.update({p: REPLICATED_GRAD_SUM for p in per_head})
    return out
