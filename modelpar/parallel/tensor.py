"""Tensor parallel (Megatron-LM, Shoeybi et al. 2019, Sec. 3) with DTensor `parallelize_module`.

A colwise Linear splits its output features over the TP ranks, the following rowwise Linear splits its
input features and all-reduces its output, so each (colwise, rowwise) pair costs one all-reduce in
forward and one in backward. The plan is derived automatically:

- the built-in GPT: per block ``attn.q/k/v`` colwise, ``attn.o`` rowwise, ``mlp.up`` colwise,
  ``mlp.down`` rowwise (embedding and head replicated);
- any chain of ``nn.Linear`` layers (with element-wise ops between them): consecutive pairs become
  (colwise, rowwise); an unpaired last Linear stays replicated.

A user may pass their own ``{module path: ParallelStyle}`` plan instead.
Every split is checked before any process group exists (case C7), naming the module, the dimension
and the degree.
"""

from __future__ import annotations

import torch.nn as nn

COLWISE, ROWWISE = "colwise", "rowwise"


def derive_tp_plan(model: nn.Module) -> dict[str, str]:
    """``{module path: "colwise" | "rowwise"}`` for the GPT or a chain of Linears.

    Raises:
        ValueError: the model has fewer than two Linear layers to pair.
    """
    from modelpar.models.gpt import GPT

    if isinstance(model, GPT):
        plan = {}
        for i in range(len(model.blocks)):
            p = f"blocks.{i}."
            plan.update({p + "attn.q": COLWISE, p + "attn.k": COLWISE, p + "attn.v": COLWISE,
                         p + "attn.o": ROWWISE, p + "mlp.up": COLWISE, p + "mlp.down": ROWWISE})
        return plan
    linears = [n for n, m in model.named_modules() if isinstance(m, nn.Linear)]
    if len(linears) < 2:
        raise ValueError(f"tensor parallel needs at least two nn.Linear layers to pair (colwise, rowwise); "
                         f"{type(model).__name__} has {len(linears)}. Pass your own TP plan instead.")
    plan = {}
    for a, b in zip(linears[0::2], linears[1::2]):
        plan[a], plan[b] = COLWISE, ROWWISE
    return plan


def validate_tp_plan(model: nn.Module, tp_plan: dict[str, str], tp_degree: int) -> None:
    """Check every split divides evenly (case C7), and the GPT's heads.

    Raises:
        ValueError: naming the module, the dimension and the degree.
    """
    if tp_degree == 1:
        return
    from modelpar.models.gpt import GPT

    if isinstance(model, GPT) and model.cfg.n_head % tp_degree:
        raise ValueError(f"tensor parallel degree {tp_degree} does not divide the number of attention "
                         f"heads n_head={model.cfg.n_head}")
    modules = dict(model.named_modules())
    for path, style in tp_plan.items():
        m = modules.get(path)
        if m is None:
            raise ValueError(f"TP plan names {path!r}, which is not a module of {type(model).__name__}")
        if not isinstance(m, nn.Linear):
            raise ValueError(f"TP plan entry {path!r} is {type(m).__name__}; only nn.Linear can be split")
        if style == COLWISE:
            dim_name, dim = "out_features", m.out_features
        elif style == ROWWISE:
            dim_name, dim = "in_features", m.in_features
        else:
            raise ValueError(f"TP plan entry {path!r} has style {style!r}; valid: colwise, rowwise")
        if dim % tp_degree:
            raise ValueError(f"tensor parallel degree {tp_degree} does not divide {path}.{dim_name}={dim} "
                             f"({style} split of Linear({m.in_features}, {m.out_features}))")


def apply_tp(model: nn.Module, tp_mesh, tp_plan: dict[str, str], *, present: set[str] | None = None) -> int:
    """Shard the Linears of ``tp_plan`` over ``tp_mesh`` in place; returns how many were split.

    ``present`` restricts to module paths that exist on this rank (pipeline stages hold only some).
    """
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

    styles = {COLWISE: ColwiseParallel, ROWWISE: RowwiseParallel}
    plan = {p: styles[s]() for p, s in tp_plan.items() if present is None or p in present}
    if plan:
        parallelize_module(model, tp_mesh, plan)
    return len(plan)
