"""The rule-of-thumb baseline (``--strategy rules``): common advice, written as code.

The advice (../shared/reference/classic-expectations.md, "Advice as commonly given") applied with
this precedence: (1) what fits in memory, (2) the model-size band, (3) the device count, (4) the task.
"Model parallel" means pp when the model has at least two blocks per device, else tp. The table is in
docs/planner.md; `RULES` holds the same rows.
"""

from __future__ import annotations

from modelpar.plan import ParallelPlan
from modelpar.planner.hardware import Hardware
from modelpar.planner.memory import Batch, estimate_memory
from modelpar.planner.profile import ModelProfile

RULES = (
    ("memory", "the whole model + a micro-batch of 1 does not fit one device", "shard: FSDP over all devices "
     "(or model parallel if the size band says so and it fits)"),
    ("size", "<= 100M parameters", "one device, or DDP on several"),
    ("size", "100M - 500M", "DDP if it fits, else model parallel"),
    ("size", "500M - 1B", "model parallel (hybrid with DDP on > 8 devices)"),
    ("size", "> 1B", "FSDP (HSDP: shard inside a node, replicate across, on > 8 devices)"),
    ("devices", "1", "single"),
    ("devices", "> 8", "hybrid: the size-band choice inside a node x DDP across nodes"),
    ("task", "image classification / detection", "DDP whenever it fits"),
)


def _model_parallel(profile: ModelProfile, num_blocks: int, n: int) -> dict | None:
    """pp with two blocks per device at least, else tp; the other where the model refuses one (its
    forward cannot be cut: ``pipeline_refusal``; no TP plan train runs: ``tp_refusal``); None: neither."""
    pp_ok = num_blocks >= 2 * n and not profile.pipeline_refusal
    if pp_ok:
        return {"pp": n, "n_microbatches": 2 * n}
    return None if profile.tp_refusal else {"tp": n}


def rule_plan(profile: ModelProfile, num_devices: int, hw: Hardware, *, global_batch_size: int,
              task: str = "language", optimizer: str = "adamw", precision: str = "fp32",
              allow_ddp: bool = True) -> tuple[ParallelPlan, str]:
    """The plan the common advice picks, and the rule that picked it.

    Args:
        profile: the model's profile; num_devices: world size N; hw: device (memory per rank).
        global_batch_size: samples per step (must be divisible by the data-parallel degree chosen).
        task: ``"language"``, ``"image"`` or ``"detection"``.
        allow_ddp: False (``meta_init``): no replicas of unsharded parameters; the DDP rule is skipped
            and model parallelism's data-parallel axis shards (FSDP) instead of replicating.

    Raises:
        ValueError: unknown task or num_devices < 1.
    """
    if task not in ("language", "image", "detection"):
        raise ValueError(f"task={task!r} is unknown; valid: language, image, detection")
    if num_devices < 1:
        raise ValueError(f"num_devices must be >= 1, got {num_devices}")
    n = num_devices
    P = profile.num_params
    blocks = len(profile.blocks) - (2 if profile.arch else 0)

    def mem(plan: ParallelPlan) -> float:
        local = plan.n_microbatches if plan.pp > 1 else 1
        return estimate_memory(profile, plan, Batch(local * plan.dp, local), optimizer=optimizer,
                               overhead_bytes=hw.framework_overhead_bytes).total

    def make(**deg) -> ParallelPlan:
        return ParallelPlan(precision=precision, **deg)

    if n == 1:
        return make(), "devices: 1 -> single"
    ddp = make(dp_replicate=n)
    replica_fits = allow_ddp and mem(ddp) <= hw.memory_bytes
    if replica_fits and (P <= 500e6 or task != "language"):
        why = "task: image -> DDP" if task != "language" else f"size {P / 1e6:.3g}M <= 500M and fits -> DDP"
        return ddp, why
    per_node = min(n, hw.devices_per_node)
    if P > 1e9:
        plan = make(dp_shard=n) if n <= 8 else make(dp_replicate=n // per_node, dp_shard=per_node)
        why = "size > 1B -> FSDP" + (" (HSDP across nodes)" if n > 8 else "")
    else:
        inner = n if n <= 8 else per_node
        mp = _model_parallel(profile, blocks, inner)
        if mp is None:          # too few blocks for pp (or no cut) and no TP plan: the sharding rule
            return make(dp_shard=n), f"size {P / 1e6:.3g}M -> model parallel, which the model refuses -> FSDP"
        plan = make(**{"dp_replicate" if allow_ddp else "dp_shard": n // inner}, **mp)
        why = f"size {P / 1e6:.3g}M -> model parallel" + ((" x DDP" if allow_ddp else " x FSDP") if n > 8 else "")
    if mem(plan) > hw.memory_bytes and plan.dp_shard != n:
        plan, why = make(dp_shard=n), why + "; does not fit -> FSDP over all devices"
    return plan, why
