"""Pieces the planner commands (plan, estimate) share: the model's profile and the device."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from modelpar.models.factory_check import factory_lm_seq_len  # noqa: F401  (re-exported)
from modelpar.planner.profile_blocks import PROFILE_LAYERS, deepen_profile

GIB = 2 ** 30


@dataclass
class PlannerOptions:
    """What the planner assumes about the run.

    Args:
        optimizer: adamw, sgd or sgd_momentum (SGD with momentum 0.9).
        json: print the result as a plan file (JSON: ParallelPlan fields + batch terms) on stdout.
    """

    optimizer: str = "adamw"
    json: bool = False


def profile_for(model: str, model_config: dict, seq_len: int, precision: str, blocks: str = ""):
    """`profile_model` of ``--model`` (built-ins and Hugging Face models on the meta device; a
    factory's model on CPU with a one-sample input from its ``batch_fn`` or its first Linear).
    Returns ``(profile, description)``. An HF language model is profiled at ``seq_len`` tokens
    (0: `modelpar.models.hf.default_seq_len`, as every command). ``blocks`` (``--blocks``): the path of
    the container of the repeated blocks (empty: `profile.default_blocks`' rule).

    Raises:
        ValueError: unknown model, bad ``--model-config``, an HF ``seq_len`` beyond the model's
            max_position_embeddings, ``blocks`` naming no container, or a factory model whose input
            shape cannot be found.
    """
    from modelpar.models import MLP_PRESETS, PRESETS
    from modelpar.models.spec import build_builtin, check_model
    from modelpar.planner.profile import default_blocks, profile_model

    dtype = torch.bfloat16 if precision == "bf16" else torch.float32
    kind = check_model(model, model_config)
    if kind == "hf":
        return _hf_profile(model, model_config, seq_len, dtype, blocks)
    if kind == "factory":       # built on CPU, its forward checked (one function: train --strategy auto's too)
        from modelpar.models.factory_check import factory_profile

        return factory_profile(model, seq_len, dtype, blocks)
    kw = {"seq_len": seq_len} if (seq_len and model in PRESETS) else {}
    layers = 0
    if model == "cnn":
        m = build_builtin(model)                     # tiny: profiled under FakeTensorMode
        x = torch.zeros(1, 1, 8, 8)
    else:
        if model in PRESETS and not blocks:
            # a GPT's layers are one class with one shape: profiled at `PROFILE_LAYERS` and deepened as
            # `_hf_profile` does (gpt-70b: 88 layers; tests/test_planner_hf.py checks the two equal)
            layers = int((model_config or {}).get("n_layer", PRESETS[model].n_layer))
            if layers > PROFILE_LAYERS:
                kw["n_layer"] = PROFILE_LAYERS
        m = build_builtin(model, model_config, device="meta", **kw)
        if model in MLP_PRESETS:
            x = torch.zeros(1, MLP_PRESETS[model][0], device="meta")
        else:
            x = torch.zeros(1, m.cfg.seq_len, dtype=torch.long, device="meta")
    prof = profile_model(m, x, dtype=dtype, blocks=default_blocks(m, blocks or None), autocast=dtype == torch.bfloat16)
    return (deepen_profile(prof, layers) if layers > PROFILE_LAYERS else prof), model


def params_phrase(prof) -> str:
    """``"2.3M params"`` of a `planner.profile.ModelProfile`, with the trainable ones where some are
    frozen (``"2.3M params, 0.082M trainable"``): the planner prices gradients and optimizer state of
    those only."""
    out = f"{prof.num_params / 1e6:,.1f}M params"
    if prof.trainable_params != prof.num_params:
        out += f", {prof.trainable_params / 1e6:,.3g}M trainable"
    return out


def hf_seq_len(name: str, cfg, seq_len: int) -> int:
    """The tokens per sample an HF language model runs at: ``seq_len``, or (0) its position limit
    capped at `modelpar.models.hf.DEFAULT_SEQ_LEN` (`default_seq_len`: the same in every command).

    Raises:
        ValueError: ``seq_len`` beyond the config's max_position_embeddings (naming both).
    """
    from modelpar.models.hf import default_seq_len, facts

    limit = facts(cfg).max_positions
    if seq_len < 0:
        raise ValueError(f"--seq-len must be >= 0, got {seq_len}")
    if seq_len and limit and seq_len > limit:
        raise ValueError(f"--seq-len {seq_len} is longer than {name}'s max_position_embeddings={limit} (the "
                         f"positions its embeddings / rotary setup are configured for); give --seq-len <= {limit}, "
                         f"or raise max_position_embeddings in --model-config")
    return seq_len or default_seq_len(limit)


# (`PROFILE_LAYERS`: a deeper GPT or uniform HF model is profiled at that depth, `deepen_profile`)
HF_PROFILE_LAYERS = PROFILE_LAYERS


def _hf_profile(model: str, model_config: dict, seq_len: int, dtype, blocks: str = ""):
    """(profile, description) of a Hugging Face model built from its config on the meta device.

    The layers of one family and config are one class with one shape, so a model deeper than
    `HF_PROFILE_LAYERS` is profiled with that many layers and its third layer's row stands for every
    layer between the second and the last (the first differs: it first saves the rotary tables the
    others share; the last feeds the head); a test checks this equals profiling every layer. Configs
    with per-layer settings (``layer_types`` that differ, e.g. sliding-window layers), and models
    whose blocks ``--blocks`` names, are profiled whole."""
    from modelpar.models.hf import build_hf, example_input, facts, load_config
    from modelpar.planner.profile import default_blocks, profile_model

    cfg = load_config(model, model_config)
    f = facts(cfg)
    seq = hf_seq_len(model, cfg, seq_len) if f.task == "lm" else 0
    layers = f.layers
    short = not blocks and layers > HF_PROFILE_LAYERS and _uniform_layers(cfg, layers)
    over = dict(model_config or {})
    if short:
        over["num_hidden_layers"] = HF_PROFILE_LAYERS
        if isinstance(getattr(cfg, "layer_types", None), (list, tuple)):
            over["layer_types"] = list(cfg.layer_types)[:HF_PROFILE_LAYERS]
    m = build_hf(model, over, device="meta", seed=None)
    if f.task == "lm":              # priced as train runs it: what the forward never reaches is frozen
        from modelpar.models.hf_unused import freeze_unreached

        freeze_unreached(m, model, over, seq)
    x = example_input(m, 1, seq, device="meta")
    try:
        prof = profile_model(m, x, dtype=dtype, blocks=default_blocks(m, blocks or None),
                             autocast=dtype == torch.bfloat16)
    except Exception as e:      # noqa: BLE001 - a config transformers builds but its forward refuses: one line
        if isinstance(e, ValueError):
            raise
        msg = " ".join(str(e).split())[:240]
        raise ValueError(f"--model {model}: profiling its forward on a batch of (1, {seq or 'image'}) on the meta "
                         f"device failed ({type(e).__name__}: {msg}); a config transformers builds can still be one "
                         f"its forward refuses (e.g. DeepSeek-V3's n_group must divide n_routed_experts): check "
                         f"--model-config") from e
    if short:
        prof = deepen_profile(prof, layers)
    from modelpar.parallel.tp_factory import with_tp_refusal

    prof = with_tp_refusal(prof, m, x)            # a family without a TP plan (ResNet): tp pruned
    from modelpar.parallel.cut import with_pipeline_refusal

    prof = with_pipeline_refusal(prof, m, x, blocks)  # a forward no stage runs (Swin): pp pruned, as train refuses it
    what = f"seq {seq}" if f.task == "lm" else f"image {f.image_size}"
    return prof, f"{model} ({type(m.hf).__name__}, {what})"


def _uniform_layers(cfg, layers: int) -> bool:
    """True when no config field is a per-layer list with differing entries."""
    for v in cfg.to_dict().values():
        if isinstance(v, (list, tuple)) and len(v) == layers and len({str(e) for e in v}) > 1:
            return False
    return True


def precision_for(requested: str | None, hw) -> str:
    """``--precision`` as given, or (unset) the planner commands' default: fp32 on a cpu profile, bf16
    on a GPU one.

    Raises:
        ValueError: a precision other than fp32 / bf16 (naming the flag and the value).
    """
    if requested and requested not in ("fp32", "bf16"):
        raise ValueError(f"--precision {requested!r} is unknown; valid: fp32, bf16")
    return requested or ("fp32" if hw.kind == "cpu" else "bf16")
