"""Pipeline parallel with `torch.distributed.pipelining`.

The model's blocks are cut into ``pp x virtual_stages`` contiguous stages. By default the split is
the planner's (`planned_ranges`: `modelpar.stage_split.split_blocks` on the model's profile, as
`modelpar.planner.loads.stage_ranges` splits it), so a pipeline holds the blocks the planner priced:
a transformer's layers evenly, any other model's blocks minimising the largest stage's FLOPs.
Boundaries, split points or an explicit cost kind (FLOPs counted on an example micro-batch, measured
time, parameter counts; `stage_costs`) override it; the input part goes with the first stage and the
output part with the last. Each stage module registers the original modules under their original paths, so stage
state dicts use the same names as the whole model. A model whose forward does its own glue (the
"forward" form of `modelpar.parallel.parts`, e.g. a Hugging Face model) gets stage modules that run
that forward around their blocks (`modelpar.parallel.stages`); its boundary check is the chained
stages against the whole forward. The local batch is split into ``n_microbatches``
micro-batches and run by one of torch's schedules (GPipe: Huang et al. 2019; 1F1B: Narayanan et al.
2019, PipeDream-Flush; interleaved 1F1B: Narayanan et al. 2021; zero bubble: Qi et al. 2024).

Stage boundaries (case C6): before the schedule is built, `check_stage_boundaries` runs the whole
model once on an example micro-batch (every rank holds it, so every rank reaches the same verdict)
and records what crosses each boundary. A tensor, or tuples / lists / dicts of tensors, are flattened
into a tuple of tensors (what `PipelineStage` sends) and rebuilt on the receiving stage; any other
leaf (an int, a string, ...) raises one ValueError naming the stage and the field, on every rank,
before training.

Loss scaling is done in the loss function, not by the schedule (``scale_grads=False``): each
micro-batch loss is divided by ``n_microbatches x accumulation steps`` for a mean loss, so gradients
summed over micro-batches and accumulated schedule steps equal one device's (case C4).
"""

from __future__ import annotations

import functools
from collections.abc import Callable

import torch
import torch.nn as nn
from torch.utils import _pytree as pytree

from modelpar.parallel.parts import (ModelParts, balanced_partition, block_costs, block_param_costs, eval_mode,
                                    stage_ranges)
from modelpar.plan import SPLIT_BACKWARD_SCHEDULES, weight_pass_groups

SCHEDULE_CLASSES = {
    "gpipe": "ScheduleGPipe",
    "1f1b": "Schedule1F1B",
    "interleaved1f1b": "ScheduleInterleaved1F1B",
    "loopedbfs": "ScheduleLoopedBFS",
    "interleavedzerobubble": "ScheduleInterleavedZeroBubble",
    "zbvzerobubble": "ScheduleZBVZeroBubble",
    "dualpipev": "ScheduleDualPipeV",
}


def get_schedule_class(name: str):
    """The torch schedule class for a modelpar schedule name.

    Raises:
        ValueError: unknown name (listing the valid ones), or a schedule the installed torch lacks.
    """
    import torch.distributed.pipelining.schedules as sched

    if name not in SCHEDULE_CLASSES:
        raise ValueError(f"unknown pipeline schedule {name!r}; valid: {', '.join(SCHEDULE_CLASSES)}")
    cls = getattr(sched, SCHEDULE_CLASSES[name], None)
    if cls is None:
        raise ValueError(f"pipeline schedule {name!r} needs a newer torch than {torch.__version__}")
    return cls


