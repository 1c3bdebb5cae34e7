"""Device and interconnect descriptions the cost and memory models read.

Built-in profiles hold vendor datasheet peaks plus one *achievable* large-GEMM fraction each, taken
from a published benchmark, never fitted to the training runs they are checked against:

- Maximum Achievable Matmul FLOPS (MAMF), S. Bekman, "Machine Learning Engineering",
  compute/accelerator/README.md, "Maximum achievable FLOPS" table
  (https://github.com/stas00/ml-engineering/tree/master/compute/accelerator#maximum-achievable-flops):
  A100 SXM bf16 267.9 TFLOP/s of 312 (0.859); H100 SXM bf16 792.1 of 989 (0.801). The H200 uses
  the H100 figure (the same GH100 compute die and clocks; only memory differs); the A100 40 GB the
  A100 SXM figure.

Bandwidths are per device and per direction (NVLink 3: 600 GB/s bidirectional = 300 GB/s each way;
NVLink 4: 900 -> 450). Inter-node bandwidth is the node's InfiniBand bandwidth divided by its GPUs
(8 x HDR 200 Gb/s = 25 GB/s per A100; 8 x NDR 400 Gb/s = 50 GB/s per H100/H200).

The step-time model reads the built-in GPU profiles through `modelpar.planner.gpu` (cited kernel
and NCCL tables: achieved bus bandwidths, attention rates, measured HBM fraction); the link fields
here then only say which groups stay inside a node.

`cpu_profile` describes this machine before calibration (an estimate); `modelpar calibrate`
measures it and `save_profile` / `load_profile` keep the result as JSON.
"""

from __future__ import annotations

import dataclasses
import json
import os

from dataclasses import dataclass
from pathlib import Path

from modelpar.planner.calibration import SCHEMA_VERSION, Calibration
from modelpar.planner.thin_matmul import beyond_grid_factor

GIB = 2 ** 30
DEVICE_KINDS = ("cpu", "gpu")     # `Hardware.kind`


