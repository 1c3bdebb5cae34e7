"""A factory model (``module:factory``, `modelpar.models.spec`) as every command sees it before launch:
its one-sample example input and its planner profile (`factory_profile`: the one function ``plan``,
``estimate`` and ``train --strategy auto`` profile it with)."""

from __future__ import annotations

import torch


def factory_lm_seq_len(model: str, extra: dict, seq_len: int) -> int:
    """Tokens per sample of a factory language model (``{"model", "task": "lm", "vocab_size",
    "max_positions"}``, `modelpar.models.spec`): ``seq_len``, or (0) its ``max_positions``, as train's.

    Raises:
        ValueError: neither given, or ``seq_len`` beyond ``max_positions`` (naming both).
    """
    maxpos = extra.get("max_positions")
    if seq_len < 0:
        raise ValueError(f"--seq-len must be >= 0, got {seq_len}")
    if seq_len and isinstance(maxpos, int) and seq_len > maxpos:
        raise ValueError(f"--seq-len {seq_len} exceeds the max_positions={maxpos} that --model {model!r} declares")
    seq = seq_len or (maxpos if isinstance(maxpos, int) else 0)
    if seq < 1:
        raise ValueError(f"--model {model!r}: a factory language model without 'max_positions' needs --seq-len")
    return seq


def factory_input(name: str, um, seq_len: int) -> torch.Tensor:
    """The one-sample input of a factory model (`spec.UserModel`): its ``batch_fn``'s first sample,
    zero token ids of a language model, or zeros of a classifier's input shape.

    Raises:
        ValueError: a classifier whose input shape is neither declared nor inferable.
    """
    from modelpar.models.spec import infer_classifier_shapes

    if um.batch_fn is not None:
        return um.batch_fn(0)[0][:1]
    if um.extra.get("task") == "lm":
        return torch.zeros(1, factory_lm_seq_len(name, um.extra, seq_len), dtype=torch.long)
    shape = um.extra.get("input_shape")
    shapes = infer_classifier_shapes(um.model, tuple(shape) if shape else None, um.extra.get("num_classes", 0))
    if shapes is None:
        raise ValueError(f"--model {name!r}: cannot tell its input shape (no nn.Linear); return "
                         f"{{'model': m, 'task': 'classify', 'input_shape': [...], 'num_classes': K}} "
                         f"or a 'batch_fn' from the factory")
    return torch.zeros(1, *shapes[0])


def factory_profile(name: str, seq_len: int, dtype: torch.dtype, blocks: str = ""):
    """``(profile, description)`` of a factory model: built on CPU (its own weights), checked
    profiled on its one-sample input (`planner.profile.profile_model`, under
    FakeTensorMode) with the pipeline cut made on its weights (`parallel.cut.with_pipeline_refusal`).
    ``plan``, ``estimate`` and ``train --strategy auto`` all profile a factory model here.

    Raises:
        ValueError: see `factory_input`.
    """
    from modelpar.models.spec import build_factory
    from modelpar.parallel.cut import with_pipeline_refusal
    from modelpar.planner.profile import default_blocks, profile_model

    um = build_factory(name)
    x = factory_input(name, um, seq_len)
    prof = profile_model(um.model, x, dtype=dtype, blocks=default_blocks(um.model, blocks or None),
                         autocast=dtype == torch.bfloat16)
    return with_pipeline_refusal(prof, um.model, x, blocks), f"{type(um.model).__name__} from {name}"
