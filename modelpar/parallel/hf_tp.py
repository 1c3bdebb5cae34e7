"""Tensor and sequence parallel plans for Hugging Face transformers models (`modelpar.models.hf.HFModel`).

Two sources of a plan, in this order:

1. **The model's own plan.** transformers models of the Llama family declare one (``model._tp_plan``, the
   merge of ``config.base_model_tp_plan`` under the base model's prefix and the head's entries):
   ``{"model.layers.*.self_attn.q_proj": "colwise", ..., "lm_head": "colwise_gather_output"}``. Each
   ``*`` matches one path component; paths gain the ``hf.`` prefix of `HFModel`. Style names translate
   to modelpar's (`modelpar.parallel.tensor.STYLES`) by `HF_STYLES`; any other style name (MoE experts,
   packed projections, ...) is refused by name (`translate_hf_plan`), before any process starts.
   ``embedding_rowwise`` + ``colwise_gather_output`` on the output head become the vocab-parallel
   embedding and the colwise head whose logits stay vocab-sharded (loss parallel, as the built-in
   GPT), when the vocabulary divides the TP degree; otherwise both stay replicated.
   ``colwise_gather_output`` elsewhere (Phi-3's fused ``gate_up_proj``) gathers its output, and
   ``rowwise_split_input`` slices a replicated input. ``replicated_with_grad_allreduce`` (Qwen3's per-head
   ``q_norm`` / ``k_norm`` between the colwise and rowwise projections) keeps the parameters replicated and
   sums their per-rank partial gradients over the TP ranks (`hf_styles.ReplicatedGradSum`); ``mla_kv_a_proj``
   (DeepSeek-V2/V3) sums the gradient of the rotary key it shares with every head (`hf_styles.MlaRopeGradSum`).
2. **A derived plan** (`derive_hf_plan`) for models without one (GPT-2, ViT): in every repeated block
   (`modelpar.parallel.parts.find_blocks`), a module whose direct children are projections (all
   ``nn.Linear`` or all transformers ``Conv1D``, whose weight is stored ``(in, out)``, transposed
   against ``nn.Linear``), the leading ones reading the same input width and the last one reading
   the first one's output width (an MLP's up / down, an attention's q, k, v / o, a gated MLP's
   gate, up / down), gets the leading ones colwise and the last rowwise. The attention must view its
   heads as ``(..., -1, head_dim)`` (transformers 5's convention), so local heads follow; a module whose
   forward views them by its own head count (OPT's ``view(bsz, -1, self.num_heads, head_dim)``) is left
   replicated (`_views_by_global_heads`), and three projections of one square shape (BERT's query, key,
   value, whose output projection sits in another module) are not a group. A fused query|key|value projection
   (GPT-2's ``c_attn``: ``out = 3 x`` the next projection's ``in``, on a module with ``split_size``)
   becomes ``conv1d_colwise_qkv``: its columns are permuted so that each TP rank's contiguous shard
   holds the query, key and value columns of its own heads (`qkv_permutation`), and the attention's
   ``split_size`` follows the local width. State dicts of the laid-out module see the ORIGINAL order
   (state-dict hooks, `attach_canonical_hooks`); checkpoints use `canonical_state` / `restore_layout`.

Legality (`check_hf_tp`): query heads and key/value heads each divisible by the TP degree (naming the
config field), the vocabulary for vocab parallel, the sequence for sequence parallel; refused families
are named. Megatron-LM's column/row split: Shoeybi et al. 2019, Sec. 3; sequence parallel: Korthikanti
et al. 2022, Sec. 4.2.2.
"""

from __future__ import annotations

import math
import re

import torch
import torch.nn as nn

from modelpar.parallel import tensor as T

