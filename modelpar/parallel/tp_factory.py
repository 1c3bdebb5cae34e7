"""TP plans of models that are neither the built-in GPT nor an `modelpar.models.hf.HFModel` (factory models).

- **A transformers model inside** (the model itself, or a submodule such as ``.hf`` of a user's wrapper
  whose forward returns its logits): the plan of ``--model hf:NAME`` (`modelpar.parallel.hf_tp`: the
  declared ``_tp_plan`` translated, or the derived one; sequence parallel for the same families), its
  paths prefixed with the submodule's path (`hf_view`, `to_model_paths`).
- **Otherwise, a chain of nn.Linear layers**: consecutive Linears in module order become (colwise,
  rowwise) pairs. That guess is right only when each colwise Linear's output reaches its rowwise partner
  through element-wise ops alone (constants such as dropout's mask allowed) and nothing else reads it
  (an MLP's up -> activation -> down); an
  attention's q, k, v, o or a Linear whose output is added to a residual would crash inside the ranks
  (DTensor's "Sharding propagation failed") or compute something else. `check_pairs` checks the widths
  of each pair, and `dataflow_refusal` traces one forward (fake tensors: no memory, no FLOPs) and
  refuses a pairing whose data flow is not that, before any process starts.
"""

from __future__ import annotations

import sys

import torch
import torch.nn as nn

HINT = ("pass your own TP plan (parallelize(..., tp_plan={module path: style}) from Python), use "
        "--model hf:NAME for a transformers model, or another strategy (ddp, fsdp, pp)")
# autograd nodes of element-wise ops (the name without its trailing overload number): a colwise Linear's
# output sharded on its last dim stays so through them
_ELEMENTWISE = {"Relu", "Gelu", "Silu", "Sigmoid", "Tanh", "Mul", "Div", "Add", "Sub", "Neg", "Exp", "Pow",
                "NativeDropout", "Clone", "Elu", "LeakyRelu", "Hardtanh", "Hardswish", "Hardsigmoid", "Softplus",
                "Mish", "Threshold", "ToCopy", "Abs", "Sqrt", "Rsqrt", "Square", "Erf", "Log", "Log1p", "Sin",
                "Cos", "Clamp", "ClampMin", "ClampMax"}


def find_hf_inner(model: nn.Module) -> tuple[str, nn.Module] | None:
    """``(path, module)`` of the outermost transformers ``PreTrainedModel`` in ``model`` (path "" for the
    model itself), None when there is none (or transformers was never imported, so none can be)."""
    tf = sys.modules.get("transformers")
    base = getattr(tf, "PreTrainedModel", None) if tf is not None else None
    if base is None:
        return None
    return next(((n, m) for n, m in model.named_modules() if isinstance(m, base)), None)


def hf_view(model: nn.Module) -> tuple[nn.Module, str] | None:
    """``(HFModel view, path)`` of the transformers model inside a factory model (`find_hf_inner`): an
    `modelpar.models.hf.HFModel` around the same submodule (no copy), whose plan paths ``hf.X`` are
    ``path.X`` of ``model`` (`to_model_paths`). None when there is none, or its family is neither a
    causal LM nor an image classifier."""
    from modelpar.models.hf import HFModel, task_of

    found = find_hf_inner(model)
    if found is None or isinstance(model, HFModel):
        return None
    path, inner = found
    try:
        task = task_of(inner.config)
    except ValueError:
        return None
    return HFModel(inner, task), path


def _swap(p: str, old: str, new: str) -> str:
    if p == old:
        return new
    head = old + "." if old else ""
    return (new + "." if new else "") + p[len(head):]


def to_model_paths(plan: dict[str, str], path: str) -> dict[str, str]:
    """An `HFModel` view's plan with ``hf.`` replaced by the submodule's ``path`` in the model."""
    return {_swap(p, "hf", path): s for p, s in plan.items()}


def to_view_paths(plan: dict[str, str], path: str) -> dict[str, str]:
    """The entries of a model's plan under ``path``, with the view's ``hf.`` prefix instead."""
    head = path + "." if path else ""
    return {_swap(p, path, "hf"): s for p, s in plan.items() if p == path or p.startswith(head) or not path}


def check_pairs(model: nn.Module, plan: dict[str, str]) -> None:
    """The widths of a derived Linear-chain plan's (colwise, rowwise) pairs: each colwise Linear's
    ``out_features`` must be its rowwise partner's ``in_features``.

    Raises:
        ValueError: naming the pair, their widths and what to do instead.
    """
    from modelpar.parallel.tensor import COLWISE, ROWWISE

    mods = dict(model.named_modules())
    order = [p for p in plan if plan[p] in (COLWISE, ROWWISE)]
    for a, b in zip(order[0::2], order[1::2]):
        if mods[a].out_features != mods[b].in_features:
            raise ValueError(f"tensor parallel: {type(model).__name__} has no TP plan modelpar knows; pairing its "
                             f"nn.Linear layers in module order gives {a!r} (out_features={mods[a].out_features}) "
                             f"colwise and {b!r} (in_features={mods[b].in_features}) rowwise, which do not chain; "
                             f"{HINT}")


