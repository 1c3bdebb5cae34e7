"""Which tensor-parallel degrees a model's shape allows (pure: reads `ModelProfile.arch`).

A TP split divides the attention heads among the ranks (query heads and, for grouped-query attention,
the key/value heads each: a rank holds whole heads and the key/value heads its query heads read,
Ainslie et al. 2023 "GQA", as Megatron-LM requires), the hidden and FFN widths of the split
projections, and, where the vocabulary is split (a vocabulary-parallel embedding and head: the
built-in GPT, and HF language models unless ``arch["vocab_parallel"] == 0``), the vocabulary.
"""

from __future__ import annotations

from modelpar.plan import CORE_ATTR
from modelpar.stage_split import V_SCHEDULES  # (re-exported) stage s and stage 2 pp - 1 - s on one rank

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


def check_tp_degree(arch: dict, tp: int) -> None:
    """Raise ValueError naming every shape fact ``tp`` does not divide (see `tp_violations`)."""
    bad = tp_violations(arch, tp)
    if bad:
        raise ValueError(f"tensor parallel degree tp={tp} does not divide the model's {'; '.join(bad)}: "
                         f"each rank must hold whole heads and an equal share of each split dimension")


def tp_splits(model, styles: dict[str, str]) -> tuple[tuple[str, str, int], ...]:
    """``(module path, dimension, size)`` of every dimension the TP plan ``styles`` (``{path: "colwise" |
    "rowwise"}``, `modelpar.parallel.tensor.tp_kinds` of the runtime's derived plan) splits: an
    ``nn.Linear``'s ``out_features`` (colwise) or ``in_features`` (rowwise), an ``nn.Embedding``'s
    ``num_embeddings``, a GPT-2 ``Conv1D``'s ``nf`` / ``nx``. Reads module attributes only (meta models
    included). For any model, where ``arch`` holds no shape facts (case C7: a user's Linear chain). One
    entry per (dimension, size), naming the first module that has it: the divisibility test depends on the
    sizes only, and the list stays as long as one block's (not one entry per module of every layer)."""
    import torch.nn as nn

    mods, out, seen = dict(model.named_modules()), [], set()
    for path, kind in styles.items():
        m = mods.get(path)
        if isinstance(m, nn.Linear):
            dim = "out_features" if kind == "colwise" else "in_features"
        elif isinstance(m, nn.Embedding):
            dim = "num_embeddings"
        elif type(m).__name__ == "Conv1D" and hasattr(m, "nf"):
            dim = "nf" if kind == "colwise" else "nx"
        else:
            continue
        size = int(getattr(m, dim))
        if (dim, size) not in seen:     # the first module of each width stands for the others, so a
            seen.add((dim, size))       # profile of one block repeated lists what a full one does
            out.append((path, dim, size))
    return tuple(out)


def split_violations(splits, tp: int) -> list[str]:
    """The entries of `tp_splits` that ``tp`` does not divide, as ``"path.dim=size"`` ([] if none)."""
    return [f"{p}.{d}={n}" for p, d, n in splits if tp > 1 and n % tp]


def selective_refusal(profile) -> str:
    """Why selective checkpointing cannot run on the profiled model ("" where it can): it recomputes
    each block's attention core, and no block has one the runtime recognises (`parallel.checkpointing`;
    the profile's ``attn_core_saved_bytes``), as the training preflight refuses it."""
    if any(b.attn_core_saved_bytes for b in profile.blocks):
        return ""
    return ("--activation-checkpointing selective recomputes each block's attention core, and none of this "
            "model's blocks has one modelpar recognises (a submodule whose class sets "
            f"{CORE_ATTR} = True, as modelpar's GPT's AttentionCore does; a Hugging Face block computes "
            f"attention in a function, not a module); use full or every-k")


def tie_refusal(profile, pp: int, sched: str, dp: int) -> str:
    """Why ``train`` refuses this layout for a model whose input and output parts share a tensor (a tied
    embedding and head: the last block's ``tied_numels`` name block 0), or "": under a V-shaped schedule
    (`V_SCHEDULES`) rank 0 holds the first and the last stage, and with data parallelism (``dp`` > 1:
    FSDP2 units per stage) the two copies would sit in two units there (`modelpar.parallel.ties.check_ties`).
    `plan` ranked such a layout first for a tied model on 4 ranks and ``--strategy auto`` picked it."""
    if pp < 2 or dp < 2 or sched not in V_SCHEDULES or not profile.blocks:
        return ""
    if any(owner == 0 for owner, *_ in profile.blocks[-1].tied_numels):
        return (f"a tied input embedding and output head would sit in two data-parallel units on pipeline rank 0 "
                f"({sched} puts the first and the last stage there)")
    return ""


def check_model_takes(profile, plan) -> None:
    """What ``train`` refuses of the profiled model under ``plan`` before launch (`plan --plan FILE` and
    `estimate` of one layout price nothing it would refuse): a pipeline its forward cannot be cut into
    (``profile.pipeline_refusal``), a tie a V schedule's stages would split (`tie_refusal`), no TP plan it runs (``tp_refusal``), selective checkpointing without
    attention cores (`selective_refusal`), a TP degree that does not divide heads / widths / the
    vocabulary (`check_tp_degree`) or a split width of its TP plan (`split_violations`, case C7).

    Raises:
        ValueError: the first of these, with train's reason.
    """
    if plan.pp > 1 and profile.pipeline_refusal:
        raise ValueError(f"{plan.describe()}: {profile.pipeline_refusal}")
    why = tie_refusal(profile, plan.pp, plan.pp_schedule, plan.dp_replicate * plan.dp_shard)
    if why:
        raise ValueError(f"{plan.describe()}: {why}; use another schedule or no data parallelism")
    if plan.tp > 1 and profile.tp_refusal:
        raise ValueError(f"{plan.describe()}: {profile.tp_refusal}")
    if plan.activation_checkpointing == "selective" and selective_refusal(profile):
        raise ValueError(selective_refusal(profile))
    check_tp_degree(profile.arch, plan.tp)
    bad = split_violations(profile.tp_splits, plan.tp)
    if bad:
        raise ValueError(f"tensor parallel degree tp={plan.tp} does not divide {', '.join(bad)} (split by "
                         f"the model's TP plan); choose a TP degree that divides every split dimension")
