"""Pieces the planner commands (plan, estimate) share: the model's profile and the device."""

from __future__ import annotations

from dataclasses import dataclass

import torch

GIB = 2 ** 30


@dataclass
class PlannerOptions:
    """What the planner assumes about the run.

    Args:
        precision: fp32 or bf16 (empty: fp32 on cpu, bf16 on GPUs).
        optimizer: adamw, sgd or sgd_momentum (optimizer state and step traffic).
        json: print the result as a plan file (JSON: ParallelPlan fields + batch terms) on stdout.
    """

    precision: str = ""
    optimizer: str = "adamw"
    json: bool = False


def profile_for(model: str, model_config: dict, seq_len: int, precision: str):
    """`profile_model` of ``--model`` (built-ins on the meta device; a factory's model on CPU with a
    one-sample input from its ``batch_fn`` or its first Linear). Returns ``(profile, description)``.

    Raises:
        ValueError: unknown model, ``hf:``, bad ``--model-config``, or a factory model whose input
            shape cannot be found.
    """
    from modelpar.models import MLP_PRESETS, PRESETS
    from modelpar.models.spec import build_builtin, build_factory, check_model, infer_classifier_shapes
    from modelpar.planner.profile import profile_model

    dtype = torch.bfloat16 if precision == "bf16" else torch.float32
    if check_model(model, model_config) == "factory":
        um = build_factory(model)
        if um.batch_fn is not None:
            x = um.batch_fn(0)[0][:1]
        else:
            shapes = infer_classifier_shapes(um.model)
            if shapes is None:
                raise ValueError(f"--model {model!r}: cannot tell its input shape (no nn.Linear); return a "
                                 f"'batch_fn' from the factory")
            x = torch.zeros(1, *shapes[0])
        return profile_model(um.model, x, dtype=dtype), f"{type(um.model).__name__} from {model}"
    kw = {"seq_len": seq_len} if (seq_len and model in PRESETS) else {}
    if model == "cnn":
        m = build_builtin(model)                     # tiny: profiled under FakeTensorMode
        x = torch.zeros(1, 1, 8, 8)
    else:
        m = build_builtin(model, model_config, device="meta", **kw)
        if model in MLP_PRESETS:
            x = torch.zeros(1, MLP_PRESETS[model][0], device="meta")
        else:
            x = torch.zeros(1, m.cfg.seq_len, dtype=torch.long, device="meta")
    return profile_model(m, x, dtype=dtype), model


def precision_for(requested: str, hw) -> str:
    if requested and requested not in ("fp32", "bf16"):
        raise ValueError(f"--precision {requested!r} is unknown; valid: fp32, bf16")
    return requested or ("fp32" if hw.name == "cpu" else "bf16")
