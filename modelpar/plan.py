"""`ParallelPlan`: the one validated description of how a model is laid out over devices.

A plan is pure data. The planner produces it, `parallelize` consumes it, and it round-trips through
`to_dict` / `from_dict` so it lands in the run record and in checkpoints.

Degrees multiply to the world size: ``dp_replicate * dp_shard * tp * pp == world_size``. The mesh
axes are named ``("pp", "dp_replicate", "dp_shard", "tp")`` with size-1 axes dropped, outermost
first, so that TP (the most communication-hungry axis) sits on the closest ranks.
"""

from __future__ import annotations

import dataclasses
import functools
import json

from dataclasses import dataclass
from typing import Any

# Schedule names accepted by `pp_schedule`, mapped to torch.distributed.pipelining classes in
# modelpar.parallel.pipeline. "multi" schedules run several virtual stages per rank.
SINGLE_STAGE_SCHEDULES = ("gpipe", "1f1b")
MULTI_STAGE_SCHEDULES = ("interleaved1f1b", "loopedbfs", "interleavedzerobubble", "zbvzerobubble",
                         "dualpipev")
PP_SCHEDULES = SINGLE_STAGE_SCHEDULES + MULTI_STAGE_SCHEDULES
# schedules that split each backward into an input part (I) and a weight part (W) run later: FSDP must
# keep block parameters gathered from forward to backward under them (`fsdp_keeps_gathered`)
SPLIT_BACKWARD_SCHEDULES = ("interleavedzerobubble", "zbvzerobubble", "dualpipev")
# activation checkpointing (`modelpar.parallel.checkpointing`): "selective" recomputes only each
# block's attention core (Korthikanti et al. 2022, Sec. 5), "every-k" checkpoints blocks 0, k, 2k, ...
AC_MODES = ("none", "full", "selective", "every-k")
DEGREES = ("dp_replicate", "dp_shard", "tp", "pp")   # the four mesh degrees, outermost first
# class attribute that marks a model's attention core (QK^T, softmax, dropout, attention over V) for
# activation_checkpointing="selective"; read by the runtime (parallel.checkpointing) and the planner's
# profile, so it lives here, beside the modes, where both can import it without importing the other.
CORE_ATTR = "modelpar_attention_core"
PRECISIONS = ("fp32", "bf16")

# Strategy shorthands (DESIGN.md): each names a plan on N ranks; "auto"/"rules" are resolved by the
# planner, "placement" is one process over a device list, "custom" runs exactly the degrees given.
STRATEGIES = ("single", "placement", "ddp", "fsdp", "hsdp", "tp", "pp", "ddp+tp", "fsdp+tp", "auto",
              "rules", "custom")


