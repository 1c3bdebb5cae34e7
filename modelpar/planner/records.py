"""The planner's small records: named tuples with the fields the memory and step-time models pass
between their stages (`loads`, `memory`, `cost`, `grid`).

Named tuples, not dataclasses: they hash and compare as the plain tuples they replace (several are
memo-table keys, `memo.PlannerCache`), unpack positionally where a caller wants every field, and
cost a tuple's construction in the search's inner loops. Units as the models use them: bytes,
parameters (elements), seconds; "per sample" where a field scales with the micro-batch.
"""

from __future__ import annotations

import functools
from typing import Callable, NamedTuple


class GemmShape(NamedTuple):
    """One entry of `profile.BlockProfile.gemm_shapes`: a 2-D matrix product's shape and how often
    the block calls it, at the profiled batch (`profile_ops._mm_shape`; causal fused attention as
    layout ``"SDPA"`` with (B x H, S, D), `profile_ops._sdpa_shape`)."""

    phase: int          # 0 forward, 1 backward
    layout: str         # operand layout tag (or ``"SDPA"``)
    m: int
    k: int
    n: int
    batch_dim: int      # index (0..2) of the dimension among (m, k, n) that grows with the batch
    calls: int


class BlockRecord(NamedTuple):
    """One block's backward at its place in a stage (`loads._block_terms`), the input of
    `moments._backward_moments`. Per sample unless said otherwise; TP applied."""

    saved: float        # saved activation bytes (a stage's first block: without its input)
    kept: float         # full checkpointing: the input bytes it keeps (0 as a stage's first block);
                        # `recompute.ac_load`: what the block keeps under that mode
    peaks: tuple        # in-backward peaks (`BlockProfile.bwd_peaks`): (extra bytes, incoming
                        # gradient bytes, parameters with a stored gradient, parameters whose gradient
                        # is computed but not yet stored), `moments._scaled_peaks`
    params: float       # the block's parameters (elements)
    is_root: bool       # a transformer's embed / head: FSDP's root, not a unit
    in_grad: float      # bytes of the gradient w.r.t. the block's input (0 for the model's first block)
    in_saved: float     # bytes of its input among ``saved`` (0 as a stage's first block): under full
                        # checkpointing the same storage as the input it keeps, so counted once
    trainable: float    # the block's parameters that require gradients (elements; ``params`` less the
                        # frozen ones): its gradients and reduce-scatter input


class BwdMoment(NamedTuple):
    """A candidate peak inside block k's backward (`moments._backward_moments`). Bytes per sample and
    parameters (elements). Gradients exist for trainable parameters only: the fields that count
    gradients count those (``done_root``, ``next_unit``, ``done_units_trainable``; ``stored`` and
    ``pending`` are profiled), those that count gathered parameters count every parameter."""

    act: float          # saved activations of blocks <= k, plus the block's temporaries and incoming gradient
    act_ac: float       # the same under full checkpointing (or the mode's kept bytes, ``own``)
    done_units: float   # parameters of completed FSDP units (blocks after k)
    done_root: float    # trainable parameters of completed root blocks (embed / head after k)
    stored: float       # parameters of block k whose gradient is already stored
    unit: float         # unit k's parameters (0 for a root block)
    prev_unit: float    # the previous unit's parameters (being all-gathered by the prefetch)
    next_unit: float    # the next unit's trainable parameters (its reduce-scatter input retained)
    units_upto: float   # parameters of the units up to k
    pending: float      # parameters of block k whose gradient is computed but not yet stored
    done_units_trainable: float  # trainable parameters of completed FSDP units (their gradients)


class ReduceMoment(NamedTuple):
    """FSDP unit k's reduce-scatter (`moments._backward_moments`). Bytes per sample and parameters;
    gradients of trainable parameters only, as `BwdMoment`."""

    act: float          # saved activations of blocks < k, plus the gradient w.r.t. block k's input
    act_ac: float       # the same under full checkpointing / the mode's kept bytes
    done_units: float   # trainable parameters of completed units (their gradients)
    done_root: float    # trainable parameters of completed root blocks
    unit: float         # unit k's parameters (resharded)
    prev_unit: float    # the previous unit's
    units_before: float  # parameters of the units before k
    unit_trainable: float  # unit k's trainable parameters (its gradient: reduce-scatter input and output)


class ProjMode(NamedTuple):
    """What of a plan decides a rank's backward and reduce moments (`moments._projections`); also the
    memo key of the projections (`RankLoad.projections`, `PlannerCache.projections`)."""

    fsdp: bool          # dp_shard > 1
    ac: bool            # any activation checkpointing
    prev: bool          # gradients from earlier micro-batches / local batches exist
    rafw: bool          # FSDP's reshard_after_forward
    work: int           # bytes of a gathered / working parameter (2 bf16, 4 fp32)
    pp: int             # 0 none, 1 a pipeline, 2 one under autocast: its schedule runs inside autocast, whose
                        # cached weight copies (made in the step's first forward) have the lowest autograd
                        # sequence numbers of a later micro-batch's graph, so the engine casts their
                        # gradients last and each stays alive (2 B/param) until the stage's backward ends
    gloo: bool          # collectives on gloo (its reduce-scatter copies its input)
    sharded_acc: bool   # sharded gradients of earlier local batches held (FSDP accumulation)


class MomentTerms(NamedTuple):
    """A moment beyond a step's base bytes as linear forms in the micro-batch b and ws = 1 / dp_shard
    (`moments._bwd_terms`, `moments._rs_terms`): gradients = grads_k + grads_g ws, activations =
    acts_a b + acts_k, gathered parameters gathered_k, buffers = buffers_k + buffers_g ws (bytes)."""

    grads_k: float
    grads_g: float
    acts_a: float
    acts_k: float
    gathered_k: float
    buffers_k: float
    buffers_g: float


