"""Which tensor-parallel degrees a model's shape allows (pure: reads `ModelProfile.arch`, or `tp_split`).

A TP split divides the attention heads among the ranks (query heads and, for grouped-query attention,
the key/value heads each: a rank holds whole heads and the key/value heads its query heads read,
Ainslie et al. 2023 "GQA", as Megatron-LM requires), the hidden and FFN widths of the split
projections, and, where the vocabulary is split (a vocabulary-parallel embedding and head: the
built-in GPT, and HF language models unless ``arch["vocab_parallel"] == 0``), the vocabulary.
"""

from __future__ import annotations

# (arch key, what it is), in the order a message names them
TP_FIELDS = (("n_head", "attention (query) heads"), ("n_kv_head", "key/value heads"),
             ("d_model", "hidden size"), ("ffn", "FFN width"), ("vocab_size", "vocabulary"))


def tp_violations(arch: dict, tp: int) -> list[str]:
    """The shape facts of ``arch`` that the TP degree ``tp`` does not divide, as ``"what key=value"``
    strings ([] when ``tp`` is legal, or ``arch`` is empty: no facts, nothing checked here)."""
    if tp <= 1 or not arch:
        return []
    out = []
    for key, what in TP_FIELDS:
        if key == "vocab_size" and arch.get("vocab_parallel", 1) == 0:
            continue
        v = arch.get(key)
        if v and v % tp:
            out.append(f"{what} {key}={v}")
    return out


def check_tp_degree(arch: dict, tp: int, tp_split: tuple = ()) -> None:
    """Raise ValueError naming every shape fact ``tp`` does not divide (see `tp_violations`); without
    ``arch``, every split dimension of ``tp_split`` (`ModelProfile.tp_split`: module, dimension, size)."""
    bad = tp_violations(arch, tp)
    if bad:
        raise ValueError(f"tensor parallel degree tp={tp} does not divide the model's {'; '.join(bad)}: "
                         f"each rank must hold whole heads and an equal share of each split dimension")
    bad = [f"{d}={n}" for d, n in tp_split if n % tp] if (tp > 1 and not arch) else []
    if bad:
        raise ValueError(f"tensor parallel degree tp={tp} does not divide {', '.join(bad)} (the TP plan's "
                         f"colwise / rowwise splits): each rank must hold an equal share of each split dimension")


def tp_split_dims(model, styles: dict[str, str]) -> tuple[tuple[str, int], ...]:
    """``(("path.out_features", 5), ...)``: the dimension each split of the runtime's TP plan divides
    (``styles``: `modelpar.parallel.tensor.tp_kinds`; colwise: a Linear's output features or a Conv1D's
    ``nf``, rowwise: input features / ``nx``; embeddings and other modules are not listed), as
    `modelpar.parallel.tensor.validate_tp_plan` checks them at launch (case C7). Read where ``arch`` is
    empty (models that are not transformers), so the planner proposes no TP degree the runtime refuses."""
    mods = dict(model.named_modules())
    out = []
    for path, kind in styles.items():
        m = mods.get(path)
        col = kind == "colwise"
        for dim in (("out_features", "nf") if col else ("in_features", "nx")):
            if isinstance(getattr(m, dim, None), int):
                out.append((f"{path}.{dim}", int(getattr(m, dim))))
                break
    return tuple(out)


def split_violations(profile, tp: int) -> list[str]:
    """`tp_violations` of a profile: its ``arch`` facts, or (no ``arch``) its ``tp_split`` dimensions."""
    if tp <= 1:
        return []
    if profile.arch:
        return tp_violations(profile.arch, tp)
    return [f"{d}={n}" for d, n in profile.tp_split if n % tp]