@dataclass(frozen=True)
class Hardware:
    """One device type and its links. Units: FLOP/s, bytes, bytes/s, seconds.

    Attributes:
        peak_flops: dense peak by precision name (``"fp32"``, ``"bf16"``), FLOP/s.
        memory_bytes: memory one rank may use.
        mem_bandwidth: device memory bandwidth (HBM or DRAM share), bytes/s.
        intra_bw / intra_latency: per-device link inside a node (NVLink; shared memory on CPU).
        inter_bw / inter_latency: per-device share of the network between nodes.
        devices_per_node: ranks that share the fast intra-node links.
        gemm_fraction: achievable fraction of ``peak_flops`` for large matrix products (source in the
            module docstring, or "calibrated").
        mem_bw_fraction: achievable fraction of ``mem_bandwidth`` for element-wise kernels.
        op_overhead_s: fixed cost per dispatched operator (kernel launch / eager dispatch), seconds.
        framework_overhead_bytes: memory outside the model's tensors (CUDA context, allocator
            slack), bytes; measured by calibrate.
        comm_overlap: whether communication can proceed while the rank computes. False on CPU
            ranks that own all their cores: gloo moves and reduces data with the same cores (and the
            kernel's loopback TCP), so a collective adds its time even when issued asynchronously.
        calibration: what `modelpar calibrate` measured (`modelpar.planner.calibration.Calibration`);
            None for built-in and estimated profiles.
        kind: ``"cpu"`` (host cores: gloo collectives, single-tensor / CPU optimizer kernels, fp32
            by default) or ``"gpu"`` (an accelerator: foreach optimizer kernels, bf16 by default).
            The models switch on this field, never on ``name``. Profiles saved before the field
            existed load with ``"cpu"`` when their name is ``"cpu"`` (`load_profile`).

    Raises:
        ValueError: ``kind`` is not one of `DEVICE_KINDS`.
    """

    name: str
    peak_flops: dict[str, float]
    memory_bytes: float
    mem_bandwidth: float
    intra_bw: float
    intra_latency: float
    inter_bw: float
    inter_latency: float
    devices_per_node: int
    gemm_fraction: float
    mem_bw_fraction: float = 0.8       # assumption (not fitted): STREAM-like kernels reach ~80%
    op_overhead_s: float = 4e-6        # CUDA launch latency order; calibrate measures it
    framework_overhead_bytes: float = 0.0
    comm_overlap: bool = True          # collectives run beside compute (GPU copy engines / NCCL SMs)
    source: str = ""
    calibration: Calibration | None = None
    kind: str = "gpu"

    def __post_init__(self) -> None:
        if self.kind not in DEVICE_KINDS:
            raise ValueError(f"hardware {self.name!r}: kind={self.kind!r} is unknown; valid: "
                             f"{', '.join(DEVICE_KINDS)}")

    def achievable_flops(self, precision: str) -> float:
        """``peak_flops[precision] * gemm_fraction``, FLOP/s. Raises ValueError for an unknown precision."""
        if precision not in self.peak_flops:
            raise ValueError(f"hardware {self.name!r} has no peak for precision {precision!r}; "
                             f"known: {sorted(self.peak_flops)}")
        return self.peak_flops[precision] * self.gemm_fraction

    def gemm_flops(self, precision: str, call_flops: float) -> float:
        """Achievable FLOP/s of a matrix product of ``call_flops`` FLOPs.

        With a calibrated curve (``calibration.matmul_flops``: FLOP/s of an N x N x N product, from
        `modelpar calibrate`) the rate is interpolated log-linearly in the equivalent square size
        ``(call_flops / 2) ** (1/3)`` and clamped at the ends; otherwise `achievable_flops`. The
        curve is measured in fp32; bf16 scales it by ``peak[bf16] / peak[fp32]``.
        """
        pts = self.matmul_curve()
        if not pts or call_flops <= 0:
            return self.achievable_flops(precision)
        import math
        scale = self.peak_flops[precision] / self.peak_flops.get("fp32", self.peak_flops[precision])
        n = (call_flops / 2) ** (1 / 3)
        if n <= pts[0][0]:
            return pts[0][1] * scale
        if n >= pts[-1][0]:
            return pts[-1][1] * scale
        for (n0, f0), (n1, f1) in zip(pts, pts[1:]):
            if n0 <= n <= n1:
                w = (math.log(n) - math.log(n0)) / (math.log(n1) - math.log(n0))
                return math.exp(math.log(f0) + w * (math.log(f1) - math.log(f0))) * scale
        return self.achievable_flops(precision)

    def shape_flops(self, precision: str, layout: str, m: float, k: float, n: float) -> float | None:
        """Achievable FLOP/s of one ``m x k @ k x n`` product of ``layout`` (``"NT"``, ``"NN"``,
        ``"TN"``: which operand is transposed) from the calibrated shape grid
        (``calibration.matmul_shapes``), or None where the calibration has no grid for ``layout``
        (files from before schema 3, built-in and estimated profiles: the caller prices the product
        on `gemm_flops`). Interpolation: trilinear in (log M, log K, log N) on log FLOP/s between
        the grid's points, each coordinate clamped to the grid's range; bf16 scales the fp32 grid
        by ``peak[bf16] / peak[fp32]`` as `gemm_flops` does. Thin products whose large operand is
        past the grid's (weights beyond the last-level cache) take the calibrated factor of
        `modelpar.planner.thin_matmul.beyond_grid_factor` on the clamped rate (files before schema
        4: the clamped rate, unchanged)."""
        grid = self.calibration.matmul_shapes.get(layout) if self.calibration is not None else None
        r = _grid_rate(grid, m, k, n)
        if r is None:
            return None
        r *= beyond_grid_factor(self.calibration, layout, m, k, n)
        return r * self.peak_flops[precision] / self.peak_flops.get("fp32", self.peak_flops[precision])

    def attention_factor(self, bh: float, s: float, d: float) -> float | None:
        """How much faster (> 1) or slower (< 1) causal fused attention of ``bh`` (batch x heads)
        sequences of ``s`` tokens and head dimension ``d`` runs, in counted FLOP/s, than at the shape
        ``attention_flops`` was measured at (`ATTENTION_REFERENCE`), both from the calibrated grid
        (``calibration.attention_shapes``, interpolated as `shape_flops` does, clamped to its range).
        The CPU flash kernel's rate falls with short sequences and small head dimensions (1 thread,
        this host kind: 39 GFLOP/s at (32, 256, 64), 19.5 at gpt-1m's (64, 128, 32)); a ratio of two
        rates of one run, so the grid's moment cancels. None without a grid."""
        grid = self.calibration.attention_shapes if self.calibration is not None else None
        r, ref = _grid_rate(grid, bh, s, d), _grid_rate(grid, *ATTENTION_REFERENCE)
        return None if r is None or ref is None else r / ref

    def shape_factor(self, layout: str, m: float, k: float, n: float) -> float | None:
        """How much faster (> 1) or slower (< 1) an ``m x k @ k x n`` product of ``layout`` runs than
        square products of the same FLOPs, both from the calibrated grid (`shape_flops`): the
        product's rate over the harmonic mean of the grid's three layouts at the equivalent square
        size ``(m k n) ** (1/3)`` (the curve's own definition, `micro._linear_matmul_rate`). A ratio
        of two rates measured the same way in the same run: what the grid's method and moment add to
        its rates cancels, and the square curve keeps setting the level. None without a grid."""
        r = self.shape_flops("fp32", layout, m, k, n)
        if r is None:
            return None
        sq = (m * k * n) ** (1 / 3)
        sq_rates = [self.shape_flops("fp32", lay, sq, sq, sq) for lay in ("NT", "NN", "TN")]
        if any(x is None for x in sq_rates):
            return None
        return r * sum(1 / x for x in sq_rates) / len(sq_rates)     # r / harmonic mean

    def matmul_curve(self) -> list[tuple[int, float]]:
        """The calibrated ``(N, FLOP/s)`` points of N x N x N products, sorted by N ([] if none)."""
        return self.calibration.matmul_points if self.calibration is not None else []

    def collective(self, op: str) -> tuple[float, float] | None:
        """Calibrated (bandwidth bytes/s, latency s) of ``op`` (``all_reduce``, ``all_gather``,
        ``reduce_scatter``, ``send_recv``) between local ranks, or None if not calibrated."""
        t = self.calibration.collectives.get(op) if self.calibration is not None else None
        return (t.bandwidth, t.latency_s) if t is not None and t.bandwidth else None

    def collective_seconds(self, op: str, nbytes: float, n: int, *, in_context: bool = False) -> float | None:
        """Measured seconds of ``op`` on ``nbytes`` between ``n`` local ranks, interpolated in the
        calibrated table (log-log between measured sizes; the smallest size's time below it; linear
        in bytes above the largest), or None when ``op`` was not measured with ``n`` ranks.
        ``nbytes``: the full (gathered / reduced) size, as in the alpha-beta forms of cost.py.
        ``in_context``: the table of calls issued between compute segments (the wait for the slowest
        rank included) where calibrated, else the back-to-back one."""
        cal = self.calibration
        if cal is None or n != (cal.collective_ranks or self.devices_per_node):
            return None
        t = cal.collectives.get(op)
        pts = t.points(in_context) if t is not None else []
        if not pts:
            return None
        return interpolate_sizes(pts, nbytes)

    def fresh_seconds(self, sizes, elem_bytes: float, *, alone: bool = False) -> float:
        """Seconds the allocator adds for fresh tensors of ``sizes`` elements (``elem_bytes`` each):
        each tensor at or above ``fresh_alloc_min_bytes`` costs ``fresh_alloc_s_per_byte`` per byte
        (page faults on first touch + unmapping on free; measured by calibrate; 0 elsewhere, e.g. on
        GPUs, whose caching allocator reuses blocks). ``alone``: the rate of one rank allocating while
        the others do not (pipeline stages), where calibrated."""
        cal = self.calibration
        if cal is None:
            return 0.0
        c = cal.fresh_alloc_s_per_byte
        if alone and cal.fresh_alloc_s_per_byte_alone is not None:
            c = cal.fresh_alloc_s_per_byte_alone
        if not c:
            return 0.0
        thr = cal.fresh_alloc_min_bytes
        return c * sum(k * elem_bytes for k in sizes if k * elem_bytes >= thr)

    def link(self, n: int, span: int) -> tuple[float, float]:
        """(bandwidth bytes/s, latency s) of a group of ``n`` ranks whose members lie ``span``
        ranks apart: inside one node when the group's extent ``n * span`` divides
        ``devices_per_node`` (otherwise some groups straddle two nodes and the slowest link rules)."""
        if self.devices_per_node % (n * span) == 0:
            return self.intra_bw, self.intra_latency
        return self.inter_bw, self.inter_latency

    def to_dict(self) -> dict:
        """The profile as saved (`save_profile`): its fields, the calibration as its JSON form."""
        d = {f.name: getattr(self, f.name) for f in dataclasses.fields(self) if f.name != "calibration"}
        d["peak_flops"] = dict(self.peak_flops)
        d["calibration"] = self.calibration.to_json() if self.calibration is not None else None
        return d


