"""The V schedules' (zbvzerobubble, dualpipev) stage placement and per-chunk micro-batches in flight
(`modelpar.planner.vshape`), against torch's own schedule tables; and, slow, the predicted per-rank
peak against `modelpar train`'s measurement."""

from __future__ import annotations

import pytest

from modelpar.plan import ParallelPlan
from modelpar.planner.vshape import action_table, closed_form, v_states
from modelpar.stage_split import V_SCHEDULES, rank_stages, stage_rank

CASES = [("zbvzerobubble", p, m) for p in (2, 3, 4) for m in (p, 2 * p, 3 * p, 2 * p - 1)] + \
        [("dualpipev", p, m) for p in (2, 3, 4) for m in (2 * p, 3 * p, 2 * p + 1)]


def _counts(schedule: str, p: int, m: int, rank: int) -> list[tuple[int, int]]:
    """(chunk 0, chunk 1) activations held after each compute action of torch's table: forwards less
    full backwards and weight passes (an independent walk of the table)."""
    s0, s1 = rank, 2 * p - 1 - rank
    held, out = {s0: 0, s1: 0}, []
    for a in action_table(schedule, p, m)[rank]:
        for x in (a.sub_actions or (a,)) if a is not None else ():
            t = x.computation_type.value
            held[x.stage_index] += 1 if t == "F" else -1 if t in ("B", "W") else 0
            out.append((held[s0], held[s1]))
    return out


@pytest.mark.parametrize("schedule,p,m", CASES)
def test_fullest_moment_per_chunk_matches_torchs_table(schedule, p, m):
    """At each rank's fullest moment of torch's table the chunks hold the closed form's counts (ZB-V:
    2p-1-r and r+1, DualPipeV: 2p-r and r+1, each at most m), and `v_states` lists that moment."""
    for r in range(p):
        counts = _counts(schedule, p, m, r)
        top = max(a + b for a, b in counts)
        assert top == sum(closed_form(schedule, p, m, r))
        assert closed_form(schedule, p, m, r) in [c for c in counts if sum(c) == top]
        states = v_states(schedule, p, m)[r]
        assert max(c0 + c1 for c0, c1, *_ in states) == top
        # every moment of the walk is bounded by a listed state of some chunk
        assert all(any(s[0] >= a and s[1] >= b for s in states) for a, b in counts[:-1])


def _pending(schedule: str, p: int, m: int, rank: int) -> list[tuple[int, int]]:
    """(chunk 0, chunk 1) micro-batches whose input pass ran and weight pass did not, after each compute
    action of torch's table (an independent walk; the first stage's I is a no-op: never pending)."""
    s0, s1 = rank, 2 * p - 1 - rank
    pend, out = {s0: 0, s1: 0}, []
    for a in action_table(schedule, p, m)[rank]:
        for x in (a.sub_actions or (a,)) if a is not None else ():
            t, st = x.computation_type.value, x.stage_index
            if st != 0:
                pend[st] += 1 if t == "I" else -1 if t == "W" else 0
            out.append((pend[s0], pend[s1]))
    return out


@pytest.mark.parametrize("schedule,p,m", CASES)
def test_input_passes_waiting_for_their_weight_pass(schedule, p, m):
    """`v_states`' i0 / i1 (micro-batches between I and W, whose intermediate gradients torch keeps)
    reach the table's largest counts; ZB-V's cool-down holds r of them per chunk on rank r (chunk 0
    of rank 0 is the first stage: none)."""
    for r in range(p):
        walk = _pending(schedule, p, m, r)
        states = v_states(schedule, p, m)[r]
        assert max(s[5] for s in states) <= max(a for a, _ in walk)
        assert max(s[6] for s in states) <= max(b for _, b in walk)
        if schedule == "zbvzerobubble" and m >= 2 * p:
            assert max(s[5] for s in states) == (r if r else 0)
            assert max(s[6] for s in states) == r


