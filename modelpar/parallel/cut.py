"""Where a pipeline cuts a model, checked before anything runs: `cut_pipeline` (the stage ranges a plan
gives and the boundary checks every rank makes in `compose.parallelize`, which the launcher's preflight
repeats on a factory model's own weights) and `pipeline_cut_refusal` (whether any cut keeps the model's
forward: the planner then prices no pipeline for one that does not, `ModelProfile.pipeline_refusal`)."""

from __future__ import annotations

import torch
import torch.nn as nn

from modelpar.parallel import pipeline
from modelpar.parallel.parts import ModelParts, check_parts_order, get_model_parts
from modelpar.plan import ParallelPlan


def cut_pipeline(model: nn.Module, parts: ModelParts, plan: ParallelPlan, example_input: torch.Tensor | None,
                 split_points=None, block_costs=None) -> tuple[list[tuple[int, int]], list | None]:
    """Where ``plan``'s pipeline cuts ``parts`` and what crosses each boundary: ``(ranges, specs)``,
    ``ranges`` the [start, end) blocks of each stage (``plan.stage_boundaries``, ``split_points``, the
    costs ``block_costs`` or, by default, the planner's split), ``specs`` `pipeline.check_stage_boundaries`'
    (None without an example). With an example micro-batch it first checks that the parts in order
    reproduce the model (`check_parts_order`) and that the chained stages do (`pipeline.check_stage_boundaries`):
    on real weights these compare values, on a meta-built model shapes only. `parallelize` runs it on
    every rank; `modelpar.train.loop.preflight` runs it on a factory model's real weights before launch.

    Raises:
        ValueError: a model cut inside its own forward without an example; parts or stages that do not
            reproduce the model (cases C5, C6 and glue a cut cannot keep); bad boundaries or split points.
    """
    specs = None
    check_own_parameters(model, parts)
    if example_input is None and parts.form == "forward":   # (a meta-built model is cut on a meta example)
        raise ValueError(f"pipelines of {type(model).__name__} need an example micro-batch "
                         f"(parallelize(..., example_input=...)) to find where its forward can be cut")
    if example_input is not None:
        check_parts_order(model, parts, example_input)
    bounds = plan.stage_boundaries
    if split_points:
        from modelpar.parallel.stages import boundaries_from_split_points
        bounds = boundaries_from_split_points(parts, split_points, plan.num_stages)
    if bounds is None and block_costs is None and (example_input is not None or pipeline.is_transformer(model, parts)):
        ranges = pipeline.planned_ranges(model, parts, plan.num_stages, example_input)   # the planner's split
    else:
        costs = pipeline.stage_costs(parts, block_costs, example_input) if bounds is None else None
        ranges = pipeline.split_stages(parts, plan.num_stages, bounds, block_costs=costs)
    if example_input is not None:
        specs = pipeline.check_stage_boundaries(parts, ranges, example_input)
    return ranges, specs


def check_own_parameters(model: nn.Module, parts: ModelParts) -> None:
    """Refuse a pipeline of a model that runs as its children in order (the sequential and ModuleList
    forms) but holds parameters itself, outside every child: its stages run the children, never the
    model's own forward, so those parameters would be neither used nor trained, and values cannot show
    it (`check_parts_order` compares outputs; a zero-initialised position table changes none).

    Raises:
        ValueError: naming the parameters."""
    if parts.form not in ("sequential", "modulelist"):
        return                                   # the forward form: `stages.trace_parts` refuses them itself
    own = [n for n, _ in model.named_parameters(recurse=False)]
    if own:
        raise ValueError(f"{type(model).__name__}: parameters {own[:4]} belong to the model itself, outside its "
                         f"children; pipeline stages run the children in order and would never use or train them. "
                         f"Move them into a child module (e.g. the input part) or train without a pipeline")


def pipeline_cut_refusal(model: nn.Module, example_input: torch.Tensor, blocks: str | None = None) -> str:
    """Why ``model`` cannot be cut into pipeline stages, or "" where it can: its parts found as
    `parallelize` finds them on ``example_input`` (real weights: values compare), then the finest cut
    (every block a stage) checked as `cut_pipeline` checks the plan's (`check_parts_order`,
    `pipeline.check_stage_boundaries`): a forward that computes around its blocks fails at some cut.
    The planner commands and ``--strategy auto`` price no pipeline for such a model (`ModelProfile.pipeline_refusal`),
    which ``train`` would refuse before launch. A model with fewer than two blocks gives "" (the search
    prunes more stages than layers itself)."""
    try:
        with torch.no_grad():
            parts = get_model_parts(model, None, blocks=blocks, example_input=example_input)
            if parts.num_blocks < 2:
                return ""
            check_own_parameters(model, parts)
            check_parts_order(model, parts, example_input)
            pipeline.check_stage_boundaries(parts, [(i, i + 1) for i in range(parts.num_blocks)], example_input)
    except (ValueError, RuntimeError, TypeError) as e:
        return str(e)
    return ""


def with_pipeline_refusal(profile, model: nn.Module, example_input: torch.Tensor, blocks: str = ""):
    """``profile`` (`planner.profile.ModelProfile`) with its ``pipeline_refusal`` set from cutting
    ``model``'s own weights (`pipeline_cut_refusal`): the search then prices no pipeline for a model
    whose forward computes around its blocks, as ``train`` would refuse one (``plan``, ``estimate`` and
    ``--strategy auto`` on factory models)."""
    import dataclasses

    dev = next((p.device for p in model.parameters()), example_input.device)
    why = pipeline_cut_refusal(model, example_input.to(dev), blocks or None)
    return dataclasses.replace(profile, pipeline_refusal=why) if why else profile


def check_split_points(split_points, plan: ParallelPlan) -> None:
    """``--split-points`` where it means something: it names the blocks that start a pipeline's stages
    (or a placement's segments), so a plan with neither takes none, and a plan whose stage boundaries are
    set already (``--stage-boundaries``, a plan file's) would get two answers to one question.

    Raises:
        ValueError: either case, naming the values."""
    if not split_points:
        return
    given = ",".join(split_points)
    if not (plan.pp_enabled or plan.is_placement):
        raise ValueError(f"--split-points {given} names the blocks that start pipeline stages; {plan.describe()} "
                         f"runs no pipeline: drop it, or add a pipeline (--pp N)")
    if plan.stage_boundaries:
        raise ValueError(f"--split-points {given} and stage_boundaries={list(plan.stage_boundaries)} (--stage-boundaries "
                         f"or the plan file's) both say where the stages start: give one")