_MAMF_A100 = 267.9e12 / 312e12    # MAMF A100 SXM bf16 (see module docstring)
_MAMF_H100 = 792.1e12 / 989e12    # MAMF H100 SXM bf16

BUILTIN: dict[str, Hardware] = {
    "A100-40GB": Hardware("A100-40GB", {"bf16": 312e12, "fp32": 19.5e12}, 40 * GIB, 1.555e12,
                          300e9, 5e-6, 25e9, 10e-6, 8, _MAMF_A100, framework_overhead_bytes=1 * GIB,
                          source="NVIDIA A100 datasheet; MAMF (Bekman) for gemm_fraction"),
    "A100-80GB": Hardware("A100-80GB", {"bf16": 312e12, "fp32": 19.5e12}, 80 * GIB, 2.039e12,
                          300e9, 5e-6, 25e9, 10e-6, 8, _MAMF_A100, framework_overhead_bytes=1 * GIB,
                          source="NVIDIA A100 datasheet; MAMF (Bekman) for gemm_fraction"),
    "H100-80GB-SXM": Hardware("H100-80GB-SXM", {"bf16": 989e12, "fp32": 67e12}, 80 * GIB, 3.35e12,
                              450e9, 5e-6, 50e9, 10e-6, 8, _MAMF_H100, framework_overhead_bytes=1 * GIB,
                              source="NVIDIA H100 datasheet; MAMF (Bekman) for gemm_fraction"),
    "H200": Hardware("H200", {"bf16": 989e12, "fp32": 67e12}, 141e9, 4.8e12,
                     450e9, 5e-6, 50e9, 10e-6, 8, _MAMF_H100, framework_overhead_bytes=1 * GIB,
                     source="NVIDIA H200 datasheet; MAMF of H100 SXM (same die) for gemm_fraction"),
}