@pytest.mark.parametrize("schedule", V_SCHEDULES)
def test_sends_held_on_gloo_only_and_only_to_other_ranks(schedule):
    """With ``held_sends`` (gloo) the states count the outputs and input gradients the runtime's pending
    sends hold; none without, and none for a neighbour on the same rank (the V's turn at rank p - 1)
    or without one (the first stage sends no gradient, the last no output)."""
    p, m = 4, 3 * 4
    for r in range(p):
        assert all(s[7:] == (0, 0, 0, 0) for s in v_states(schedule, p, m)[r])
        held = v_states(schedule, p, m, True)[r]
        f0, f1, g0, g1 = (max(s[k] for s in held) for k in (7, 8, 9, 10))
        assert (f0 == 0) == (r == p - 1) and (g1 == 0) == (r == p - 1)
        assert (f1 == 0) == (r == 0) and (g0 == 0) == (r == 0)
        assert max(f0, f1, g0, g1) <= m


def test_gloo_sends_and_weight_pass_gradients_raise_the_v_estimate():
    """A ZB-V rank's estimate grows by the pending sends on gloo, and by the gradients its input passes
    keep for their weight passes; a 1F1B rank's does not change with gloo (no FSDP here)."""
    import dataclasses

    from modelpar.planner.loads import rank_loads
    from modelpar.planner.memory import rank_memory
    from modelpar.planner.profile import ModelProfile
    from tests.helpers.profiles import gpt_profile

    prof = gpt_profile("gpt-1m")[0]
    bare = ModelProfile(**{**{f.name: getattr(prof, f.name) for f in dataclasses.fields(prof)},
                           "blocks": tuple(dataclasses.replace(b, wgrad_bytes=0, wgrad_tp_sharded_bytes=0)
                                           for b in prof.blocks)})
    kw = dict(micro_batch_size=4, optimizer="adamw", overhead_bytes=0.0, global_batch_size=32)
    for sched, v in (("zbvzerobubble", 2), ("1f1b", 1)):
        plan = ParallelPlan(pp=2, pp_schedule=sched, virtual_stages=v, n_microbatches=8)
        for r, (ld, ld0) in enumerate(zip(rank_loads(prof, plan, act_bytes=4), rank_loads(bare, plan, act_bytes=4))):
            on, off = (rank_memory(ld, plan, pp_rank=r, gloo=g, **kw).total for g in (True, False))
            if sched == "1f1b":
                assert on == off
                continue
            assert on > off
            assert off > rank_memory(ld0, plan, pp_rank=r, **kw).total or r == 0


def test_zbv_paper_peak_is_two_p_micro_batches():
    """Qi et al. 2024 Sec. 6: ZB-V holds 2p micro-batches' activations (of one stage pair) per rank
    once m >= 2p - 1 (a 1F1B rank holds p of its one stage, 2p on two stages)."""
    for p in (2, 4, 8):
        assert all(sum(closed_form("zbvzerobubble", p, 4 * p, r)) == 2 * p for r in range(p))
        assert all(max(c0 + c1 for c0, c1, *_ in st) == 2 * p for st in v_states("zbvzerobubble", p, 4 * p))


@pytest.mark.parametrize("schedule", V_SCHEDULES)
def test_placement_matches_torch_and_runtime(schedule):
    from torch.distributed.pipelining.schedules import generate_stage_to_rank_mapping

    from modelpar.parallel.pipeline import stage_indices
    for p in (2, 3, 4):
        torch_map = generate_stage_to_rank_mapping(p, 2 * p, style="v")
        assert {s: stage_rank(s, p, schedule) for s in range(2 * p)} == torch_map
        for r in range(p):
            assert rank_stages(r, p, 2, schedule) == stage_indices(r, p, 2, schedule) == [r, 2 * p - 1 - r]
    assert [stage_rank(s, 2, "interleaved1f1b") for s in range(4)] == [0, 1, 0, 1]