# transformers style name -> modelpar style (None: left replicated); see module docstring
HF_STYLES = {
    "colwise": T.COLWISE,
    "rowwise": T.ROWWISE,
    "colwise_gather_output": "colwise_gather",    # the output head: COLWISE_VOCAB (vocab-sharded logits)
    "colwise_rep": "colwise_gather",
    "rowwise_split_input": "rowwise_split",       # replicated input cut into this rank's features
    "rowwise_rep": "rowwise_split",
    "embedding_rowwise": T.ROWWISE_VOCAB,
    "sequence_parallel": T.SEQ_NORM,
    "replicate": None,
    "replicated_with_grad_allreduce": "replicated_grad_sum",   # see REPLICATED_GRAD_SUM
    "mla_kv_a_proj": "mla_rope_grad_sum",                      # see MLA_ROPE_GRAD_SUM
}
# derived-plan styles for transformers' Conv1D (weight (in, out))
CONV1D_COLWISE, CONV1D_ROWWISE, CONV1D_ROWWISE_SEQ = "conv1d_colwise", "conv1d_rowwise", "conv1d_rowwise_seq"
CONV1D_COLWISE_QKV = "conv1d_colwise_qkv"      # colwise of a fused q|k|v projection, columns permuted per rank
COLWISE_GATHER = "colwise_gather"              # nn.Linear colwise, output all-gathered (replicated)
ROWWISE_SPLIT = "rowwise_split"                # nn.Linear rowwise from a replicated input (sliced locally)
SHARD_SEQ_INPUT = "shard_seq_input"            # a block's hidden states: replicated -> sequence shards
GATHER_SEQ_HIDDEN = "gather_seq_hidden"        # attention / MLP input (positional or hidden_states=): gathered
# a module between a colwise and a rowwise projection that holds replicated parameters but sees only this
# rank's heads (Qwen3's per-head q_norm / k_norm): its parameter gradients are partial, summed over the TP ranks
REPLICATED_GRAD_SUM = "replicated_grad_sum"
# MLA's replicated kv_a_proj_with_mqa (DeepSeek-V2/V3): the gradient of its output's rotary key part is summed
MLA_ROPE_GRAD_SUM = "mla_rope_grad_sum"
STYLES = (CONV1D_COLWISE, CONV1D_ROWWISE, CONV1D_ROWWISE_SEQ, CONV1D_COLWISE_QKV, SHARD_SEQ_INPUT,
          GATHER_SEQ_HIDDEN, COLWISE_GATHER, ROWWISE_SPLIT, REPLICATED_GRAD_SUM, MLA_ROPE_GRAD_SUM)
CONV1D_STYLES = {CONV1D_COLWISE: "nf", CONV1D_COLWISE_QKV: "nf", CONV1D_ROWWISE: "nx", CONV1D_ROWWISE_SEQ: "nx"}
# model families whose blocks modelpar can put on sequence shards (norms inside the blocks, hidden states
# passed positionally or as hidden_states=)
SP_FAMILIES = ("llama", "gpt2")


def is_hf(model: nn.Module) -> bool:
    from modelpar.models.hf import HFModel

    return isinstance(model, HFModel)


def _is_conv1d(m: nn.Module) -> bool:
    return type(m).__name__ == "Conv1D" and hasattr(m, "nf") and hasattr(m, "nx")


def _dims(m: nn.Module) -> tuple[int, int] | None:
    """(in, out) features of an nn.Linear or a Conv1D, else None."""
    if isinstance(m, nn.Linear):
        return m.in_features, m.out_features
    if _is_conv1d(m):
        return m.nx, m.nf
    return None


def _expand(pattern: str, names: list[str]) -> list[str]:
    """Module paths matching ``pattern`` (``*`` = one path component)."""
    pp = pattern.split(".")
    out = []
    for n in names:
        parts = n.split(".")
        if len(parts) == len(pp) and all(a == "*" or a == b for a, b in zip(pp, parts)):
            out.append(n)
    return out


def declared_plan(model: nn.Module) -> dict[str, str]:
    """The transformers model's own TP plan (``{pattern: hf style}``, ``hf.`` not yet prefixed), {} if none."""
    plan = getattr(model.hf, "_tp_plan", None) or {}
    return dict(plan)


