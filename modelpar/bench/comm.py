"""The communication profile of one training step, read from torch.profiler events.

Two kinds of profiler events describe every collective (both need ``record_shapes=True``):

- the *issuing* op, a dispatcher op on the thread that asked for it (``c10d::allreduce_``,
  ``c10d::_allgather_base_``, ``c10d::_reduce_scatter_base_``, ``c10d::send``, ``c10d::recv_``, and the
  functional collectives ``_c10d_functional::*`` that DTensor / tensor parallel uses);
- the *backend* event the process-group backend records while the collective runs (``gloo:all_reduce``
  on a gloo worker thread, ``gloo:send`` / ``gloo:recv`` on the caller's thread, ``nccl:*`` on GPUs).

Each backend event is matched to its issuing op (first in, first out within a family of collectives,
checking tensor sizes where both sides recorded them). The issuing op says what the collective is for
(`classify`); the backend event says how long it ran. Bytes come from the recorded input shapes and
dtypes: the payload of an all-reduce is its tensor, of an all-gather its gathered output, of a
reduce-scatter its unscattered input, of a send/recv the tensor sent.

Times (microseconds in the events, seconds in the results):

- recorded time: the summed duration of the backend events of a kind (on a CPU with gloo this includes
  the time spent waiting for the slowest peer);
- exposed time: the part of the union of those intervals during which the training thread ran no
  ``aten::`` compute op, i.e. communication the step could not hide behind compute (the training thread
  waits, or runs only Python between ops);
- share of step: exposed time / the step's wall time.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import asdict, dataclass, field

# What each collective is for (the table rows of the profile).
KIND_GRAD_ALLREDUCE = "gradient all-reduce (DP)"
KIND_PARAM_ALLGATHER = "parameter all-gather (FSDP)"
KIND_GRAD_REDUCESCATTER = "gradient reduce-scatter (FSDP)"
KIND_TP = "tensor-parallel collectives"
KIND_PP = "pipeline send/recv (activations)"
KIND_SYNC = "grad-norm / loss syncs"
KIND_OTHER = "other (broadcast, barrier)"
KINDS = (KIND_GRAD_ALLREDUCE, KIND_PARAM_ALLGATHER, KIND_GRAD_REDUCESCATTER, KIND_TP, KIND_PP, KIND_SYNC,
         KIND_OTHER)

BACKEND_PREFIXES = ("gloo:", "nccl:", "mpi:", "ucc:")
FUNCTIONAL_PREFIX = "_c10d_functional::"
STEP_MARK = "modelpar.bench.step"                   # record_function around the profiled step
FWD_BWD_MARK = "modelpar.bench.forward_backward"     # record_function around each forward/backward

# bytes per element by the dtype strings the profiler records
DTYPE_BYTES = {"float": 4, "double": 8, "c10::Half": 2, "c10::BFloat16": 2, "long int": 8, "int": 4,
               "short int": 2, "signed char": 1, "unsigned char": 1, "bool": 1, "c10::Float8_e4m3fn": 1,
               "c10::Float8_e5m2": 1, "c10::complex<float>": 8}


@dataclass(frozen=True)
class TraceEvent:
    """One profiler event. Units: microseconds (absolute clock shared by the processes of a machine)."""

    name: str
    start_us: float
    dur_us: float
    thread: int
    shapes: tuple = ()
    dtypes: tuple = ()

    @property
    def end_us(self) -> float:
        return self.start_us + self.dur_us


def events_from_profiler(prof) -> list[TraceEvent]:
    """All CPU-side events of a finished ``torch.profiler.profile`` as `TraceEvent`s (kineto clock)."""
    out = []
    for k in prof.profiler.kineto_results.events():
        try:
            shapes = tuple(tuple(s) if isinstance(s, (list, tuple)) else () for s in k.shapes())
            dtypes = tuple(k.dtypes())
        except Exception:                   # some events carry no inputs
            shapes, dtypes = (), ()
        out.append(TraceEvent(k.name(), k.start_ns() / 1e3, k.duration_ns() / 1e3, int(k.start_thread_id()),
                              shapes, dtypes))
    return out


# ---- families: which backend events an issuing op can produce ----------------------------------
def op_family(name: str) -> str | None:
    """``all_reduce`` | ``all_gather`` | ``reduce_scatter`` | ``send`` | ``recv`` | ``broadcast`` |
    ``barrier`` | ``other`` for a collective event name; None for anything else."""
    n = name.lower()
    if not (n.startswith(BACKEND_PREFIXES) or n.startswith("c10d::") or n.startswith(FUNCTIONAL_PREFIX)):
        return None
    if "wait" in n or "wrap_tensor" in n:
        return None
    for key, fam in (("reduce_scatter", "reduce_scatter"), ("all_gather", "all_gather"),
                     ("allgather", "all_gather"), ("all_reduce", "all_reduce"), ("allreduce", "all_reduce"),
                     ("send", "send"), ("recv", "recv"), ("broadcast", "broadcast"), ("barrier", "barrier")):
        if key in n:
            return fam
    return "other"


def is_backend(e: TraceEvent) -> bool:
    return e.name.lower().startswith(BACKEND_PREFIXES)


def _compatible(issuer_family: str, backend_family: str) -> bool:
    # gloo runs reduce-scatter as an all-reduce of the whole input
    return issuer_family == backend_family or (issuer_family == "reduce_scatter" and backend_family == "all_reduce")


def _numel(shape) -> int:
    n = 1
    for d in shape:
        n *= int(d)
    return n


def _tensor_sizes(e: TraceEvent) -> list[tuple[int, int]]:
    """(numel, bytes per element) of every tensor input the event recorded."""
    out = []
    for shape, dt in zip(e.shapes, e.dtypes or ("",) * len(e.shapes)):
        if dt in DTYPE_BYTES:
            out.append((_numel(shape), DTYPE_BYTES[dt]))
    return out


@dataclass
class Collective:
    """One collective of the step: its issuing op, backend event and what it is for."""

    issuer: TraceEvent
    family: str
    functional: bool                     # issued through _c10d_functional (DTensor / TP / grad norm)
    in_fwd_bwd: bool                     # issued inside forward/backward (not optimizer / grad clip)
    parent: TraceEvent | None = None     # the functional op around a c10d op
    backend: TraceEvent | None = None
    kind: str = KIND_OTHER

    def sizes(self) -> list[tuple[int, int]]:
        s = _tensor_sizes(self.issuer)
        for e in (self.parent, self.backend):
            if e is not None:
                s += _tensor_sizes(e)
        return s

    @property
    def nbytes(self) -> int:
        """Payload bytes: the largest tensor the collective touched (see the module docstring)."""
        sizes = self.sizes()
        if not sizes:
            return 0
        n, b = max(sizes)
        return n * b

    @property
    def interval(self) -> tuple[float, float]:
        e = self.backend or self.issuer
        return e.start_us, e.end_us


def classify(c: Collective) -> str:
    """What a collective is for, from where and how it was issued.

    Outside forward/backward (gradient clipping, loss averaging): `KIND_SYNC`. Inside: send/recv are
    pipeline activations; functional collectives are tensor parallel (DTensor); c10d all-gather /
    reduce-scatter are FSDP's; a c10d all-reduce is DDP's (or HSDP's replicate-axis) gradient
    reduction; anything else (DDP's buffer broadcast, barriers) is `KIND_OTHER`.
    """
    if not c.in_fwd_bwd:
        return KIND_SYNC
    if c.family in ("send", "recv"):
        return KIND_PP
    if c.functional:
        return KIND_TP
    return {"all_gather": KIND_PARAM_ALLGATHER, "reduce_scatter": KIND_GRAD_REDUCESCATTER,
            "all_reduce": KIND_GRAD_ALLREDUCE}.get(c.family, KIND_OTHER)


def _inside(e: TraceEvent, outer: Iterable[TraceEvent]) -> TraceEvent | None:
    for o in outer:
        if o.thread == e.thread and o.start_us <= e.start_us and e.end_us <= o.end_us + 1e-3:
            return o
    return None


def find_collectives(events: list[TraceEvent]) -> list[Collective]:
    """Pair issuing ops with backend events and classify them (see the module docstring).

    Args:
        events: the events of one profiled region (any order).
    """
    fwd_bwd = [e for e in events if e.name == FWD_BWD_MARK]
    functional = [e for e in events if e.name.startswith(FUNCTIONAL_PREFIX) and op_family(e.name)]
    c10d = sorted((e for e in events if e.name.startswith("c10d::") and op_family(e.name)), key=lambda e: e.start_us)
    colls: list[Collective] = []
    for e in c10d:                  # any thread: on GPUs DDP issues from the autograd thread
        parent = _inside(e, functional)
        in_fb = not fwd_bwd or any(f.start_us <= e.start_us <= f.end_us for f in fwd_bwd)
        colls.append(Collective(e, op_family(e.name), parent is not None, in_fb, parent=parent))
    for c in colls:
        c.kind = classify(c)
    # backend events, first in first out per family, sizes checked where both sides know them
    unmatched = list(colls)
    for b in sorted((e for e in events if is_backend(e)), key=lambda e: e.start_us):
        fam = op_family(b.name)
        bsizes = {n for n, _ in _tensor_sizes(b)}
        cands = [c for c in unmatched if _compatible(c.family, fam) and c.issuer.start_us <= b.start_us + 1.0]
        pick = None
        for c in cands:
            known = {n for n, _ in c.sizes()}
            if not known or not bsizes or known & bsizes:
                pick = c
                break
        if pick is None and cands:
            pick = cands[0]
        if pick is not None:
            pick.backend = b
            unmatched.remove(pick)
    return colls


# ---- interval arithmetic -------------------------------------------------------------------------
def union(intervals: Iterable[tuple[float, float]]) -> list[tuple[float, float]]:
    """Merge ``[(start, end), ...]`` into disjoint sorted intervals."""
    out: list[list[float]] = []
    for a, b in sorted(i for i in intervals if i[1] > i[0]):
        if out and a <= out[-1][1]:
            out[-1][1] = max(out[-1][1], b)
        else:
            out.append([a, b])
    return [(a, b) for a, b in out]


def length(intervals: Iterable[tuple[float, float]]) -> float:
    return sum(b - a for a, b in union(intervals))


def subtract(intervals: Iterable[tuple[float, float]], minus: Iterable[tuple[float, float]]) -> list[tuple[float, float]]:
    """The parts of ``intervals`` not covered by ``minus`` (both unions first)."""
    out = []
    cut = union(minus)
    for a, b in union(intervals):
        cur = a
        for c, d in cut:
            if d <= cur or c >= b:
                continue
            if c > cur:
                out.append((cur, c))
            cur = max(cur, d)
            if cur >= b:
                break
        if cur < b:
            out.append((cur, b))
    return out


def clip(intervals, lo: float, hi: float) -> list[tuple[float, float]]:
    return [(max(a, lo), min(b, hi)) for a, b in intervals if min(b, hi) > max(a, lo)]


# ---- the profile ---------------------------------------------------------------------------------
@dataclass
class KindStats:
    """One row of the profile. Units: bytes, seconds, fraction of the step."""

    kind: str
    calls: int = 0
    bytes: int = 0
    recorded_s: float = 0.0
    exposed_s: float = 0.0
    share: float = 0.0


@dataclass
class CommProfile:
    """Communication of one step on one rank."""

    step_s: float
    kinds: dict[str, KindStats] = field(default_factory=dict)
    recorded_s: float = 0.0
    exposed_s: float = 0.0                 # union over kinds, so overlapping kinds count once

    @property
    def share(self) -> float:
        return self.exposed_s / self.step_s if self.step_s > 0 else 0.0

    def to_dict(self) -> dict:
        return {"step_s": self.step_s, "recorded_s": self.recorded_s, "exposed_s": self.exposed_s,
                "share": self.share, "kinds": {k: asdict(v) for k, v in self.kinds.items()}}

    @classmethod
    def from_dict(cls, d: dict) -> "CommProfile":
        return cls(d["step_s"], {k: KindStats(**v) for k, v in d["kinds"].items()}, d["recorded_s"], d["exposed_s"])


def comm_profile(events: list[TraceEvent], *, train_thread: int | None = None) -> CommProfile:
    """The communication profile of the step marked by `STEP_MARK` in ``events``.

    Raises:
        ValueError: no `STEP_MARK` event (the step was not profiled with the marker).
    """
    marks = [e for e in events if e.name == STEP_MARK]
    if not marks:
        raise ValueError(f"no {STEP_MARK!r} event in the trace: profile the step inside "
                         f"record_function({STEP_MARK!r})")
    step = marks[0]
    tid = step.thread if train_thread is None else train_thread
    lo, hi = step.start_us, step.end_us
    inside = [e for e in events if e.end_us >= lo and e.start_us <= hi]
    colls = find_collectives(inside)
    compute = [(e.start_us, e.end_us) for e in inside if e.thread == tid and e.name.startswith("aten::")]
    prof = CommProfile(step_s=step.dur_us / 1e6)
    for kind in KINDS:
        mine = [c for c in colls if c.kind == kind]
        if not mine:
            continue
        iv = clip([c.interval for c in mine], lo, hi)
        prof.kinds[kind] = KindStats(kind, len(mine), sum(c.nbytes for c in mine),
                                     sum(b - a for a, b in iv) / 1e6,
                                     length(subtract(iv, compute)) / 1e6)
    all_iv = clip([c.interval for c in colls], lo, hi)
    prof.recorded_s = sum(k.recorded_s for k in prof.kinds.values())
    prof.exposed_s = length(subtract(all_iv, compute)) / 1e6
    for k in prof.kinds.values():
        k.share = k.exposed_s / prof.step_s if prof.step_s > 0 else 0.0
    return prof


def merge_ranks(profiles: list[CommProfile]) -> CommProfile:
    """One profile for a job: bytes and calls of the busiest rank per kind, times as the mean over
    ranks, step time the slowest rank's."""
    if not profiles:
        return CommProfile(0.0)
    step = max(p.step_s for p in profiles)
    out = CommProfile(step_s=step)
    n = len(profiles)
    for kind in KINDS:
        rows = [p.kinds[kind] for p in profiles if kind in p.kinds]
        if rows:
            out.kinds[kind] = KindStats(kind, max(r.calls for r in rows), max(r.bytes for r in rows),
                                        sum(r.recorded_s for r in rows) / n, sum(r.exposed_s for r in rows) / n)
            out.kinds[kind].share = out.kinds[kind].exposed_s / step if step > 0 else 0.0
    out.recorded_s = sum(p.recorded_s for p in profiles) / n
    out.exposed_s = sum(p.exposed_s for p in profiles) / n
    return out
