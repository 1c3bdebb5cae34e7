"""``--strategy auto`` and ``--strategy rules``: the planner chooses the degrees for a TrainConfig."""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from pathlib import Path

import torch

from modelpar.plan import ParallelPlan

AUTO_CALIBRATE_ENV = "MODELPAR_AUTO_CALIBRATE"   # "0": never measure the machine on the fly


def calibration_path() -> Path:
    """``$MODELPAR_CALIBRATION``, else ``~/.cache/modelpar/calibration.json``."""
    from modelpar.planner.commands import default_calibration_path
    return Path(default_calibration_path())


def ensure_calibration(local_ranks: int) -> Path | None:
    """The machine's calibration file, measured now (`modelpar calibrate`, ~20 s, once per machine:
    the file is kept) if there is none and ``$MODELPAR_AUTO_CALIBRATE`` is not ``0``; None when it
    stays uncalibrated."""
    path = calibration_path()
    if path.is_file():
        return path
    if os.environ.get(AUTO_CALIBRATE_ENV, "1") == "0":
        return None
    from modelpar.planner.commands import calibrate_main
    print(f"modelpar: this machine has no calibration yet; measuring it once with {local_ranks} local "
          f"rank(s) (`modelpar calibrate --out {path}`; set {AUTO_CALIBRATE_ENV}=0 to skip)", flush=True)
    calibrate_main(["--out", str(path), "--ranks", str(max(1, local_ranks))])
    return path if path.is_file() else None


@dataclass(frozen=True)
class Choice:
    plan: ParallelPlan
    local_batch_size: int        # 0: global / dp
    reason: str


def hardware_for(cfg, world_size: int):
    """The device profile named by ``cfg.hardware``, else this machine's (see TrainConfig.hardware)."""
    from modelpar.planner import get_hardware

    local = min(world_size, int(os.environ.get("LOCAL_WORLD_SIZE", world_size)))
    if cfg.hardware:
        return get_hardware(cfg.hardware, local_ranks=local)
    if torch.cuda.is_available():
        from modelpar.planner.hardware import hardware_for_device
        return hardware_for_device(torch.cuda.get_device_name(0), torch.cuda.get_device_properties(0).total_memory)
    path = ensure_calibration(local)
    if path is not None:
        import dataclasses

        from modelpar.planner.hardware import total_ram_bytes
        hw = get_hardware(str(path), local_ranks=local)
        # the memory budget follows this launch's local ranks, whatever the calibration used
        return dataclasses.replace(hw, memory_bytes=total_ram_bytes() / max(1, local))
    return get_hardware("cpu", local_ranks=local)


PLAN_ENV = "MODELPAR_CHOSEN_PLAN"      # set by the launcher so every rank runs the plan it checked
_CACHE: dict[str, Choice] = {}


def choose_for_config(cfg, world_size: int, *, strategy: str = "auto") -> Choice:
    """Cached `_choose` (keyed by the config), or the launcher's choice passed in PLAN_ENV."""
    key = json.dumps([cfg.to_dict(), world_size, strategy], sort_keys=True, default=str)
    if key not in _CACHE:
        handed = os.environ.get(PLAN_ENV)
        if handed:
            d = json.loads(handed)
            if d["key"] == key:
                _CACHE[key] = Choice(ParallelPlan.from_dict(d["plan"]), d["local_batch_size"], d["reason"])
        if key not in _CACHE:
            _CACHE[key] = _choose(cfg, world_size, strategy=strategy)
    return _CACHE[key]


def export_choice(cfg, world_size: int, strategy: str) -> None:
    """Put the choice in the environment of the ranks about to be launched."""
    c = choose_for_config(cfg, world_size, strategy=strategy)
    key = json.dumps([cfg.to_dict(), world_size, strategy], sort_keys=True, default=str)
    os.environ[PLAN_ENV] = json.dumps({"key": key, "plan": c.plan.to_dict(), "local_batch_size": c.local_batch_size,
                                       "reason": c.reason})


def _choose(cfg, world_size: int, *, strategy: str = "auto") -> Choice:
    """Profile the config's model on the meta device and let the planner (``auto``) or the
    rule-of-thumb baseline (``rules``) pick the plan for ``world_size`` ranks.

    The user's explicit choices (precision, activation checkpointing when not "none") are kept.

    Raises:
        ValueError: no plan fits (the planner's pruning reasons are in the message).
    """
    from modelpar.planner import choose_plan, profile_model, rule_plan
    from modelpar.train.task import build_task, example_input

    task = build_task(cfg, device="meta", load_data=False)
    x = example_input(task, 1).to("meta")
    dtype = torch.bfloat16 if cfg.precision == "bf16" else torch.float32
    prof = profile_model(task.model, x, dtype=dtype)
    hw = hardware_for(cfg, world_size)
    if strategy == "rules":
        plan, why = rule_plan(prof, world_size, hw, global_batch_size=cfg.global_batch_size,
                              task="language" if task.kind == "lm" else "image", precision=cfg.precision)
        local = 0
        reason = f"rules: {why}"
    else:
        from modelpar.planner.search import AC_CHOICES, AC_EVERY_CHOICES
        ac = AC_CHOICES if cfg.activation_checkpointing == "none" else (cfg.activation_checkpointing,)
        every = (cfg.ac_every,) if cfg.activation_checkpointing == "every-k" else AC_EVERY_CHOICES
        plan, rep = choose_plan(prof, world_size, hw, global_batch_size=cfg.global_batch_size,
                                precision=cfg.precision, optimizer="adamw" if cfg.optimizer == "adamw" else "sgd",
                                checkpointing=ac, ac_every=every)
        local = rep.ranked[0].batch.local_batch_size
        reason = f"auto: best of {len(rep.ranked)} feasible plans on {hw.name} ({rep.summary()})"
        if not cfg.hardware and not torch.cuda.is_available() and not calibration_path().is_file():
            reason += (f"; the CPU profile is uncalibrated: run `modelpar calibrate --out {calibration_path()}` "
                       f"once on this machine for measured matmul and collective speeds")
    d = plan.to_dict()
    d.update(precision=cfg.precision, cpu_offload=cfg.cpu_offload and d.get("dp_shard", 1) > 1,
             compile=cfg.compile)
    return Choice(ParallelPlan.from_dict(d), local, reason)