def interpolate_sizes(pts: list[tuple[float, float]], nbytes: float) -> float:
    """Seconds at ``nbytes`` from measured ``(bytes, seconds)`` points sorted by size: log-log between
    points, the smallest size's time below it, linear in bytes above the largest; 0 for no bytes."""
    import math
    if nbytes <= 0:
        return 0.0
    if nbytes <= pts[0][0]:
        return pts[0][1]
    if nbytes >= pts[-1][0]:
        return pts[-1][1] * nbytes / pts[-1][0]
    for (b0, t0), (b1, t1) in zip(pts, pts[1:]):
        if b0 <= nbytes <= b1:
            w = (math.log(nbytes) - math.log(b0)) / (math.log(b1) - math.log(b0))
            return math.exp(math.log(t0) + w * (math.log(t1) - math.log(t0)))
    return pts[-1][1]


def hardware_for_device(device_name: str, total_memory: int = 0) -> Hardware:
    """The built-in profile of a CUDA device, by its name (``torch.cuda.get_device_name``): H200,
    H100 / H800, A100 / A800 (80 GB when the name or ``total_memory`` bytes say so, else 40 GB).
    Other GPUs get the H100 profile, an assumption to override with ``--hardware``."""
    n = device_name.upper()
    if "H200" in n:
        return BUILTIN["H200"]
    if "A100" in n or "A800" in n:
        big = "80G" in n.replace(" ", "") or total_memory > 50 * GIB
        return BUILTIN["A100-80GB" if big else "A100-40GB"]
    return BUILTIN["H100-80GB-SXM"]