def test_rank_loads_place_v_stages_and_keep_round_robin():
    """Rank 0 holds the first and the last stage under a V schedule (the logits there), the stages'
    blocks in chunk order; interleaved keeps r and r + p."""
    from modelpar.planner.loads import plan_stage_ranges, rank_loads
    from tests.helpers.profiles import gpt_profile

    prof = gpt_profile("gpt-1m")[0]
    zbv = ParallelPlan(pp=2, pp_schedule="zbvzerobubble", virtual_stages=2, n_microbatches=4)
    il = ParallelPlan(pp=2, pp_schedule="interleaved1f1b", virtual_stages=2, n_microbatches=4)
    lz, li = rank_loads(prof, zbv, act_bytes=4), rank_loads(prof, il, act_bytes=4)
    assert [ld.is_last for ld in lz] == [True, False] and [ld.is_last for ld in li] == [False, True]
    rng = plan_stage_ranges(prof, zbv)
    assert [n for n, _ in lz[0].chunks] == [rng[0][1] - rng[0][0], rng[3][1] - rng[3][0]]
    assert lz[0].chunks[1][1] == 0.0 and lz[0].chunks[0][1] > 0     # the last stage sends nothing on
    assert lz[0].key != li[0].key                                      # memo tables keep them apart
    assert sum(ld.params for ld in lz) == pytest.approx(sum(ld.params for ld in li))


def test_v_in_flight_table_and_others_unchanged():
    from modelpar.planner.memory import in_flight
    zbv = ParallelPlan(pp=4, pp_schedule="zbvzerobubble", virtual_stages=2, n_microbatches=8)
    assert in_flight(zbv, 1) == v_states("zbvzerobubble", 4, 8)[1]
    assert in_flight(ParallelPlan(pp=4, n_microbatches=8), 1) == 3.0
    il = ParallelPlan(pp=4, pp_schedule="interleaved1f1b", virtual_stages=2, n_microbatches=8)
    assert in_flight(il, 0) == pytest.approx(min(8, 4 * (1 + 3 / 8)))


def test_v_rank_memory_counts_each_chunk():
    """The V estimate of a rank grows with the in-flight micro-batches of each chunk: more micro-batches
    never lower a rank's peak, and rank 1 (2 + 2 in flight at p = 2) holds more activations than 1F1B's
    rank 1 (1 micro-batch of 2 stages' worth), as the old model had it."""
    from modelpar.planner.memory import Batch, rank_estimates
    from tests.helpers.profiles import gpt_profile

    prof = gpt_profile("gpt-1m")[0]
    tot = []
    for m in (2, 4, 8):
        plan = ParallelPlan(pp=2, pp_schedule="zbvzerobubble", virtual_stages=2, n_microbatches=m)
        tot.append([e.total for e in rank_estimates(prof, plan, Batch(4 * m, 4 * m))])
    assert all(a[r] <= b[r] for a, b in zip(tot, tot[1:]) for r in range(2))


@pytest.mark.slow
@pytest.mark.timeout(600)
@pytest.mark.parametrize("name,tol", [("gpt1m-pp2-zbvzerobubble-m4", 0.10), ("gpt1m-8l-pp4-zbvzerobubble-m8", 0.06),
                                      ("gpt1m-8l-pp4-interleaved1f1b-m4", 0.08),
                                      ("gpt1m-8l-pp2-zbvzerobubble-m4-every-k2", 0.06),
                                      ("llama-pp2-zbvzerobubble-m4-full", 0.08)])