@dataclass(frozen=True)
class ParallelPlan:
    """How one model is laid out over ``world_size`` ranks.

    Attributes:
        dp_replicate: data-parallel degree with replicated model states (DDP; the outer HSDP axis).
        dp_shard: data-parallel degree with sharded model states (FSDP2 / ZeRO-3).
        tp: tensor-parallel degree (Megatron-style colwise/rowwise split of each block's Linears).
        pp: pipeline-parallel degree (number of ranks along the pipeline).
        pp_schedule: one of ``PP_SCHEDULES``; used only when ``pp > 1``.
        n_microbatches: pipeline micro-batches per local batch; used only when ``pp > 1`` (the
            command line refuses ``--n-microbatches`` for a plan without a pipeline).
        virtual_stages: stages per pipeline rank (> 1 for interleaved schedules; the commands set 2
            for them when unset).
        stage_boundaries: optional first-block index of every stage after the first
            (``len == pp * virtual_stages - 1``); None balances stages automatically.
        activation_checkpointing: ``"none"``, ``"full"`` (non-reentrant recompute of every block),
            ``"selective"`` (recompute only each block's attention core: QK^T, softmax, dropout and
            attention over V, Korthikanti et al. 2022, Sec. 5; with a fused attention kernel, which
            saves no (seq x seq) tensor, this frees only the kernel's own output and log-sum-exp) or
            ``"every-k"`` (full recompute of blocks 0, k, 2k, ... with k = ``ac_every``).
        ac_every: k of ``"every-k"`` (>= 1; 1 checkpoints every block, like ``"full"``); must stay 1
            with the other modes.
        precision: ``"fp32"`` or ``"bf16"`` (bf16 compute, fp32 master weights and reductions).
        reshard_after_forward: FSDP only; free gathered parameters after forward (ZeRO-3) or keep
            them until backward (ZeRO-2-like, more memory, less communication).
        cpu_offload: FSDP only; keep sharded parameters and optimizer state in CPU memory (CUDA only).
        sequence_parallel: shard norm/dropout activations along the sequence under TP.
        compile: ``torch.compile`` each block (after TP and checkpointing, before FSDP/DDP).
        placement_devices: for single-process layer placement, the device of each segment (a JSON
            list on the command line, e.g. ``'["cuda:0","cuda:1"]'``); None for multi-process plans.
        defer_grad_sync: FSDP only, without a pipeline: under gradient accumulation keep unsharded
            fp32 gradients and reduce-scatter them once, on the last local batch of the step
            (``set_requires_gradient_sync(False)`` before it: 4 B/param of unsharded gradients held,
            one reduce-scatter per step). False (default): reduce-scatter every local batch and
            accumulate sharded gradients (FSDP2's default; under HSDP the all-reduce across replicas
            still runs once per step, ``set_requires_all_reduce(False)`` before the last).
    """

    dp_replicate: int = 1
    dp_shard: int = 1
    tp: int = 1
    pp: int = 1
    pp_schedule: str = "1f1b"
    n_microbatches: int = 1
    virtual_stages: int = 1
    stage_boundaries: tuple[int, ...] | None = None
    activation_checkpointing: str = "none"
    precision: str = "fp32"
    reshard_after_forward: bool = True
    cpu_offload: bool = False
    sequence_parallel: bool = False
    compile: bool = False
    placement_devices: tuple[str, ...] | None = None
    ac_every: int = 1
    defer_grad_sync: bool = False

    # ---- derived ------------------------------------------------------------------------------
    @property
    def world_size(self) -> int:
        return self.dp_replicate * self.dp_shard * self.tp * self.pp

    @property
    def dp(self) -> int:
        """Total data-parallel degree (replicate x shard): how many distinct batch slices."""
        return self.dp_replicate * self.dp_shard

    @property
    def num_stages(self) -> int:
        return self.pp * self.virtual_stages

    @property
    def pp_enabled(self) -> bool:
        return self.pp > 1

    @property
    def tp_enabled(self) -> bool:
        return self.tp > 1

    @property
    def fsdp_enabled(self) -> bool:
        return self.dp_shard > 1

    @property
    def hsdp_enabled(self) -> bool:
        return self.dp_replicate > 1 and self.dp_shard > 1

    @property
    def is_placement(self) -> bool:
        return self.placement_devices is not None

    def mesh_axes(self) -> tuple[tuple[str, int], ...]:
        """Named mesh axes with their sizes, outermost first, size-1 axes dropped."""
        axes = (("pp", self.pp), ("dp_replicate", self.dp_replicate), ("dp_shard", self.dp_shard),
                ("tp", self.tp))
        return tuple((n, s) for n, s in axes if s > 1)

    def describe(self) -> str:
        """Short human name, e.g. ``"fsdp2 x tp2"`` or ``"pp2(1f1b, m=4)"``."""
        if self.is_placement:
            return f"placement({', '.join(self.placement_devices)})"
        parts = []
        if self.pp > 1:
            v = f", v={self.virtual_stages}" if self.virtual_stages > 1 else ""
            parts.append(f"pp{self.pp}({self.pp_schedule}, m={self.n_microbatches}{v})")
        if self.hsdp_enabled:
            parts.append(f"hsdp{self.dp_replicate}x{self.dp_shard}")
        elif self.dp_shard > 1:
            parts.append(f"fsdp{self.dp_shard}")
        elif self.dp_replicate > 1:
            parts.append(f"ddp{self.dp_replicate}")
        if self.tp > 1:
            parts.append(f"tp{self.tp}" + ("+sp" if self.sequence_parallel else ""))
        name = " x ".join(parts) or "single"
        extras = []
        if self.activation_checkpointing == "every-k":
            extras.append(f"ac=every-{self.ac_every}")
        elif self.activation_checkpointing != "none":
            extras.append(f"ac={self.activation_checkpointing}")
        if self.defer_grad_sync:
            extras.append("deferred grad sync")
        if self.compile:
            extras.append("compiled")
        if self.precision != "fp32":
            extras.append(self.precision)
        return name + (f" [{', '.join(extras)}]" if extras else "")

    # ---- validation ---------------------------------------------------------------------------
    def validate(self, world_size: int | None = None, *, num_blocks: int | None = None,
                 local_batch_size: int | None = None) -> "ParallelPlan":
        """Check the plan on its own and against the job; return self.

        Args:
            world_size: number of ranks the job runs on (1 for placement plans).
            num_blocks: number of pipeline-splittable blocks of the model, if known.
            local_batch_size: samples per data-parallel rank per forward/backward, if known.

        Raises:
            ValueError: naming the field and the numbers, for any inconsistency.
        """
        for name in ("dp_replicate", "dp_shard", "tp", "pp", "n_microbatches", "virtual_stages"):
            v = getattr(self, name)
            if not isinstance(v, int) or v < 1:
                raise ValueError(f"ParallelPlan.{name} must be a positive integer, got {v!r}")
        if self.pp_schedule not in PP_SCHEDULES:
            raise ValueError(f"ParallelPlan.pp_schedule={self.pp_schedule!r} is unknown; valid: "
                             f"{', '.join(PP_SCHEDULES)}")
        if self.activation_checkpointing not in AC_MODES:
            raise ValueError(f"ParallelPlan.activation_checkpointing="
                             f"{self.activation_checkpointing!r} is unknown; valid: {', '.join(AC_MODES)}")
        if not isinstance(self.ac_every, int) or isinstance(self.ac_every, bool) or self.ac_every < 1:
            raise ValueError(f"ParallelPlan.ac_every must be a positive integer, got {self.ac_every!r}")
        if self.ac_every != 1 and self.activation_checkpointing != "every-k":
            raise ValueError(f"ParallelPlan.ac_every={self.ac_every} only applies with "
                             f"activation_checkpointing='every-k', got activation_checkpointing="
                             f"{self.activation_checkpointing!r} (--ac-every {self.ac_every} needs "
                             f"--activation-checkpointing every-k)")
        if self.defer_grad_sync and (self.dp_shard == 1 or self.pp > 1):
            raise ValueError(f"ParallelPlan.defer_grad_sync=True needs FSDP (dp_shard > 1) without a pipeline "
                             f"(torch.distributed.pipelining reduces gradients at the end of every schedule "
                             f"step itself), got dp_shard={self.dp_shard}, pp={self.pp}")
        if self.precision not in PRECISIONS:
            raise ValueError(f"ParallelPlan.precision={self.precision!r} is unknown; valid: "
                             f"{', '.join(PRECISIONS)}")
        if self.is_placement:
            if self.world_size != 1:
                raise ValueError(f"placement runs in one process: degrees must all be 1, got "
                                 f"dp_replicate={self.dp_replicate} dp_shard={self.dp_shard} "
                                 f"tp={self.tp} pp={self.pp}")
            if len(self.placement_devices) < 1:
                raise ValueError("ParallelPlan.placement_devices is empty")
        if world_size is not None and self.world_size != world_size:
            raise ValueError(
                f"the product of the degrees dp_replicate x dp_shard x tp x pp = {self.dp_replicate} x "
                f"{self.dp_shard} x {self.tp} x {self.pp} = {self.world_size} does not equal the world "
                f"size {world_size}")
        if self.pp > 1:
            multi = self.pp_schedule in MULTI_STAGE_SCHEDULES
            if not multi and self.virtual_stages != 1:
                raise ValueError(f"pp_schedule={self.pp_schedule!r} runs one stage per rank, but "
                                 f"virtual_stages={self.virtual_stages}; use one of "
                                 f"{', '.join(MULTI_STAGE_SCHEDULES)} for virtual stages")
            if multi and self.virtual_stages < 2:
                raise ValueError(f"pp_schedule={self.pp_schedule!r} needs virtual_stages >= 2 (stages per "
                                 f"rank: --virtual-stages 2), got {self.virtual_stages}")
            if self.pp_schedule in ("zbvzerobubble", "dualpipev") and self.virtual_stages != 2:
                raise ValueError(f"pp_schedule={self.pp_schedule!r} needs virtual_stages == 2 (V shape: "
                                 f"--virtual-stages 2), got {self.virtual_stages}")
            # torch.distributed.pipelining refuses these at schedule construction, after the model is
            # built (Schedule1F1B / ScheduleDualPipeV.__init__): caught here, before any work
            if self.pp_schedule in ("1f1b", "dualpipev") and self.n_microbatches < self.num_stages:
                raise ValueError(f"pp_schedule={self.pp_schedule!r} needs n_microbatches >= the number of "
                                 f"pipeline stages ({self.num_stages}), got n_microbatches="
                                 f"{self.n_microbatches}; use gpipe or more micro-batches")
            if self.pp_schedule in ("interleaved1f1b", "interleavedzerobubble"):
                # torch's schedules run max(1, m // pp) rounds of equal size (their __init__ raises)
                rounds = max(1, self.n_microbatches // self.pp)
                if self.n_microbatches % rounds:
                    raise ValueError(f"pp_schedule={self.pp_schedule!r} runs n_microbatches // pp = "
                                     f"{rounds} rounds of equal size, so n_microbatches must be a multiple "
                                     f"of {rounds}, got --n-microbatches {self.n_microbatches} with --pp "
                                     f"{self.pp}; use a multiple of pp (e.g. {rounds * self.pp})")
            if (self.pp_schedule in SPLIT_BACKWARD_SCHEDULES and self.activation_checkpointing != "none"
                    and not weight_pass_groups()):
                raise ValueError(f"pp_schedule={self.pp_schedule!r} with activation_checkpointing="
                                 f"{self.activation_checkpointing!r} needs torch.utils.checkpoint.GraphExecGroup, "
                                 f"which this torch lacks (its weight pass would replay each checkpointed block per "
                                 f"parameter group); upgrade torch, or use --activation-checkpointing none or 1f1b")
            if self.reshard_after_forward and fsdp_keeps_gathered(self.pp, self.dp_shard, self.pp_schedule):
                raise ValueError(f"pp_schedule={self.pp_schedule!r} with FSDP (dp_shard={self.dp_shard}) needs "
                                 f"reshard_after_forward=False (--no-reshard-after-forward): it runs the weight "
                                 f"part of a micro-batch's backward after later forwards, and FSDP resharding "
                                 f"after those forwards loses or corrupts the weight gradients (torch 2.13); "
                                 f"or use pp_schedule 1f1b / interleaved1f1b")
            if num_blocks is not None and self.num_stages > num_blocks:
                raise ValueError(f"pp x virtual_stages = {self.pp} x {self.virtual_stages} = "
                                 f"{self.num_stages} pipeline stages but the model has only "
                                 f"{num_blocks} blocks")
            if local_batch_size is not None and local_batch_size % self.n_microbatches:
                raise ValueError(f"local batch size {local_batch_size} is not divisible by "
                                 f"n_microbatches={self.n_microbatches} (case C5: pipeline micro-batches "
                                 f"must all have the same size); set --n-microbatches to a divisor of "
                                 f"{local_batch_size}, or raise --global-batch-size")
            if self.stage_boundaries is not None:
                b = tuple(self.stage_boundaries)
                if len(b) != self.num_stages - 1:
                    raise ValueError(f"stage_boundaries has {len(b)} entries; {self.num_stages} stages "
                                     f"need {self.num_stages - 1}")
                if list(b) != sorted(set(b)) or (b and b[0] < 1) or (
                        b and num_blocks is not None and b[-1] >= num_blocks):
                    raise ValueError(f"stage_boundaries={b} must be strictly increasing block indices "
                                     f"in [1, {num_blocks if num_blocks is not None else 'num_blocks'})")
        elif self.virtual_stages != 1 or self.stage_boundaries is not None:
            if self.stage_boundaries is not None or self.virtual_stages != 1:
                raise ValueError(f"virtual_stages={self.virtual_stages} / stage_boundaries="
                                 f"{self.stage_boundaries} only apply when pp > 1 (pp={self.pp})")
        if self.cpu_offload and self.dp_shard == 1:
            raise ValueError("cpu_offload=True needs FSDP (dp_shard > 1)")
        if self.sequence_parallel and self.tp == 1:
            raise ValueError("sequence_parallel=True needs tp > 1")
        return self

    # ---- serialization ------------------------------------------------------------------------
    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), sort_keys=True)

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> "ParallelPlan":
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(d) - known)
        if unknown:
            raise ValueError(f"unknown ParallelPlan fields {unknown}; valid: {sorted(known)}")
        d = dict(d)
        for k in ("stage_boundaries", "placement_devices"):
            if d.get(k) is not None:
                d[k] = tuple(d[k])
        if "reshard_after_forward" not in d and fsdp_keeps_gathered(d.get("pp", 1), d.get("dp_shard", 1),
                                                                   d.get("pp_schedule", "1f1b")):
            d["reshard_after_forward"] = False          # absent: what the schedule needs, as train resolves it
        return cls(**d)