def meminfo_bytes(field: str) -> int | None:
    """``field`` of Linux's /proc/meminfo (``"MemTotal"``, ``"MemAvailable"``), bytes; None where the
    file or the field is missing."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith(field + ":"):
                    return int(line.split()[1]) * 1024
    except OSError:
        return None
    return None


def total_ram_bytes() -> float:
    """This machine's physical memory, bytes (/proc/meminfo, else sysconf)."""
    total = meminfo_bytes("MemTotal")
    return float(total if total is not None else os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES"))


def cpu_profile(local_ranks: int = 1) -> Hardware:
    """An *uncalibrated* estimate of this machine as ``local_ranks`` CPU ranks on one node.

    Memory per rank = total RAM / local_ranks; FLOP/s assumes 32 fp32 FLOP/cycle/core at 2.5 GHz
    (AVX2 FMA) over the cores a rank gets. Run ``modelpar calibrate`` for measured values.

    Raises:
        ValueError: ``local_ranks < 1``.
    """
    if local_ranks < 1:
        raise ValueError(f"cpu_profile local_ranks must be >= 1, got {local_ranks}")
    cores = max(1, (os.cpu_count() or 1) // local_ranks)
    flops = cores * 32 * 2.5e9
    return Hardware("cpu", {"fp32": flops, "bf16": flops / 2}, total_ram_bytes() / local_ranks,
                    10e9 / local_ranks, 2e9, 50e-6, 2e9, 50e-6, max(local_ranks, 1), 0.5,
                    mem_bw_fraction=1.0, op_overhead_s=10e-6, comm_overlap=False,
                    source="estimate (uncalibrated)", kind="cpu")


def get_hardware(name_or_path: str, *, local_ranks: int = 1) -> Hardware:
    """A built-in profile by name (case-insensitive), ``"cpu"``, or a JSON file saved by calibrate.

    Raises:
        ValueError: the name is neither built in nor an existing file.
    """
    if name_or_path.lower() == "cpu":
        return cpu_profile(local_ranks)
    for k, v in BUILTIN.items():
        if k.lower() == name_or_path.lower():
            return v
    if Path(name_or_path).is_file():
        return load_profile(name_or_path)
    if name_or_path.endswith(".json") or os.sep in name_or_path:
        raise ValueError(f"hardware file {name_or_path!r} does not exist (a profile `modelpar calibrate --out FILE` "
                         f"writes; or a name: {', '.join(BUILTIN)}, cpu)")
    raise ValueError(f"unknown hardware {name_or_path!r}; valid: {', '.join(BUILTIN)}, cpu, or a JSON "
                     f"profile written by `modelpar calibrate`")


def save_profile(hw: Hardware, path: str | os.PathLike) -> None:
    """Write ``hw`` as JSON to ``path`` (schema `modelpar.planner.calibration.SCHEMA_VERSION`)."""
    Path(path).write_text(json.dumps({"schema_version": SCHEMA_VERSION, **hw.to_dict()}, indent=2, sort_keys=True))


def load_profile(path: str | os.PathLike) -> Hardware:
    """Read a JSON profile written by `save_profile`, or by a modelpar from before the schema (version 1:
    the measured tables as string keys of ``extra``; converted).

    Raises:
        ValueError: a newer schema, missing or unknown fields (named).
    """
    d = json.loads(Path(path).read_text())
    version = d.pop("schema_version", 1)
    if not isinstance(version, int) or version > SCHEMA_VERSION:
        raise ValueError(f"hardware profile {path}: schema version {version!r} is newer than this modelpar "
                         f"reads ({SCHEMA_VERSION}); re-run `modelpar calibrate` or upgrade modelpar")
    try:
        if version == 1:
            d["calibration"] = Calibration.from_legacy_extra(d.pop("extra", {}) or {})
        elif d.get("calibration") is not None:
            d["calibration"] = Calibration.from_json(d["calibration"])
    except (ValueError, KeyError, TypeError) as e:
        raise ValueError(f"hardware profile {path}: {e}") from None
    if "kind" not in d:                  # saved before `Hardware.kind`: only CPU profiles were named "cpu"
        d["kind"] = "cpu" if d.get("name") == "cpu" else "gpu"
    names = {f.name for f in dataclasses.fields(Hardware)}
    unknown = sorted(set(d) - names)
    if unknown:
        raise ValueError(f"hardware profile {path}: unknown fields {unknown}")
    try:
        return Hardware(**d)
    except TypeError as e:
        raise ValueError(f"hardware profile {path}: {e}") from None


# the shape ``Calibration.attention_flops`` is measured at (`micro.measure_attention`): batch 8 x 4
# heads, 256 tokens, head dimension 64
ATTENTION_REFERENCE = (32, 256, 64)


def _grid_rate(grid: dict | None, m: float, k: float, n: float) -> float | None:
    """A rate from a 3-D grid ``{(a, b, c): rate}`` at ``(m, k, n)``: trilinear in the logs of the
    coordinates on log rate between the grid's points, each coordinate clamped to the grid's range
    (an axis of one value is constant). None for an empty grid or a missing / non-positive corner."""
    if not grid:
        return None
    import math
    axes = [sorted({p[i] for p in grid}) for i in range(3)]
    coords = []
    for ax, x in zip(axes, (m, k, n)):
        x = min(max(x, ax[0]), ax[-1])
        if len(ax) == 1:
            coords.append(((ax[0], 1.0),))
            continue
        j = max(0, min(len(ax) - 2, next((i for i in range(len(ax) - 1) if x <= ax[i + 1]), len(ax) - 2)))
        lo, hi = ax[j], ax[j + 1]
        w = (math.log(x) - math.log(lo)) / (math.log(hi) - math.log(lo))
        coords.append(((lo, 1 - w), (hi, w)))
    acc = 0.0
    for a, wa in coords[0]:
        for b, wb in coords[1]:
            for c, wc in coords[2]:
                if wa * wb * wc:
                    r = grid.get((a, b, c))
                    if r is None or r <= 0:
                        return None
                    acc += wa * wb * wc * math.log(r)
    return math.exp(acc)