def test_v_schedule_predicted_rank_peaks_match_train(name, tol):
    """`modelpar train` of gpt-1m under ZB-V (micro-batch 4) on 2 and 4 CPU ranks: each rank's measured
    peak (StepMemory, ``peak_tensor_bytes_per_rank``) within ``tol`` of the planner's. Measured 32.1 / 31.1
    MiB (pp2 m4) and 51.2 / 49.5 / 56.9 / 62.2 MiB (8 layers, pp4 m8); the round-robin model with 1F1B's
    in-flight count predicted 27.2 / 21.1 MiB (-16%, -32%), the per-chunk model without the weight pass's
    kept gradients and the held sends 29.4 / 27.4 and 49.5 / 47.5 / 47.5 / 47.5 MiB (-12%; -17%, -24% on
    ranks 2 and 3: both fail); now 30.2 / 30.4 and 50.8 / 50.5 / 56.5 / 63.0 MiB. Interleaved 1F1B (8 layers,
    pp4 v2 m4): measured 40.8 / 40.2 / 37.7 / 32.4 MiB, Korthikanti's in-flight formula gave 41.5 / 40.9 /
    32.7 / 24.3 (-13%, -25% on ranks 2 and 3: fails), torch's table with the sends gloo holds 41.5 / 40.9 / 39.1 /
    34.7 (+7% on rank 3; docs/planner.md "Pipeline memory"). Under checkpointing (every second block; full on
    the tiny Llama) the measured peaks need the ``W`` moments (`test_weight_pass_moments_under_checkpointing`)
    and a ``W`` that replays each block once (`pipeline.group_weight_pass`; without it W's replays pile up)."""
    from modelpar.measure import rank_memory as prm

    c = next(c for c in prm.configs() if c["name"] == name)
    measured = prm.measure(c)
    predicted = prm.predict(c)
    assert len(measured) == c["pp"] and all(measured), measured
    for r, (meas, pred) in enumerate(zip(measured, predicted)):
        assert abs(pred - meas) <= tol * meas, (r, meas, pred)


def test_profile_counts_the_gradients_an_input_pass_keeps():
    """`BlockProfile.wgrad_bytes` of a GPT block: the outputs of ln_1, the fused qkv (3 d), the attention's
    output projection, ln_2, fc (4 d) and the MLP's projection: 11 x tokens x d_model x 4 B per sample in
    fp32; the colwise ones (qkv, fc: 7 of them) are the TP-sharded part. The head's is its norm's output
    and the logits (vocab-sharded under TP)."""
    from tests.helpers.profiles import gpt_profile

    prof = gpt_profile("gpt-1m")[0]
    d, seq, vocab, bs = prof.arch["d_model"], prof.tokens_per_sample, prof.arch["vocab_size"], prof.batch_size
    block, head = prof.blocks[1], prof.blocks[-1]
    assert block.wgrad_bytes == 11 * seq * d * 4 * bs
    assert block.wgrad_tp_sharded_bytes == 7 * seq * d * 4 * bs
    assert head.wgrad_bytes == (d + vocab) * seq * 4 * bs and head.wgrad_tp_sharded_bytes == vocab * seq * 4 * bs


@pytest.mark.parametrize("p,m,v", [(2, 4, 2), (4, 8, 2), (4, 12, 2), (4, 8, 4), (8, 16, 2)])
def test_interleaved_in_flight_is_torchs_warmup(p, m, v):
    """Interleaved 1F1B: rank r holds its warm-up's (v - 1) p + 2 (p - 1 - r) chunk forwards and one more
    (torch's ``_get_warmup_ops``), / v in whole-rank micro-batches: Korthikanti's p (1 + (p - 1)/(p v)) on
    rank 0, above the old (p - r)(1 + ...) on every later rank. Interleaved zero bubble: p on every rank, and
    (r + 1) / v micro-batches between I and W (the first stage's I is a no-op)."""
    from modelpar.planner.memory import in_flight
    from modelpar.planner.vshape import interleaved_in_flight

    il = interleaved_in_flight("interleaved1f1b", p, m, v)
    for r in range(p):
        assert il[r] == ((min(m, ((v - 1) * p + 2 * (p - 1 - r) + 1) / v), 0.0, 0.0, 0.0),)
        plan = ParallelPlan(pp=p, pp_schedule="interleaved1f1b", virtual_stages=v, n_microbatches=m)
        assert in_flight(plan, r) == il[r][0][0]          # one moment without sends: the scalar
        if r:
            assert il[r][0][0] > (p - r) * (1 + (p - 1) / (p * v))
    assert il[0][0][0] == pytest.approx(p * (1 + (p - 1) / (p * v)))
    zb = interleaved_in_flight("interleavedzerobubble", p, m, v)
    assert zb == tuple(((float(p), (r + 1) / v, 0.0, 0.0),) for r in range(p))
    plan = ParallelPlan(pp=p, pp_schedule="interleavedzerobubble", virtual_stages=v, n_microbatches=m)
    assert in_flight(plan, p - 1) == ((float(p), p / v, 0.0, 0.0),)
    # gloo: the held sends grow as the in-flight count falls (every moment kept); a rank ends holding every
    # output it sent (all but the last stage's) and every input gradient (all but the first stage's)
    for r, moments in enumerate(interleaved_in_flight("interleaved1f1b", p, m, v, True)):
        assert max(w for w, *_ in moments) == il[r][0][0]
        assert max(f for _, _, f, _ in moments) <= m - (1 / v if r == p - 1 else 0)
        assert max(g for *_, g in moments) <= m - (1 / v if r == 0 else 0)