class StageModule(nn.Module):
    """One pipeline stage: (input part) -> blocks[a:b] -> (output part), original paths kept.

    ``in_spec`` / ``out_spec``: pytree specs of the structures crossing this stage's boundaries
    (None for a plain tensor); a structured input arrives as its flattened tensors and is rebuilt,
    a structured output leaves as a tuple of its tensors.

    Case C14: what crosses a boundary is made contiguous in both directions. Outputs sent on
    (``.contiguous()``, a no-op for a contiguous tensor): torch's send / recv need contiguous tensors,
    and the receiving stage allocates its buffers with the strides of the first output it sees, so a
    transposed view or a strided slice ended in "input tensor has to be contiguous". Gradients sent
    back: every received input passes through `_contiguous_grad`, so the gradient of an input the
    stage transposes first leaves contiguous too.
    """

    def __init__(self, parts: ModelParts, first: int, end: int, *, is_first: bool, is_last: bool,
                 in_spec=None, out_spec=None):
        super().__init__()
        self._is_first, self._is_last = is_first, is_last
        self._order: list[str] = []
        self._in_spec, self._out_spec = in_spec, out_spec
        entries = (parts.pre if is_first else []) + parts.blocks[first:end] + (parts.post if is_last else [])
        for path, mod in entries:
            self._register_path(path, mod)
            self._order.append(path)

    def _register_path(self, path: str, mod: nn.Module) -> None:
        owner: nn.Module = self
        *heads, leaf = path.split(".")
        for h in heads:
            if not hasattr(owner, h) or not isinstance(getattr(owner, h), nn.Module):
                owner.add_module(h, nn.ModuleDict())
            owner = getattr(owner, h)
        owner.add_module(leaf, mod)

    def forward(self, *args):
        if not self._is_first:
            args = tuple(_contiguous_grad(a) if isinstance(a, torch.Tensor) and a.requires_grad else a
                         for a in args)
        x = pytree.tree_unflatten(list(args), self._in_spec) if self._in_spec is not None else args[0]
        for path in self._order:
            x = self.get_submodule(path)(x)
        if self._out_spec is not None:
            x = tuple(pytree.tree_leaves(x))
        if self._is_last:
            return x
        if isinstance(x, tuple):
            return tuple(t.contiguous() for t in x)
        return x.contiguous()


class _ContiguousGrad(torch.autograd.Function):
    """Identity in forward; the gradient leaves contiguous (case C14, see `StageModule`)."""

    @staticmethod
    def forward(ctx, x):
        return x.view_as(x)

    @staticmethod
    def backward(ctx, g):
        return g.contiguous()


def _contiguous_grad(x: torch.Tensor) -> torch.Tensor:
    return _ContiguousGrad.apply(x)


def _field_name(path) -> str:
    return "".join(str(k) for k in path) or "(the output itself)"


@torch.no_grad()
def check_stage_boundaries(parts: ModelParts, ranges: list[tuple[int, int]], example_input) -> list:
    """Dry-run the parts in order on ``example_input`` (one micro-batch) and check every boundary.

    Returns one pytree spec per boundary (``len(ranges) - 1``; None where a plain tensor crosses).

    Raises:
        ValueError: a stage's output holds something other than tensors (in tuples, lists, dicts), naming
            the stage, its blocks, the field path and the type (case C6). Every rank runs the same dry
            run on the same model, so every rank raises the same error before training.
    """
    if parts.form == "forward":                 # the model's own forward on every stage
        from modelpar.parallel.stages import check_chain

        return check_chain(parts, ranges, example_input)
    with eval_mode(parts.all()):
        return _check_boundaries(parts, ranges, example_input)


