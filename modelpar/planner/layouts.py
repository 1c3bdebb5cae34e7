"""The search's layouts and their candidates: `layouts` walks every (degrees, schedule) of a search
with the layout-level prunes, and `evaluate_group` evaluates one (micro-batch size, micro-batch
count) group of a layout (its checkpointing modes and deferred-sync variants) as `search.search_plans`
always has, appending each fitting candidate (`fitting_variants`: the memory test, then
`StepForm.at`). The full ranking evaluates every group in enumeration order; the top-k mode
(`topk.top_candidates`) takes one checkpointing mode and variant at a time (`fitting_variants`
with ``stop``, `step_parts`) in increasing order of a lower bound on their step time. Both use these functions, so both see the same candidates with the same numbers
(the memo tables are pure: a value does not depend on which candidate filled it first).
"""

from __future__ import annotations

from modelpar.plan import ParallelPlan, autocasts
from modelpar.planner.comms import _coll
from modelpar.planner.cost import _finish, step_form, tp_bytes_per_sample
from modelpar.planner.grid import plan_memory as _plan_memory
from modelpar.planner.legality import V_SCHEDULES, split_violations, tie_refusal, tp_violations
from modelpar.planner.memory import Batch, rank_loads


class Search:
    """What one search shares between its layouts (set by `search.search_plans`)."""

    __slots__ = ("profile", "hw", "rep", "budget", "cache", "ac_opts", "has_full", "n_ac", "num_layers",
                 "global_batch_size", "optimizer", "precision", "sequence_parallel", "dp_overlap",
                 "allow_fsdp", "allow_ddp", "defer_grad_sync", "overhead", "state_bytes", "mem_kw", "flops", "act_bytes",
                 "load_cache", "flight_cache", "shared_times", "families", "ranked", "sort_keys", "schedules", "inner", "ac_bounds",
                 "representatives", "plan_of", "candidate")


class Layout:
    """One (dp_replicate, dp_shard, tp, pp, schedule, v) that passed the layout-level prunes: its rank
    loads, memo tables, step forms (built on first use) and (b, m, accumulation, Batch) groups."""

    __slots__ = ("order", "dr", "ds", "tp", "pp", "sched", "v", "sp", "reps", "loads", "every_rank",
                 "bounds", "plans", "flights", "flights_k", "sform", "sform_k", "mem_args", "groups",
                 "interleaved", "per_dp")

    def form(self, S: Search, plan: ParallelPlan, every_k: bool):
        """The layout's `cost.StepForm` (every-k: over every rank; pipelines: every rank too, whose
        times give the fill and drain; else the representative ranks)."""
        form = self.sform_k if every_k else self.sform
        if form is not None:
            return form
        loads = [ld for _, ld in self.every_rank] if (every_k or self.pp > 1) else self.loads
        form = step_form(loads, plan, S.hw, optimizer=S.optimizer, tp_bytes=tp_bytes_per_sample(S.profile, plan),
                         dp_overlap=S.dp_overlap, cache=S.cache)
        _share_times(S, self, form, plan, every_k)
        if every_k:
            self.sform_k = form
        else:
            self.sform = form
        return form

    def plan(self, S: Search, m: int, ac: str, k: int, defer: bool) -> ParallelPlan:
        return S.plan_of(self.plans, self.dr, self.ds, self.tp, self.pp, self.sched, m, self.v, ac, k, defer,
                         S.precision, self.sp)


