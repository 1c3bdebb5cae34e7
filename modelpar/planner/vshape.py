"""Micro-batches in flight per chunk of a V-shaped pipeline schedule, read from torch's own action table.

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
    """The states no other state of the same backward chunk (last field) is >= in every field, sorted."""
    return tuple(sorted(s for s in states
                        if not any(o != s and o[4] == s[4] and all(x >= y for x, y in zip(o[:4], s[:4]))
                                   for o in states)))


@functools.lru_cache(maxsize=1024)
def v_states(schedule: str, p: int, m: int) -> tuple[tuple, ...]:
    """Per pipeline rank, the moments that can be its peak: the start of each backward computation,
    ``(c0, c1, n_out, grads, chunk)`` with c0 / c1 the micro-batches whose activations chunk 0 (stage r)
    / chunk 1 (stage 2p - 1 - r) holds (the one being backpropagated included), ``n_out`` the outputs
    the model's last stage (rank 0's chunk 1) has computed (0 on other ranks), ``grads`` 1 once a weight
    gradient exists on the rank, ``chunk`` the chunk whose backward runs (module docstring). A backward
    computation is a ``B``, an ``I`` of any stage but the first, or the first stage's ``W``; a moment
    inside a forward holds no more than the backward that follows its run of forwards. Units:
    micro-batches."""
    table = action_table(schedule, p, m)
    if table is None:
        return tuple(tuple((*closed_form(schedule, p, m, r), m if r == 0 else 0, 1, x) for x in (0, 1))
                     for r in range(p))
    out = []
    for r in range(p):
        s0, s1 = r, 2 * p - 1 - r
        held = {s0: 0, s1: 0}
        n_out = grads = 0
        states = set()
        for a in table[r]:
            for x in _flat(a):
                kind, st = x.computation_type.value, x.stage_index
                if kind == "F":
                    held[st] += 1
                    n_out += r == 0 and st == s1
                    continue
                if kind == "B" or (kind == "I" and st != 0) or (kind == "W" and st == 0):
                    states.add((held[s0], held[s1], n_out, grads, int(st == s1)))
                if kind in ("B", "W"):
                    held[st] -= 1
                    grads = 1
        out.append(_front(states))
    return tuple(out)