def _check_boundaries(parts: ModelParts, ranges, example_input) -> list:
    specs = []
    x = example_input
    for p in parts.pre:
        x = p[1](x)
    for i, (a, b) in enumerate(ranges):
        for _, blk in parts.blocks[a:b]:
            x = blk(x)
        if i == len(ranges) - 1:
            break
        if isinstance(x, torch.Tensor):
            specs.append(None)
            continue
        leaves, spec = pytree.tree_flatten_with_path(x)
        bad = [(path, leaf) for path, leaf in leaves if not isinstance(leaf, torch.Tensor)]
        if bad:
            path, leaf = bad[0]
            raise ValueError(
                f"pipeline stage {i} (blocks {parts.blocks[a][0]}..{parts.blocks[b - 1][0]}) returns "
                f"{type(x).__name__} whose field {_field_name(path)} is {type(leaf).__name__} ({leaf!r}); only "
                f"tensors (alone or in tuples, lists, dicts) can be sent to stage {i + 1}. Return it as a "
                f"tensor, or move the stage boundary (stage_boundaries) so this value stays inside a stage"
                + (f"; {len(bad) - 1} more such field(s)" if len(bad) > 1 else ""))
        if not leaves:
            raise ValueError(f"pipeline stage {i} (blocks {parts.blocks[a][0]}..{parts.blocks[b - 1][0]}) "
                             f"returns {type(x).__name__} holding no tensor; nothing can be sent to stage {i + 1}")
        specs.append(spec)
    return specs


def stage_indices(pp_rank: int, pp: int, virtual_stages: int, schedule: str) -> list[int]:
    """Stage indices held by one pipeline rank: round-robin (``r, r+p, ...``) or V-shape for the
    ZBV / DualPipeV schedules (``r`` and ``2p-1-r``): `modelpar.stage_split.rank_stages`, which the
    planner places stages with too."""
    from modelpar.stage_split import rank_stages

    return rank_stages(pp_rank, pp, virtual_stages, schedule)


def split_stages(parts: ModelParts, num_stages: int, boundaries=None, block_costs=None) -> list[tuple[int, int]]:
    """[start, end) block range of each of ``num_stages`` stages.

    Raises:
        ValueError: more stages than blocks.
    """
    if num_stages > parts.num_blocks:
        raise ValueError(f"{num_stages} pipeline stages but the model has only {parts.num_blocks} blocks")
    if boundaries is None:
        boundaries = balanced_partition(block_costs or block_param_costs(parts), num_stages)
    return stage_ranges(parts.num_blocks, boundaries)


def is_transformer(model: nn.Module, parts: ModelParts, tokens: int = 1) -> bool:
    """True where the planner splits ``model``'s layers evenly (its ``arch`` facts exist: the built-in
    GPT, a Hugging Face model with attention heads); see `planned_ranges`."""
    return parts.form != "sequential" and bool(_arch_of(model, tokens))


def _arch_of(model, tokens):
    from modelpar.planner.profile import _arch_of as arch_of
    return arch_of(model, tokens)


def planned_ranges(model: nn.Module, parts: ModelParts, num_stages: int,
                   example_input: torch.Tensor | None = None) -> list[tuple[int, int]]:
    """The planner's split of ``parts`` into ``num_stages`` stages, as [start, end) ranges of
    ``parts.blocks``: `modelpar.planner.loads.stage_ranges` (hence `modelpar.stage_split.split_blocks`)
    on the model's profile, whose blocks are ``parts.blocks`` with the input and output parts as its
    ``embed`` / ``head`` ends (none for an ``nn.Sequential``).

    A transformer (the planner's ``arch`` facts exist: the built-in GPT, a Hugging Face model with
    attention heads) is split evenly by layer count, which needs no profile; any other model is
    profiled (`modelpar.planner.profile.profile_model`, meta / fake tensors, no weight touched) on
    ``example_input`` for its per-block FLOPs. Deterministic, so every rank gets the same split.

    Raises:
        ValueError: more stages than blocks; a model that is not a transformer without an example input.
    """
    from modelpar.planner.loads import stage_ranges as planner_ranges
    from modelpar.planner.profile import BlockProfile, ModelProfile, profile_model

    ends = parts.form != "sequential"
    names = ([("embed", None)] if ends else []) + list(parts.blocks) + ([("head", None)] if ends else [])
    tokens = example_input.shape[1] if example_input is not None and example_input.dim() == 2 else 1
    arch = _arch_of(model, tokens) if ends else {}
    if arch:                                   # even by layers: only the count matters
        blk = [BlockProfile(n, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0) for n, _ in names]
        prof = ModelProfile(blocks=tuple(blk), dtype="fp32", batch_size=1, tokens_per_sample=tokens, arch=arch)
    elif example_input is None:
        raise ValueError(f"the planner's stage split of {type(model).__name__} needs an example micro-batch "
                         f"(parallelize(..., example_input=...)) to count its blocks' FLOPs")
    else:
        prof = profile_model(model, example_input, blocks=names)
    rng = planner_ranges(prof, num_stages)
    off = len(prof.blocks) - parts.num_blocks == 2      # the profile's ends: not blocks of the runtime
    return stage_ranges(parts.num_blocks, [a - off for a, _ in rng[1:]])


