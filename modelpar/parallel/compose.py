"""`parallelize(model, plan)`: apply every technique of a plan, in one fixed order.

The order matters and is the same for every plan:

1. pipeline split: cut the model into stage modules first, so later steps see only this rank's
   layers (TP plans are written in whole-model paths, which stage modules keep);
2. tensor parallel: turns weights into DTensors sharded over the ``tp`` axis; FSDP must see these
   DTensors to shard them further over the data axis (2-D FSDP x TP);
3. activation checkpointing: wraps block forwards, after TP so recompute replays the TP collectives;
4. FSDP (``dp_shard > 1``, HSDP with ``dp_replicate``) or DDP (``dp_replicate`` only) last: data
   parallelism wraps whatever the previous steps produced.

The result, `ParallelModel`, hides the pipeline / non-pipeline difference behind
``forward_backward(x, y)`` and ``evaluate(x, y)``.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from dataclasses import dataclass, field

import torch
import torch.distributed as dist
import torch.nn as nn

from modelpar.parallel import checkpointing, data_parallel, pipeline, placement, tensor
from modelpar.parallel.mesh import MeshInfo
from modelpar.parallel.parts import ModelParts, check_parts_order, get_model_parts
from modelpar.plan import ParallelPlan


@dataclass
class ParallelModel:
    """A model laid out by a plan, with one training-step entry point.

    Attributes:
        modules: the modules this rank trains (the whole model, or its pipeline stages); their
            parameters are what the optimizer gets, their state dicts use the original names.
        wrapped: what forward is called on (the DDP wrapper where DDP is on).
    """

    plan: ParallelPlan
    mesh: MeshInfo
    modules: list[nn.Module]
    wrapped: nn.Module | None
    loss_fn: Callable
    device: torch.device
    schedule: object | None = None
    stage_indices: list[int] = field(default_factory=list)
    stage_ranges: list[tuple[int, int]] = field(default_factory=list)
    layout: list = field(default_factory=list)
    _loss_scale: float = 1.0

    # ---- helpers ------------------------------------------------------------------------------
    @property
    def has_first_stage(self) -> bool:
        return self.schedule is None or 0 in self.stage_indices

    @property
    def has_last_stage(self) -> bool:
        return self.schedule is None or (self.plan.num_stages - 1) in self.stage_indices

    def parameters(self):
        for m in self.modules:
            yield from m.parameters()

    def named_parameters(self):
        seen = set()
        for m in self.modules:
            for n, p in m.named_parameters():
                if id(p) not in seen:
                    seen.add(id(p))
                    yield n, p

    def train(self, mode: bool = True):
        for m in self.modules:
            m.train(mode)

    def _autocast(self):
        if self.plan.precision == "bf16" and not self.plan.fsdp_enabled:
            return torch.autocast(self.device.type, dtype=torch.bfloat16)
        return contextlib.nullcontext()

    def _grad_sync(self, enabled: bool):
        """Skip DDP/FSDP gradient reduction on all but the last accumulation step."""
        w = self.wrapped
        if w is not None and hasattr(w, "no_sync") and not enabled:
            return w.no_sync()
        for m in self.modules:
            if hasattr(m, "set_requires_gradient_sync"):
                m.set_requires_gradient_sync(enabled)
        return contextlib.nullcontext()

    def _scaled_loss(self, out, y):
        return self.loss_fn(out, y) * self._loss_scale

    # ---- the step -----------------------------------------------------------------------------
    def forward_backward(self, x: torch.Tensor, y: torch.Tensor, *, loss_scale: float = 1.0,
                         sync_grads: bool = True) -> torch.Tensor | None:
        """Forward and backward of one local batch; gradients accumulate into ``.grad``.

        Args:
            x, y: the local batch (inputs, targets), first dim = local batch size.
            loss_scale: factor on the mean loss (1 / accumulation steps).
            sync_grads: reduce gradients across data-parallel ranks in this call (the last
                accumulation step).

        Returns:
            The unscaled mean loss of this local batch (a 0-dim tensor) on ranks holding the last
            stage, None on other pipeline ranks.
        """
        with self._grad_sync(sync_grads):
            if self.schedule is None:
                with self._autocast():
                    out = self.wrapped(x.to(self.device))
                    loss = self.loss_fn(out, y.to(out.device))
                (loss * loss_scale).backward()
                return loss.detach()
            m = self.plan.n_microbatches
            self._loss_scale = loss_scale / m
            losses: list[torch.Tensor] = []
            kwargs = {"target": y.to(self.device), "losses": losses} if self.has_last_stage else {}
            args = (x.to(self.device),) if self.has_first_stage else ()
            with self._autocast():
                self.schedule.step(*args, **kwargs)
            if not self.has_last_stage:
                return None
            return torch.stack([l.detach() for l in losses]).sum() / loss_scale

    @torch.no_grad()
    def evaluate(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor | None:
        """Mean loss of ``(x, y)`` without gradients (None on pipeline ranks without the last stage)."""
        if self.schedule is None:
            with self._autocast():
                out = self.wrapped(x.to(self.device))
                return self.loss_fn(out, y.to(out.device)).float()
        self._loss_scale = 1.0
        losses: list[torch.Tensor] = []
        kwargs = {"target": y.to(self.device), "losses": losses} if self.has_last_stage else {}
        args = (x.to(self.device),) if self.has_first_stage else ()
        with self._autocast():
            self.schedule.eval(*args, **kwargs)
        return torch.stack(losses).float().mean() if self.has_last_stage else None


def parallelize(model: nn.Module, plan: ParallelPlan, mesh: MeshInfo, *, loss_fn: Callable,
                device: torch.device, example_input: torch.Tensor | None = None,
                tp_plan: dict[str, str] | None = None, split_points: tuple[str, ...] | None = None,
                find_unused_parameters: bool = False) -> ParallelModel:
    """Lay ``model`` out according to ``plan`` on this rank (see the module docstring for the order).

    Args:
        model: the full model, on CPU or ``device``, with its initial weights (the same on every rank).
        mesh: from `modelpar.parallel.mesh.build_mesh`.
        loss_fn: ``loss_fn(output, target) -> scalar`` mean loss.
        example_input: one micro-batch of input, used to check the block order for pipelines.
        tp_plan: ``{module path: "colwise" | "rowwise"}``; derived when None.

    Raises:
        ValueError: the model cannot be split as the plan needs (see `modelpar.parallel.parts`), or a
            TP split does not divide evenly.
    """
    parts: ModelParts = get_model_parts(model, split_points)
    plan.validate(num_blocks=parts.num_blocks if plan.pp_enabled else None)
    if plan.tp_enabled:
        tp_plan = tp_plan if tp_plan is not None else tensor.derive_tp_plan(model)
        tensor.validate_tp_plan(model, tp_plan, plan.tp)

    if plan.is_placement:                          # one process, many devices
        layout = placement.apply_placement(parts, plan.placement_devices,
                                           boundaries=list(plan.stage_boundaries) if plan.stage_boundaries else None)
        checkpointing.apply_ac([m for _, m in parts.blocks], mode=plan.activation_checkpointing)
        first = torch.device(plan.placement_devices[0])
        return ParallelModel(plan, mesh, [model], model, loss_fn, first, layout=layout)

    model.to(device)
    # 1. pipeline split
    schedule, indices, ranges = None, [], []
    if plan.pp_enabled:
        if parts.form == "split_points":
            raise ValueError("pipelines over split points of an arbitrary module are not supported yet; "
                             "use an nn.Sequential or the ModuleList form (see modelpar.parallel.parts)")
        if example_input is not None:
            check_parts_order(model, parts, example_input.to(device))
        ranges = pipeline.split_stages(parts, plan.num_stages, plan.stage_boundaries)
        indices = pipeline.stage_indices(mesh.pp_rank, plan.pp, plan.virtual_stages, plan.pp_schedule)
        modules: list[nn.Module] = pipeline.build_stage_modules(parts, ranges, indices)
    else:
        modules = [model]
    block_ids = {id(m) for _, m in parts.blocks}

    def local_blocks(mod: nn.Module) -> list[nn.Module]:
        return [m for m in mod.modules() if id(m) in block_ids]

    # 2. tensor parallel
    if plan.tp_enabled:
        for mod in modules:
            present = {n for n, _ in mod.named_modules()}
            tensor.apply_tp(mod, mesh.sub("tp"), tp_plan, present=present)
    # 3. activation checkpointing
    for mod in modules:
        checkpointing.apply_ac(local_blocks(mod), mode=plan.activation_checkpointing)
    # 4. data parallel
    runtime_modules = modules                      # what forward / the pipeline stages call
    if plan.fsdp_enabled:
        dp_mesh = mesh.sub("dp_replicate", "dp_shard")
        for mod in modules:
            data_parallel.apply_fsdp(mod, dp_mesh, local_blocks(mod), precision=plan.precision,
                                     reshard_after_forward=plan.reshard_after_forward,
                                     cpu_offload=plan.cpu_offload)
    elif plan.dp_replicate > 1:
        dp_mesh = mesh.sub("dp_replicate")
        runtime_modules = [data_parallel.apply_ddp(mod, dp_mesh, find_unused_parameters=find_unused_parameters)
                           for mod in modules]

    pm = ParallelModel(plan, mesh, modules, runtime_modules[0] if not plan.pp_enabled else None, loss_fn,
                       device, stage_indices=indices, stage_ranges=ranges)
    if plan.pp_enabled:
        pm.schedule = pipeline.build_schedule(runtime_modules, indices, plan.num_stages,
                                              schedule=plan.pp_schedule, n_microbatches=plan.n_microbatches,
                                              loss_fn=pm._scaled_loss, device=device, pp_group=mesh.group("pp"))
    return pm
