"""The training loop: one code path for one process and many (with no process group the
collectives are skipped, not special-cased).

``preflight(cfg, world_size)`` resolves and checks the plan on the meta device before any process
starts; ``train(cfg)`` is what each rank runs.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.distributed as dist

from modelpar.parallel.compose import ParallelModel
from modelpar.parallel.parts import ModelParts, get_model_parts, split_points_of
from modelpar.parallel.stages import boundaries_from_split_points
from modelpar.parallel.tensor import default_tp_plan, validate_tp_plan
from modelpar.parallel.ties import check_ties
from modelpar.plan import ParallelPlan, gradient_accumulation_steps, split_global_batch
from modelpar.train.config import TrainConfig
from modelpar.train.data import eval_shard
from modelpar.train.step import OPTIMIZERS
from modelpar.train.task import Task, build_task
from modelpar.models.spec import model_kind
from modelpar.train.materialise import check_meta_init
from modelpar.train.tokens import check_lm_data


@dataclass
class Batches:
    """The derived batch terms of a run."""

    global_batch_size: int
    local_batch_size: int
    accum_steps: int
    micro_batch_size: int


def batch_terms(cfg: TrainConfig, plan: ParallelPlan, local_batch_size: int = 0) -> Batches:
    """The batch terms of ``cfg`` under ``plan``; ``local_batch_size`` (0: ``cfg.local_batch_size``,
    else global / dp) is the resolved local batch (the planner picks it under ``auto``)."""
    local = local_batch_size or cfg.local_batch_size or split_global_batch(cfg.global_batch_size, plan)
    if local < 1:
        raise ValueError(f"global_batch_size={cfg.global_batch_size} is smaller than the data-parallel degree "
                         f"{plan.dp}")
    accum = gradient_accumulation_steps(cfg.global_batch_size, local, plan.dp)
    return Batches(cfg.global_batch_size, local, accum, local // (plan.n_microbatches if plan.pp > 1 else 1))


def preflight(cfg: TrainConfig, world_size: int, resolved=None) -> tuple[ParallelPlan, Batches]:
    """Every check that needs no process: plan, batch terms, model form, TP divisibility (meta device).

    ``resolved`` (`modelpar.train.resolve.Resolved`): the plan the launcher resolved (read from the
    run folder's plan.json on every rank), validated here instead of resolving again; None resolves
    ``cfg`` now.

    Language models: `modelpar.train.tokens.check_lm_data` (sequence length within the model's
    positions, token ids and tokenizer within its vocabulary).

    A factory model is built once for all of these (`modelpar.models.spec.one_factory_build`; the
    scope of ``modelpar train``'s launcher when it is in one), and dropped on return.

    Raises:
        ValueError: one clear message naming the field and the numbers.
    """
    from modelpar.models.spec import one_factory_build

    with one_factory_build():
        return _preflight(cfg, world_size, resolved)


def _preflight(cfg: TrainConfig, world_size: int, resolved) -> tuple[ParallelPlan, Batches]:
    for name in ("steps", "global_batch_size"):
        if getattr(cfg, name) < 1:
            raise ValueError(f"{name} must be >= 1, got {getattr(cfg, name)}")
    if cfg.optimizer not in OPTIMIZERS:
        raise ValueError(f"--optimizer {cfg.optimizer!r} is unknown; valid: {', '.join(OPTIMIZERS)}")
    task = build_task(cfg, device="meta", load_data=False)
    if task.lm is not None:     # sequence length within the positions, token ids within the vocabulary
        check_lm_data(cfg, model=cfg.model, vocab=task.lm.vocab, max_positions=task.lm.max_positions,
                      seq_len=task.lm.seq_len)
    if resolved is None:        # (a resolved plan: the launcher checked the forward before resolving it)
        check_factory_forward(cfg)
        from modelpar.train.resolve import resolve
        resolved = resolve(cfg, world_size)
    plan = resolved.plan
    try:
        parts = get_model_parts(task.model, split_points_of(cfg.split_points), blocks=cfg.blocks or None)
    except ValueError:          # DDP / FSDP / TP need no block structure (as `parallelize` decides)
        if (plan.pp_enabled or plan.is_placement or plan.activation_checkpointing != "none" or plan.compile
                or cfg.blocks or cfg.split_points):
            raise
        parts = ModelParts(form="whole")
    from modelpar.parallel.cut import check_split_points

    check_split_points(split_points_of(cfg.split_points), plan)
    if plan.pp > 1 and cfg.split_points:        # --split-points: one block path per stage after the first
        boundaries_from_split_points(parts, split_points_of(cfg.split_points), plan.num_stages)
    check_meta_init(cfg, plan)
    plan.validate(1 if plan.is_placement else world_size)    # the degrees first: the batch terms divide by them
    batches = batch_terms(cfg, plan, resolved.local_batch_size)
    plan.validate(1 if plan.is_placement else world_size,
                  num_blocks=parts.num_blocks if parts.form != "whole" else None,
                  local_batch_size=batches.local_batch_size)
    if plan.pp > 1 and cfg.eval_samples // plan.dp < batches.local_batch_size:
        # `evaluate` runs whole local batches only under a pipeline: fewer samples would average none (NaN)
        raise ValueError(f"eval_samples={cfg.eval_samples} gives each of the {plan.dp} data-parallel rank(s) fewer "
                         f"than one local batch ({batches.local_batch_size} samples), which a pipeline evaluates "
                         f"whole; raise --eval-samples to >= {batches.local_batch_size * plan.dp}")
    if plan.activation_checkpointing != "none":     # e.g. selective on blocks without an attention core
        from modelpar.parallel.checkpointing import check_ac
        check_ac(parts.blocks, plan.activation_checkpointing, plan.ac_every)
    if plan.pp > 1 and model_kind(cfg.model) in ("factory", "hf"):
        _cut_real_weights(cfg, plan, batches.micro_batch_size)
    tp_plan = (default_tp_plan(task.model, sequence_parallel=plan.sequence_parallel, tp_degree=plan.tp)[0]
               if plan.tp > 1 else None)
    if tp_plan is not None:
        validate_tp_plan(task.model, tp_plan, plan.tp, seq_len=cfg.seq_len or None)
        from modelpar.parallel.tp_factory import check_guess
        from modelpar.train.task import example_input

        check_guess(task.model, tp_plan, example_input(task, 1))    # a guessed Linear pairing: its data flow
    check_ties(task.model, plan, parts, tp_plan=tp_plan)        # case C13: a layout that breaks a tie
    if plan.cpu_offload and not torch.cuda.is_available():
        raise ValueError("cpu_offload=True needs CUDA: on a CPU-only run the shards already live in CPU memory")
    if cfg.sync_batchnorm:          # case C15: refused before any process starts
        from modelpar.parallel.batchnorm import check_sync_batchnorm

        check_sync_batchnorm(True, "cuda" if torch.cuda.is_available() else "cpu")
    return plan, batches


def check_factory_forward(cfg: TrainConfig) -> None:
    """A factory model's one forward on its own weights and a one-sample batch of its task
    (`modelpar.models.factory_check.check_forward`), before the plan is resolved and any process starts:
    a forward that fails (float inputs into an embedding, inputs the batch does not give) or returns
    no logits tensor (a Hugging Face model's ``ModelOutput``) is refused in one line naming the form it
    needs. Built-in and Hugging Face models (modelpar's own wrapper) are not run. The factory is called
    here unless a `modelpar.models.spec.one_factory_build` scope already holds its build.

    Raises:
        ValueError: see `check_forward` and `modelpar.train.task.build_task`.
    """
    if model_kind(cfg.model) != "factory":
        return
    from modelpar.models.factory_check import check_forward
    from modelpar.train.task import example_input

    real = build_task(cfg, device="cpu", load_data=False)
    if real.lm is not None and real.lm.max_positions and real.lm.seq_len > real.lm.max_positions:
        return                  # `check_lm_data` (preflight) names the flag and the limit
    check_forward(cfg.model, real.model, example_input(real, 1), form=real.kind,
                  vocab=real.lm.vocab if real.lm is not None else 0, classes=real.classes)


def _cut_real_weights(cfg: TrainConfig, plan: ParallelPlan, micro_batch_size: int) -> None:
    """The pipeline cut every rank makes (`parallel.cut.cut_pipeline`), made here on the factory model's own
    weights (``preflight``'s one build, `modelpar.models.spec.one_factory_build`; its model on the meta
    device compares shapes only): a forward whose glue a stage cut cannot keep (a residual added around
    each block in the model's own forward) is refused before launch, as ``modelpar verify`` refuses it,
    not on the ranks after the run folder exists. A Hugging Face model is cut on the meta device (shapes
    only: its family's values are `modelpar verify`'s to check), so a forward no stage can run (Swin's
    embeddings hand a tuple on) is refused here too, not by every rank after launch.

    Raises:
        ValueError: the parts or the chained stages do not reproduce the model (naming the difference).
    """
    from modelpar.parallel.cut import cut_pipeline
    from modelpar.train.task import example_input

    dev = "cpu" if model_kind(cfg.model) == "factory" else "meta"
    real = build_task(cfg, device=dev, load_data=False)
    split_points = split_points_of(cfg.split_points)
    ex = example_input(real, micro_batch_size).to(dev)
    with torch.no_grad():             # the parts as `parallelize` finds them: with the example micro-batch
        parts = get_model_parts(real.model, split_points, blocks=cfg.blocks or None, example_input=ex)
        cut_pipeline(real.model, parts, plan, ex, split_points)


def lr_at(step: int, cfg: TrainConfig) -> float:
    """Linear warm-up to ``lr`` over ``warmup_steps``, then cosine decay to ``min_lr`` at ``steps``
    (Loshchilov & Hutter 2017, SGDR, without restarts)."""
    if step < cfg.warmup_steps:
        return cfg.lr * (step + 1) / cfg.warmup_steps
    t = (step - cfg.warmup_steps) / max(1, cfg.steps - cfg.warmup_steps)
    return cfg.min_lr + 0.5 * (cfg.lr - cfg.min_lr) * (1 + math.cos(math.pi * min(t, 1.0)))


def build_optimizer(pm: ParallelModel, cfg: TrainConfig) -> torch.optim.Optimizer:
    """`modelpar.train.step.make_optimizer` over this rank's parameters with the config's settings."""
    from modelpar.train.step import make_optimizer

    return make_optimizer(pm.parameters(), cfg.optimizer, lr=cfg.lr, weight_decay=cfg.weight_decay)


def _all_reduce_sum(t: torch.Tensor) -> torch.Tensor:
    if dist.is_initialized():
        dist.all_reduce(t)
    return t


def reduce_losses(pm: ParallelModel, pending: list[tuple[torch.Tensor | float, int]]) -> list[float]:
    """Per step, the mean over data-parallel ranks of a loss held by last-stage ranks (counted once
    per DP rank), for several steps at once: one all-reduce of a (steps, 2) float64 tensor of
    (loss sum, count) instead of one per step, so a run reads its losses only when it logs them.

    ``pending``: per step, ``(sum of local-batch mean losses, how many)`` as `train_step` returns
    them (the sum a 0-dim tensor or a float). Returns one float per step (nan where no rank held a
    loss); the same on every rank.
    """
    own = pm.has_last_stage and pm.mesh.tp_rank == 0
    t = torch.zeros(len(pending), 2, dtype=torch.float64)
    if own:
        for i, (s, c) in enumerate(pending):
            t[i, 0] = s.detach().to("cpu", torch.float64) if torch.is_tensor(s) else s
            t[i, 1] = float(c)
    if pm.mesh.mesh is not None and len(pending):   # one process (or the one-process reference): none
        _all_reduce_sum(t)
    return [(s / c).item() if c > 0 else float("nan") for s, c in t]


def reduce_loss(pm: ParallelModel, loss_sum: torch.Tensor | float, count: int, device=None) -> float:
    """`reduce_losses` of one step (``device`` is ignored: the reduction runs on CPU tensors)."""
    return reduce_losses(pm, [(loss_sum, count)])[0]


@torch.no_grad()
def evaluate(pm: ParallelModel, task: Task, batches: Batches) -> float:
    """Mean validation loss over ``task.val``: each DP rank takes a disjoint slice, reduced as
    (sum, count), so no sample is counted twice (case C2)."""
    pm.train(False)
    x, y = task.val
    sl = eval_shard(len(x), pm.mesh.dp_rank, pm.plan.dp)
    xs, ys = x[sl], y[sl]
    step = batches.local_batch_size
    total, count = 0.0, 0
    if pm.plan.pp > 1:      # fixed micro-batch shapes: whole local batches only, the rest dropped
        n_batches = (len(x) // pm.plan.dp) // step
    else:                   # every rank runs the same number of forwards (FSDP/TP collectives)
        n_batches = math.ceil(math.ceil(len(x) / pm.plan.dp) / step)
    for i in range(n_batches):
        xb, yb = xs[i * step:(i + 1) * step], ys[i * step:(i + 1) * step]
        n = len(xb)
        if n == 0:          # this rank's slice ran out: a dummy forward with weight 0
            xb, yb = x[:1], y[:1]
        loss = pm.evaluate(xb, yb)
        if loss is not None:
            total += loss.item() * n
            count += n
    pm.train(True)
    return reduce_loss(pm, total, count, pm.device)
