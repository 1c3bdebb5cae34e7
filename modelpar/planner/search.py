"""Search every layout of N devices, prune what cannot run, rank the rest by predicted throughput.

The space: every factorization dp_replicate x dp_shard x tp x pp = N, times pipeline schedule
(gpipe, 1f1b, interleaved1f1b and interleavedzerobubble with v in VIRTUAL_STAGES, zbvzerobubble with
v = 2), pipeline micro-batch count, activation checkpointing (none; where that does not fit,
selective, every-k with k in AC_EVERY_CHOICES, full), micro-batch size, and for FSDP with gradient
accumulation whether to defer the gradient sync.
Pruning keeps the reason; a whole subtree pruned at the layout level counts every candidate under it.
Each surviving candidate gets a memory estimate (`memory.rank_memory`) and a step-time estimate
(`cost.rank_step`), both over a few representative pipeline ranks (`_representatives`: first, last,
most parameters, most FLOPs + memory traffic), which bound every other rank where each stage runs
the same checkpointing. Under every-k checkpointing they do not (which of a stage's layers are
checkpointed differs per stage, so another rank can be slower or hold more), so every-k candidates
are evaluated on every pipeline rank, as `estimate_step` / `estimate_memory` are.
"""

from __future__ import annotations

import gc
from collections import Counter
from dataclasses import dataclass, field

from modelpar.plan import (AC_MODES, PP_SCHEDULES, STRATEGY_FAMILIES, ParallelPlan, fsdp_keeps_gathered,
                           strategy_of_degrees)
from modelpar.planner.cost import StepEstimate
from modelpar.planner.hardware import Hardware
from modelpar.planner.loads import _has_ends
from modelpar.planner.legality import selective_refusal
from modelpar.planner.layouts import Search, can_defer, evaluate_group, group_pruned, layouts
from modelpar.planner.memo import PlannerCache
from modelpar.planner.memory import OPTIMIZER_BYTES, Batch, MemoryEstimate
from modelpar.planner.topk import top_candidates
from modelpar.planner.profile import ModelProfile

VIRTUAL_STAGES = (2, 4, 8)
MICRO_BATCH_SIZES = (1, 2, 4, 8, 16, 32, 64)
AC_CHOICES = ("none", "selective", "every-k", "full")
AC_EVERY_CHOICES = (4, 2)     # k of "every-k" the search tries (ParallelPlan.ac_every)


def _ac_options(checkpointing: tuple[str, ...], every: tuple[int, ...], profile: ModelProfile,
                num_layers: int) -> list[tuple[str, int]]:
    """(mode, ac_every) pairs to try, roughly by increasing recompute: none, selective, every-k (larger
    k first), full. "selective" only for a model with attention cores (its profile says what they save),
    every-k only for k < the number of layers."""
    out = []
    for mode in ("none", "selective", "every-k", "full"):
        if mode not in checkpointing:
            continue
        if mode == "selective" and not any(b.attn_core_saved_bytes for b in profile.blocks):
            continue
        if mode == "every-k":
            out.extend((mode, k) for k in sorted(set(every), reverse=True) if 1 < k < num_layers)
        else:
            out.append((mode, 1))
    return out


@dataclass(slots=True)
class Candidate:
    plan: ParallelPlan
    batch: Batch
    memory: MemoryEstimate
    step: StepEstimate

    @property
    def micro_batch_size(self) -> int:
        return self.batch.micro_batch_size(self.plan)

    def layout_key(self) -> tuple:
        """Degrees + schedule: variants in micro-batch size, m, v or checkpointing count as one."""
        p = self.plan
        return (p.dp_replicate, p.dp_shard, p.tp, p.pp, p.pp_schedule if p.pp > 1 else "")


