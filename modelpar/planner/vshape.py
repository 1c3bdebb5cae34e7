"""Micro-batches in flight on a pipeline rank (`in_flight`), per chunk of a V-shaped schedule (`v_states`)
and per rank of an interleaved one (`interleaved_in_flight`), read from torch's own action tables.

Under ``zbvzerobubble`` (ZB-V: Qi et al. 2024, "Zero Bubble Pipeline Parallelism", ICLR, Sec. 6; its
memory discussed in Qi et al. 2024, "Pipeline Parallelism with Controllable Memory", NeurIPS, whose
V-shape building block it is) and ``dualpipev`` (DeepSeek-AI 2024, "DeepSeek-V3 Technical Report",
Sec. 3.2.2, DualPipe's V variant) pipeline rank r holds two chunks: stage r (chunk 0) and stage
2p - 1 - r (chunk 1) (`modelpar.stage_split.rank_stages`). The two chunks hold different numbers of
micro-batches at the rank's peak, so 1F1B's ``min(p - r, m)`` for the whole rank (Korthikanti et al.
2022, Sec. 4.2.3) does not describe them: in torch's tables (torch 2.13) ZB-V's rank r holds
``min(2p - 1 - r, m)`` micro-batches on chunk 0 and ``min(r + 1, m)`` on chunk 1 at its fullest moment
(2p together once m >= 2p - 1), DualPipeV's ``2p - r`` and ``r + 1`` (2p + 1 together; it needs m >= 2p).
The paper's ZB-V holds 2p micro-batches' activations of one stage-pair per rank, as counted here.

How the runtime frees them (torch.distributed.pipelining ``PipelineStage``): a micro-batch's saved
activations are released by its full backward (``B``) or, when the backward is split, by its weight
pass (``W``): the input pass (``I``, ``stage_backward_input``) runs ``autograd.grad`` with
``retain_graph=True`` and keeps the graph for ``W`` (the first stage runs nothing at ``I`` and its
whole backward at ``W``). So a chunk's count is its forwards less its ``B`` and ``W`` actions.

`v_states` simulates a rank's action list in order (torch's ``_calculate_single_rank_operations`` of
the schedule class: the table its runtime executes; ``OVERLAP_F_B`` runs its forward, then its
backward) and keeps every moment's (chunk 0 count, chunk 1 count, outputs the model's last stage has
computed, weight gradients exist on the rank) that no other moment's exceeds in every field (the
memory model prices each, `memory.MemoryForm.parts`). Memoized per (schedule, p, m): the search asks
for a few micro-batch counts per pipeline degree. Where torch's table cannot be built (a torch without
these private methods), the closed forms above stand in, with gradients present and every output
computed (an upper bound).
"""

from __future__ import annotations

import functools
import types

from modelpar.stage_split import V_SCHEDULES

# torch's schedule class of each V schedule
_CLASSES = {"zbvzerobubble": "ScheduleZBVZeroBubble", "dualpipev": "ScheduleDualPipeV"}


def closed_form(schedule: str, p: int, m: int, rank: int) -> tuple[int, int]:
    """(chunk 0, chunk 1) micro-batches in flight on ``rank`` at its fullest moment (module docstring)."""
    if schedule == "dualpipev":
        return min(2 * p - rank, m), min(rank + 1, m)
    return min(2 * p - 1 - rank, m), min(rank + 1, m)


def action_table(schedule: str, p: int, m: int) -> dict[int, list] | None:
    """torch's compute actions of every rank of ``schedule`` on ``p`` ranks and ``m`` micro-batches (the
    schedule class's ``_calculate_single_rank_operations``, which reads only these sizes), or None where
    this torch cannot build it."""
    try:
        from torch.distributed.pipelining import schedules as sch

        cls = getattr(sch, _CLASSES[schedule])
        fake = types.SimpleNamespace(pp_group_size=p, num_stages=2 * p, _n_microbatches=m)
        return {r: cls._calculate_single_rank_operations(fake, r) for r in range(p)}
    except Exception:       # a private API: any change in it falls back to the closed form
        return None


def _flat(a) -> list:
    if a is None:
        return []
    subs = getattr(a, "sub_actions", None)
    return [x for s in subs for x in _flat(s)] if subs else [a]


def _front(states: set) -> tuple:
    """The states no other state of the same backward chunk (field 4) is >= in every other field, sorted."""
    def geq(o, s):
        return all(x >= y for j, (x, y) in enumerate(zip(o, s)) if j != 4)
    return tuple(sorted(s for s in states if not any(o != s and o[4] == s[4] and geq(o, s) for o in states)))