def stage_costs(parts: ModelParts, kind, example_input) -> list[float]:
    """Per-block costs for `split_stages`: a list given by the user, or a kind (see `parts.block_costs`);
    None picks ``"flops"`` with an example input, else ``"params"`` (`parallelize`'s default is not
    this but `planned_ranges`).

    Raises:
        ValueError: a cost list of the wrong length, or an unknown kind.
    """
    if isinstance(kind, (list, tuple)):
        if len(kind) != parts.num_blocks:
            raise ValueError(f"block_costs has {len(kind)} entries; the model has {parts.num_blocks} blocks")
        return [float(c) for c in kind]
    if kind is None:
        kind = "flops" if example_input is not None else "params"
    costs = block_costs(parts, kind, example_input)
    import torch.distributed as dist
    if kind == "time" and dist.is_initialized():       # timings differ per rank: all take rank 0's
        box = [costs]
        dist.broadcast_object_list(box, src=0)
        costs = box[0]
    return costs


def build_stage_modules(parts: ModelParts, ranges: list[tuple[int, int]], indices: list[int],
                        boundary_specs: list | None = None) -> list[nn.Module]:
    """The stage modules with the given ``indices``; ``boundary_specs`` from `check_stage_boundaries`.
    The "forward" form's stages are shells of the whole model (`modelpar.parallel.stages.build_stage`)."""
    n = len(ranges)
    if parts.form == "forward":
        from modelpar.parallel.stages import build_stage

        return [build_stage(parts, *ranges[i], index=i, is_first=i == 0, is_last=i == n - 1) for i in indices]
    specs = boundary_specs or [None] * (n - 1)
    return [StageModule(parts, *ranges[i], is_first=(i == 0), is_last=(i == n - 1),
                        in_spec=specs[i - 1] if i > 0 else None, out_spec=specs[i] if i < n - 1 else None)
            for i in indices]


def build_schedule(stage_modules: list[nn.Module], indices: list[int], num_stages: int, *, schedule: str,
                   n_microbatches: int, loss_fn: Callable, device: torch.device, pp_group):
    """Wrap stage modules in `PipelineStage` objects and build the torch schedule.

    ``loss_fn(output, target)`` must already carry the 1 / (micro-batches x accumulation) factor for a
    mean loss; the schedule does not rescale gradients.
    """
    from torch.distributed.pipelining import PipelineStage

    cls = get_schedule_class(schedule)
    stages = [PipelineStage(m, i, num_stages, device, group=pp_group) for m, i in zip(stage_modules, indices)]
    if schedule in SPLIT_BACKWARD_SCHEDULES:
        for st in stages:
            group_weight_pass(st)
    if len(stages) == 1 and schedule in ("gpipe", "1f1b"):
        return cls(stages[0], n_microbatches=n_microbatches, loss_fn=loss_fn, scale_grads=False)
    return cls(stages, n_microbatches=n_microbatches, loss_fn=loss_fn, scale_grads=False)


