"""What `planner.profile` reads of a model besides running it: its pipeline-splittable blocks
(`default_blocks`), shape facts (`_arch_of`), the TP styles of its derived plan (`_tp_styles`) and
which parameters belong to which block (`_block_params`, `_param_rows`) and the checked block list
(`_checked_blocks`). Split out of `profile.py` unchanged; `profile` re-exports `default_blocks`."""

from __future__ import annotations

import torch.nn as nn


def default_blocks(model: nn.Module, container: str | None = None) -> list[tuple[str, nn.Module | None]]:
    """The pipeline-splittable blocks: GPT -> embed, blocks.i, head; Sequential -> its children; any
    other model whose repeated blocks `modelpar.parallel.parts.find_blocks` finds (a Hugging Face
    model's ``model.layers`` / ``transformer.h`` / ...) -> ``("embed", None)``, the blocks,
    ``("head", None)``, where None stands for the rest of the model that runs before (after) the blocks,
    the parent's forward code included (embeddings, position ids, rotary tables; final norm, head);
    anything else -> the whole model as one block. ``container`` (``--blocks PATH``) names the
    ModuleList / Sequential of the blocks instead (any model; raises ValueError if it is none)."""
    from modelpar.parallel.parts import find_blocks
    if container:
        return [("embed", None)] + find_blocks(model, container)[1] + [("head", None)]
    if all(hasattr(model, a) for a in ("embed", "blocks", "head")):
        return ([("embed", model.embed)] + [(f"blocks.{i}", b) for i, b in enumerate(model.blocks)]
                + [("head", model.head)])
    if isinstance(model, nn.Sequential):
        return [(n, m) for n, m in model.named_children()]
    try:
        _, found = find_blocks(model)
    except ValueError:
        return [("model", model)]
    return [("embed", None)] + found + [("head", None)]


def _checked_blocks(model: nn.Module, blocks) -> tuple[list, dict, dict]:
    """`profile.profile_model`'s ``blocks`` (None: `default_blocks`) checked, with each module's path
    (``fqn``: module -> path) and each block module's ``ModuleTracker`` name -> block index.

    Raises:
        ValueError: a None block other than the first or the last, a block that is not a submodule of
            ``model``, or no block that is a submodule.
    """
    blocks = list(blocks) if blocks is not None else default_blocks(model)
    root_name = type(model).__name__
    fqn = {m: n for n, m in model.named_modules()}
    for i, (n, m) in enumerate(blocks):
        if m is None and 0 < i < len(blocks) - 1:
            raise ValueError(f"block {n!r}: only the first and the last block may be None (the rest of the model)")
        if m is not None and m not in fqn:
            raise ValueError(f"block {n!r} is not a submodule of the model")
    if all(m is None for _, m in blocks):
        raise ValueError("profile_model needs at least one block that is a submodule")
    names = {(f"{root_name}.{fqn[m]}" if fqn[m] else root_name): i for i, (_, m) in enumerate(blocks)
             if m is not None}
    return blocks, fqn, names


def _arch_of(model: nn.Module, tokens: int, vocab_parallel: bool | None = None) -> dict[str, int]:
    from modelpar.planner.hf_facts import hf_arch, is_hf_model
    from modelpar.parallel.tp_factory import hf_view
    # a transformers model (or one inside a factory's model): its config's facts; a type `hf:` does not
    # train (T5, ...) inside a factory's model is priced as any other module
    view = (model,) if is_hf_model(model) else hf_view(model)
    if view is not None:
        try:
            return hf_arch(view[0], tokens, vocab_parallel)
        except ValueError:
            return {}
    cfg = getattr(model, "cfg", None)
    if cfg is None or not hasattr(cfg, "n_head"):
        return {}
    return {"n_head": cfg.n_head, "d_model": cfg.d_model, "ffn": cfg.ffn, "n_layer": cfg.n_layer,
            "vocab_size": cfg.vocab_size, "seq_len": cfg.seq_len}


def _tp_styles(model: nn.Module, vocab_parallel: bool | None = None) -> dict[str, str]:
    """``{module path: "colwise" | "rowwise"}`` of the TP plan modelpar's runtime derives for ``model``
    ({} if none): `tensor.default_tp_plan`, whose GPT plan splits the token embedding (rowwise over
    the vocabulary: its weight is sharded) and the head (colwise over the vocabulary) unless
    ``vocab_parallel=False``; for a Hugging Face model the plan `modelpar.parallel.hf_tp` builds (its
    declared ``_tp_plan`` translated, or the derived one: GPT-2's Conv1D and fused c_attn), with a
    vocabulary-parallel embedding and head for language models."""
    from modelpar.parallel import tensor
    try:
        plan, _ = tensor.default_tp_plan(model, loss_parallel=vocab_parallel)
    except ValueError:
        return {}
    return tensor.tp_kinds(plan)      # Conv1D styles of HF models too (h-tp hook)


