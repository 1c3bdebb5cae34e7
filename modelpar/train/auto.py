"""``--strategy auto`` and ``--strategy rules``: the planner chooses the degrees for a TrainConfig."""

from __future__ import annotations

import dataclasses
import os
from dataclasses import dataclass
from pathlib import Path

import torch

from modelpar.calibrate import AUTO_CALIBRATE_ENV, default_calibration_path  # noqa: F401  (re-exported)
from modelpar.plan import ParallelPlan


def calibration_path() -> Path:
    """``$MODELPAR_CALIBRATION``, else ``~/.cache/modelpar/calibration.json``."""
    return default_calibration_path()


def ensure_calibration(local_ranks: int) -> Path | None:
    """The machine's calibration file, measured now (`modelpar.calibrate.calibrate`, ~40 s, once per
    machine: the file is kept) if there is none and ``$MODELPAR_AUTO_CALIBRATE`` is not ``0``; None
    when it stays uncalibrated."""
    from modelpar.calibrate import machine_hardware
    machine_hardware(local_ranks, measure_if_missing=True)
    path = calibration_path()
    return path if path.is_file() else None


@dataclass(frozen=True)
class Choice:
    plan: ParallelPlan
    local_batch_size: int        # 0: global / dp
    reason: str
    predicted_tokens_per_s: float = 0.0     # the planner's prediction (auto, language models; else 0)


def hardware_for(cfg, world_size: int, *, measure_if_missing: bool = True):
    """The device profile named by ``cfg.hardware``, else this machine's (`machine_hardware`; the only
    caller that measures an uncalibrated machine on the fly, see TrainConfig.hardware)."""
    from modelpar.calibrate import machine_hardware
    from modelpar.planner import get_hardware

    local = min(world_size, int(os.environ.get("LOCAL_WORLD_SIZE", world_size)))
    if cfg.hardware:
        return get_hardware(cfg.hardware, local_ranks=local)
    if measure_if_missing:
        remeasure_stale_calibration(local)
    return machine_hardware(local, measure_if_missing=measure_if_missing)[0]


def calibration_schema(path: Path) -> int:
    """The ``schema_version`` of the calibration file at ``path`` (1: a file from before the schema
    field; 0: unreadable)."""
    import json

    try:
        v = json.loads(path.read_text()).get("schema_version", 1)
    except (OSError, ValueError, AttributeError):
        return 0
    return v if isinstance(v, int) else 0


def remeasure_stale_calibration(local_ranks: int, say=print) -> bool:
    """Measure this machine again (`modelpar.calibrate.calibrate`, ~2 min, the file replaced) when its
    calibration file was written by an older modelpar (``schema_version`` below
    `modelpar.planner.calibration.SCHEMA_VERSION`) and ``$MODELPAR_AUTO_CALIBRATE`` is not ``0``; CPU
    only (`train --strategy auto`, like a missing file). Returns whether it measured.

    Why: an old file lacks the later tables (schema 3: per-shape matmul and attention rates), so the
    planner prices every product on the square-matrix curve; on the 2-core host of the main job a
    schema-2 file predicted 15,762 tokens/s for the plan that ran 10,029 (calibrations of the current
    schema on the same host: 11,107 and 13,105)."""
    from modelpar.calibrate import calibrate
    from modelpar.planner.calibration import SCHEMA_VERSION

    path = calibration_path()
    if torch.cuda.is_available() or not path.is_file() or os.environ.get(AUTO_CALIBRATE_ENV, "1") == "0":
        return False
    version = calibration_schema(path)
    if version >= SCHEMA_VERSION:
        return False
    say(f"modelpar: this machine's calibration {path} is from an older modelpar (schema {version}, now "
        f"{SCHEMA_VERSION}); measuring it again with {max(1, local_ranks)} local rank(s) (set "
        f"{AUTO_CALIBRATE_ENV}=0 to keep it)")
    calibrate(path, max(1, local_ranks), say=say)
    return True


# the `ParallelPlan` fields the choice takes from the config (search settings, or kept as set); any
# other field the config sets goes on top of the chosen plan (`modelpar.train.resolve`)
FROM_CONFIG = ("precision", "activation_checkpointing", "ac_every", "cpu_offload", "compile")


def choose(cfg, world_size: int, *, strategy: str = "auto", measure_if_missing: bool = True) -> Choice:
    """The planner's (``auto``) or the rules baseline's (``rules``) plan for ``cfg`` on ``world_size``
    ranks; called once, by the launcher (`modelpar.train.resolve.resolve`). ``measure_if_missing``:
    calibrate an uncalibrated machine first (``train`` only)."""
    return _choose(cfg, world_size, strategy=strategy, measure_if_missing=measure_if_missing)