def translate_hf_plan(model: nn.Module, hf_plan: dict[str, str], *, tp_degree: int | None = None) -> dict[str, str]:
    """``{hf.<path>: modelpar style}`` of a transformers plan, wildcards expanded.

    Raises:
        ValueError: a style name modelpar does not translate (named with its pattern and the supported
            names), or an output head given another style than colwise_gather_output. A pattern that
            matches no module (one the config leaves out) adds nothing, as in transformers.
    """
    names = [n for n, _ in model.named_modules()]
    typ = type(model.hf).__name__
    for pat, style in hf_plan.items():
        if style not in HF_STYLES:
            raise ValueError(f"{typ}'s TP plan (_tp_plan) gives {pat!r} the style {style!r}, which modelpar does "
                             f"not translate; supported: {', '.join(sorted(HF_STYLES))}. Pass your own plan "
                             f"(parallelize(..., tp_plan={{module path: style}}) from Python)")
    vocab = getattr(model.hf.config, "vocab_size", None)
    vocab_ok = tp_degree is None or (vocab is not None and vocab % tp_degree == 0)
    head = model.hf.get_output_embeddings() if model.task == "lm" else None
    head_path = next((n for n, m in model.named_modules() if head is not None and m is head), None)
    out: dict[str, str] = {}
    for pat, style in hf_plan.items():
        for p in _expand("hf." + pat, names):       # a pattern of a module this config lacks: nothing
            if p == head_path and model.task == "lm" and HF_STYLES[style] not in (COLWISE_GATHER, None):
                raise ValueError(f"{typ}'s TP plan gives its output head {pat!r} the style {style!r}; modelpar "
                                 f"splits the head colwise over the vocabulary (colwise_gather_output) only")
            ours = T.COLWISE_VOCAB if HF_STYLES[style] == COLWISE_GATHER and p == head_path else HF_STYLES[style]
            if ours in (T.COLWISE_VOCAB, T.ROWWISE_VOCAB) and not vocab_ok:
                continue                # the vocabulary does not divide: embedding and head replicated
            if ours is not None:
                out[p] = ours
    return out


def derive_hf_plan(model: nn.Module, *, tp_degree: int | None = None) -> dict[str, str]:
    """A GPT-2 style plan (module docstring, item 2) plus the vocab-parallel embedding and head.

    Raises:
        ValueError: no block holds a (colwise, rowwise) pair the rule recognises (the family named).
    """
    from modelpar.parallel.parts import find_blocks

    typ = type(model.hf).__name__
    try:
        _, blocks = find_blocks(model)
    except ValueError as e:
        raise ValueError(f"tensor parallel: cannot find the repeated blocks of {typ} to derive a TP plan ({e})") from None
    plan: dict[str, str] = {}
    for bpath, block in blocks:
        for name, parent in block.named_modules():
            projs = [(n, c) for n, c in parent.named_children() if _dims(c) is not None]
            if len(projs) < 2:
                continue
            *firsts, (n2, b) = projs
            (in_a, out_a), (in_b, _) = _dims(firsts[0][1]), _dims(b)
            base = f"{bpath}.{name}." if name else f"{bpath}."
            conv = all(_is_conv1d(c) for _, c in projs)
            lin = all(isinstance(c, nn.Linear) for _, c in projs)
            same_in = all(_dims(c)[0] == in_a for _, c in firsts)
            if not (conv or lin) or not same_in or _views_by_global_heads(parent):
                continue
            if len(projs) == 3 and len({_dims(c) for _, c in projs}) == 1 and in_a == out_a:
                continue                # BERT's query, key, value: no output projection beside them
            if out_a == in_b:           # (up | q, k, v | gate, up) colwise -> (down | o) rowwise
                plan.update({base + n: CONV1D_COLWISE if conv else T.COLWISE for n, _ in firsts})
                plan[base + n2] = CONV1D_ROWWISE if conv else T.ROWWISE
            elif (conv and len(firsts) == 1 and out_a == 3 * in_b
                  and getattr(parent, "split_size", None) == in_b):
                plan[base + firsts[0][0]], plan[base + n2] = CONV1D_COLWISE_QKV, CONV1D_ROWWISE
    if not plan:
        raise ValueError(f"tensor parallel: {typ} declares no TP plan (_tp_plan) and modelpar found no "
                         f"(colwise ..., rowwise) group of projections in its blocks to derive one from. Pass your own plan (parallelize(..., tp_plan={{module path: style}}) from Python)")
    plan.update(_vocab_entries(model, tp_degree))
    return plan