def dataflow_refusal(model: nn.Module, plan: dict[str, str], example_input: torch.Tensor) -> str:
    """Why a derived Linear-chain plan (`check_pairs` passed) would not compute the model's forward
    (one forward on fake tensors, autograd's graph read), or "" when every colwise Linear's output
    reaches its rowwise partner through element-wise ops only and nothing else reads it."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    from modelpar.parallel.tensor import COLWISE, ROWWISE

    order = [p for p in plan if plan[p] in (COLWISE, ROWWISE)]
    pairs = list(zip(order[0::2], order[1::2]))
    seen: dict[str, list] = {p: [] for p in order}
    hooks = [model.get_submodule(p).register_forward_hook(
        lambda _m, args, out, p=p: seen[p].append((args[0] if args else None, out))) for p in order]
    dev = next((p.device for p in model.parameters()), example_input.device)
    try:
        with torch.enable_grad():
            if dev.type == "meta":  # meta parameters: autograd's graph without fake tensors
                y = model(example_input.to(dev))
            else:
                with FakeTensorMode(allow_non_fake_inputs=True) as mode:
                    y = model(mode.from_tensor(example_input.to(dev)))
    except Exception as e:      # noqa: BLE001 -- a forward fake tensors cannot run: not provable
        return (f"tensor parallel: {type(model).__name__}'s forward could not be traced to check the TP plan "
                f"guessed from its nn.Linear layers ({type(e).__name__}: {e}); {HINT}")
    finally:
        for h in hooks:
            h.remove()
    root = getattr(y, "grad_fn", None)
    consumers: dict = {}
    stack, done = [root], set()
    while stack:
        n = stack.pop()
        if n is None or n in done:
            continue
        done.add(n)
        for nxt, _ in n.next_functions:
            if nxt is not None:
                consumers.setdefault(nxt, set()).add(n)
                stack.append(nxt)
    for a, b in pairs:
        why = _pair_refusal(seen[a], seen[b], consumers, root)
        if why:
            return (f"tensor parallel: {type(model).__name__} has no TP plan modelpar knows, and pairing its "
                    f"nn.Linear layers in module order ({a!r} colwise, {b!r} rowwise) is not how its forward "
                    f"uses them: {why}; {HINT}")
    return ""


def _name(node) -> str:
    return type(node).__name__.removesuffix("Backward0").removesuffix("Backward1").removesuffix("Backward")


def _pair_refusal(calls_a: list, calls_b: list, consumers: dict, root) -> str:
    if not calls_a or len(calls_a) != len(calls_b):
        return f"they run {len(calls_a)} and {len(calls_b)} time(s) in one forward"
    for (_, out_a), (in_b, _) in zip(calls_a, calls_b):
        start, end = getattr(in_b, "grad_fn", None), getattr(out_a, "grad_fn", None)
        if start is None or end is None:
            return "the rowwise Linear's input is not computed from the colwise Linear's output"
        path, stack = set(), [start]
        while stack:            # from the rowwise input back to the colwise output: element-wise ops only
            n = stack.pop()
            if n is end or n in path:
                continue
            if _name(n) not in _ELEMENTWISE:
                return (f"the rowwise Linear's input comes through {_name(n)}, not only element-wise ops on "
                        f"the colwise Linear's output")
            path.add(n)         # operands without a graph (dropout's mask, a scalar) are constants
            stack.extend(nxt for nxt, _ in n.next_functions if nxt is not None)
        if end is root or any(n is root for n in path):
            return "the colwise Linear's output is the model's output"
        inside = path | {end}
        for n in inside:
            extra = consumers.get(n, set()) - path
            if n is not start and extra:
                return (f"the colwise Linear's output is also read by {_name(next(iter(extra)))}, "
                        f"outside the pair")
        if start is not end and len(consumers.get(start, set())) > 1:
            return "the rowwise Linear's input is also read elsewhere"
    return ""


def guessed(model: nn.Module) -> bool:
    """True when ``model``'s derived TP plan is the Linear-chain guess (neither the built-in GPT, nor an
    `HFModel`, nor a model holding a transformers model: `hf_view`)."""
    from modelpar.models.gpt import GPT
    from modelpar.models.hf import HFModel

    return not isinstance(model, (GPT, HFModel)) and hf_view(model) is None


def check_guess(model: nn.Module, plan: dict[str, str], example_input: torch.Tensor) -> None:
    """Refuse a derived Linear-chain plan whose data flow is not (colwise -> element-wise -> rowwise)
    (`dataflow_refusal`); nothing for other models. ``example_input``: one batch of the model's input
    (moved to the meta device when the model is on it).

    Raises:
        ValueError: one line naming the pair, what its forward does instead and what to do.
    """
    if not guessed(model) or not plan:
        return
    why = dataflow_refusal(model, plan, example_input)
    if why:
        raise ValueError(why)


def tp_refusal(model: nn.Module, example_input: torch.Tensor) -> str:
    """Why ``train`` would refuse ``model`` under tensor parallel whatever the degree (its TP plan cannot
    be derived, or the derived guess is not its forward's data flow), or "": the planner's
    ``ModelProfile.tp_refusal`` (it then ranks no layout with tp > 1)."""
    from modelpar.parallel.tensor import default_tp_plan

    try:
        plan, _ = default_tp_plan(model)
        check_guess(model, plan, example_input)
    except ValueError as e:
        return str(e)
    return ""


def with_tp_refusal(profile, model: nn.Module, example_input: torch.Tensor):
    """``profile`` (`planner.profile.ModelProfile`) with its ``tp_refusal`` set (`tp_refusal`)."""
    import dataclasses

    why = tp_refusal(model, example_input)
    return dataclasses.replace(profile, tp_refusal=why) if why else profile