def _share_times(S: Search, L: Layout, form, plan: ParallelPlan, every_k: bool) -> None:
    """Let ``form`` share its per-micro-batch-size tables (`cost.StepForm._times`' ``per_b``: each
    rank's forward and backward seconds, the TP all-reduce and per-Linear cost; `StepForm._slowest`'s
    ``slowest``) with the forms of the other layouts of one (tp, pp, v) that compute the same numbers.
    Those tables read, besides ``b`` and the plan's checkpointing and schedule (in their keys): the
    loads (one list per (tp, pp, v), V placement or not (`V_SCHEDULES`: other stages on each rank,
    `loads.rank_loads`) and rank set: the same objects), the precision, hardware and
    profile (one per search), and of the form: ``alone`` (dp x tp = 1: fixed by tp, pp and the
    device count), ``zb`` (the schedule), ``cast_b`` (the data-parallel wrapper), ``p`` / ``v``,
    ``tp_per_matrix`` (TP's all-reduce count), and the TP all-reduce's link (`comms._coll_sum`'s
    memoized (table, latency, volume) of the tp axis,
    read back from the cache): forms equal in all of these get equal tables. Where the link cannot be
    read back, the form keeps its own tables."""
    link = None
    if L.tp > 1:
        _coll(plan, "tp", S.hw, "all_reduce", 1.0, L.tp, not S.hw.comm_overlap, S.cache)
        link = S.cache.links.get((plan.tp, plan.dp_shard, plan.dp_replicate, plan.pp, "tp", "all_reduce", plan.tp,
                                  not S.hw.comm_overlap))
        if link is None:
            return
    key = (L.tp, L.pp, L.v, L.sched in V_SCHEDULES, every_k or L.pp > 1, form.alone, form.zb, form.cast_b,
           form.mem_s, link, getattr(form, "tp_per_matrix", None))
    form.per_b, form.slowest = S.shared_times.setdefault(key, ({}, {}))