_HEAD_ATTRS = r"self\.(?:num_heads|num_attention_heads|num_key_value_heads|n_heads?)\b"
# a view / reshape by the head count (OPT, Bloom), or the head count handed to a helper that views by it
# (GPT-Neo's ``self._split_heads(query, self.num_heads, self.head_dim)``)
_GLOBAL_HEADS = re.compile(rf"\.(?:view|reshape)\([^)]*{_HEAD_ATTRS}|[(,]\s*{_HEAD_ATTRS}")


def _views_by_global_heads(parent: nn.Module) -> bool:
    """True when ``parent``'s forward views its projections by its own (global) head count, as OPT's
    attention does (``q.view(bsz, -1, self.num_heads, head_dim)``): split colwise, a rank's
    ``heads / tp`` heads would fold into the sequence dimension, silently wrong (OPT under tp2: loss
    4.8e-4 off one process at step 2), or hands that count to a helper that does (GPT-Neo's
    ``_split_heads(q, self.num_heads, head_dim)``: tp2 crashed in the ranks). Such a group stays replicated."""
    import inspect

    try:
        src = inspect.getsource(type(parent).forward)
    except (OSError, TypeError):
        return False
    return bool(_GLOBAL_HEADS.search(src))


def _vocab_entries(model: nn.Module, tp_degree: int | None) -> dict[str, str]:
    """Vocab-parallel input embedding and output head of a causal LM (when the vocabulary divides)."""
    if model.task != "lm":
        return {}
    vocab = model.hf.config.vocab_size
    if tp_degree is not None and vocab % tp_degree:
        return {}
    names = {id(m): n for n, m in model.named_modules()}
    emb, head = model.hf.get_input_embeddings(), model.hf.get_output_embeddings()
    out = {}
    if isinstance(emb, nn.Embedding) and id(emb) in names:
        out[names[id(emb)]] = T.ROWWISE_VOCAB
    if isinstance(head, nn.Linear) and id(head) in names:
        out[names[id(head)]] = T.COLWISE_VOCAB
    return out


def hf_tp_plan(model: nn.Module, *, sequence_parallel: bool = False, tp_degree: int | None = None,
               loss_parallel: bool | None = None) -> dict[str, str]:
    """The TP plan of an `HFModel`: its own translated plan, else a derived one; with sequence parallel
    the norms of every block and the final norm on sequence shards.

    ``loss_parallel`` False: embedding and head stay replicated. ``tp_degree`` (when known): a vocabulary
    it does not divide leaves them replicated instead of being refused.

    Raises:
        ValueError: see `translate_hf_plan`, `derive_hf_plan`; sequence parallel on a family outside
            `SP_FAMILIES`.
    """
    declared = declared_plan(model)
    plan = translate_hf_plan(model, declared, tp_degree=tp_degree) if declared else derive_hf_plan(model, tp_degree=tp_degree)
    from modelpar.parallel.hf_tp_region import guard_split_regions

    plan = guard_split_regions(model, plan)     # parameters between the colwise and rowwise projections
    if loss_parallel is False:
        plan = {p: s for p, s in plan.items() if s not in (T.COLWISE_VOCAB, T.ROWWISE_VOCAB)}
    if sequence_parallel:
        plan = _add_sequence_parallel(model, plan)
    return plan


def _is_norm(m: nn.Module) -> bool:
    return isinstance(m, nn.LayerNorm) or type(m).__name__.endswith("RMSNorm")


