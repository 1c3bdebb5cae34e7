"""What `modelpar calibrate` measured on a machine: a typed, versioned record the cost model reads.

A calibration file is JSON with ``schema_version`` (`SCHEMA_VERSION`), the device description
(`Hardware` fields) and a ``calibration`` object holding this dataclass. Version 3 adds what the
measurement knows about its own noise (``rounds``, ``spread``); version-2 files load with one round
and no spreads. Version 4 adds ``matmul_thin``; older files load without it (thin products beyond
the shape grid priced at its edge, as before). Version 5 adds ``dispatch_overhead_s``; older files
load without it (None: the per-op term prices the profiled non-view, non-matmul ops at the hardware's
``op_overhead_s``, as before). Version 6 adds ``compute_contention`` (and its per-kernel
``compute_contention_terms``); older files load with 1.0 and no terms (compute at the one-process
rates, as before). Files written before the schema existed (version 1: a flat `Hardware` dict whose measured tables were string keys of an
``extra`` dict, e.g. ``all_reduce_ctx_1048576``) are read and converted by `from_legacy_extra`, so
old caches keep working.

Units: FLOP/s, bytes, bytes/s, seconds. Message sizes in the collective tables are the full
(gathered / reduced) size in bytes, as in the alpha-beta forms of `modelpar.planner.cost`.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field
from functools import cached_property

SCHEMA_VERSION = 6
COLLECTIVE_OPS = ("all_reduce", "all_gather", "reduce_scatter", "send_recv")


@dataclass(frozen=True)
class CollectiveTable:
    """One collective between the calibrated local ranks.

    Attributes:
        latency_s / bandwidth: the alpha-beta fit (seconds, bytes/s).
        seconds: measured back-to-back times, ``{bytes: s}``.
        in_context: measured times of calls issued between compute segments (the wait for the
            slowest rank included), ``{bytes: s}``; empty where not measured.
    """

    latency_s: float
    bandwidth: float
    seconds: dict[int, float] = field(default_factory=dict)
    in_context: dict[int, float] = field(default_factory=dict)

    def points(self, in_context: bool) -> list[tuple[float, float]]:
        """Sorted ``(bytes, seconds)``: the in-context table where asked and measured, else back-to-back."""
        return self._ctx_points if in_context and self.in_context else self._points

    @cached_property
    def _points(self) -> list[tuple[float, float]]:
        return sorted((float(b), t) for b, t in self.seconds.items())

    @cached_property
    def _ctx_points(self) -> list[tuple[float, float]]:
        return sorted((float(b), t) for b, t in self.in_context.items())


@dataclass(frozen=True)
class Calibration:
    """Measured rates of one machine (`modelpar.calibrate.calibrate`).

    Attributes:
        matmul_flops: ``{N: FLOP/s}`` of a Linear's three N x N x N products on operands from memory.
        attention_flops: fused causal attention, counted FLOP/s.
        elementwise_bw: element-wise operators, counted bytes/s (None: not measured; the memory
            bandwidth applies).
        zero_bubble_backward_factor: a split (input / weight) backward's time over a plain one.
        core_share: the share of a core each rank had (< 1 when ranks outnumber cores).
        collective_ranks: ranks the collectives were measured with (0: not measured).
        collectives: op name (`COLLECTIVE_OPS`) -> `CollectiveTable`.
        mem_bandwidth_alone: one rank's memory bandwidth while the others idle (None: not measured).
        fresh_alloc_s_per_byte / fresh_alloc_min_bytes: allocator cost of fresh tensors at or above
            the threshold (page faults + unmapping), every rank at once; ``..._alone``: one rank alone.
        tp_linear_overhead_s / tp_linear_overhead_s_per_byte: framework time per TP Linear call
            (forward + backward) and per input byte.
        fsdp_unit_overhead_s / fsdp_tensor_overhead_s: framework time per FSDP2 unit and per
            parameter tensor.
        matmul_shapes: ``{layout: {(M, K, N): FLOP/s}}``: a grid of M x K x N fp32 products per
            layout (``"NT"`` a Linear's forward, ``"NN"`` its input gradient, ``"TN"`` its weight
            gradient) on operands from memory (`modelpar.calibrate.micro.measure_shapes`); empty
            for files from before schema 3, where the square curve prices every product.
        attention_shapes: ``{(B x H, S, D): counted FLOP/s}``: causal fused attention forward +
            backward over a grid of sequence lengths S and head dimensions D
            (`modelpar.calibrate.micro.measure_attention_shapes`), read as factors over its own point
            at ``attention_flops``' shape (`Hardware.attention_factor`); empty for files without it,
            where ``attention_flops`` prices every call.
        matmul_thin: ``{layout: {(rows, weight bytes): FLOP/s}}``: thin products whose weight-sized
            operand reaches far past the last-level cache (`modelpar.calibrate.thin`), read as
            factors beyond the shape grid's edge (`modelpar.planner.thin_matmul`); empty for files
            before schema 4, where the grid's edge prices them.
        dispatch_overhead_s: framework seconds per dispatched aten call as a module-structured
            model pays it, every call counted (views and matmuls included: module calls, autograd
            nodes and the engine, allocation, tiny kernels), from a chain of tiny pre-norm MLP blocks
            forward + backward (`modelpar.calibrate.micro.measure_dispatch_overhead`); priced per
            profiled call (`BlockProfile.fwd_calls`) in place of ``op_overhead_s`` per non-view,
            non-matmul op. None: not measured (files before schema 5), the old per-op term.
        compute_contention: a compute kernel's thread-CPU time with every local rank running the
            same kernels at the same moment over its time alone (the geometric mean over
            ``compute_contention_terms``; `modelpar.calibrate.contention`), its spread over the
            rounds in ``spread["compute_contention"]``. 1.0: not measured (files before schema 6,
            one-rank calibrations): compute priced at the one-process rates, as before.
        compute_contention_terms: ``{kernel: concurrent / alone}`` behind ``compute_contention``.
        rounds: rounds each term was measured in (the median kept; 1: a file from before
            schema 3, whose terms had no repeats at this level).
        spread: ``{term: relative spread}`` over those rounds, ``(max - min) / |median|``
            (`modelpar.calibrate.micro.robust`); term names are the fields above, ``matmul_flops[N]``,
            ``mem_bandwidth``, ``op_overhead_s``, ``matmul_peak`` and ``<op>.in_context[small]`` /
            ``[<n> KiB]``. Empty for files from before schema 3. Read by nothing in the cost model:
            it says how far a prediction can be trusted.
    """

    matmul_flops: dict[int, float] = field(default_factory=dict)
    attention_flops: float = 0.0
    elementwise_bw: float | None = None
    zero_bubble_backward_factor: float = 1.0
    core_share: float = 1.0
    collective_ranks: int = 0
    collectives: dict[str, CollectiveTable] = field(default_factory=dict)
    mem_bandwidth_alone: float | None = None
    fresh_alloc_s_per_byte: float = 0.0
    fresh_alloc_min_bytes: float = float("inf")
    fresh_alloc_s_per_byte_alone: float | None = None
    tp_linear_overhead_s: float = 0.0
    tp_linear_overhead_s_per_byte: float = 0.0
    fsdp_unit_overhead_s: float = 0.0
    fsdp_tensor_overhead_s: float = 0.0
    matmul_shapes: dict[str, dict[tuple[int, int, int], float]] = field(default_factory=dict)
    attention_shapes: dict[tuple[int, int, int], float] = field(default_factory=dict)
    matmul_thin: dict[str, dict[tuple[int, int], float]] = field(default_factory=dict)
    dispatch_overhead_s: float | None = None
    compute_contention: float = 1.0
    compute_contention_terms: dict[str, float] = field(default_factory=dict)
    rounds: int = 1
    spread: dict[str, float] = field(default_factory=dict)

    @cached_property
    def matmul_points(self) -> list[tuple[int, float]]:
        """``matmul_flops`` as sorted ``(N, FLOP/s)`` points."""
        return sorted(self.matmul_flops.items())

    def to_json(self) -> dict:
        """A JSON-ready dict (integer table keys become strings; inf becomes null)."""
        d = {k: v for k, v in asdict(self).items() if not k.startswith("_")}
        d["matmul_flops"] = {str(k): v for k, v in self.matmul_flops.items()}
        d["collectives"] = {op: {"latency_s": t.latency_s, "bandwidth": t.bandwidth, "seconds": {str(k): v for k, v in t.seconds.items()},
                                 "in_context": {str(k): v for k, v in t.in_context.items()}}
                            for op, t in self.collectives.items()}
        if d["fresh_alloc_min_bytes"] == float("inf"):
            d["fresh_alloc_min_bytes"] = None
        d["spread"] = {k: (v if math.isfinite(v) else None) for k, v in self.spread.items()}
        d["matmul_shapes"] = {lay: {"x".join(map(str, mkn)): r for mkn, r in sorted(g.items())}
                              for lay, g in self.matmul_shapes.items()}
        d["attention_shapes"] = {"x".join(map(str, k)): r for k, r in sorted(self.attention_shapes.items())}
        d["matmul_thin"] = {lay: {"x".join(map(str, k)): r for k, r in sorted(g.items())} for lay, g in self.matmul_thin.items()}
        return d

    @classmethod
    def from_json(cls, d: dict) -> "Calibration":
        """Inverse of `to_json`.

        Raises:
            ValueError: unknown fields or collective ops (named).
        """
        import dataclasses

        names = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(d) - names)
        if unknown:
            raise ValueError(f"calibration has unknown fields {unknown}")
        d = dict(d)
        d["matmul_flops"] = {int(k): float(v) for k, v in d.get("matmul_flops", {}).items()}
        colls = {}
        for op, t in d.get("collectives", {}).items():
            if op not in COLLECTIVE_OPS:
                raise ValueError(f"calibration has an unknown collective {op!r}; known: {', '.join(COLLECTIVE_OPS)}")
            colls[op] = CollectiveTable(t["latency_s"], t["bandwidth"],
                                        {int(k): float(v) for k, v in t.get("seconds", {}).items()},
                                        {int(k): float(v) for k, v in t.get("in_context", {}).items()})
        d["collectives"] = colls
        if d.get("fresh_alloc_min_bytes") is None:
            d["fresh_alloc_min_bytes"] = float("inf")
        d["spread"] = {str(k): (float("inf") if v is None else float(v)) for k, v in d.get("spread", {}).items()}
        d["rounds"] = int(d.get("rounds", 1))
        d["matmul_shapes"] = {lay: {tuple(int(x) for x in k.split("x")): float(v) for k, v in g.items()}
                              for lay, g in d.get("matmul_shapes", {}).items()}
        d["attention_shapes"] = {tuple(int(x) for x in k.split("x")): float(v)
                                 for k, v in d.get("attention_shapes", {}).items()}
        d["matmul_thin"] = {lay: {tuple(int(x) for x in k.split("x")): float(v) for k, v in g.items()}
                            for lay, g in d.get("matmul_thin", {}).items()}
        return cls(**d)

    @classmethod
    def from_legacy_extra(cls, extra: dict[str, float]) -> "Calibration | None":
        """The calibration a version-1 file kept as string keys in ``extra`` (None for an empty dict).

        Raises:
            ValueError: a key this reader does not know (named), so nothing measured is dropped silently.
        """
        if not extra:
            return None
        plain = {f for f in ("attention_flops", "elementwise_bw", "zero_bubble_backward_factor", "core_share",
                             "mem_bandwidth_alone", "fresh_alloc_s_per_byte", "fresh_alloc_min_bytes",
                             "fresh_alloc_s_per_byte_alone", "tp_linear_overhead_s",
                             "tp_linear_overhead_s_per_byte", "fsdp_unit_overhead_s", "fsdp_tensor_overhead_s")}
        kw: dict = {"matmul_flops": {}}
        tabs: dict[str, dict] = {}
        for k, v in extra.items():
            if k in plain:
                kw[k] = v
            elif k == "collective_ranks":
                kw[k] = int(v)
            elif k.startswith("matmul_flops_"):
                kw["matmul_flops"][int(k.rsplit("_", 1)[1])] = v
            else:
                op = next((o for o in COLLECTIVE_OPS if k.startswith(o + "_")), None)
                rest = k[len(op) + 1:] if op else ""
                t = tabs.setdefault(op, {"seconds": {}, "in_context": {}}) if op else None
                if rest == "latency":
                    t["latency_s"] = v
                elif rest == "bw":
                    t["bandwidth"] = v
                elif rest.startswith("t_"):
                    t["seconds"][int(float(rest[2:]))] = v
                elif rest.startswith("ctx_"):
                    t["in_context"][int(float(rest[4:]))] = v
                else:
                    raise ValueError(f"calibration (schema 1) has an unknown entry {k!r}")
        kw["collectives"] = {op: CollectiveTable(t.get("latency_s", 0.0), t.get("bandwidth", 0.0), t["seconds"],
                                                 t["in_context"]) for op, t in tabs.items()}
        return cls(**kw)


NO_CALIBRATION = Calibration()      # what an uncalibrated profile (built-in GPUs, the CPU estimate) reads