def _choose(cfg, world_size: int, *, strategy: str = "auto", measure_if_missing: bool = True) -> Choice:
    """Profile the config's model (on the meta device; a factory model on CPU under FakeTensorMode,
    `models.factory_check.factory_profile`) and let the planner (``auto``) or the rule-of-thumb
    baseline (``rules``) pick the plan for ``world_size`` ranks (under ``meta_init``: layouts that
    shard the parameters only).

    The user's explicit choices (precision, activation checkpointing when not "none") are kept.

    Raises:
        ValueError: no plan fits (the planner's pruning reasons are in the message).
    """
    from modelpar.planner import choose_plan, profile_model, rule_plan
    from modelpar.train.task import build_task, example_input

    from modelpar.models import PRESETS
    from modelpar.planner import profile_blocks

    # a built-in GPT deeper than `PROFILE_LAYERS` is profiled at that depth and its steady layer repeated,
    # as `plan` profiles it (`profile_blocks.deepen_profile`: the same profile, ~20x faster for gpt-70b)
    layers = (int((cfg.model_config or {}).get("n_layer", PRESETS[cfg.model].n_layer))
              if cfg.model in PRESETS and not cfg.blocks else 0)
    short = layers > profile_blocks.PROFILE_LAYERS
    task = build_task(dataclasses.replace(cfg, model_config={**(cfg.model_config or {}),
                                                             "n_layer": profile_blocks.PROFILE_LAYERS})
                      if short else cfg, device="meta", load_data=False)
    lay = cfg.layout                           # what the user set (None: unset)
    precision = lay.precision or "fp32"
    dtype = torch.bfloat16 if precision == "bf16" else torch.float32
    from modelpar.models.spec import model_kind

    try:
        if model_kind(cfg.model) == "factory":
            # as `plan` profiles it (one function): its own weights on CPU under FakeTensorMode, its forward
            # checked, the pipeline cut made on its weights. Not on meta: a wrapped Hugging Face model's
            # forward reads values (its causal mask looks for packed sequences with .item()), which meta tensors lack
            from modelpar.models.factory_check import factory_profile

            prof = factory_profile(cfg.model, cfg.seq_len, dtype, cfg.blocks or "")[0]
        else:
            prof = profile_model(task.model, example_input(task, 1).to("meta"), dtype=dtype,
                                 autocast=dtype == torch.bfloat16)
    except Exception as e:      # noqa: BLE001 - a model the planner cannot profile: one message, a way out
        kind = model_kind(cfg.model)
        if kind == "builtin" or (kind == "factory" and isinstance(e, ValueError)):     # already one line
            raise
        raise ValueError(f"--strategy {strategy} needs the planner's profile of --model {cfg.model}, which failed "
                         f"({type(e).__name__}: {str(e)[:200]}); name a strategy instead (--strategy ddp, fsdp, "
                         f"...)") from e
    if short:
        prof = profile_blocks.deepen_profile(prof, layers)
    if model_kind(cfg.model) == "hf":       # no TP plan train would run: no tp layout (a factory's: factory_profile)
        from modelpar.parallel.tp_factory import with_tp_refusal

        prof = with_tp_refusal(prof, task.model, example_input(task, 1))
        from modelpar.parallel.cut import with_pipeline_refusal     # no pipeline train would refuse (Swin)

        prof = with_pipeline_refusal(prof, task.model, example_input(task, 1).to("meta"), cfg.blocks or "")
    hw = hardware_for(cfg, world_size, measure_if_missing=measure_if_missing)
    if strategy == "rules":
        from modelpar.train.resolve import given_fields, with_checkpointing_given

        plan, why = rule_plan(prof, world_size, hw, global_batch_size=cfg.global_batch_size,
                              task="language" if task.kind == "lm" else "image", precision=precision,
                              allow_ddp=not cfg.meta_init)
        plan = with_checkpointing_given(plan, given_fields(cfg))     # rules choose no checkpointing
        local, predicted = 0, 0.0
        reason = f"rules: {why}"
    else:
        from modelpar.train.resolve import given_fields, search_settings

        # the search settings `plan` / `estimate` take from the same flags (one function)
        plan, rep = choose_plan(prof, world_size, hw, global_batch_size=cfg.global_batch_size,
                                precision=precision, optimizer=cfg.optimizer, allow_ddp=not cfg.meta_init,
                                **search_settings(given_fields(cfg)))
        local = rep.ranked[0].batch.local_batch_size
        predicted = rep.ranked[0].step.samples_per_s * task.tokens_per_sample if task.kind == "lm" else 0.0
        reason = f"auto: the fastest feasible plan on {hw.name} ({rep.summary()})"
        if not cfg.hardware and not torch.cuda.is_available() and not calibration_path().is_file():
            reason += (f"; the CPU profile is uncalibrated: run `modelpar calibrate --out {calibration_path()}` "
                       f"once on this machine for measured matmul and collective speeds")
    d = plan.to_dict()
    d.update(precision=precision, cpu_offload=bool(lay.cpu_offload) and d.get("dp_shard", 1) > 1,
             compile=bool(lay.compile))
    return Choice(ParallelPlan.from_dict(d), local, reason, predicted)