def _add_sequence_parallel(model: nn.Module, plan: dict[str, str]) -> dict[str, str]:
    """Norms on sequence shards (Korthikanti et al. 2022): the first block's input is cut into shards,
    each attention / MLP gathers its input, each rowwise projection reduce-scatters, the final norm
    works on shards and the head gathers (or, vocab-parallel, takes sequence shards in)."""
    from modelpar.parallel.parts import find_blocks

    mtype = model.hf.config.model_type
    if mtype not in SP_FAMILIES:
        raise ValueError(f"sequence parallel is supported for the Hugging Face families {', '.join(SP_FAMILIES)}; "
                         f"{type(model.hf).__name__} (model_type {mtype!r}) is not one of them (its blocks' "
                         f"norms and hidden-state passing are not checked): use tensor parallel without "
                         f"--sequence-parallel")
    _, blocks = find_blocks(model)
    out = dict(plan)
    row_seq = {T.ROWWISE: T.ROWWISE_SEQ, CONV1D_ROWWISE: CONV1D_ROWWISE_SEQ}
    for p, s in plan.items():
        if s in row_seq:
            out[p] = row_seq[s]
    out[blocks[0][0]] = SHARD_SEQ_INPUT
    block_paths = {p for p, _ in blocks}
    for bpath, block in blocks:
        for name, child in block.named_children():
            path = f"{bpath}.{name}"
            if _is_norm(child):
                out[path] = T.SEQ_NORM
            elif any(q.startswith(path + ".") and out[q] in (T.ROWWISE_SEQ, CONV1D_ROWWISE_SEQ) for q in out):
                out[path] = GATHER_SEQ_HIDDEN
    # the final norm: the norm module outside the blocks, after them (transformer.ln_f, model.norm)
    finals = [n for n, m in model.named_modules() if _is_norm(m) and not any(n.startswith(b + ".") for b in block_paths)]
    head = next((p for p, s in plan.items() if s == T.COLWISE_VOCAB), None)
    if finals:
        out[finals[-1]] = T.SEQ_NORM
    if head is not None:
        out[head] = T.COLWISE_VOCAB_SEQ
    else:
        lm = model.hf.get_output_embeddings() if model.task == "lm" else None
        names = {id(m): n for n, m in model.named_modules()}
        if lm is None or id(lm) not in names:
            raise ValueError(f"sequence parallel: cannot find the output head of {type(model.hf).__name__}")
        out[names[id(lm)]] = GATHER_SEQ_HIDDEN
    return out


def check_hf_tp(model: nn.Module, tp_plan: dict[str, str], tp_degree: int, *, seq_len: int | None = None) -> None:
    """Heads, key/value heads, vocabulary and sequence legality of an `HFModel` under TP degree ``tp_degree``.

    Raises:
        ValueError: naming the config field (``LlamaConfig.num_key_value_heads``), its value and the degree;
            a Conv1D split that does not divide (``path.nf`` / ``path.nx``).
    """
    from modelpar.models.hf import facts

    cfg = model.hf.config
    cname = type(cfg).__name__
    f = facts(cfg)
    splits_heads = any(s in (T.COLWISE, CONV1D_COLWISE_QKV) for s in tp_plan.values())
    if splits_heads and f.heads is not None:
        hname = "num_attention_heads"
        if f.heads % tp_degree:
            mods = _head_split_modules(model, tp_plan, f.heads, f.heads)
            raise ValueError(f"tensor parallel degree {tp_degree} does not divide {cname}.{hname}={f.heads}: "
                             + (f"the attention projections {mods} are split by query heads" if mods else
                                _unsplit_attention(model)) +
                             f"; use a TP degree dividing {math.gcd(f.heads, f.kv_heads or f.heads)}")
        if f.kv_heads is not None and f.kv_heads % tp_degree:
            mods = _head_split_modules(model, tp_plan, f.heads, f.kv_heads)
            raise ValueError(f"tensor parallel degree {tp_degree} does not divide {cname}.num_key_value_heads="
                             f"{f.kv_heads}: " + (f"the key/value projections {mods} are split by key/value "
                                                   f"heads (GQA)" if mods else _unsplit_attention(model)) +
                             f"; use a TP degree dividing {f.kv_heads}")
    if T.SEQ_NORM in tp_plan.values() and seq_len is not None and seq_len % tp_degree:
        raise ValueError(f"sequence parallel: tensor parallel degree {tp_degree} does not divide the sequence "
                         f"length seq_len={seq_len}")
    modules = dict(model.named_modules())
    for path, style in tp_plan.items():
        if style in CONV1D_STYLES:
            m = modules.get(path)
            if m is None:
                continue                # named by validate_tp_plan
            if not _is_conv1d(m):
                raise ValueError(f"TP plan entry {path!r} is {type(m).__name__}; {style} splits a transformers Conv1D")
            dim = CONV1D_STYLES[style]
            n = getattr(m, dim)
            if n % tp_degree or (style == CONV1D_COLWISE_QKV and n % (3 * tp_degree)):
                raise ValueError(f"tensor parallel degree {tp_degree} does not divide {path}.{dim}={n} "
                                 f"({style} split of Conv1D(nf={m.nf}, nx={m.nx}))")


