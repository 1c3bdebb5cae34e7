"""Tied parameters (case C13): one ``nn.Parameter`` reachable under several names, e.g. an output
layer that reuses the token embedding (``head.weight = embed.weight``, GPT-2's default).

Ties are found by identity (``named_parameters(remove_duplicate=False)``), for any model. Every
strategy keeps them tied:

- one rank holding every copy (DDP, FSDP with the copies in one FSDP unit, a V-shaped pipeline
  schedule whose rank 0 holds the first and the last stage): the copies are one tensor; autograd sums
  both uses into its gradient, and `ParallelModel.parameters` yields it once (the optimizer updates
  it once, the gradient norm counts it once);
- tensor parallel: the copies must get one sharding (a vocab-sharded head, colwise, and a
  vocab-sharded embedding, rowwise, are both split on dim 0 of the (vocab, d) weight);
  `parallelize_module` replaces each module's parameter by its own DTensor, so `retie` points every
  copy back at one of them;
- a pipeline whose copies live on different ranks (the first and the last stage of 1F1B): each rank
  holds one copy and computes only its own use's gradient, so after backward the copies' gradients
  are summed over the ranks that hold them (`TiedGradSync`, one all-reduce per tie over a process group
  of just those ranks, one group per data-parallel / TP coordinate; Megatron-LM's "embedding group",
  Shoeybi et al. 2019 / Narayanan et al. 2021). Both copies then take the same optimizer step from the
  same value and stay equal; the global gradient norm counts the tie on the lowest holding rank only.

Layouts that cannot keep a tie are refused by `check_ties` (one ValueError naming the parameters),
the same on every rank, before any process group work: copies in different FSDP / replicate units on
one rank (FSDP2 would manage them as two parameters), and copies given different TP shardings.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn as nn

from modelpar.parallel.parts import ModelParts
from modelpar.plan import runtime_layout


def find_ties(model: nn.Module) -> list[tuple[str, ...]]:
    """Groups of parameter names that are one tensor (by identity), in registration order; each group
    has two or more names, the first being the name ``named_parameters()`` keeps."""
    by_id: dict[int, list[str]] = {}
    for name, p in model.named_parameters(remove_duplicate=False):
        by_id.setdefault(id(p), []).append(name)
    return [tuple(names) for names in by_id.values() if len(names) > 1]


def describe(tie: tuple[str, ...]) -> str:
    return " = ".join(tie)


# ---- where each copy lives -------------------------------------------------------------------------
def _owner(parts: ModelParts, name: str) -> tuple[str, str]:
    """(part kind, path of the part) holding parameter ``name``: kind "pre" | "block" | "post" | "whole"."""
    for kind, group in (("pre", parts.pre), ("block", parts.blocks), ("post", parts.post)):
        for path, _ in group:
            if name.startswith(path + "."):
                return kind, path
    return "whole", ""


def stage_of(parts: ModelParts, ranges: list[tuple[int, int]], name: str) -> int:
    """Pipeline stage index holding parameter ``name`` (input part: 0, output part: the last)."""
    kind, path = _owner(parts, name)
    if kind == "pre":
        return 0
    if kind == "post":
        return len(ranges) - 1
    j = [p for p, _ in parts.blocks].index(path) if kind == "block" else 0
    return next(s for s, (a, b) in enumerate(ranges) if a <= j < b)


def _pp_rank_of_stage(stage: int, plan) -> int:
    from modelpar.parallel.pipeline import stage_indices

    return next(r for r in range(plan.pp)
                if stage in stage_indices(r, plan.pp, plan.virtual_stages, plan.pp_schedule))


def holders(tie: tuple[str, ...], parts: ModelParts, ranges, plan) -> dict[int, list[str]]:
    """pp rank -> the names of ``tie`` held there (one entry ``{0: all names}`` without a pipeline)."""
    if not plan.pp_enabled:
        return {0: list(tie)}
    out: dict[int, list[str]] = {}
    for n in tie:
        out.setdefault(_pp_rank_of_stage(stage_of(parts, ranges, n), plan), []).append(n)
    return out


# ---- refusals --------------------------------------------------------------------------------------
def _tp_placement(model: nn.Module, name: str, tp_plan: dict[str, str]) -> str:
    """How TP lays out parameter ``name`` under ``tp_plan`` (a short description)."""
    from modelpar.parallel import tensor

    path, leaf = name.rsplit(".", 1) if "." in name else ("", name)
    style = tp_plan.get(path)
    if style is None or style in tensor.INPUT_ONLY_STYLES:
        return "replicated"
    if style in tensor.COLWISE_STYLES:
        return "Shard(0)"
    if style in tensor.ROWWISE_STYLES:
        return "Shard(1)" if leaf == "weight" else "Replicate()"
    if style == tensor.ROWWISE_VOCAB:
        return "Shard(0)"
    return f"{style} (Replicate())"


def check_ties(model: nn.Module, plan, parts: ModelParts, *, tp_plan: dict[str, str] | None = None,
               ranges: list[tuple[int, int]] | None = None, ties: list[tuple[str, ...]] | None = None) -> None:
    """Refuse a layout that cannot keep every tie of ``model`` (see the module docstring).

    Args:
        parts: the model's parts (`get_model_parts`; form "whole" when it has no block structure).
        tp_plan: the TP plan in use (None without TP).
        ranges: the pipeline's block ranges; None before they are known (then only ties whose copies'
            stages do not depend on the balance, those of the input and output parts, are checked).

    Raises:
        ValueError: naming the tied parameters, the plan and what to do instead.
    """
    ties = find_ties(model) if ties is None else ties
    if not ties:
        return
    devs = tuple(getattr(plan, "placement_devices", ()) or ())
    if plan.is_placement and devs and devs[0] != devs[-1]:
        for tie in ties:
            kinds = {_owner(parts, n)[0] for n in tie}
            if {"pre", "post"} <= kinds:
                raise ValueError(
                    f"tied parameters {describe(tie)} would live on two devices: placement puts the input "
                    f"part on {devs[0]} and the output part on {devs[-1]}, and one tensor cannot be on both. "
                    f"Use a pipeline (pp) instead, which keeps a copy per stage and sums their gradients, "
                    f"or untie them")
    if plan.tp_enabled and tp_plan is not None:
        for tie in ties:
            lay = {n: _tp_placement(model, n, tp_plan) for n in tie}
            if len(set(lay.values())) > 1:
                raise ValueError(
                    f"tied parameters {describe(tie)} would be split differently by tensor parallel "
                    f"({', '.join(f'{n}: {v}' for n, v in lay.items())}); a tie needs one layout for every "
                    f"copy: shard their modules alike in the TP plan (e.g. an embedding rowwise over the "
                    f"vocabulary with a colwise head), or leave both replicated")
    if not runtime_layout(plan).fsdp2:
        return
    if plan.pp_enabled and ranges is None:
        known = [t for t in ties if all(_owner(parts, n)[0] in ("pre", "post") for n in t)]
        ranges = [(0, 1)] * plan.num_stages if known else None
        ties = known
    for tie in ties:
        if plan.pp_enabled:
            on_rank = holders(tie, parts, ranges, plan)
            where = {n: (stage_of(parts, ranges, n), _unit(parts, n)) for n in tie}
        else:
            on_rank, where = {0: list(tie)}, {n: (0, _unit(parts, n)) for n in tie}
        for rank, names in on_rank.items():
            units = {where[n] for n in names}
            if len(units) > 1:
                kind = "FSDP" if plan.fsdp_enabled else "replicate (DDP semantics over FSDP2)"
                ctx = (f"pipeline rank {rank} holds {len({u[0] for u in units})} stages with copies "
                       f"({plan.pp_schedule})" if plan.pp_enabled else "one rank holds them")
                raise ValueError(
                    f"tied parameters {describe(tie)} would be managed by {len(units)} separate {kind} units "
                    f"({', '.join(f'{n}: {_unit_name(where[n])}' for n in names)}; {ctx}), which shard them "
                    f"as separate parameters and break the tie. Use a layout that puts the copies in one "
                    f"unit on each rank: no data parallelism over stages holding both copies (e.g. a "
                    f"one-stage-per-rank schedule such as 1f1b instead of a V schedule), or untie them")


def _unit(parts: ModelParts, name: str) -> str:
    """The FSDP unit of a parameter: its block, or "" for the root (input / output parts)."""
    kind, path = _owner(parts, name)
    return path if kind == "block" else ""


def _unit_name(where: tuple[int, str]) -> str:
    stage, unit = where
    return f"stage {stage} {'block ' + unit if unit else 'root unit'}"


# ---- keeping copies one tensor on a rank -----------------------------------------------------------
def retie(modules: list[nn.Module], ties: list[tuple[str, ...]]) -> int:
    """Point every copy of each tie held by ``modules`` (this rank's whole model or stage modules,
    which keep the original paths) at one parameter: the first copy's. Returns how many copies were
    re-pointed. Needed after TP, which gives every module a new DTensor parameter. Only the modules
    ``named_modules`` reaches count: a pipeline stage's stub of a part another stage holds
    (`stages._Stub`) reads attributes through to the original module until released, and that
    module's parameter (the original, never laid out) is not this stage's copy."""
    n = 0
    held = [dict(mod.named_modules(remove_duplicate=False)) for mod in modules]
    for tie in ties:
        slots = []
        for mods in held:
            for name in tie:
                path, leaf = name.rsplit(".", 1) if "." in name else ("", name)
                owner = mods.get(path)
                if owner is not None and leaf in owner._parameters:
                    slots.append((owner, leaf))
        if len(slots) < 2:
            continue
        keep = slots[0][0]._parameters[slots[0][1]]
        for owner, leaf in slots[1:]:
            if owner._parameters[leaf] is not keep:
                owner._parameters[leaf] = keep
                n += 1
    return n


class TiedGradSync:
    """Sum the gradients of tied copies held on different pipeline ranks (module docstring).

    Built on every rank in the same order (process groups are created collectively). ``pairs``: this
    rank's (parameter, process group of its holders) per cross-rank tie; ``norm_skip``: ids of this
    rank's copies that the global gradient norm must not count (another holder counts them).
    """

    def __init__(self, pairs: list[tuple[nn.Parameter, object]], norm_skip: set[int], names: list[str]):
        self.pairs, self.norm_skip, self.names = pairs, norm_skip, names

    @torch.no_grad()
    def all_reduce(self) -> None:
        """Sum this rank's copies' gradients with the other holders' (an absent gradient counts as 0)."""
        for p, group in self.pairs:
            if p.grad is None:
                p.grad = torch.zeros_like(p)
            _grad_like_param(p)
            g = p.grad.to_local() if hasattr(p.grad, "to_local") else p.grad
            dist.all_reduce(g, op=dist.ReduceOp.SUM, group=group)