def group_weight_pass(stage) -> None:
    """Run each weight pass (``W``) of ``stage`` under one ``torch.utils.checkpoint.GraphExecGroup``, so a
    checkpointed block's forward is replayed once per ``W``, not once per parameter group.

    torch's ``stage_backward_weight`` calls ``autograd.grad`` once per parameter group (a Linear's or a
    norm's weights and bias), and non-reentrant checkpointing recomputes a region on the first unpack of
    each backward call: a GPT block was replayed 8 times per ``W`` and the replays' activations piled up
    (docs/planner.md "Split-backward schedules and activation checkpointing"). The groups' calls cover
    disjoint parts of the graph, which is what ``GraphExecGroup`` asks for (torch PR 166536 added it for
    zero-bubble schedules); the input pass (``I``) stays outside the group, so a checkpointed block is
    replayed twice per micro-batch: once at ``I``, once at ``W``. Wraps the instance's
    ``backward_weight_one_chunk`` in place (as `ActionTimer` does); nothing where torch's pipelining enters
    such a group itself (`_torch_groups_weight_pass`: groups cannot be nested) or has none
    (`plan.weight_pass_groups`; `ParallelPlan.validate` then refuses checkpointing with these schedules)."""
    if not weight_pass_groups() or _torch_groups_weight_pass():
        return
    from torch.utils.checkpoint import GraphExecGroup

    orig = stage.backward_weight_one_chunk

    def grouped(*a, **k):
        with GraphExecGroup():
            return orig(*a, **k)
    stage.backward_weight_one_chunk = grouped


@functools.cache
def _torch_groups_weight_pass() -> bool:
    """Whether torch's pipelining enters a ``GraphExecGroup`` itself (none does up to torch 2.13); read from
    its source once per process."""
    import inspect

    try:
        from torch.distributed.pipelining import _backward, stage

        return any("GraphExecGroup" in inspect.getsource(m) for m in (_backward, stage))
    except Exception:       # no source (a frozen install): wrap, as for every torch seen so far
        return False


class ActionTimer:
    """Wall time inside every compute action this rank runs: ``F`` (forward), ``B`` (full backward),
    ``I`` / ``W`` (zero-bubble input / weight backward), per stage and micro-batch.

    Wraps the `PipelineStage` methods the schedules call (``forward_one_chunk``,
    ``backward_one_chunk``, ``backward_weight_one_chunk``) on the given schedule's stages, so the
    timings are those of the schedule's own actions. Use as a context manager around
    ``schedule.step``; ``records`` holds ``(stage index, action, micro-batch, start s, end s)``.
    """

    def __init__(self, schedule):
        self.stages = list(getattr(schedule, "_stages", None) or [schedule._stage])
        self.records: list[tuple[int, str, int, float, float]] = []
        self._saved = []

    def _wrap(self, stage, attr: str, kind):
        import time

        orig = getattr(stage, attr)

        def timed(chunk_id, *a, **k):
            t0 = time.perf_counter()
            try:
                return orig(chunk_id, *a, **k)
            finally:
                self.records.append((stage.stage_index, kind(a, k), chunk_id, t0, time.perf_counter()))
        self._saved.append((stage, attr, orig))
        setattr(stage, attr, timed)

    def __enter__(self):
        for st in self.stages:
            self._wrap(st, "forward_one_chunk", lambda a, k: "F")
            self._wrap(st, "backward_one_chunk",
                       lambda a, k: "B" if k.get("full_backward", a[1] if len(a) > 1 else True) else "I")
            self._wrap(st, "backward_weight_one_chunk", lambda a, k: "W")
        return self

    def __exit__(self, *exc):
        for st, attr, orig in reversed(self._saved):
            setattr(st, attr, orig)
        self._saved.clear()

    def busy_seconds(self) -> float:
        """Sum of the time inside all recorded actions (s)."""
        return sum(t1 - t0 for *_, t0, t1 in self.records)

    def busy_by_stage(self) -> dict[int, float]:
        """Compute time per stage index (s): the measured cost of each stage."""
        out: dict[int, float] = {}
        for s, _, _, t0, t1 in self.records:
            out[s] = out.get(s, 0.0) + (t1 - t0)
        return out