def _head_split_modules(model: nn.Module, tp_plan: dict[str, str], heads: int, split_heads: int) -> str:
    """The colwise attention projections of the first repeated block that ``split_heads`` heads split (of
    ``heads`` query heads: the key/value ones under GQA have ``split_heads / heads`` of the query
    width), as ``'a', 'b' (and the same in every block)`` for a refusal; the plan's colwise entries of
    that block when none is found by width."""
    from modelpar.parallel.parts import find_blocks

    try:
        _, blocks = find_blocks(model)
        first = blocks[0][0] + "."
    except ValueError:
        first = ""
    modules = dict(model.named_modules())
    cols = [p for p, s in tp_plan.items() if p.startswith(first) and s in (T.COLWISE, CONV1D_COLWISE_QKV)
            and _dims(modules.get(p)) is not None]
    attn = [p for p in cols if "attn" in p.rsplit(".", 1)[0].lower() or "attention" in p.rsplit(".", 1)[0].lower()]
    widths = {p: _dims(modules[p])[1] // (3 if tp_plan[p] == CONV1D_COLWISE_QKV else 1) for p in attn}
    q = max(widths.values(), default=0)
    if not attn:
        return ""
    named = [p for p in attn if widths[p] * heads == q * split_heads] or attn
    more = " (and the same in every block)" if first and len(blocks) > 1 else ""
    return ", ".join(repr(p) for p in named) + more


def _unsplit_attention(model: nn.Module) -> str:
    """The refusal's reason where the TP plan splits no attention projection (Falcon's and GPT-BigCode's
    fused multi-query ones): the planner prices tensor parallel by whole heads per rank, so it is refused
    alike here."""
    return (f"modelpar's TP plan of {type(model.hf).__name__} splits its MLPs only (not its fused attention), "
            f"and modelpar plans and checks tensor parallel by whole heads per rank, so it is refused before "
            f"launch (--strategy fsdp, pp or ddp train this model)")


# ---- the fused q|k|v permutation ------------------------------------------------------------------
def qkv_permutation(width: int, tp_degree: int, groups: int = 3) -> torch.Tensor:
    """Column order that puts each rank's heads of the ``groups`` fused parts side by side.

    ``width`` = ``groups x E`` columns laid out ``[q | k | v]``; each part is cut into ``tp_degree``
    chunks of ``E / tp_degree`` (whole heads when the heads divide). Returns ``perm`` (int64,
    ``(width,)``) with ``permuted = canonical[..., perm]``, so rank r's contiguous shard of ``permuted``
    is ``[q_r | k_r | v_r]``; ``canonical = permuted[..., argsort(perm)]``.
    """
    e = width // groups
    c = e // tp_degree
    return torch.cat([torch.arange(g * e + r * c, g * e + (r + 1) * c) for r in range(tp_degree)
                      for g in range(groups)])


def _reorder(v: torch.Tensor, idx: torch.Tensor, dim: int) -> torch.Tensor:
    """``v`` with its ``dim`` reindexed by ``idx`` (a DTensor keeps its mesh and placements; one gather)."""
    from torch.distributed.tensor import DTensor, distribute_tensor

    if isinstance(v, DTensor):
        full = v.full_tensor().index_select(dim, idx.to(v.device))
        return distribute_tensor(full, v.device_mesh, v.placements, src_data_rank=None)
    return v.index_select(dim, idx.to(v.device))


def permute_fused_qkv(attn_parent: nn.Module, conv: nn.Module, tp_degree: int) -> None:
    """Permute a fused Conv1D's columns in place (before sharding), record it on the module, set the
    parent's ``split_size`` to the local width and attach the canonical state-dict hooks."""
    perm = qkv_permutation(conv.nf, tp_degree)
    with torch.no_grad():
        conv.weight.data = conv.weight.data[:, perm].contiguous()
        conv.bias.data = conv.bias.data[perm].contiguous()
    conv._modelpar_perm = perm
    attn_parent.split_size = conv.nf // 3 // tp_degree
    attach_canonical_hooks(conv)


def _dim_of(leaf: str) -> int:
    return 1 if leaf == "weight" else 0


def attach_canonical_hooks(conv: nn.Module) -> None:
    """``conv.state_dict()`` gives the original column order; ``load_state_dict`` takes it."""
    def save_hook(module, state, prefix, _meta):
        inv = torch.argsort(module._modelpar_perm)
        for leaf in ("weight", "bias"):
            if prefix + leaf in state:
                state[prefix + leaf] = _reorder(state[prefix + leaf], inv, _dim_of(leaf))

    def load_hook(module, state, prefix, *_args):
        for leaf in ("weight", "bias"):
            if prefix + leaf in state:
                state[prefix + leaf] = _reorder(state[prefix + leaf], module._modelpar_perm, _dim_of(leaf))

    conv.register_state_dict_post_hook(save_hook)
    conv.register_load_state_dict_pre_hook(load_hook)


def permuted_params(modules: list[nn.Module]) -> dict[str, torch.Tensor]:
    """``{parameter name: perm}`` of every permuted fused projection in ``modules`` (names as the
    modules name them)."""
    out = {}
    for m in modules:
        for name, mod in m.named_modules():
            perm = getattr(mod, "_modelpar_perm", None)
            if perm is not None:
                for leaf in ("weight", "bias"):
                    out[f"{name}.{leaf}" if name else leaf] = perm
    return out


def _fqn_of(key: str, perms: dict) -> str | None:
    """The parameter name of a model (``fqn``) or flattened optimizer (``state.fqn.exp_avg``) key."""
    if key in perms:
        return key
    if key.startswith("state."):
        fqn = key[len("state."):].rsplit(".", 1)[0]
        return fqn if fqn in perms else None
    return None


def canonical_state(state: dict, perms: dict[str, torch.Tensor], *, inverse: bool = False) -> dict:
    """``{"model": ..., "optim": ...}`` with every permuted tensor (parameter and optimizer state of the
    same shape) in the original order (``inverse``: back into the laid-out order), new tensors; the
    rest untouched. For checkpoints: save canonical, load canonical then `restore_layout`."""
    if not perms:
        return state
    out = {}
    for part, sd in state.items():
        new = dict(sd)
        for k, v in sd.items():
            fqn = _fqn_of(k, perms)
            if fqn is not None and torch.is_tensor(v) and v.dim() > 0:
                idx = perms[fqn] if inverse else torch.argsort(perms[fqn])
                new[k] = _reorder(v, idx, _dim_of(fqn.rsplit(".", 1)[-1]))
        out[part] = new
    return out


def restore_layout(state: dict, perms: dict[str, torch.Tensor]) -> None:
    """In place: tensors of ``state`` that were loaded with the original order get the laid-out order."""
    laid = canonical_state(state, perms, inverse=True)
    with torch.no_grad():
        for part, sd in state.items():
            for k, v in sd.items():
                if laid[part][k] is not v:
                    v.copy_(laid[part][k])


def prepare_modules(model: nn.Module, tp_plan: dict[str, str], tp_degree: int, present: set[str]) -> None:
    """Before sharding, for ``present``: permute fused q|k|v projections, tell MLA ones the rotary width."""
    for path, style in ((p, s) for p, s in tp_plan.items() if p in present):   # a stage holds only some
        parent = model.get_submodule(path.rsplit(".", 1)[0]) if "." in path else model
        if style == CONV1D_COLWISE_QKV:
            permute_fused_qkv(parent, model.get_submodule(path), tp_degree)
        elif style == MLA_ROPE_GRAD_SUM:
            model.get_submodule(path).mla_rope_dim = int(parent.qk_rope_head_dim)