def test_interleaved_zero_bubble_estimate_prices_the_weight_pass_gradients():
    """An interleaved zero-bubble rank's estimate grows by the gradients its pending weight passes keep
    (`RankLoad.wgrad` x (r + 1) / v micro-batches); interleaved 1F1B's does not read them."""
    import dataclasses

    from modelpar.planner.loads import rank_loads
    from modelpar.planner.memory import rank_memory
    from modelpar.planner.profile import ModelProfile
    from tests.helpers.profiles import gpt_profile

    prof = gpt_profile("gpt-1m")[0]
    bare = ModelProfile(**{**{f.name: getattr(prof, f.name) for f in dataclasses.fields(prof)},
                           "blocks": tuple(dataclasses.replace(b, wgrad_bytes=0, wgrad_tp_sharded_bytes=0)
                                           for b in prof.blocks)})
    kw = dict(micro_batch_size=4, optimizer="adamw", overhead_bytes=0.0, global_batch_size=32)
    for sched in ("interleavedzerobubble", "interleaved1f1b"):
        plan = ParallelPlan(pp=2, pp_schedule=sched, virtual_stages=2, n_microbatches=8)
        for r, (ld, ld0) in enumerate(zip(rank_loads(prof, plan, act_bytes=4), rank_loads(bare, plan, act_bytes=4))):
            with_g, without = (rank_memory(x, plan, pp_rank=r, **kw) for x in (ld, ld0))
            if sched == "interleaved1f1b":
                assert with_g.total == without.total
            else:       # both ranks peak in a backward (the loss's on rank 1), where the pending gradients sit
                assert with_g.phase not in ("optimizer", "pipeline_end"), with_g.phase
                assert with_g.total >= without.total + 4 * (r + 1) / 2 * ld.wgrad * 0.999