@dataclass
class SearchReport:
    """Ranked feasible candidates (fastest first) and what was pruned, by reason.

    With ``top_k`` (`search_plans`' top-k mode) ``ranked`` holds the first ``top_k`` of the full
    ranking only, ``pruned`` counts the layouts pruned whole and what the evaluated groups pruned, and
    ``topk_stats`` the work: (layout, micro-batch size, micro-batch count) groups bounded
    (``groups``) and with a candidate's memory estimated (``evaluated``), candidates whose step time
    was computed (``timed``), and the fitting candidates found (``fitting``, a lower bound on the
    number that fit)."""

    num_devices: int
    considered: int = 0
    pruned: Counter = field(default_factory=Counter)
    ranked: list[Candidate] = field(default_factory=list)
    top_k: int | None = None
    topk_stats: dict = field(default_factory=dict)

    @property
    def num_pruned(self) -> int:
        return sum(self.pruned.values())

    def distinct_layouts(self, k: int) -> list[Candidate]:
        """The best candidate of each of the first ``k`` distinct layouts (`Candidate.layout_key`)."""
        out, seen = [], set()
        for c in self.ranked:
            if c.layout_key() not in seen:
                seen.add(c.layout_key())
                out.append(c)
                if len(out) == k:
                    break
        return out

    def summary(self) -> str:
        reasons = ", ".join(f"{r}: {n}" for r, n in self.pruned.most_common())
        if self.top_k is not None:
            st = self.topk_stats
            return (f"{self.considered} candidates considered on {self.num_devices} devices; best "
                    f"{len(self.ranked)} of >= {st['fitting']} feasible, exact (evaluated {st['evaluated']} of "
                    f"{st['groups']} candidate groups, {st['timed']} step times, in order of a lower bound "
                    f"on step time; "
                    f"{self.num_pruned} pruned so far{': ' + reasons if reasons else ''})")
        return (f"{self.considered} candidates considered on {self.num_devices} devices, "
                f"{self.num_pruned} pruned{' (' + reasons + ')' if reasons else ''}, {len(self.ranked)} feasible")