def build_tied_grad_sync(ties: list[tuple[str, ...]], parts: ModelParts, ranges, plan, mesh,
                         modules: list[nn.Module]) -> TiedGradSync | None:
    """The `TiedGradSync` of this rank (None when no tie spans pipeline ranks).

    The holders of a tie are the pp ranks whose stages hold a copy; for each coordinate of the other
    mesh axes (data parallel, TP) they form one new group of those ranks (``dist.new_group``, called
    for every coordinate by every rank, as it must be). A group of its own, not the ``pp`` group: on
    gloo an all-reduce on the group that carries the schedule's point-to-point traffic was seen to
    receive a pipeline activation instead ("Received data size doesn't match expected size", pp x
    tp). Under TP the copies are DTensors with the same sharding and the same TP coordinate, so their
    local shards are summed.
    """
    if not plan.pp_enabled or not ties:
        return None
    dm = mesh.mesh
    names = list(dm.mesh_dim_names)
    grid = dm.mesh.movedim(names.index("pp"), -1).reshape(-1, plan.pp).tolist()
    me = dist.get_rank()
    cache: dict[tuple[int, ...], object] = {}
    pairs, skip, shown = [], set(), []
    for tie in ties:
        held = holders(tie, parts, ranges, plan)
        if len(held) < 2:
            continue
        hs = tuple(sorted(held))
        if hs not in cache:
            mine = None
            for row in grid:
                ranks = [row[h] for h in hs]
                g = dist.new_group(ranks)
                if me in ranks:
                    mine = g
            cache[hs] = mine
        if mesh.pp_rank not in held:
            continue
        p = _find_param(modules, held[mesh.pp_rank][0])
        pairs.append((p, cache[hs]))
        if mesh.pp_rank != hs[0]:
            skip.add(id(p))
        shown.append(describe(tie))
    if not cache:
        return None
    return TiedGradSync(pairs, skip, shown)


def _find_param(modules: list[nn.Module], name: str) -> nn.Parameter:
    path, leaf = name.rsplit(".", 1) if "." in name else ("", name)
    for mod in modules:
        try:
            owner = mod.get_submodule(path)
        except AttributeError:
            continue
        if leaf in owner._parameters:
            return owner._parameters[leaf]
    raise KeyError(name)


def _grad_like_param(p: torch.Tensor) -> None:
    """Give a DTensor parameter's gradient the parameter's placements (no communication from
    Replicate to Shard). DTensor's embedding backward leaves a vocab-sharded embedding's gradient
    Replicate (the whole (vocab, d) on every TP rank) while the head's copy of a tie is Shard(0):
    the holders' local tensors must be the same shard before they are summed."""
    g = p.grad
    if hasattr(g, "placements") and hasattr(p, "placements") and tuple(g.placements) != tuple(p.placements):
        p.grad = g.redistribute(p.device_mesh, p.placements)