def _block_params(model, blocks, fqn, owner, block_of):
    """Per block, ``[(owner module path, leaf name, parameter)]``: a module block's parameters; for a
    None block, those of the modules outside every block module that ran while it was current
    (``owner``), modules that never ran joining the last None block (they still take memory)."""
    inside = {m for _, b in blocks if b is not None for m in b.modules()}
    out = []
    rest = len(blocks) - 1 if blocks[-1][1] is None else 0
    for i, (_, mod) in enumerate(blocks):
        rows = []
        if mod is not None:
            base = fqn[mod]
            for pn, p in mod.named_parameters():
                path, _, leaf = (f"{base}.{pn}" if base else pn).rpartition(".")
                rows.append((path, leaf, p))
        else:
            for m in model.modules():
                if m in inside or owner.get(m, rest) != i:
                    continue
                rows += [(fqn[m], pn, p) for pn, p in m.named_parameters(recurse=False)]
        out.append(rows)
    return out


def _param_rows(rows, styles: dict[str, str], counted: dict[int, int], i: int) -> tuple:
    """Block ``i``'s parameters (``rows``: `_block_params`' entries) as `profile.BlockProfile` fields:
    ``(param_numels, tied_numels, frozen, tied_frozen)``. A parameter an earlier block holds
    (``counted``: id -> its block, filled here) is a tie of this block, counted there once. ``frozen``
    / ``tied_frozen``: per entry True where ``requires_grad`` is False, () where no entry is."""
    numels, tied, frozen, tied_frozen = [], [], [], []
    for path, leaf, p in rows:
        st = styles.get(path)
        if id(p) in counted:
            if counted[id(p)] != i:
                tied.append((counted[id(p)], p.numel(), p.dim() >= 2, st == "colwise" or st == "rowwise"))
                tied_frozen.append(not p.requires_grad)
            continue
        counted[id(p)] = i
        numels.append((p.numel(), p.dim() >= 2, st == "colwise" or (st == "rowwise" and leaf == "weight")))
        frozen.append(not p.requires_grad)
    return (numels, tied, tuple(frozen) if any(frozen) else (),
            tuple(tied_frozen) if any(tied_frozen) else ())


# a model deeper than this is profiled at this depth and its steady layers repeated (`deepen_profile`)
PROFILE_LAYERS = 4


def deepen_profile(p, layers: int):
    """A profile of `PROFILE_LAYERS` layers (embedding or stem, the layers, the head) standing for
    ``layers`` of them: the third layer's row repeated for every layer between the second and the
    last (the first differs: it is the first to save what the others share, e.g. rotary tables, and
    its input is the embedding's output; the last feeds the head), the autocast variant likewise.
    ``arch["n_layer"]`` becomes ``layers``. Valid where every layer is one class with one shape (the
    built-in GPTs and uniform Hugging Face configs: `cli.common.profile_for`, `train.auto`); tests
    check it equals profiling every layer (tests/test_planner_hf.py, tests/test_planner_structure.py)."""
    import dataclasses

    if p is None:
        return None
    b = list(p.blocks)
    first, mid, last = b[1], b[3], b[-2]
    stem = first.name.rsplit(".", 1)[0]
    rows = [first] + [dataclasses.replace(mid, name=f"{stem}.{k}") for k in range(1, layers - 1)]
    rows.append(dataclasses.replace(last, name=f"{stem}.{layers - 1}"))
    return dataclasses.replace(p, blocks=(b[0], *rows, b[-1]), arch={**p.arch, "n_layer": layers},
                               autocast=deepen_profile(p.autocast, layers))


class TPSplitScopes:
    """Where the FLOPs of a profiled op are split by the TP plan of ``styles`` (`_tp_styles`): inside
    a colwise or rowwise module (its matmuls), or in the own code of a module that holds a colwise
    and a rowwise module as direct children (between them: the attention core over split heads, the
    MLP's activation), outside its other parameter-holding children. Everything else a TP rank
    computes whole: a Linear the plan leaves replicated (OPT's attention, whose forward views by the
    global head count), a mixture of experts' experts (no plan entry), a router. Names are
    ``ModuleTracker``'s: the root's class name, then the module path.

    Called with the tracker's active module names, True where the op is split."""

    def __init__(self, model: nn.Module, styles: dict[str, str], root_name: str):
        def tracked(path: str) -> str:
            return f"{root_name}.{path}" if path else root_name
        self.styled = frozenset(tracked(p) for p in styles)
        mods = dict(model.named_modules())
        self.core: dict[str, frozenset[str]] = {}
        for parent in {p.rpartition(".")[0] for p, st in styles.items() if st == "colwise"}:
            kids = {c for c in styles if c.rpartition(".")[0] == parent}
            if parent in mods and {"colwise", "rowwise"} <= {styles[c] for c in kids}:
                holders = (f"{parent}.{n}" if parent else n for n, m in mods[parent].named_children()
                           if next(m.parameters(), None) is not None)
                self.core[tracked(parent)] = frozenset(tracked(h) for h in holders)

    def __call__(self, parents: set[str]) -> bool:
        if not self.styled.isdisjoint(parents):
            return True
        core = self.core
        return any(p in core and parents.isdisjoint(core[p]) for p in parents)