@functools.lru_cache(maxsize=1024)
def v_states(schedule: str, p: int, m: int, held_sends: bool = False, w_moments: bool = False) -> tuple[tuple, ...]:
    """Per pipeline rank, the moments that can be its peak: the start of each backward computation,
    ``(c0, c1, n_out, grads, chunk, i0, i1, f0, f1, g0, g1)``:

    - ``c0`` / ``c1``: the micro-batches whose activations chunk 0 (stage r) / chunk 1 (stage 2p - 1 - r)
      holds (the one being backpropagated included); ``n_out`` the outputs the model's last stage (rank
      0's chunk 1) has computed (0 on other ranks); ``grads`` 1 once a weight gradient exists on the
      rank; ``chunk`` the chunk whose backward runs;
    - ``i0`` / ``i1``: micro-batches between their input pass ``I`` and their weight pass ``W`` on the
      chunk: torch's ``stage_backward_input`` keeps, besides the graph (in ``c``), the gradient at every
      parameter's first autograd node on the input's path (its ``param_groups`` ``grads``) for ``W``
      (the first stage runs nothing at ``I``: 0 there);
    - with ``held_sends`` (gloo): the multi-stage runtime keeps every p2p send's work until the step
      ends (``_PipelineScheduleRuntime._step_microbatches``' ``send_ops``), and a gloo send's work holds
      its tensor: ``f0`` / ``f1`` stage outputs sent to another rank beyond ``c`` (the micro-batches whose
      ``B`` or ``W`` ran), ``g0`` / ``g1`` input gradients sent (one per ``B`` or ``I``); 0 on a chunk
      whose neighbour stage is on this rank (the V's turn at rank p - 1) or that has none. NCCL
      (torch >= 2.7) releases a finished send's tensors from its watchdog: 0 without ``held_sends``.

    A backward computation is a ``B``, an ``I`` of any stage but the first, or the first stage's ``W``,
    and with ``w_moments`` every ``W`` (its micro-batch still counted in ``i``): under full or every-k
    checkpointing a ``W`` replays its chunk's checkpointed blocks one at a time
    (`modelpar.parallel.pipeline.group_weight_pass`) on top of the gradients its ``I`` kept, more than its
    ``I`` held (without checkpointing a ``W`` allocates little: its moments are left out). A moment inside
    a forward holds no more than the backward that follows its run of forwards. Units: micro-batches."""
    table = action_table(schedule, p, m)
    if table is None:
        up = m if held_sends else 0
        return tuple(tuple((*closed_form(schedule, p, m, r), m if r == 0 else 0, 1, x, m, m, up, up, up, up)
                           for x in (0, 1)) for r in range(p))
    out = []
    for r in range(p):
        s0, s1 = r, 2 * p - 1 - r
        # a chunk's forward send / backward send goes to another rank (module docstring: stage s lives on
        # rank s for s < p, on rank 2p - 1 - s after the V's turn)
        fwd_remote = {s0: held_sends and r < p - 1, s1: held_sends and r > 0}
        bwd_remote = {s0: held_sends and r > 0, s1: held_sends and r < p - 1}
        held = {s0: 0, s1: 0}
        pend = {s0: 0, s1: 0}           # I done, W pending
        freed = {s0: 0, s1: 0}          # B or W done (activations freed; the output still sent)
        sent_b = {s0: 0, s1: 0}         # input gradients sent
        n_out = grads = 0
        states = set()
        for a in table[r]:
            for x in _flat(a):
                kind, st = x.computation_type.value, x.stage_index
                if kind == "F":
                    held[st] += 1
                    n_out += r == 0 and st == s1
                    continue
                if kind == "B" or (kind == "I" and st != 0) or (kind == "W" and (st == 0 or w_moments)):
                    states.add((held[s0], held[s1], n_out, grads, int(st == s1), pend[s0], pend[s1],
                                freed[s0] * fwd_remote[s0], freed[s1] * fwd_remote[s1],
                                sent_b[s0] * bwd_remote[s0], sent_b[s1] * bwd_remote[s1]))
                if kind == "I" and st != 0:
                    pend[st] += 1
                if kind in ("B", "I"):
                    sent_b[st] += st != 0
                if kind in ("B", "W"):
                    held[st] -= 1
                    freed[st] += 1
                    grads = 1
                    if kind == "W" and st != 0:
                        pend[st] -= 1
        out.append(_front(states))
    return tuple(out)


# torch's schedule class of each round-robin interleaved schedule (stage s on rank s mod p)
_ROUND_ROBIN = {"interleaved1f1b": "ScheduleInterleaved1F1B", "interleavedzerobubble": "ScheduleInterleavedZeroBubble"}