def test_the_weight_pass_replays_each_checkpointed_block_once_in_one_group():
    """torch's ``W`` (``stage_backward_weight``) runs one ``autograd.grad`` per parameter group and, alone,
    each replays the checkpointed block's forward: 2 GPT blocks, 2 forwards, 2 replays in ``I``, 16 in
    ``W`` (one per group). `pipeline.group_weight_pass` runs ``W`` inside one ``GraphExecGroup``: 2 replays,
    the gradients equal to a run without checkpointing. Selective checkpointing (the attention core,
    parameter-free) replays only at ``I``."""
    import torch
    import torch.nn as nn
    from torch.distributed.pipelining._backward import stage_backward_input, stage_backward_weight

    import modelpar.models.gpt as G
    from modelpar.parallel.checkpointing import apply_ac
    from modelpar.parallel.pipeline import group_weight_pass

    cfg = G.PRESETS["gpt-1m"]
    calls = {"block": 0, "core": 0}

    class Counted(G.Block):
        def forward(self, x):
            calls["block"] += 1
            return super().forward(x)

    class Stage:            # what the schedule calls: ``backward_weight_one_chunk`` after ``I``
        def __init__(self, params, groups):
            self.params, self.groups = params, groups

        def backward_weight_one_chunk(self, chunk_id, last_backward=False):
            stage_backward_weight(iter(self.params), self.groups)

    def run(mode: str, grouped: bool):
        torch.manual_seed(0)
        blocks = nn.ModuleList([Counted(cfg) for _ in range(2)])
        apply_ac(list(blocks), mode=mode)
        x = torch.randn(2, cfg.seq_len, cfg.d_model, requires_grad=True)
        y = x
        for b in blocks:
            y = b(y)
        params = list(blocks.parameters())
        before = dict(calls)
        _, groups = stage_backward_input([y], [torch.ones_like(y)], [x], iter(params))
        at_i = {k: calls[k] - before[k] for k in calls}
        stage = Stage(params, groups)
        if grouped:
            group_weight_pass(stage)
        stage.backward_weight_one_chunk(0)
        at_w = {k: calls[k] - before[k] - at_i[k] for k in calls}
        return [p.grad for p in params], at_i, at_w, len(groups)

    orig_core = G.AttentionCore.forward

    def core(self, *a):
        calls["core"] += 1
        return orig_core(self, *a)

    G.AttentionCore.forward = core
    try:
        ref, *_ = run("none", False)
        _, at_i, at_w, n_groups = run("full", False)
        assert (at_i["block"], at_w["block"]) == (2, n_groups) and n_groups > 2, (at_i, at_w, n_groups)
        grads, at_i, at_w, _ = run("full", True)
        assert (at_i["block"], at_w["block"]) == (2, 2), (at_i, at_w)
        assert all(torch.equal(a, b) for a, b in zip(grads, ref))
        grads, at_i, at_w, _ = run("selective", True)
        assert (at_i["core"], at_w["core"]) == (2, 0), (at_i, at_w)
        assert all(torch.equal(a, b) for a, b in zip(grads, ref))
    finally:
        G.AttentionCore.forward = orig_core


@pytest.mark.parametrize("schedule", ["interleavedzerobubble", "zbvzerobubble", "dualpipev"])
def test_split_backward_schedules_take_checkpointing_priced_and_ranked(schedule):
    """Every checkpointing mode validates under a split-backward schedule, and the search ranks such plans
    where memory is tight (every ranked plan validates: it ranked DualPipeV with fewer micro-batches than
    its 2 pp stages once, which torch refuses). Their step time prices two replays of each checkpointed
    block (at ``I`` and at ``W``) and one of each attention core: full's recompute is twice interleaved
    1F1B's (the same round-robin ranks), selective's the same."""
    from modelpar.planner.cost import estimate_step
    from modelpar.planner.hardware import get_hardware
    from modelpar.planner.memory import Batch
    from modelpar.planner.search import search_plans
    from tests.helpers.profiles import gpt_profile

    for mode, k in (("full", 1), ("selective", 1), ("every-k", 2)):
        ParallelPlan(pp=2, pp_schedule=schedule, virtual_stages=2, n_microbatches=4,
                     activation_checkpointing=mode, ac_every=k).validate(2)
    prof = gpt_profile("gpt-1m")[0]
    hw = get_hardware("cpu", local_ranks=4)
    for top_k in (None, 20):
        rep = search_plans(prof, 4, hw, global_batch_size=16, memory_fraction=0.002, top_k=top_k,
                           schedules=(schedule,))
        assert [c for c in rep.ranked if c.plan.activation_checkpointing != "none"], rep.summary()
        for c in rep.ranked:
            c.plan.validate(4)
    if schedule == "interleavedzerobubble":
        h100 = get_hardware("H100-80GB-SXM")
        rc = {(s, ac): estimate_step(prof, ParallelPlan(pp=2, virtual_stages=2, n_microbatches=4, pp_schedule=s,
                                                        activation_checkpointing=ac), Batch(16, 4), h100).recompute
              for s in ("interleaved1f1b", schedule) for ac in ("full", "selective")}
        assert rc[(schedule, "full")] == pytest.approx(2 * rc[("interleaved1f1b", "full")], rel=1e-9)
        assert rc[(schedule, "selective")] == pytest.approx(rc[("interleaved1f1b", "selective")], rel=1e-9)
        assert 0 < rc[(schedule, "selective")] < rc[(schedule, "full")]