def plan_for_strategy(strategy: str, world_size: int, **overrides: Any) -> ParallelPlan:
    """The plan a strategy shorthand names on ``world_size`` ranks (DESIGN.md, "Strategy names").

    ``ddp+tp`` and ``fsdp+tp`` put TP on 2 ranks (or ``overrides['tp']``) and DP on the rest;
    ``hsdp`` shards over 2 ranks (or ``overrides['dp_shard']``) and replicates over the rest.

    Raises:
        ValueError: unknown strategy (the valid ones are listed), or a world size the strategy
            cannot use.
    """
    s = strategy.lower()
    n = world_size
    if s in ("auto", "rules"):
        raise ValueError(f"strategy {strategy!r} is resolved by the planner, not by plan_for_strategy")
    if s not in STRATEGIES:
        raise ValueError(f"unknown strategy {strategy!r}; valid: {', '.join(STRATEGIES)}")
    ov = dict(overrides)
    if s == "custom":
        deg = {}                    # the overrides are the degrees
    elif s == "single":
        deg = {}
        if n != 1:
            raise ValueError(f"strategy 'single' runs on 1 rank, got nproc={n}")
    elif s == "placement":
        deg = {}
        ov.setdefault("placement_devices", ("cpu",) * 2)
    elif s == "ddp":
        deg = {"dp_replicate": n}
    elif s == "fsdp":
        deg = {"dp_shard": n}
    elif s == "tp":
        deg = {"tp": n}
    elif s == "pp":
        deg = {"pp": n}
        ov.setdefault("n_microbatches", 2 * n)
    else:
        inner_name = "dp_shard" if s == "hsdp" else "tp"
        inner = ov.pop(inner_name, 2)
        outer = {"hsdp": "dp_replicate", "ddp+tp": "dp_replicate", "fsdp+tp": "dp_shard"}[s]
        if n % inner or n // inner < 2 or inner < 2:
            raise ValueError(f"strategy {strategy!r} needs nproc = {outer} x {inner_name} with both >= 2 ({inner_name}="
                             f"{inner}), got nproc={n}; on {n} ranks use one axis, e.g. --strategy {'fsdp' if s == 'hsdp' else 'tp'}")
        deg = {outer: n // inner, inner_name: inner}
    for k in DEGREES:
        if k in ov and k in deg and ov[k] != deg[k]:
            raise ValueError(f"strategy {strategy!r} on {n} ranks sets {k}={deg[k]}, but {ov[k]} was given")
    deg.update(ov)
    return ParallelPlan(**deg)


@functools.cache
def weight_pass_groups() -> bool:
    """Whether torch has ``torch.utils.checkpoint.GraphExecGroup`` (PR 166536), which a split-backward schedule
    needs under checkpointing (`modelpar.parallel.pipeline.group_weight_pass`; else `ParallelPlan.validate` refuses)."""
    try:
        from torch.utils.checkpoint import GraphExecGroup  # noqa: F401
    except ImportError:
        return False
    return True


def fsdp_keeps_gathered(pp: int, dp_shard: int, pp_schedule: str) -> bool:
    """Whether FSDP's blocks must keep their parameters gathered between forward and backward
    (``reshard_after_forward=False``): FSDP under a pipeline schedule with a split backward
    (`SPLIT_BACKWARD_SCHEDULES`). Unset, ``--reshard-after-forward`` follows it (`train.resolve`), and
    the planner's plans do (its memory and time models read the plan's field)."""
    return pp > 1 and dp_shard > 1 and pp_schedule in SPLIT_BACKWARD_SCHEDULES


def strategy_of(plan: ParallelPlan) -> str:
    """The strategy shorthand whose family ``plan`` belongs to (DESIGN.md, "Strategy names"): the
    axes with a degree > 1 name it (``ddp``, ``fsdp``, ``hsdp``, ``tp``, ``pp``, ``ddp+tp``,
    ``fsdp+tp``; ``single`` on one rank, ``placement`` for a device list); any other combination of
    axes (a pipeline with data parallelism, HSDP with TP, ...) is ``custom``. ``modelpar plan
    --strategy S`` ranks the plans with ``strategy_of(plan) == S``."""
    if plan.is_placement:
        return "placement"
    return strategy_of_degrees(plan.dp_replicate, plan.dp_shard, plan.tp, plan.pp)


def strategy_of_degrees(dp_replicate: int, dp_shard: int, tp: int, pp: int) -> str:
    """`strategy_of` a multi-rank plan with these degrees (its family depends on them only)."""
    axes = tuple(n for n, d in (("dp_replicate", dp_replicate), ("dp_shard", dp_shard), ("tp", tp), ("pp", pp))
                 if d > 1)
    return _FAMILIES.get(axes, "custom")


_FAMILIES = {(): "single", ("dp_replicate",): "ddp", ("dp_shard",): "fsdp", ("tp",): "tp", ("pp",): "pp",
             ("dp_replicate", "dp_shard"): "hsdp", ("dp_replicate", "tp"): "ddp+tp", ("dp_shard", "tp"): "fsdp+tp"}
# every value `strategy_of_degrees` returns
STRATEGY_FAMILIES = (*_FAMILIES.values(), "custom")


def split_global_batch(global_batch_size: int, plan: "ParallelPlan") -> int:
    """The local batch ``train`` runs without a given local batch: ``global_batch_size`` over the plan's
    data-parallel ranks (`modelpar.train.loop.batch_terms`; ``estimate``'s per-strategy list asks the same).

    Raises:
        ValueError: the data-parallel degree does not divide the global batch, or exceeds it.
    """
    if global_batch_size % plan.dp:
        raise ValueError(f"global_batch_size={global_batch_size} is not divisible by the data-parallel "
                         f"degree {plan.dp} (dp_replicate x dp_shard = {plan.dp_replicate} x {plan.dp_shard})")
    if global_batch_size // plan.dp < 1:
        raise ValueError(f"global_batch_size={global_batch_size} is smaller than the data-parallel degree "
                         f"{plan.dp}")
    return global_batch_size // plan.dp


def gradient_accumulation_steps(global_batch_size: int, local_batch_size: int, dp_degree: int) -> int:
    """global / (local x dp), the derived number of forward/backward passes per optimizer step.

    Raises:
        ValueError: if the global batch is not a whole multiple of local x dp.
    """
    if min(global_batch_size, local_batch_size, dp_degree) < 1:
        raise ValueError(f"batch sizes and dp degree must be positive, got global_batch_size="
                         f"{global_batch_size}, local_batch_size={local_batch_size}, dp={dp_degree}")
    per_step = local_batch_size * dp_degree
    if global_batch_size % per_step:
        raise ValueError(f"global_batch_size={global_batch_size} is not divisible by local_batch_size x "
                         f"data-parallel degree = {local_batch_size} x {dp_degree} = {per_step}")
    return global_batch_size // per_step


# ---- the runtime's data-parallel wrappers ------------------------------------------------------
DP_WRAPPERS = ("none", "ddp", "replicate", "fsdp", "hsdp")


@dataclass(frozen=True)
class RuntimeLayout:
    """Which wrapper runs a plan's data-parallel axes, and how it reduces gradients under
    accumulation: what `modelpar.parallel.compose.parallelize` applies and what the planner's
    memory and step-time models charge (both read `runtime_layout`, so they cannot disagree).

    Attributes:
        dp_wrapper: ``"none"`` (no data parallelism); ``"ddp"`` (torch DistributedDataParallel over
            ``dp_replicate``: replicated states, bucketed all-reduce, the buckets the gradients'
            storage); ``"replicate"`` (FSDP2's ``replicate`` per block and the root, DDP semantics:
            ``dp_replicate`` under a pipeline or TP, where DDP's reducer does not work, see
            `modelpar.parallel.data_parallel.apply_replicate`); ``"fsdp"`` (FSDP2 ``fully_shard`` per
            block and the root over ``dp_shard``); ``"hsdp"`` (``fully_shard`` over the 2-D
            (``dp_replicate``, ``dp_shard``) mesh).
        dp_mesh_axes: the mesh axes the wrapper spans, outermost first (() for ``"none"``).
        sharded_grad_accumulation: each local batch of gradient accumulation is reduce-scattered and
            the shards accumulate (FSDP2's default): FSDP / HSDP without a pipeline and without
            ``defer_grad_sync``; under HSDP the all-reduce across replicas runs on the last local
            batch only. False: unsharded gradients accumulate and one reduction ends the step (DDP,
            replicate, a deferred FSDP sync; pipelines, whose runtime reduces after each schedule).
    """

    dp_wrapper: str
    dp_mesh_axes: tuple[str, ...]
    sharded_grad_accumulation: bool

    @property
    def fsdp2(self) -> bool:
        """FSDP2 modules (``fully_shard`` or ``replicate``): mixed precision by their policy."""
        return self.dp_wrapper in ("replicate", "fsdp", "hsdp")

    @property
    def shards_states(self) -> bool:
        """Parameters, gradients and optimizer state sharded over ``dp_shard`` (ZeRO-3)."""
        return self.dp_wrapper in ("fsdp", "hsdp")


def runtime_layout(plan: ParallelPlan) -> RuntimeLayout:
    """The data-parallel runtime of ``plan`` (see `RuntimeLayout`); pure, no torch import.

    ``dp_shard > 1``: FSDP2 ``fully_shard`` (HSDP with ``dp_replicate > 1``). ``dp_replicate > 1``
    alone: FSDP2 ``replicate`` under a pipeline or TP, torch DDP otherwise.
    """
    if plan.dp_shard > 1:
        return _LAYOUTS["hsdp" if plan.dp_replicate > 1 else "fsdp", plan.pp == 1 and not plan.defer_grad_sync]
    if plan.dp_replicate > 1:
        return _LAYOUTS["replicate" if (plan.pp > 1 or plan.tp > 1) else "ddp", False]
    return _LAYOUTS["none", False]


def autocasts(plan: ParallelPlan) -> bool:
    """Whether modelpar's runtime trains ``plan`` under ``torch.autocast`` with fp32 parameters: bf16
    without FSDP2 (``fully_shard`` / ``replicate`` hold bf16 parameters by their mixed-precision
    policy instead; `modelpar.parallel.compose.ParallelModel._autocast`). The planner profiles such
    plans' activations under autocast (`planner.profile.profile_model`'s ``autocast``)."""
    return plan.precision == "bf16" and not runtime_layout(plan).fsdp2


# every layout `runtime_layout` returns (immutable; the planner asks ~10^5 times a search)
_LAYOUTS = {(w, sharded): RuntimeLayout(w, {"none": (), "ddp": ("dp_replicate",), "replicate": ("dp_replicate",),
                                            "fsdp": ("dp_shard",), "hsdp": ("dp_replicate", "dp_shard")}[w], sharded)
            for w in DP_WRAPPERS for sharded in (False, True)}