@functools.lru_cache(maxsize=1024)
def interleaved_in_flight(schedule: str, p: int, m: int, v: int, held_sends: bool = False) -> tuple | None:
    """Per pipeline rank of an interleaved schedule (``v`` stages per rank, round-robin), from torch's own
    action table (the class's ``_calculate_single_rank_operations``): the moments that can be the rank's
    peak, ``(in flight, between I and W, sent outputs, sent input gradients)``, all in micro-batches of the
    whole rank (chunk counts / v: a rank's chunks hold equal blocks, but for the embedding and head), as
    `v_states` counts them per chunk (the sends with ``held_sends`` only, gloo; else 0). None where this
    torch cannot build the table (the formula of `memory.in_flight` stands in).

    Interleaved 1F1B runs ``(v - 1) p + 2 (p - 1 - r)`` chunk forwards before rank r's first backward
    (torch's ``_get_warmup_ops``, m a multiple of p; Megatron-LM's interleaved schedule warms up alike),
    so rank r holds ``((v - 1) p + 2 (p - 1 - r) + 1) / v``: Korthikanti et al. 2022's ``p (1 + (p - 1)
    / (p v))`` on rank 0, more on later ranks (2.5 against 1.375 on rank 3 of p = 4, v = 2).
    Interleaved zero bubble warms up with one forward per hop and frees a micro-batch at its ``W``: every
    rank holds p, and rank r keeps up to (r + 1) / v micro-batches' ``I`` -> ``W`` gradients at the same
    moment (the two maxima coincide in torch's tables)."""
    try:
        from torch.distributed.pipelining import schedules as sch

        cls = getattr(sch, _ROUND_ROBIN[schedule])
        rounds = max(1, m // p)
        fake = types.SimpleNamespace(pp_group_size=p, n_local_stages=v, _n_microbatches=m,
                                     number_of_rounds=rounds, microbatches_per_round=m // rounds)
        table = {r: cls._calculate_single_rank_operations(fake, r) for r in range(p)}
    except Exception:       # a private API: any change in it falls back to the formula
        return None
    last = p * v - 1
    out = []
    for r in range(p):
        held = pend = freed = sent_b = 0
        states = set()
        for a in table[r]:
            for x in _flat(a):
                kind, st = x.computation_type.value, x.stage_index
                if kind == "F":
                    held += 1
                    continue
                if kind != "I" or st != 0:
                    # every backward computation, a weight pass's too: interleaved zero bubble runs forwards
                    # right before some W, where the rank holds the most (without these moments it is priced
                    # 5-9% low; priced at a full backward's peak, W moments make `v_states`' ZB-V 2-9% high,
                    # so the V tables keep B / I moments only); the chunk field of `_front` is 0 here
                    states.add((held, pend, freed, sent_b, 0))
                if kind in ("B", "W"):
                    held -= 1
                    freed += held_sends and st != last          # its output went to another rank
                pend += 1 if (kind == "I" and st != 0) else -1 if (kind == "W" and st != 0) else 0
                sent_b += held_sends and kind in ("B", "I") and st != 0
        out.append(tuple((h / v, i / v, f / v, g / v) for h, i, f, g, _ in _front(states)))
    return tuple(out)


def w_moments(plan) -> bool:
    """Whether ``plan``'s V tables carry the ``W`` moments (`v_states`' ``w_moments``): under full or
    every-k checkpointing a ``W`` replays blocks. `in_flight` and `grid.plan_memory`'s table key read it."""
    return plan.activation_checkpointing in ("full", "every-k")


def in_flight(plan, pp_rank: int, gloo: bool = False) -> float | tuple:
    """Micro-batches whose activations a pipeline rank holds at its peak (Korthikanti Sec. 4.2.3).

    GPipe / looped BFS: m. 1F1B and zero-bubble variants: min(p - rank, m). Interleaved: from torch's
    table (`vshape.interleaved_in_flight`: p x (1 + (p - 1)/(p v)) on the first rank, more on later ones
    than that formula's (p - rank) x (1 + ...), which stands in where the table cannot be built), at most
    m; a tuple of moments ``(in flight, between I and W, sent outputs, sent input gradients)`` where the
    last three are not all 0. The V schedules
    (`V_SCHEDULES`: ZB-V, Qi et al. 2024 Sec. 6; DualPipeV) hold different counts on the rank's two
    chunks: a tuple of candidate moments, per chunk, from torch's own schedule (`vshape.v_states`),
    which `MemoryForm.parts` prices one by one (``gloo``: with the sends the multi-stage runtime holds).
    """
    p, m, v = plan.pp, plan.n_microbatches, plan.virtual_stages
    if p == 1:
        return 1.0
    if plan.pp_schedule in V_SCHEDULES:
        return v_states(plan.pp_schedule, p, m, gloo, w_moments(plan))[pp_rank]
    if plan.pp_schedule in ("gpipe", "loopedbfs"):
        return float(m)
    if v > 1 and plan.pp_schedule in ("interleaved1f1b", "interleavedzerobubble"):
        table = interleaved_in_flight(plan.pp_schedule, p, m, v, gloo)
        if table is None:
            return min(float(m), (p - pp_rank) * (1 + (p - 1) / (p * v)))
        out = tuple((min(float(m), w), *rest) for w, *rest in table[pp_rank])
        return out[0][0] if len(out) == 1 and not any(out[0][1:]) else out
    return float(min(p - pp_rank, m))
