"""The pipeline stage split: which blocks each stage holds, decided once for the planner and the runtime.

The planner (`modelpar.planner.loads.stage_ranges`, from a `ModelProfile`) and the runtime's default
(`modelpar.parallel.pipeline.planned_ranges`, from the same kind of profile of the model it is given)
both call `split_blocks`, so a pipeline built without explicit boundaries holds the blocks the planner
priced, for every schedule and virtual-stage count (``num_stages = pp x virtual_stages``, or ``2 pp``
for the V-shaped schedules: `ParallelPlan.num_stages`; which rank holds which stage is
`modelpar.parallel.pipeline.stage_indices`). Pure: no torch import.

The rule:

- the blocks are a list with optional *ends*: the input part (embeddings, the parent forward's glue
  before the repeated blocks) and the output part (final norm, head), which join the first and the
  last stage and are never a stage of their own;
- *even* (transformers, whose layers are identical): the layers are split as evenly as possible,
  ``cuts[k] = k L // S`` (Megatron-LM's layout: Narayanan et al. 2021, Sec. 2.2 assigns
  ``L / p`` layers per stage);
- otherwise the split that minimises the largest stage cost (`balanced_partition`), the ends' costs
  added to the first and last layer. Callers pass per-sample forward + backward FLOPs, which are
  proportional to the batch, so the planner's profile (batch 1) and the runtime's (one micro-batch)
  give the same split.
"""

from __future__ import annotations

from collections.abc import Sequence


def balanced_partition(costs: Sequence[float], num_parts: int) -> list[int]:
    """Split ``costs`` into ``num_parts`` contiguous non-empty groups minimising the largest group sum.

    Exact dynamic program, O(parts x n^2) (the linear partition problem). Among equal optima the
    first found in the scan wins (deterministic, so every rank and the planner agree). Returns the
    start index of every group after the first (``len == num_parts - 1``).

    Raises:
        ValueError: more parts than items.
    """
    n = len(costs)
    if num_parts > n:
        raise ValueError(f"cannot split {n} blocks into {num_parts} non-empty stages")
    if num_parts == 1:
        return []
    prefix = [0.0]
    for c in costs:
        prefix.append(prefix[-1] + c)
    inf = float("inf")
    # best[k][i]: minimal max-sum splitting the first i items into k groups
    best = [[inf] * (n + 1) for _ in range(num_parts + 1)]
    arg = [[0] * (n + 1) for _ in range(num_parts + 1)]
    best[0][0] = 0.0
    for k in range(1, num_parts + 1):
        for i in range(k, n - (num_parts - k) + 1):
            for j in range(k - 1, i):
                v = max(best[k - 1][j], prefix[i] - prefix[j])
                if v < best[k][i] - 1e-12:
                    best[k][i], arg[k][i] = v, j
    cuts, i = [], n
    for k in range(num_parts, 1, -1):
        i = arg[k][i]
        cuts.append(i)
    return sorted(cuts)


def split_blocks(costs: Sequence[float], num_stages: int, *, ends: bool, even: bool) -> list[tuple[int, int]]:
    """Block index ranges ``[start, end)`` of each of ``num_stages`` pipeline stages (module docstring).

    Args:
        costs: one cost per block, the ends included when ``ends`` (any unit; only ratios matter;
            ignored when ``even``).
        ends: the first and the last entry are the input / output parts (they need ``len(costs) >= 3``;
            with fewer blocks there are no ends).
        even: split the layers by count, not by cost.

    Returns:
        ``num_stages`` contiguous ranges covering ``range(len(costs))``; with ends, the first range
        starts at 0 and the last ends at ``len(costs)``.

    Raises:
        ValueError: fewer than one stage, or more stages than layers (the blocks between the ends).
    """
    n = len(costs)
    ends = ends and n >= 3
    lo, hi = (1, n - 1) if ends else (0, n)
    layers = hi - lo
    if num_stages < 1:
        raise ValueError(f"num_stages must be >= 1, got {num_stages}")
    if num_stages > layers:
        raise ValueError(f"{num_stages} pipeline stages but the model has only {layers} blocks")
    if even:
        cuts = [lo + (k * layers) // num_stages for k in range(num_stages + 1)]
    else:
        inner = [float(c) for c in costs[lo:hi]]
        if ends:
            inner[0] += float(costs[0])
            inner[-1] += float(costs[-1])
        cuts = [lo] + [lo + c for c in balanced_partition(inner, num_stages)] + [hi]
    rng = [(cuts[k], cuts[k + 1]) for k in range(num_stages)]
    if ends:
        rng[0] = (0, rng[0][1])
        rng[-1] = (rng[-1][0], n)
    return rng


# schedules whose ranks hold stage r and stage 2 pp - 1 - r (a "V": Qi et al. 2024, "Zero Bubble
# Pipeline Parallelism", ICLR, Sec. 6; torch's ``generate_stage_to_rank_mapping(style="v")``)
V_SCHEDULES = ("zbvzerobubble", "dualpipev")


def rank_stages(pp_rank: int, pp: int, virtual_stages: int, schedule: str) -> list[int]:
    """Stage indices pipeline rank ``pp_rank`` holds, in the order the rank builds them (its chunks):
    ``[r, 2 pp - 1 - r]`` under a V schedule (`V_SCHEDULES`), else round-robin ``[r, r + pp, ...]``
    (``virtual_stages`` of them). The runtime (`modelpar.parallel.pipeline.stage_indices`) and the
    planner (`modelpar.planner.loads.rank_loads`) both place stages with this."""
    if schedule in V_SCHEDULES:
        return [pp_rank, 2 * pp - 1 - pp_rank]
    return [pp_rank + v * pp for v in range(virtual_stages)]


def stage_rank(stage: int, pp: int, schedule: str) -> int:
    """The pipeline rank holding ``stage`` (`rank_stages`' inverse)."""
    if schedule in V_SCHEDULES and stage >= pp:
        return 2 * pp - 1 - stage
    return stage % pp