class MemoryParts(NamedTuple):
    """`memory.MemoryForm.parts`: `memory.MemoryEstimate`'s fields before ``overhead`` (bytes), and
    the moment of the peak."""

    params: float
    grads: float
    optimizer: float
    activations: float
    fsdp_gathered: float
    comm_buffers: float
    phase: str


class BlockTerms(NamedTuple):
    """`loads._block_terms`: one profile's per-block contributions to a `loads.RankLoad` for one TP
    degree, sequence parallel and activation scale."""

    prefix: list            # prefix sums over blocks of the additive fields `loads._SUMS`
    first_adj: list         # per block: (saved, saved_ac) corrections when it is its stage's first
    unit_params: list       # per block: FSDP-unit parameters, None for a transformer's embed / head
    numels: list            # per block: [(elements, is a matrix)] of its parameters
    record: Callable        # record(i, first, last) -> the block's `BlockRecord` at that place
    ac_info: list           # per block: (layer index or -1, attention-core saved bytes, forward
                            # FLOPs, fused-attention forward FLOPs), per sample
    stages: dict            # per stage range (a, b): its `StageTerms` (`stage_terms`, filled on use)
    shapes: list            # per block: ((`loads.RankLoad.gemm_shapes` key, calls), ...) per sample
    unit_trainable: list    # per block: the FSDP unit's trainable parameters, None for an embed / head
    trainable_numels: list  # per block: ``numels``' entries of its trainable parameters (the same list
                            # where none is frozen)
    all_trainable: bool     # no parameter of any block frozen (tied copies included): a rank's trainable
                            # lists are its parameter lists (`loads.rank_loads` shares them)


class StageTerms(NamedTuple):
    """`stage_terms`: what one stage (blocks a..b-1) adds to its rank's `loads.RankLoad`
    beyond the prefix sums, for one `BlockTerms` (TP degree, sequence parallel, activation scale)."""

    numels: list            # (elements, is a matrix) of each parameter tensor, in block order
    units: list             # FSDP units' parameters, in order
    records: list           # each block's `BlockRecord` at its place in the stage
    ac_blocks: list         # each block's `RankLoad.ac_blocks` entry
    shapes: dict            # `RankLoad.gemm_shapes`' calls per shape key, summed over the stage's blocks
    max_unit: float         # the largest FSDP unit's parameters (0.0 for none)
    diff: tuple             # the prefix sums' difference over the stage, in the order of `loads._SUMS`
    sizes: tuple            # the elements of each parameter tensor (``numels``' first fields)
    trainable_numels: list  # ``numels`` of the trainable parameter tensors
    unit_trainable: list    # each FSDP unit's trainable parameters, in order
    max_unit_trainable: float  # the most trainable parameters of an FSDP unit (0.0 for none)
    trainable_sizes: tuple  # the elements of each trainable parameter tensor


class SlowestRank(NamedTuple):
    """`cost.StepForm._slowest`: the pipeline rank with the most work at one micro-batch size and
    checkpointing mode (seconds per micro-batch)."""

    index: int              # its position in the form's loads
    load: object            # its `loads.RankLoad`
    t_f: float              # forward
    t_b: float              # backward
    t_rc: float             # recompute
    t_tp: float             # TP collectives and per-Linear cost
    fill: tuple | None      # GPipe / 1F1B: `formulas.fill_drain_from_sums`' sums before m, else None


def fast_new(cls):
    """A constructor of the named tuple ``cls`` from one tuple of its values in field order, without
    the Python frame of ``cls(...)`` (`tuple.__new__` itself, as ``cls._make`` uses): for the search's
    inner loops, where a record is built ~10^5 times per search."""
    return functools.partial(tuple.__new__, cls)


def stage_terms(terms: BlockTerms, a: int, b: int) -> StageTerms:
    """What stage ``[a, b)`` adds to its rank's `loads.RankLoad` beyond the prefix sums, memoized in
    ``terms.stages``: the search's layouts cut the blocks into few distinct stages (one split per
    stage count), so most of its ~200 `loads.rank_loads` calls find every stage there. The shapes'
    calls are counts (integers), so a rank's sum over its stages' sums is exact."""
    numels, units, recs, acb, shapes = [], [], [], [], {}
    everything = terms.all_trainable           # the trainable lists are the same lists
    tr_numels, tr_units = (numels, units) if everything else ([], [])
    for i in range(a, b):
        numels.extend(terms.numels[i])
        u = terms.unit_params[i]
        if u is not None:
            units.append(u)
        if not everything:
            tr_numels.extend(terms.trainable_numels[i])
            if u is not None:
                tr_units.append(terms.unit_trainable[i])
        recs.append(terms.record(i, i == a, i == b - 1))
        acb.append((recs[-1],) + terms.ac_info[i])
        for key, calls in terms.shapes[i]:
            shapes[key] = shapes.get(key, 0) + calls
    sizes, max_unit = tuple(k for k, _ in numels), max(units, default=0.0)
    out = terms.stages[(a, b)] = StageTerms(numels, units, recs, acb, shapes, max_unit, tuple(
        x - y for x, y in zip(terms.prefix[b], terms.prefix[a])), sizes, tr_numels, tr_units,
        max_unit if everything else max(tr_units, default=0.0), sizes if everything else tuple(k for k, _ in tr_numels))
    return out
