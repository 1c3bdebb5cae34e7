"""`parallelize(model, plan)`: apply every technique of a plan, in one fixed order.

The order matters and is the same for every plan:

1. pipeline split: cut the model into stage modules first, so later steps see only this rank's
   layers (TP plans are written in whole-model paths, which stage modules keep);
2. tensor parallel: turns weights into DTensors sharded over the ``tp`` axis; FSDP must see these
   DTensors to shard them further over the data axis (2-D FSDP x TP);
3. activation checkpointing (every block, every k-th block, or only the attention cores:
   `modelpar.parallel.checkpointing`): wraps forwards, after TP so recompute replays the TP collectives;
3b. ``torch.compile`` of each block (``plan.compile``), after TP and checkpointing so the compiled
   graph contains the DTensor ops and the recompute region, and before data parallelism so FSDP's
   per-block hooks stay outside the graph (the order torchtitan uses);
4. FSDP (``dp_shard > 1``, HSDP with ``dp_replicate``) or DDP (``dp_replicate`` only) last: data
   parallelism wraps whatever the previous steps produced. With a pipeline or TP, ``dp_replicate``
   alone uses FSDP2's ``replicate`` (the same semantics as DDP): the pipelining runtime drives the
   gradient reduction of FSDP-style modules itself, and DDP's DTensor path swaps TP parameters for
   plain local tensors after each forward, so ``parameters()`` and ``state_dict()`` lose them
   (clipping and checkpoints then miss the TP weights).

Before step 1, a pipeline plan dry-runs the whole model on one example micro-batch to check every
stage boundary (case C6, `pipeline.check_stage_boundaries`); every rank holds the whole model at
that point, so every rank raises the same error.

The result, `ParallelModel`, hides the pipeline / non-pipeline difference behind
``forward_backward(x, y)`` and ``evaluate(x, y)``.

Loss scaling (cases C4, C5): one device computes the loss of the whole global batch. For a mean
loss (``loss_reduction="mean"``) each local batch's loss is multiplied by 1 / accumulation steps and
each pipeline micro-batch's by a further 1 / n_microbatches; data parallelism averages over its
ranks. For a sum loss (``"sum"``) no accumulation or micro-batch factor applies, and the loss is
multiplied by the data-parallel degree to undo the average DDP / FSDP take. Gradients are then the
one-device gradients whatever the layout.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from dataclasses import dataclass, field

import torch
import torch.nn as nn

from modelpar.parallel import checkpointing, compiling, data_parallel, layer_checks, pipeline, placement, tensor, ties
from modelpar.parallel.mesh import MeshInfo
from modelpar.parallel.cut import cut_pipeline
from modelpar.parallel.parts import ModelParts, get_model_parts
from modelpar.plan import ParallelPlan, runtime_layout


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
    loss_reduction: str = "mean"          # "mean" | "sum": what loss_fn does over its batch
    loss_parallel: bool = False           # logits are vocab-sharded DTensors; loss under loss_parallel()
    fsdp_mixed_precision: bool = False    # bf16 done by FSDP2's MixedPrecisionPolicy (no autocast)
    grad_check: Callable | None = None    # per-step gradient-use check (grad_use.GradUseCheck; C1, C12)
    buffer_sync: Callable | None = None   # BatchNorm running statistics averaged over dp (C15)
    ties: list = field(default_factory=list)   # tied parameter names (case C13, `modelpar.parallel.ties`)
    tied_sync: "ties.TiedGradSync | None" = None   # sums tied copies' gradients across pipeline ranks
    _scaled: "_ScaledLoss | None" = None  # the schedule's loss function (see _ScaledLoss)
    _sync_flags: tuple | None = field(default=None, repr=False)   # FSDP sync flags last set (_grad_sync)

    def __post_init__(self):
        if self._scaled is None:
            self._scaled = _ScaledLoss(self.loss_fn)

    # ---- helpers ------------------------------------------------------------------------------
    @property
    def has_first_stage(self) -> bool:
        return self.schedule is None or 0 in self.stage_indices

    @property
    def has_last_stage(self) -> bool:
        return self.schedule is None or (self.plan.num_stages - 1) in self.stage_indices

    @property
    def target_device(self) -> torch.device:
        """Where the targets go: the device the output comes out on, under layer placement the last
        segment's (``layout[-1]``: the head's device, e.g. ``cuda:0`` of ``("cpu", "cuda:0")``), else
        ``device``."""
        return torch.device(self.layout[-1][0]) if self.layout else self.device

    def parameters(self):
        """This rank's parameters, each once (stage modules of one rank may share a tied one)."""
        seen = set()
        for m in self.modules:
            for p in m.parameters():
                if id(p) not in seen:
                    seen.add(id(p))
                    yield p

    def norm_parameters(self, params=None):
        """The parameters whose gradients this rank counts in the global gradient norm: all but
        the tied copies another pipeline rank counts (case C13: a tie is counted once).
        ``params``: `parameters` already listed (saves a second walk over the modules)."""
        skip = self.tied_sync.norm_skip if self.tied_sync is not None else set()
        return [p for p in (self.parameters() if params is None else params) if id(p) not in skip]

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
        if self.plan.precision == "bf16" and not self.fsdp_mixed_precision:
            return torch.autocast(self.device.type, dtype=torch.bfloat16)
        return contextlib.nullcontext()

    def _grad_sync(self, enabled: bool):
        """Gradient reduction of one local batch; ``enabled`` on the last accumulation step.

        - DDP (and FSDP2's ``replicate``): no reduction before the last step (gradients are
          unsharded either way, so skipping costs no memory).
        - FSDP without a pipeline: reduce-scatter every local batch and accumulate sharded
          gradients (FSDP2's default); under HSDP the all-reduce across replicas runs on the last
          step only (``set_requires_all_reduce``; the partial sums stay sharded). With
          ``plan.defer_grad_sync`` the reduction is skipped before the last step and unsharded
          fp32 gradients accumulate (``set_requires_gradient_sync(False)``).
        - Pipelines: torch.distributed.pipelining turns the sync off for every micro-batch's backward
          and reduces once at the end of each schedule step (``PipelineStage.perform_reduce_grad``
          sets ``set_requires_gradient_sync(True)`` and runs FSDP's post-backward), whatever is set
          here: each accumulation step ends with a reduction.

        Without a pipeline the flags are set only when they change (FSDP2's setters walk every
        submodule: ~500 Python calls per step for gpt-1m); nothing else sets them on such a model.
        """
        w = self.wrapped
        if w is not None and hasattr(w, "no_sync") and not enabled:
            return w.no_sync()
        if runtime_layout(self.plan).sharded_grad_accumulation:
            flags = (True, enabled if self.plan.hsdp_enabled else None)
        else:
            flags = (enabled, None)
        if self.schedule is None and flags == self._sync_flags:
            return contextlib.nullcontext()
        for m in self.modules:
            if not hasattr(m, "set_requires_gradient_sync"):
                continue
            m.set_requires_gradient_sync(flags[0])
            if flags[1] is not None:
                m.set_requires_all_reduce(flags[1])
        # a pipeline schedule sets the flags itself during its step: set them again every time
        self._sync_flags = flags if self.schedule is None else None
        return contextlib.nullcontext()

    @property
    def _loss_scale(self) -> float:
        return self._scaled.scale

    @_loss_scale.setter
    def _loss_scale(self, v: float) -> None:
        self._scaled.scale = v

    def _loss_context(self):
        if self.loss_parallel:
            from torch.distributed.tensor.parallel import loss_parallel
            return loss_parallel()
        return contextlib.nullcontext()

    def _check_batch(self, x: torch.Tensor) -> None:
        """Case C5: a local batch the schedule cannot split evenly is refused on every rank (every rank
        is given the batch) before any stage runs."""
        m = self.plan.n_microbatches
        if self.schedule is not None and (len(x) < m or len(x) % m):
            raise ValueError(f"local batch size {len(x)} is not divisible by n_microbatches={m}: pipeline "
                             f"micro-batches must all have the same size (no padding or dropping is done)")

    def _eval_by_training_step(self, args, kwargs) -> None:
        """One schedule step for its losses only: gradients before it are restored after it."""
        params = list(self.parameters())
        saved = [p.grad for p in params]
        for p in params:
            p.grad = None
        with torch.enable_grad(), self._grad_sync(False):
            self.schedule.step(*args, **kwargs)
        for p, g in zip(params, saved):
            p.grad = g

    def check_grad_use(self) -> None:
        """After the backward of an optimizer step, before clipping and ``optimizer.step()``: raise
        one ValueError on every rank if the data-parallel ranks used different parameters (case C12,
        `modelpar.parallel.grad_use`). Collective; a no-op with ``check_unused_params=False``."""
        if self.grad_check is not None:
            self.grad_check()

    def after_optimizer_step(self) -> None:
        """Average BatchNorm running statistics over the data-parallel group (case C15). Collective."""
        if self.buffer_sync is not None:
            self.buffer_sync()

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
        self._check_batch(x)
        # sum losses: no 1/accum factor; x dp undoes the data-parallel average (module docstring)
        scale = loss_scale if self.loss_reduction == "mean" else float(self.plan.dp)
        with self._grad_sync(sync_grads), self._loss_context():
            if self.schedule is None:
                with self._autocast():
                    out = self.wrapped(x.to(self.device))
                    loss = self.loss_fn(out, y.to(self.target_device))
                (loss if scale == 1.0 else loss * scale).backward()    # x 1.0: the same gradients
                return _plain(loss.detach())
            m = self.plan.n_microbatches
            self._loss_scale = scale / m if self.loss_reduction == "mean" else scale
            losses: list[torch.Tensor] = []
            kwargs = {"target": y.to(self.device), "losses": losses} if self.has_last_stage else {}
            args = (x.to(self.device),) if self.has_first_stage else ()
            with self._autocast():
                self.schedule.step(*args, **kwargs)
            if sync_grads and self.tied_sync is not None:   # C13: tied copies on other stages' ranks
                self.tied_sync.all_reduce()
            if not self.has_last_stage:
                return None
            total = torch.stack([_plain(l.detach()) for l in losses]).sum() / self._loss_scale
            return total / m if self.loss_reduction == "mean" else total

    def _reshard(self) -> None:
        """Free FSDP's gathered parameters: a forward without backward (evaluation) leaves the root's
        (``reshard_after_forward=False``) gathered, and while gathered the module's registered
        parameters are the unsharded compute-dtype (bf16) copies instead of the fp32 shards."""
        from torch.distributed.fsdp import FSDPModule

        for mod in self.modules:
            for m in mod.modules():
                if isinstance(m, FSDPModule):
                    m.reshard()

    def evaluate(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor | None:
        """Mean (or, for sum losses, summed) loss of ``(x, y)`` without gradients (None on pipeline
        ranks without the last stage); FSDP parameters are resharded after it."""
        try:
            with torch.no_grad():
                return self._evaluate(x, y)
        finally:
            if self.fsdp_mixed_precision or self.plan.fsdp_enabled:
                self._reshard()

    def _evaluate(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor | None:
        """Mean loss of ``(x, y)`` without gradients (None on pipeline ranks without the last stage)."""
        self._check_batch(x)
        with self._loss_context():
            if self.schedule is None:
                with self._autocast():
                    out = self.wrapped(x.to(self.device))
                    return _plain(self.loss_fn(out, y.to(self.target_device))).float()
            self._loss_scale = 1.0
            losses: list[torch.Tensor] = []
            kwargs = {"target": y.to(self.device), "losses": losses} if self.has_last_stage else {}
            args = (x.to(self.device),) if self.has_first_stage else ()
            with self._autocast():
                if self.plan.pp_schedule in EVAL_WITH_BACKWARD:
                    self._eval_by_training_step(args, kwargs)
                else:
                    self.schedule.eval(*args, **kwargs)
        if not self.has_last_stage:
            return None
        stacked = torch.stack([_plain(l) for l in losses]).float()
        return stacked.mean() if self.loss_reduction == "mean" else stacked.sum()


# torch 2.13's forward-only `schedule.eval` fails for the zero-bubble schedules ("can't
# steal_bwd_input if this stage doesn't have backward"): they evaluate with a full schedule step whose
# gradients are thrown away (about 3x the compute of a forward; the losses are exact).
EVAL_WITH_BACKWARD = ("interleavedzerobubble", "zbvzerobubble", "dualpipev")


class _ScaledLoss:
    """``loss_fn(out, y) * scale``: the loss function given to the pipeline schedule.

    A separate object rather than a bound method of `ParallelModel`, so the schedule holds no
    reference back to the model: without that cycle the schedule, its stages and their pending
    point-to-point work are freed as soon as the `ParallelModel` is dropped, while the process group
    still exists (freed later by the cyclic collector, after the group was destroyed, gloo aborted
    the process at exit: 'terminate called without an active exception').
    """

    def __init__(self, loss_fn: Callable):
        self.loss_fn, self.scale = loss_fn, 1.0

    def __call__(self, out, y):
        return self.loss_fn(out, y) * self.scale


def _plain(t: torch.Tensor) -> torch.Tensor:
    """A replicated DTensor (the loss under loss parallel) as a plain tensor."""
    return t.full_tensor() if hasattr(t, "full_tensor") else t


def parallelize(model: nn.Module, plan: ParallelPlan, mesh: MeshInfo, *, loss_fn: Callable,
                device: torch.device, example_input: torch.Tensor | None = None,
                tp_plan: dict[str, str] | None = None, split_points: tuple[str, ...] | None = None,
                blocks: str | None = None,
                find_unused_parameters: bool = False, loss_reduction: str = "mean",
                loss_parallel: bool | None = None, block_costs: list[float] | str | None = None,
                check_unused_params: bool = True, sync_batchnorm: bool = False) -> ParallelModel:
    """Lay ``model`` out according to ``plan`` on this rank (see the module docstring for the order).

    Args:
        model: the full model, on CPU or ``device``, with its initial weights (the same on every rank).
        mesh: from `modelpar.parallel.mesh.build_mesh`.
        loss_fn: ``loss_fn(output, target) -> scalar``, the mean (or, with ``loss_reduction="sum"``,
            the sum) over the batch it is given.
        example_input: one micro-batch of input; for pipelines it checks the block order and dry-runs
            the stage boundaries (case C6), and measures block costs.
        tp_plan: ``{module path: style}`` (`modelpar.parallel.tensor.STYLES`); derived when None.
        loss_parallel: GPT under TP: split the token embedding and the output head over the vocabulary
            and compute the cross entropy on the vocab-sharded logits (``loss_fn`` must be a cross
            entropy); None: on for the built-in GPT with the derived TP plan (`tensor.default_tp_plan`).
        split_points: block paths that start a pipeline stage (``--split-points``), instead of balancing.
        blocks: path of the block container (``--blocks``) where `parts.find_blocks`' rule picks wrong.
        block_costs: pipeline stage balancing: per-block costs, or ``"flops"`` (counted on
            ``example_input``), ``"time"`` (measured), ``"params"`` (`modelpar.parallel.parts.block_costs`);
            None: the planner's split (`pipeline.planned_ranges`: a transformer's layers evenly, other
            models by their profiled FLOPs, which needs ``example_input``; without one, ``"params"``).
        find_unused_parameters: DDP's own option (it then reduces zeros for parameters a rank did not
            use: rank-divergent use is handled instead of refused).
        check_unused_params: check at every optimizer step that the data-parallel ranks used the same
            parameters (`modelpar.parallel.grad_use`, case C12; one small all-reduce per step, none under
            DDP after the first step).
        sync_batchnorm: convert BatchNorm layers to SyncBatchNorm over the data-parallel group (CUDA
            only; `modelpar.parallel.batchnorm`, case C15). Without it a model with BatchNorm gets one
            warning (rank 0) that its batch statistics are per rank.

    Raises:
        ValueError: the model cannot be split as the plan needs (see `modelpar.parallel.parts`), a
            stage boundary carries something other than tensors, a TP split does not divide evenly
            (the GPT's vocabulary included), a derived TP plan the model's forward does not follow
            (`tp_factory.check_guess`, with ``example_input``), tied parameters the layout cannot keep tied
            (`ties.check_ties`), an unknown ``loss_reduction``, or ``sync_batchnorm`` without CUDA.
    """
    if loss_reduction not in ("mean", "sum"):
        raise ValueError(f"loss_reduction={loss_reduction!r} is unknown; valid: mean, sum")
    needs_blocks = plan.pp_enabled or plan.is_placement or plan.activation_checkpointing != "none" or plan.compile
    dev0 = next((p.device for p in model.parameters()), torch.device("cpu"))
    ex_parts = example_input.to(dev0) if example_input is not None else None
    try:
        parts: ModelParts = get_model_parts(model, split_points, blocks=blocks, example_input=ex_parts)
    except (ValueError, RuntimeError, TypeError):   # a forward the trace cannot follow: DDP / FSDP need no cut
        if needs_blocks or split_points or blocks:
            raise
        # DDP / FSDP / TP need no block structure: FSDP then shards the whole model as one unit
        parts = ModelParts(form="whole")
    plan.validate(num_blocks=parts.num_blocks if plan.pp_enabled else None)
    tied = ties.find_ties(model)
    if plan.activation_checkpointing != "none":        # e.g. "selective" without attention cores
        checkpointing.check_ac(parts.blocks, plan.activation_checkpointing, plan.ac_every)
    block_index = {id(m): i for i, (_, m) in enumerate(parts.blocks)}
    shard_head = False
    if plan.tp_enabled:
        if tp_plan is None:
            tp_plan, _ = tensor.default_tp_plan(model, sequence_parallel=plan.sequence_parallel,
                                                loss_parallel=loss_parallel, tp_degree=plan.tp)
            if example_input is not None:       # a guessed Linear pairing: its forward's data flow
                from modelpar.parallel.tp_factory import check_guess
                check_guess(model, tp_plan, example_input[:1])
        seq = example_input.shape[1] if example_input is not None and example_input.dim() == 2 else None
        tensor.validate_tp_plan(model, tp_plan, plan.tp, seq_len=seq)
        shard_head = tensor.head_is_vocab_sharded(tp_plan)
    if not plan.pp_enabled:
        ties.check_ties(model, plan, parts, tp_plan=tp_plan, ties=tied)

    if plan.is_placement:                          # one process, many devices
        layout = placement.apply_placement(parts, plan.placement_devices,
                                           boundaries=list(plan.stage_boundaries) if plan.stage_boundaries else None)
        checkpointing.apply_ac([m for _, m in parts.blocks], mode=plan.activation_checkpointing,
                               every=plan.ac_every)
        if plan.compile:
            compiling.apply_compile([m for _, m in parts.blocks])
        first = torch.device(plan.placement_devices[0])
        return ParallelModel(plan, mesh, [model], model, loss_fn, first, layout=layout,
                             loss_reduction=loss_reduction)

    if not any(p.is_meta for p in model.parameters()):    # a meta-built model: materialised per shard later
        model.to(device)                                   # (modelpar.train.materialise)
    model = layer_checks.prepare_batchnorm(model, plan, mesh, device, sync=sync_batchnorm)
    # 1. pipeline split (first: every later step sees only this rank's stages)
    indices, ranges = [], []
    if plan.pp_enabled:
        ex = example_input.to(dev0 if dev0.type == "meta" else device) if example_input is not None else None
        ranges, specs = cut_pipeline(model, parts, plan, ex, split_points, block_costs)
        ties.check_ties(model, plan, parts, tp_plan=tp_plan, ranges=ranges, ties=tied)
        indices = pipeline.stage_indices(mesh.pp_rank, plan.pp, plan.virtual_stages, plan.pp_schedule)
        modules: list[nn.Module] = pipeline.build_stage_modules(parts, ranges, indices, specs)
    else:
        modules = [model]
    block_ids = {id(m) for _, m in parts.blocks}

    def local_blocks(mod: nn.Module) -> list[nn.Module]:
        return [m for m in mod.modules() if id(m) in block_ids]

    # 2. tensor parallel (before FSDP, which shards the TP DTensors further over the data axes)
    if plan.tp_enabled:
        from modelpar.models.gpt import GPT

        for mod in modules:
            present = {n for n, m in mod.named_modules() if not getattr(m, "_modelpar_stub", False)}
            tensor.apply_tp(mod, mesh.sub("tp"), tp_plan, present=present, own_outputs=not isinstance(model, GPT))
        ties.retie(modules, tied)              # TP gave each copy its own DTensor: one again (C13)
    # 3. activation checkpointing (after TP, so recompute replays the TP collectives)
    for mod in modules:
        blks = local_blocks(mod)
        checkpointing.apply_ac(blks, mode=plan.activation_checkpointing, every=plan.ac_every,
                               indices=[block_index[id(m)] for m in blks])
    # 3b. compile each block (same code for every block: one graph, reused)
    if plan.compile:
        for mod in modules:
            compiling.apply_compile(local_blocks(mod))
    # 4. data parallel last: it wraps whatever the previous steps produced
    # (the wrapper per data-parallel axis is `plan.runtime_layout`, which the planner's models read too)
    runtime_modules = modules                      # what forward / the pipeline stages call
    layout = runtime_layout(plan)
    fsdp_style = layout.fsdp2
    if layout.shards_states:                       # fsdp, hsdp
        dp_mesh = mesh.sub(*layout.dp_mesh_axes)
        for mod in modules:
            data_parallel.apply_fsdp(mod, dp_mesh, local_blocks(mod), precision=plan.precision,
                                     reshard_after_forward=plan.reshard_after_forward,
                                     cpu_offload=plan.cpu_offload)
    elif layout.dp_wrapper == "replicate":         # DDP semantics under PP / TP, see docstring
        dp_mesh = mesh.sub(*layout.dp_mesh_axes)
        for mod in modules:
            data_parallel.apply_replicate(mod, dp_mesh, local_blocks(mod), precision=plan.precision)
    elif layout.dp_wrapper == "ddp":
        dp_mesh = mesh.sub(*layout.dp_mesh_axes)
        runtime_modules = [data_parallel.apply_ddp(mod, dp_mesh, find_unused_parameters=find_unused_parameters)
                           for mod in modules]

    pm = ParallelModel(plan, mesh, modules, runtime_modules[0] if not plan.pp_enabled else None, loss_fn,
                       device, stage_indices=indices, stage_ranges=ranges, loss_reduction=loss_reduction,
                       loss_parallel=shard_head, fsdp_mixed_precision=fsdp_style, ties=tied)
    if plan.pp_enabled:
        pm.tied_sync = ties.build_tied_grad_sync(tied, parts, ranges, plan, mesh, modules)
    if plan.pp_enabled:
        pm.schedule = pipeline.build_schedule(runtime_modules, indices, plan.num_stages,
                                              schedule=plan.pp_schedule, n_microbatches=plan.n_microbatches,
                                              loss_fn=pm._scaled, device=device, pp_group=mesh.group("pp"))
    layer_checks.attach(pm, check_unused_params=check_unused_params, find_unused=find_unused_parameters,
                        ddp=layout.dp_wrapper == "ddp")
    return pm