def test_weight_pass_moments_under_checkpointing():
    """Under full or every-k checkpointing a V schedule's ``W`` replays its chunk's checkpointed blocks on
    top of the gradients its ``I`` kept: its moments join the table (`vshape.v_states` ``w_moments``) and
    raise the estimate by about one block's replayed activations. gpt-1m, 8 layers, pp2 ZB-V m4, every
    second block checkpointed: measured 45.0 / 49.7 MiB per rank (`benchmarks/pipeline_rank_memory.py`),
    predicted 37.2 / 42.7 without the W moments (-17%, -14%), 43.7 / 48.4 with them."""
    from modelpar.measure import rank_memory as prm

    plain = v_states("zbvzerobubble", 2, 4, True)
    with_w = v_states("zbvzerobubble", 2, 4, True, True)
    assert all(len(b) >= 1 for b in with_w) and with_w != plain
    c = next(c for c in prm.configs() if c["name"] == "gpt1m-8l-pp2-zbvzerobubble-m4-every-k2")
    pred = prm.predict(c)
    measured = [44.96 * 2 ** 20, 49.68 * 2 ** 20]      # the benchmark's run of this configuration
    assert all(abs(p - m) <= 0.06 * m for p, m in zip(pred, measured)), (pred, measured)


def test_group_weight_pass_leaves_a_torch_that_groups_w_itself_alone(monkeypatch):
    """``GraphExecGroup`` contexts cannot be nested: where torch's pipelining enters one around ``W``
    itself, `pipeline.group_weight_pass` leaves the stage as it is; torch 2.13 does not."""
    import modelpar.parallel.pipeline as P

    class Stage:
        def backward_weight_one_chunk(self, chunk_id, last_backward=False):
            return chunk_id

    assert P._torch_groups_weight_pass() is False      # this torch: modelpar groups W
    st = Stage()
    P.group_weight_pass(st)
    assert "backward_weight_one_chunk" in vars(st) and st.backward_weight_one_chunk(3) == 3
    monkeypatch.setattr(P, "_torch_groups_weight_pass", lambda: True)
    st = Stage()
    P.group_weight_pass(st)
    assert "backward_weight_one_chunk" not in vars(st)


def test_a_torch_without_graph_exec_group_refuses_checkpointing_under_a_split_backward(monkeypatch):
    """Without ``torch.utils.checkpoint.GraphExecGroup`` (`plan.weight_pass_groups`) the weight pass would
    replay each checkpointed block per parameter group: `ParallelPlan.validate` refuses checkpointing with
    a split-backward schedule, naming it, and accepts the schedule without checkpointing (the runtime then
    leaves ``W`` as torch runs it)."""
    import modelpar.parallel.pipeline as P
    import modelpar.plan as plan_mod

    assert plan_mod.weight_pass_groups() is True        # this torch
    monkeypatch.setattr(plan_mod, "weight_pass_groups", lambda: False)
    monkeypatch.setattr(P, "weight_pass_groups", lambda: False)
    with pytest.raises(ValueError, match=r"pp_schedule='zbvzerobubble' with activation_checkpointing='full' "
                                         r"needs torch.utils.checkpoint.GraphExecGroup"):
        ParallelPlan(pp=2, pp_schedule="zbvzerobubble", virtual_stages=2, n_microbatches=4,
                     activation_checkpointing="full").validate(2)
    ParallelPlan(pp=2, pp_schedule="zbvzerobubble", virtual_stages=2, n_microbatches=4).validate(2)

    class Stage:
        def backward_weight_one_chunk(self, chunk_id, last_backward=False):
            return chunk_id

    st = Stage()
    P.group_weight_pass(st)
    assert "backward_weight_one_chunk" not in vars(st)