def factorizations(n: int) -> list[tuple[int, int, int, int]]:
    """Every (dp_replicate, dp_shard, tp, pp) with product ``n``."""
    divs = [d for d in range(1, n + 1) if n % d == 0]
    out = []
    for pp in divs:
        for tp in divs:
            if (n // pp) % tp:
                continue
            rest = n // (pp * tp)
            for ds in divs:
                if ds > rest:
                    break
                if rest % ds == 0:
                    out.append((rest // ds, ds, tp, pp))
    return out


SEARCH_SCHEDULES = ("gpipe", "1f1b", "interleaved1f1b", "interleavedzerobubble", "zbvzerobubble")


def _schedules(pp: int, allowed: tuple[str, ...]) -> list[tuple[str, int]]:
    if pp == 1:
        return [("1f1b", 1)]
    out = []
    for s in allowed:
        if s in ("interleaved1f1b", "interleavedzerobubble", "loopedbfs"):
            out.extend((s, v) for v in VIRTUAL_STAGES)
        elif s in ("zbvzerobubble", "dualpipev"):
            out.append((s, 2))
        else:
            out.append((s, 1))
    return out


def _inner(per_dp: int, pp: int) -> list[tuple[int, int]]:
    """(micro-batch size, n_microbatches) pairs for a data-parallel rank with ``per_dp`` samples."""
    out = []
    for b in MICRO_BATCH_SIZES:
        if b > per_dp or per_dp % b:
            continue
        if pp == 1:
            out.append((b, 1))
            continue
        total = per_dp // b
        ms = {total} | {k * pp for k in (1, 2, 4) if total % (k * pp) == 0}
        out.extend((b, m) for m in sorted(ms))
    return out


def _ac_bounds(reps) -> tuple[float, float, float]:
    """Per sample, over a layout's representative ranks: (attention-core bytes selective
    checkpointing frees, the amount by which block inputs exceed a block's saved bytes, the largest
    block input). A micro-batch of b samples under selective checkpointing needs at least the
    memory without checkpointing less ``m b`` x the first (m micro-batches in flight at most);
    under every-k at least full checkpointing's less ``b (m x the second + the third)``: every-k
    keeps a block's input or its saved bytes where full keeps the input, and inside a block's
    backward full checkpointing also counts that block's input (`loads._backward_moments`)."""
    core = neg = top = 0.0
    for _, ld in reps:
        core = max(core, sum(c for _, _, c, _, _ in ld.ac_blocks))
        neg = max(neg, sum(max(0.0, r[1] - r[0]) for r, *_ in ld.ac_blocks))
        top = max(top, max((r[1] for r, *_ in ld.ac_blocks), default=0.0))
    return core, neg, top


def _plan(plans: dict, dr, ds, tp, pp, sched, m, v, ac, k, defer, precision, sp) -> ParallelPlan:
    """The ParallelPlan of these fields, shared by the micro-batch sizes of a layout (memoized in
    ``plans``)."""
    key = (m, ac, k, defer)
    plan = plans.get(key)
    if plan is None:
        base = plans.get(None)
        if base is None:
            plan = plans[None] = plans[key] = ParallelPlan(
                dp_replicate=dr, dp_shard=ds, tp=tp, pp=pp, pp_schedule=sched, n_microbatches=m,
                virtual_stages=v, activation_checkpointing=ac, precision=precision, sequence_parallel=sp,
                ac_every=k, defer_grad_sync=defer, reshard_after_forward=not fsdp_keeps_gathered(pp, ds, sched))
        else:
            # the layout's first plan with the fields the search varies replaced: the same fields
            # and values the constructor gives, without the frozen dataclass's __init__ (one
            # object.__setattr__ per field, ~3 us a plan, ~10^5 plans a search)
            plan = object.__new__(ParallelPlan)
            d = plan.__dict__
            d.update(base.__dict__)
            d["n_microbatches"], d["activation_checkpointing"], d["ac_every"], d["defer_grad_sync"] = m, ac, k, defer
            plans[key] = plan
    return plan


def _representatives(loads) -> list[tuple[int, object]]:
    """The pipeline ranks the search evaluates: the first (most micro-batches in flight), the second
    (the most in flight among the ranks that receive activations, and hold receive buffers), the last
    (head and loss), the one with the most model states (parameters, and the gradient and AdamW state
    of the trainable ones: 4 + 12 B; ties by parameters, so without frozen parameters the one with the
    most parameters) and the one with the most work."""
    idx = {0, min(1, len(loads) - 1), len(loads) - 1}
    for key in (lambda l: (l.params + 3 * l.trainable, l.params), lambda l: l.fwd_flops + l.fwd_mem):
        idx.add(max(range(len(loads)), key=lambda i: key(loads[i])))
    return [(i, loads[i]) for i in sorted(idx)]


def search_plans(profile: ModelProfile, num_devices: int, hw: Hardware, *, global_batch_size: int,
                 optimizer: str = "adamw", precision: str = "bf16", sequence_parallel: bool = False,
                 dp_overlap: bool = True, memory_fraction: float = 1.0,
                 schedules: tuple[str, ...] = SEARCH_SCHEDULES, allow_fsdp: bool = True, allow_ddp: bool = True,
                 checkpointing: tuple[str, ...] = AC_CHOICES, recv_per_microbatch: bool = True,
                 ac_every: tuple[int, ...] = AC_EVERY_CHOICES, defer_grad_sync: bool = True,
                 top_k: int | None = None, strategy: str | None = None) -> SearchReport:
    """Enumerate, prune and rank every plan of ``num_devices`` for one model and batch.

    Args:
        profile: `profile_model` output of the model (any batch size; scaled per sample).
        num_devices: world size N.
        hw: device description; a rank may use ``hw.memory_bytes * memory_fraction`` bytes.
        global_batch_size: samples per optimizer step (the same on every layout).
        optimizer: ``"sgd"``, ``"sgd_momentum"`` or ``"adamw"``.
        precision: ``"fp32"`` or ``"bf16"``.
        sequence_parallel: use SP whenever tp > 1.
        dp_overlap: DDP overlaps its all-reduce with backward.
        memory_fraction: share of ``hw.memory_bytes`` a plan may use.
        schedules: pipeline schedules to consider (names from ``plan.PP_SCHEDULES``).
        allow_fsdp: consider dp_shard > 1 (set False to search the DDP x TP x PP space only).
        allow_ddp: consider data parallelism over replicas of unsharded parameters (dp_replicate > 1
            with dp_shard = 1: DDP, or FSDP2's ``replicate`` under TP / PP); False under ``meta_init``,
            which those layouts refuse (they broadcast rank 0's whole parameters when they wrap).
        checkpointing: activation checkpointing modes to consider (`plan.AC_MODES`); a mode that
            recomputes is tried only where the same plan without checkpointing does not fit.
        recv_per_microbatch: see `memory.estimate_memory` (False models Megatron-LM's runtime).
        ac_every: the k of "every-k" to try.
        defer_grad_sync: also try FSDP plans (no pipeline, gradient accumulation) that defer the
            gradient sync to the last local batch (`ParallelPlan.defer_grad_sync`): unsharded
            gradients held, one reduce-scatter per step; ranked like any other candidate, so chosen
            only where it fits and is faster.
        top_k: None: rank every feasible candidate. K >= 1: only the first K of that ranking (the same
            candidates, order and numbers), found by evaluating candidates in increasing order of a
            proven lower bound on their step time (`topk`); the report's pruning counts then cover
            what was evaluated only (`SearchReport.summary` says so).
        strategy: None: every layout. A family name (``fsdp``, ``hsdp``, ``ddp+tp``, ...: the values of
            `plan.strategy_of`): only the layouts of that family, so the ranking is the full ranking's
            plans of that family, in its order (`modelpar plan --strategy S`); the counts cover them only.

    Returns:
        SearchReport; ``ranked`` is sorted by predicted samples/s, fastest first.

    Raises:
        ValueError: non-positive device count or batch, unknown optimizer, top_k < 1, a ``strategy``
            that names no family of multi-rank plans.
    """
    if num_devices < 1 or global_batch_size < 1:
        raise ValueError(f"num_devices={num_devices} and global_batch_size={global_batch_size} must be >= 1")
    if top_k is not None and (isinstance(top_k, bool) or not isinstance(top_k, int) or top_k < 1):
        raise ValueError(f"top_k={top_k!r} must be None (every candidate) or an integer >= 1")
    if strategy is not None and strategy not in STRATEGY_FAMILIES:
        raise ValueError(f"strategy={strategy!r} names no family of plans; valid: {', '.join(STRATEGY_FAMILIES)}")
    if optimizer not in OPTIMIZER_BYTES:
        raise ValueError(f"--optimizer {optimizer!r} is unknown; valid: {', '.join(OPTIMIZER_BYTES)}")
    budget = hw.memory_bytes * memory_fraction
    foreach = hw.kind != "cpu"             # torch's optimizers use foreach kernels on accelerators
    gloo = hw.kind == "cpu"                # CPU ranks communicate over gloo (its reduce-scatter copies)
    # the blocks a pipeline can split: without the input / output parts where the profile has them (a
    # transformer's, or `profile.default_blocks`' embed / head of a model with found blocks: `loads._has_ends`)
    num_layers = len(profile.blocks) - 2 if _has_ends(profile) else len(profile.blocks)
    rep = SearchReport(num_devices)
    cache = PlannerCache(profile, hw)        # the memo tables of this search (`memo.PlannerCache`)
    bad = [s for s in schedules if s not in PP_SCHEDULES] + [a for a in checkpointing if a not in AC_MODES]
    if bad:
        raise ValueError(f"unknown schedules/checkpointing modes {bad}; valid: {PP_SCHEDULES}, {AC_MODES}")
    ac_opts = _ac_options(tuple(checkpointing), tuple(ac_every), profile, num_layers)
    if not ac_opts:
        why = [selective_refusal(profile)] if "selective" in checkpointing else []
        if "every-k" in checkpointing:
            why.append(f"every-k needs 1 < k < {num_layers} layers, given ac_every={tuple(ac_every)} (--ac-every)")
        raise ValueError(f"no checkpointing mode to search (checkpointing={tuple(checkpointing)}): "
                         + "; ".join(w for w in why if w))
    S = Search()
    S.profile, S.hw, S.rep, S.budget, S.cache, S.ac_opts = profile, hw, rep, budget, cache, ac_opts
    S.has_full, S.n_ac, S.num_layers, S.global_batch_size = ("full", 1) in ac_opts, len(ac_opts), num_layers, \
        global_batch_size
    S.optimizer, S.precision, S.sequence_parallel, S.dp_overlap = optimizer, precision, sequence_parallel, dp_overlap
    S.allow_fsdp, S.allow_ddp, S.defer_grad_sync = allow_fsdp, allow_ddp, defer_grad_sync
    S.overhead = hw.framework_overhead_bytes
    S.state_bytes = 8 + OPTIMIZER_BYTES[optimizer]
    S.mem_kw = dict(optimizer=optimizer, global_batch_size=global_batch_size,
                    foreach=foreach, recv_per_microbatch=recv_per_microbatch, gloo=gloo, cache=cache)
    S.flops = (profile.fwd_flops_per_sample, profile.train_flops_per_sample - profile.fwd_flops_per_sample)
    S.act_bytes = 2 if precision == "bf16" else 4
    S.load_cache, S.flight_cache, S.shared_times, S.families = {}, {}, {}, {}
    S.schedules = lambda pp: _schedules(pp, tuple(schedules))
    S.inner, S.ac_bounds, S.representatives, S.plan_of, S.candidate = (_inner, _ac_bounds, _representatives, _plan,
                                                                        Candidate)
    # Hot loop (~10^5 candidates at 3,072 devices). Work that depends only on the degrees, the schedule
    # or (b, m) is done once per layout (`layouts.layouts`), and a plan does not depend on the micro-batch
    # size, so one ParallelPlan per (m, checkpointing) is shared by its micro-batch sizes. The cyclic
    # garbage collector is paused: the loop allocates ~10^5 acyclic objects, and the collections they
    # would trigger also walk every object of the process (torch's, the profiled model's), about a
    # sixth of the search's time. Every candidate still gets its own memory and step estimate, from
    # per-layout forms (`memory.MemoryForm`, `cost.StepForm`: the same numbers as rank_memory /
    # rank_step, tests/test_planner_search_speed.py).
    gc_was_enabled = gc.isenabled()
    gc.disable()
    try:
        facts = factorizations(num_devices)
        if strategy is not None:
            facts = [f for f in facts if strategy_of_degrees(*f) == strategy]
        walk = layouts(S, facts)
        if top_k is not None:
            rep.ranked, _, rep.topk_stats = top_candidates(S, walk, top_k)
            rep.top_k = top_k
            return rep
        ranked, sort_keys = rep.ranked, []
        for L in walk:
            for b, m, acc, batch in L.groups:
                if group_pruned(S, L, m):
                    continue
                if can_defer(S, L, acc):
                    rep.considered += S.n_ac
                evaluate_group(S, L, b, m, acc, batch, ranked, sort_keys)
    finally:
        if gc_was_enabled:
            gc.enable()
    # fastest first, ties by memory: a stable sort on (step.total, memory.total), as before
    order = sorted(range(len(ranked)), key=sort_keys.__getitem__)
    rep.ranked = [ranked[i] for i in order]
    return rep


def choose_plan(profile: ModelProfile, num_devices: int, hw: Hardware, *, global_batch_size: int,
                top_k: int | None = 1, **kwargs) -> tuple[ParallelPlan, SearchReport]:
    """The fastest feasible plan (``--strategy auto``) and the search report.

    ``top_k``: as `search_plans` (default 1: only the best candidate is ranked, exactly the full
    ranking's first; None ranks every candidate and counts every pruning). The chosen plan's local
    batch size is ``report.ranked[0].batch.local_batch_size``.

    Raises:
        ValueError: no plan fits (the report's pruning reasons are in the message).
    """
    rep = search_plans(profile, num_devices, hw, global_batch_size=global_batch_size, top_k=top_k, **kwargs)
    if not rep.ranked:
        raise ValueError(f"no plan fits {num_devices} x {hw.name} "
                         f"({hw.memory_bytes / 2**30:.1f} GiB each): {rep.summary()}")
    return rep.ranked[0].plan, rep