def layouts(S: Search, factorizations):
    """Every layout of the search in enumeration order, after the layout-level prunes (counted in
    ``S.rep``: considered, and every candidate under a pruned layout)."""
    rep, pruned, profile, cache = S.rep, S.rep.pruned, S.profile, S.cache
    gbs, n_ac, num_layers, arch = S.global_batch_size, S.n_ac, S.num_layers, profile.arch
    order = 0
    for dr, ds, tp, pp in factorizations:
        if ds > 1 and not S.allow_fsdp:
            continue
        dp = dr * ds
        scheds = S.schedules(pp)
        per_dp = gbs // dp
        inner = S.inner(per_dp, pp) if gbs % dp == 0 else []
        n_inner = max(len(inner), 1) * n_ac
        layout_total = len(scheds) * n_inner
        rep.considered += layout_total
        if gbs % dp:
            pruned["global batch not divisible by dp"] += layout_total
            continue
        if dr > 1 and ds == 1 and not S.allow_ddp:      # replicas of unsharded parameters (--meta-init refuses)
            pruned["replicated data parallel (DDP) excluded"] += layout_total
            continue
        # the GPT's embedding and head split over the vocabulary under TP (runtime vocab parallel)
        if arch and tp > 1 and tp_violations(arch, tp):      # heads, kv heads, widths, vocab (legality.py)
            pruned["tp does not divide heads/kv heads/hidden/ffn/vocab"] += layout_total
            continue
        if tp > 1 and split_violations(profile.tp_splits, tp):   # a split width of the TP plan (case C7)
            pruned["tp does not divide a split width of the TP plan"] += layout_total
            continue
        if not arch and tp > 1 and any(b.num_params and b.num_params < tp for b in profile.blocks):
            pruned["tp larger than a layer"] += layout_total
            continue
        if tp > 1 and profile.tp_refusal:           # no TP plan train would run for this model
            pruned["the model has no TP plan train would run"] += layout_total
            continue
        if pp > 1 and profile.pipeline_refusal:     # its forward cannot be cut (train would refuse it)
            pruned["the model's forward cannot be cut into stages"] += layout_total
            continue
        sp = S.sequence_parallel and tp > 1
        mem_memo: dict[tuple, tuple] = {}     # rank memory of this layout's plans (`grid.plan_memory`)
        forms: dict[tuple, object] = {}      # and its `memory.MemoryForm`s
        mem_args = (S.mem_kw, S.budget, mem_memo, forms, S.overhead)
        # (b, m, accumulation steps, the Batch (frozen, shared by its candidates)): the same for every
        # schedule of the layout
        groups = [(b, m, gbs // (b * m * dp), Batch(gbs, b * m)) for b, m in inner]
        # the runtime autocasts (fp32 parameters) unless FSDP2 holds bf16 ones (profiled apart when the
        # profile has its autocast variant)
        ac = profile.autocast is not None and autocasts(ParallelPlan(tp=tp, pp=pp, dp_replicate=dr, dp_shard=ds,
                                                                     precision=S.precision))
        for sched, v in scheds:
            if pp * v > num_layers:
                pruned["more pipeline stages than layers"] += n_inner
                continue
            if tie_refusal(profile, pp, sched, dr * ds):
                pruned["a tie the V schedule's stages would split"] += n_inner
                continue
            key = (tp, pp, v, ac, sched in V_SCHEDULES)       # V schedules place stages apart (`loads.rank_loads`)
            cached = S.load_cache.get(key)
            if cached is None:
                plan0 = ParallelPlan(tp=tp, pp=pp, virtual_stages=v, sequence_parallel=sp,
                                     pp_schedule=sched, precision=S.precision)
                all_loads = rank_loads(profile, plan0, act_bytes=S.act_bytes, cache=cache, autocast=ac)
                # interleaved stages hold micro-batches in flight in no rank order: every rank
                reps = list(enumerate(all_loads)) if v > 1 else S.representatives(all_loads)
                # model states: 4 B per parameter, gradient and optimizer state per trainable one
                # (``state_bytes`` each where nothing is frozen: the parameters themselves)
                cached = S.load_cache[key] = (reps, [ld for _, ld in reps],
                                              max(_state_params(ld, S.state_bytes) for _, ld in reps),
                                              S.ac_bounds(reps), list(enumerate(all_loads)))
            reps, loads, max_params, bounds, every_rank = cached
            if max_params / ds * S.state_bytes + S.overhead > S.budget:
                pruned["model states exceed memory"] += n_inner
                continue
            L = Layout()
            L.order, L.dr, L.ds, L.tp, L.pp, L.sched, L.v, L.sp = order, dr, ds, tp, pp, sched, v, sp
            L.reps, L.loads, L.every_rank, L.bounds = reps, loads, every_rank, bounds
            L.plans = {}
            # in flight per rank depends only on pp, the schedule, v and m: shared by the layouts of
            # one (tp, pp, v) (the same representative ranks) and schedule
            tabs = S.flight_cache.get((tp, pp, v, sched))
            if tabs is None:
                tabs = S.flight_cache[(tp, pp, v, sched)] = ({}, {})
            L.flights, L.flights_k = tabs
            L.sform = L.sform_k = None
            L.mem_args, L.groups, L.interleaved, L.per_dp = mem_args, groups, sched.startswith("interleaved"), per_dp
            order += 1
            yield L


def _state_params(ld, state_bytes: float) -> float:
    """Parameters whose ``state_bytes`` each (parameter, gradient, optimizer state) equal the model
    states of rank load ``ld``: its parameters (4 B each) and its trainable parameters' gradients and
    optimizer state (``state_bytes - 4`` each), over ``state_bytes``; ``ld.params`` itself where
    nothing is frozen."""
    if ld.trainable == ld.params:
        return ld.params
    return (4 * ld.params + (state_bytes - 4) * ld.trainable) / state_bytes


def group_refusal(L: Layout, m: int) -> str | None:
    """Why the layout's schedule refuses this micro-batch count, or None."""
    if L.interleaved and m % L.pp:
        return "interleaved needs n_microbatches divisible by pp"
    if L.sched == "1f1b" and m < L.pp:      # torch's Schedule1F1B refuses it (ParallelPlan.validate)
        return "1f1b needs n_microbatches >= pp"
    if L.sched == "dualpipev" and m < 2 * L.pp:     # ScheduleDualPipeV too: m >= its 2 pp stages
        return "dualpipev needs n_microbatches >= 2 pp"
    return None


def group_pruned(S: Search, L: Layout, m: int) -> bool:
    """Whether the schedule refuses this micro-batch count (counted in ``S.rep.pruned``)."""
    why = group_refusal(L, m)
    if why is not None:
        S.rep.pruned[why] += S.n_ac
    return why is not None


def can_defer(S: Search, L: Layout, acc: int) -> bool:
    """Whether the group also tries deferring FSDP's gradient sync (`ParallelPlan.defer_grad_sync`)."""
    return S.defer_grad_sync and L.ds > 1 and L.pp == 1 and acc > 1


def fitting_variants(S: Search, L: Layout, b: int, m: int, acc: int, stop: int | None = None,
                     count_from: int = 0) -> list:
    """The fitting candidates of group (b, m) of layout ``L`` before their step time: (mode index in
    ``S.ac_opts``, variant (0, or 1: the deferred sync), plan, memory estimate, memory total) in the
    order of the full enumeration, for the modes up to index ``stop`` (None: every mode); prunings
    are counted in ``S.rep.pruned`` for the modes from index ``count_from`` on (the top-k mode asks
    for one mode at a time). The memory tables are memoized, so asking again repeats no estimate."""
    pruned, budget = S.rep.pruned, S.budget
    core_bound, neg_bound, in_bound = L.bounds
    reps, every_rank, flights, flights_k, mem_args = L.reps, L.every_rank, L.flights, L.flights_k, L.mem_args
    # checkpointing modes, by increasing recompute: any that recomputes is dominated where "none"
    # fits; every-k (larger k first) and full form a chain in which the first that fits dominates the
    # rest. Modes that cannot fit are skipped by the bounds of `search._ac_bounds` (exact: never a
    # candidate that would fit)
    defer = can_defer(S, L, acc)
    per = 2 if defer else 1
    fits_none = chain_fit = False
    none_over = full_res = None
    out = []
    for j, (ac, k) in enumerate(S.ac_opts):
        if stop is not None and j > stop:
            break
        cnt = per if j >= count_from else 0
        if ac != "none" and fits_none:
            pruned["dominated (fits without checkpointing)"] += cnt
            continue
        if chain_fit and ac in ("every-k", "full"):
            pruned["dominated (less recompute fits)"] += cnt
            continue
        if ac == "selective" and none_over is not None and none_over > m * b * core_bound:
            pruned["activations exceed memory"] += cnt
            continue
        if ac == "every-k" and S.has_full:
            if full_res is None:
                full_res = _plan_memory(L.plan(S, m, "full", 1, False), reps, b, acc, flights, *mem_args)
            if full_res[1] - budget > b * (m * neg_bound + in_bound):
                pruned["activations exceed memory"] += cnt
                continue
        plan = L.plans.get((m, ac, k, False)) or L.plan(S, m, ac, k, False)
        # every-k: every pipeline rank (the representatives bound the others only where all stages
        # checkpoint alike); a separate in-flight table, as its ranks differ
        ranks = every_rank if ac == "every-k" else reps
        fl = flights_k if ac == "every-k" else flights
        mem, mem_total = (full_res if (ac == "full" and full_res is not None)
                          else _plan_memory(plan, ranks, b, acc, fl, *mem_args))
        if mem_total > budget:
            pruned["activations exceed memory"] += cnt
            if ac == "none":
                none_over = mem_total - budget
            continue
        fits_none = fits_none or ac == "none"
        chain_fit = chain_fit or ac in ("every-k", "full")
        out.append((j, 0, plan, mem, mem_total))
        if defer:           # more memory than the plan without it: only if that fits
            dplan = L.plan(S, m, ac, k, True)
            dmem, dtot = _plan_memory(dplan, ranks, b, acc, fl, *mem_args)
            if dtot > budget:
                pruned["activations exceed memory"] += 1 if j >= count_from else 0
            else:
                out.append((j, 1, dplan, dmem, dtot))
    return out


def step_parts(S: Search, L: Layout, plan: ParallelPlan, b: int, acc: int) -> tuple[dict, float]:
    """`cost.StepForm.at`'s parts of ``plan`` (a plan of ``L``) at (b, accumulation) and their
    `StepEstimate.total`: the same sum in the same order, so bitwise the same float."""
    p = L.form(S, plan, plan.activation_checkpointing == "every-k").at(plan, b, acc)
    return p, (p["compute"] + p["recompute"] + p["tp_comm"] + p["pp_comm"] + p["dp_comm"] + p["bubble"]
               + p["optimizer"])


def evaluate_group(S: Search, L: Layout, b: int, m: int, acc: int, batch: Batch, ranked: list, keys: list) -> None:
    """Evaluate the candidates of group (b, m) of layout ``L``: append each fitting one to ``ranked``
    and its (step total, memory total) to ``keys``, in the order of the full enumeration. The caller
    has counted the group's considered candidates and checked `group_pruned`."""
    profile, cache, gbs, flops, candidate = S.profile, S.cache, S.global_batch_size, S.flops, S.candidate
    for j, _, pl, mm, mt in fitting_variants(S, L, b, m, acc):
        parts = L.form(S, pl, pl.activation_checkpointing == "every-k").at(pl, b, acc)
        st = _finish(parts, profile, pl, gbs, flops, cache)
        ranked.append(candidate(pl, batch, mm, st))
        keys.append((st.total, mt))
