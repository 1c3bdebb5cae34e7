"""Resolve a `TrainConfig` to one `ParallelPlan` and local batch, once.

`resolve(cfg, world_size)` is called by the launcher (``modelpar train``) before any rank starts; the
result goes into the run folder as ``plan.json`` (`modelpar.plan_file`), which the ranks read and
validate instead of resolving again. Sources, exactly one of:

- ``plan`` (``--plan FILE``): a plan file; any other plan option that disagrees with it is an error;
- ``strategy`` ``auto`` / ``rules``: the planner / the rule-of-thumb baseline choose the degrees
  (explicit degrees are then an error: the planner would ignore them);
- ``strategy`` ``custom``: the degrees given (``dp_replicate``, ``dp_shard``, ``tp``, ``pp``) are the
  layout; they must multiply to the world size;
- any other shorthand (DESIGN.md): its degrees, with a degree the shorthand does not leave open being
  an error (``--strategy fsdp --tp 2``), never a silent override.

Every other `ParallelPlan` field comes from ``cfg.layout`` (`modelpar.train.config.PlanOptions`: each
plan field, None while unset; one command-line flag each), so every plan field is reachable.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch

from modelpar.plan import DEGREES, MULTI_STAGE_SCHEDULES, ParallelPlan, fsdp_keeps_gathered, plan_for_strategy

# degrees a shorthand leaves to the user (the inner axis of the two-axis shorthands, or its own axis)
_OPEN = {"ddp": ("dp_replicate",), "fsdp": ("dp_shard",), "tp": ("tp",), "pp": ("pp",),
         "hsdp": ("dp_replicate", "dp_shard"), "ddp+tp": ("dp_replicate", "tp"), "fsdp+tp": ("dp_shard", "tp"),
         "single": (), "placement": ()}


@dataclass(frozen=True)
class Resolved:
    """A resolved layout: the plan, the local batch (samples per forward/backward per data-parallel
    rank; 0: global / dp), who chose it and, under ``auto`` for a language model, the planner's
    predicted throughput of the whole job (tokens per second)."""

    plan: ParallelPlan
    local_batch_size: int = 0
    reason: str = ""
    predicted_tokens_per_s: float = 0.0     # ``auto``, language models: the planner's prediction; else 0


def _flag(name: str) -> str:
    return "--" + name.replace("_", "-")


def given_fields(cfg) -> dict:
    """Every `ParallelPlan` field ``cfg.layout`` sets (None: unset), tuples where the plan holds them."""
    out = {}
    for k, v in dataclasses.asdict(cfg.layout).items():
        if v is not None:
            out[k] = tuple(v) if isinstance(v, list) else v
    return out


def plan_fields(cfg) -> dict:
    """The non-degree `ParallelPlan` fields ``cfg`` sets."""
    return {k: v for k, v in given_fields(cfg).items() if k not in DEGREES}


def _given_degrees(cfg) -> dict:
    return {k: v for k, v in given_fields(cfg).items() if k in DEGREES}


def _check_choices(fields: dict) -> None:
    """The named plan fields given (--pp-schedule, --precision) are among their values.

    Raises:
        ValueError: an unknown value, naming the flag and the valid ones.
    """
    from modelpar.plan import PP_SCHEDULES

    for field, valid in (("pp_schedule", PP_SCHEDULES), ("precision", ("fp32", "bf16"))):
        v = fields.get(field)
        if v is not None and v not in valid:
            raise ValueError(f"--{field.replace('_', '-')} {v!r} is unknown; valid: {', '.join(valid)}")


def resolve(cfg, world_size: int, *, measure_if_missing: bool = False) -> Resolved:
    """The one plan ``cfg`` names on ``world_size`` ranks (see the module docstring).
    ``measure_if_missing``: ``auto`` / ``rules`` may calibrate an uncalibrated machine first (only
    ``modelpar train --strategy auto`` asks for it).

    Raises:
        ValueError: contradicting sources (naming both flags), unknown names, a strategy that cannot
            use ``world_size`` ranks, or no feasible plan (``auto``).
    """
    strategy = cfg.strategy.lower()
    degrees = _given_degrees(cfg)
    _check_choices(given_fields(cfg))
    if getattr(cfg, "plan", ""):
        return _from_plan_file(cfg, world_size)
    if strategy in ("auto", "rules"):
        if degrees:
            given = ", ".join(f"{_flag(k)} {v}" for k, v in degrees.items())
            raise ValueError(f"--strategy {strategy} chooses the degrees itself, but {given} was given: drop "
                             f"the degrees, or use --strategy custom to run exactly them")
        from modelpar.train.auto import choose

        from modelpar.train.auto import FROM_CONFIG

        c = choose(cfg, world_size, strategy=strategy, measure_if_missing=measure_if_missing)
        # the fields the choice did not take from the config (FROM_CONFIG) go on top of it as given
        extra = {k: v for k, v in plan_fields(cfg).items() if k not in FROM_CONFIG and getattr(c.plan, k) != v}
        plan = dataclasses.replace(c.plan, **extra) if extra else c.plan
        return Resolved(plan, c.local_batch_size, c.reason, c.predicted_tokens_per_s)
    fields = plan_fields(cfg)
    n_micro = fields.pop("n_microbatches", None)
    if strategy == "placement":
        devs = fields.pop("placement_devices", None) or (
            ("cuda:0", "cuda:1") if torch.cuda.device_count() >= 2 else ("cpu", "cpu"))
        plan = plan_for_strategy("placement", 1, placement_devices=tuple(devs), **fields)
    elif strategy == "custom":
        if not degrees:
            raise ValueError("--strategy custom runs the degrees you give: set at least one of --dp-replicate, "
                             "--dp-shard, --tp, --pp")
        plan = ParallelPlan(**degrees, **fields)
    else:
        _check_degrees_fit(strategy, world_size, degrees)
        plan = plan_for_strategy(strategy, world_size, **degrees, **fields)
    if plan.pp > 1:
        plan = dataclasses.replace(plan, n_microbatches=n_micro or 2 * plan.pp)
        if "virtual_stages" not in fields and plan.pp_schedule in MULTI_STAGE_SCHEDULES:
            plan = dataclasses.replace(plan, virtual_stages=2)      # unset: the least such a schedule runs
    else:
        _check_pipeline_fields(strategy, n_micro, fields.get("pp_schedule"))
    if "reshard_after_forward" in fields and plan.dp_shard == 1:
        flag = "--reshard-after-forward" if fields["reshard_after_forward"] else "--no-reshard-after-forward"
        raise ValueError(f"{flag} sets what FSDP does after a forward, but --strategy {strategy} shards no "
                         f"parameters (dp_shard=1): drop it, or shard (--dp-shard N)")
    if "reshard_after_forward" not in fields and fsdp_keeps_gathered(plan.pp, plan.dp_shard, plan.pp_schedule):
        plan = dataclasses.replace(plan, reshard_after_forward=False)   # unset: what the schedule needs
    return Resolved(plan, 0, f"strategy {strategy}")


def _check_pipeline_fields(strategy: str, n_micro, schedule) -> None:
    """Pipeline options given to a plan without a pipeline are refused, as ``--virtual-stages`` is,
    not ignored.

    Raises:
        ValueError: ``--n-microbatches`` or ``--pp-schedule`` given, naming the flag and the strategy.
    """
    if n_micro is not None:
        raise ValueError(f"--n-microbatches {n_micro} splits a pipeline's local batch, but --strategy {strategy} "
                         f"runs no pipeline (pp=1): drop it (gradient accumulation follows from "
                         f"--global-batch-size and --local-batch-size) or add a pipeline (--pp N)")
    if schedule is not None:
        raise ValueError(f"--pp-schedule {schedule} orders a pipeline's micro-batches, but --strategy {strategy} "
                         f"runs no pipeline (pp=1): drop it or add a pipeline (--pp N)")


def with_run_precision(cfg):
    """``cfg`` with an unset ``--precision`` set the way `plan` and `estimate` price it: bf16 where this
    process trains on a CUDA GPU that supports it, fp32 on the CPU (`modelpar.cli.common.precision_for`
    applies the same rule to a ``--hardware`` profile), so ``train`` and ``plan`` answer for the same
    job. A plan file (``--plan``) brings its own precision; ``verify`` keeps fp32 (parity is defined in
    fp32) and does not call this."""
    if cfg.layout.precision is not None or getattr(cfg, "plan", ""):
        return cfg
    bf16 = torch.cuda.is_available() and torch.cuda.is_bf16_supported()
    return dataclasses.replace(cfg, layout=dataclasses.replace(cfg.layout, precision="bf16" if bf16 else "fp32"))


def _check_degrees_fit(strategy: str, world_size: int, degrees: dict) -> None:
    """Degrees the shorthand fixes (to 1, or to the world size) may not be given otherwise."""
    if strategy not in _OPEN:
        return                                  # plan_for_strategy lists the valid names
    for k, v in degrees.items():
        if k not in _OPEN[strategy] and v != 1:
            raise ValueError(f"--strategy {strategy} on {world_size} ranks sets {k}=1, but {_flag(k)} {v} was "
                             f"given: name a shorthand with that axis (e.g. fsdp+tp, ddp+tp, hsdp) or use "
                             f"--strategy custom with every degree")


def _from_plan_file(cfg, world_size: int) -> Resolved:
    from modelpar.plan_file import read_plan_file

    pf = read_plan_file(cfg.plan)
    if cfg.strategy.lower() not in ("auto", "custom"):
        raise ValueError(f"give --plan or --strategy, not both (--plan {cfg.plan!r}, --strategy {cfg.strategy})")
    degrees = _given_degrees(cfg)
    if degrees:
        raise ValueError(f"--plan {cfg.plan!r} sets the degrees; drop "
                         f"{', '.join(f'{_flag(k)} {v}' for k, v in degrees.items())}")
    check_agrees_with_plan_file(pf, plan_fields(cfg), cfg.plan)
    if pf.global_batch_size is not None and pf.global_batch_size != cfg.global_batch_size:
        raise ValueError(f"--plan {cfg.plan!r} was made for global_batch_size={pf.global_batch_size}, but "
                         f"--global-batch-size is {cfg.global_batch_size}; pass --global-batch-size "
                         f"{pf.global_batch_size}")
    local = cfg.local_batch_size
    if pf.local_batch_size is not None:
        if local and local != pf.local_batch_size:
            raise ValueError(f"--local-batch-size {local} contradicts --plan {cfg.plan!r} "
                             f"(local_batch_size={pf.local_batch_size}); drop one")
        local = pf.local_batch_size
    return Resolved(pf.plan, local, f"plan file {cfg.plan}")


def check_agrees_with_plan_file(pf, fields: dict, where: str) -> None:
    """Plan options given beside ``--plan`` must agree with the file (`fields`: field -> value).

    Raises:
        ValueError: the first option that differs from the file's field, naming both.
    """
    for k, v in fields.items():
        v = tuple(v) if isinstance(v, list) else v
        if getattr(pf.plan, k) != v:
            raise ValueError(f"{_flag(k)} {v!r} contradicts --plan {where!r} ({k}={getattr(pf.plan, k)!r}); "
                             f"drop one")


def search_settings(fields: dict) -> dict:
    """The planner search's checkpointing arguments (`modelpar.planner.search.search_plans`'
    ``checkpointing`` / ``ac_every``) from the plan fields given (``fields``: field -> value), the
    same in ``train --strategy auto`` and in ``plan`` / ``estimate``: ``activation_checkpointing``
    unset, any mode; set, only that mode (``none`` too); ``ac_every`` set, only that k of every-k
    (unset: the search's, 2 and 4).

    Raises:
        ValueError: an unknown mode or a k below 1 (naming the flag and the value).
    """
    from modelpar.plan import AC_MODES

    kw: dict = {}
    mode, every = fields.get("activation_checkpointing"), fields.get("ac_every")
    if mode is not None:
        if mode not in AC_MODES:
            raise ValueError(f"--activation-checkpointing {mode!r} is unknown; valid: {', '.join(AC_MODES)}")
        kw["checkpointing"] = (mode,)
    if every is not None:
        if every < 1:
            raise ValueError(f"--ac-every must be >= 1, got {every}")
        kw["ac_every"] = (every,)
    return kw


def with_checkpointing_given(plan: ParallelPlan, fields: dict) -> ParallelPlan:
    """``plan`` with the ``activation_checkpointing`` / ``ac_every`` given in ``fields`` (field -> value):
    the rules baseline (``--strategy rules`` in train, verify and plan) chooses neither, so what the
    user set applies on top of it instead of being dropped; unchanged when neither is given.

    Raises:
        ValueError: an unknown mode or a k below 1 (`search_settings`' checks, naming the flag).
    """
    search_settings(fields)
    over = {k: fields[k] for k in ("activation_checkpointing", "ac_every") if k in fields}
    return dataclasses.replace(plan, **over) if over else plan

