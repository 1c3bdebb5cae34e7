"""GPU physics tables for the built-in GPU profiles, each entry with its published source.

These numbers are taken from kernel and collective benchmarks, never fitted to the training runs the
planner is checked against (`modelpar.planner.published`). They are used only for the built-in
GPU profiles (`hardware.BUILTIN`); the CPU profile and calibrated JSON profiles never read them.

Dense matmuls (GEMM)
    Achievable large-GEMM rate: Maximum Achievable Matmul FLOPS (MAMF), S. Bekman, "Machine Learning
    Engineering", compute/accelerator/README.md, table "Maximum achievable FLOPS": A100 SXM bf16
    267.9 TFLOP/s (of 312), H100 SXM bf16 792.1 TFLOP/s (of 989). The shape dependence is the
    roofline (Williams, Waterman & Patterson, CACM 2009): a matmul moving B bytes and doing F FLOPs
    takes max(F / MAMF, B / HBM) (cost.py's matmul term), with HBM at its measured rate below.
    A published per-shape sweep for these GPUs was not found in a form we could cite entry by entry.
    Dimension quantization (NVIDIA, "Matrix Multiplication Background User's Guide",
    DU-09799-001_v001, Feb. 2023, Ch. 3): a GEMM's output is cut into thread-block tiles (Sec. 2.3:
    cuBLAS's largest and most efficient tile is 256 x 128), a partial tile costs a whole one
    (Sec. 3.1, tile quantization), and the tiles run in waves of one tile per SM (Sec. 3.2: "An
    NVIDIA A100 GPU has 108 SMs; in the particular case of 256x128 thread block tiles, it can
    execute one thread block per SM"), a partial last wave costing a whole one (wave quantization).
    So an M x N output runs at MAMF x (M N) / (waves x SMs x 256 x 128) (`wave_efficiency`; MAMF is
    the best rate over a shape sweep, i.e. at whole waves). Assumptions, stated: every large GEMM
    uses the 256 x 128 tile (the better of its two orientations), no split-K or stream-K; SMs:
    A100 108 (the guide), H100 / H200 SXM 132 (NVIDIA H100 Tensor Core GPU Architecture
    whitepaper, 2022). Applied to the transformer layers' weight GEMMs by their shapes
    (`layer_wave_seconds`), in the step model's pricing of every bf16 plan on a built-in GPU
    (`cost.StepForm`): ``plan``, ``estimate``, the search and the published rows alike.

Fused attention (FLOP/s by head dimension and sequence length; FLOPs as the papers count them:
4 s^2 d per head forward, 2.5x that backward, halved with a causal mask)
    H100 SXM5: Shah et al., "FlashAttention-3" (2024), Fig. 5 (forward, with / without causal mask,
    head dim 64 / 128) and Fig. 6 (backward, without causal mask), bars for FlashAttention-2 and -3
    at sequence 512 ... 16k (batch x seq = 16k tokens, hidden 2048). The backward with a causal mask
    is not published there: it is taken as the non-causal backward times the forward's causal /
    non-causal ratio at the same length (assumption).
    A100 SXM: Dao, "FlashAttention-2" (2023), abstract and Sec. 4.1: the forward reaches up to 73% of
    the A100's 312 TFLOP/s. The per-length, per-direction shape is that of FlashAttention-2 on the
    H100 (the same kernel, FlashAttention-3 paper Figs. 5-6) scaled so its forward plateau is 73% of
    the A100 peak (assumption: the kernel's relative curve carries over between the two GPUs; it puts
    the backward plateau at 63% of peak, which matches FlashAttention-2's stated backward figure).
    FlashAttention (v1, 2022): FlashAttention-2 paper, abstract: FlashAttention reaches "only 25-40%
    of the theoretical maximum FLOPs/s" on the A100; its table is the A100 FlashAttention-2 one
    scaled by 0.40 / 0.73 (assumption: same relative shape). H100 / H200: no published table; the
    FlashAttention-2 H100 curves scaled by the same 0.40 / 0.73 (assumption: neither kernel uses
    Hopper's new instructions, which is why FlashAttention-2 reaches only 35% of the H100's peak,
    FlashAttention-3 paper, abstract, so the work partitioning that separates them on the A100
    separates them on the H100 too). It prices the 2023 H100 runs of ``published_rows``.
    Lengths beyond 16k use the 16k value; below 512 the 512 value.

Memory-bound kernels
    HBM bandwidth achieved by streaming kernels: ~84-92% of the datasheet on H100 SXM (coalesced
    loads 2.8 of 3.35 TB/s, M. Mirai, "GPU Memory Bandwidth: What Your Profiler Isn't Telling You",
    2026; device-to-device copy ~3.0-3.1 TB/s in published H100 roofline dumps); 0.85 is used for
    every GPU here (A100: the same fraction, assumption).

Kernel launch
    ~5 us per CUDA kernel launch (order of the CUDA launch latency); on a GPU the host enqueues
    asynchronously, so launches cost time only where kernels are shorter than the launch: each
    pass takes at least (its operators) x (launch) (a dispatch floor, not an additive term).

Collectives (NCCL; bus bandwidth as nccl-tests defines it, so that a ring all-reduce of B bytes on
n ranks takes 2 (n-1)/n B / busbw)
    A100 SXM, 8 GPUs on NVLink3/NVSwitch: all_reduce_perf busbw ~200-208 GB/s (NVIDIA/nccl-tests
    issues #149 and #178, 8x A100-SXM4-80GB).
    H100 SXM, 8 GPUs on NVLink4: ~370 GB/s effective NVLink bandwidth for ring algorithms and
    non-all-reduce collectives, ~480 GB/s all-reduce busbw with NVLink SHARP (NVIDIA/nccl-tests
    issue #212, answer by NCCL's maintainer); H200: 475 GB/s all-reduce (nccl-tests issue #272).
    Between nodes: ~85% of the line rate of the NICs the group drives (nccl-tests issue #119:
    3 nodes of 8 A100s with 4x HDR each, all_reduce busbw 84.8 GB/s average, 96 peak, of the node's
    100 GB/s line rate). NCCL builds one ring per NIC, so a group with k members per node moves data
    over k NICs at once: busbw = k x 0.85 x (NIC line rate), capped by the NVLink busbw (a group of
    one GPU per node, e.g. data parallel across nodes beside TP 8, gets one NIC's). A100 8x HDR
    200 Gb/s: 25 GB/s line per NIC, 21 GB/s used; H100 8x NDR 400 Gb/s: 50 -> 42 GB/s. RoCE 1,600
    Gb/s per 8-GPU node (MosaicML's A100 cluster) is the same 25 GB/s per GPU.
    Latency: ~5 us per step inside a node, ~10 us across nodes; NCCL switches from ring to tree
    algorithms for large groups (its tuning model), so an all-reduce's latency steps are
    min(2 (n-1), 2 ceil(log2 n)) (Thakur et al. 2005 ring; binary-tree reduce + broadcast).

FSDP (PyTorch FSDP, Zhao et al., VLDB 2023, Sec. 3.3 and 4): the next unit's all-gather is prefetched
during the current unit's compute and the reduce-scatter runs on its own stream, so per micro-batch
only communication beyond compute is exposed (forward and backward windows apart), plus the root's
and first block's gathers before any compute and the first block's and root's reduce-scatters after
the last (comms._fsdp_exposed).

Compute / communication contention: NCCL runs a collective as a kernel of one CTA per channel, each
CTA holding one SM while the collective runs, so overlapped compute gets the remaining SMs
(``nccl_sm_share`` = CTAs / SMs). H100 SXM (132 SMs): an 8-GPU ncclAllGather launched 24 blocks
beside a GEMM (NVIDIA developer forum, "Compute-Communication Overlap Causes Severe GEMM Performance
Degradation because of Tail Effect", 2025, Nsight Systems trace); A100 SXM (108 SMs): NCCL builds 24
ring channels on an 8x A100 HGX with NVSwitch (NVIDIA/nccl-tests issue #100, NCCL_DEBUG log
"Channel 23/24"), one CTA each, for groups inside one node. The SM share is the linear part only; the wave-quantization tail
that post shows (the GEMM's time nearly doubled for one perfectly sized GEMM) depends on the
GEMM's tiling and is not modelled.
Across nodes (``nccl_sm_share_inter``): NCCL builds its rings per NIC, two channels per NIC on a node
of 8 GPUs with 8 NICs: a 3-node H100 cluster's NCCL_DEBUG log shows 16 ring channels ("Channel
00/16" ... "15/16"), rank 0 reaching the next node over NET/IBext_v8/7 on odd channels (NVIDIA/nccl
issue #1453, "Poor NCCL allreduce performance"); a 2-node 8-GPU log shows channels 00-15 over
NET/IBext/0-7 (deepseek-ai/DeepEP issue #106). So a group spanning nodes holds 16 SMs while its
collective runs: 16 / 132 on H100 / H200 and, assuming the same two channels per NIC on an A100 node
with one NIC per GPU (MosaicML's 1,600 Gb/s per 8-GPU node; no A100 multi-node log cited), 16 / 108.

Optimizer step: fused AdamW streams its state at HBM rate (cost.OPT_TRAFFIC bytes per parameter).

Loss: cross entropy over fp32 copies of the logits (`LOSS_BYTES_PER_LOGIT`), memory-bound.
flash-attn's fused cross entropy (``csrc/xentropy/xentropy_kernel.cu`` of flash-attention v1.0.3, the
kernel llm-foundry's ``fused_crossentropy`` loss installs as ``xentropy-cuda-lib``):
``cunn_SoftMaxXEntropyForward`` runs one block per row and reads the 16-bit row twice (max and sum,
then the sum of exponentials), writing only per-row loss and log-sum-exp; ``cunn_SoftMaxXEntropyBackward``
reads the row once and writes its gradient once: `FUSED_XENTROPY_BYTES_PER_LOGIT` (4, 4) bytes per
logit element (both reads charged at HBM, an upper bound where the second hits L2).

Framework memory (CUDA context + NCCL buffers + caching-allocator fragmentation): 1 GiB allowance per
rank; the CUDA context alone is ~300-500 MiB on these GPUs (PyTorch "CUDA semantics" notes: the
context is created on first use and is not freed by empty_cache), NCCL's channel buffers a few
hundred MiB at 8 ranks (NCCL_BUFFSIZE 4 MiB x channels x peers).
"""

from __future__ import annotations

import bisect
import math
from dataclasses import dataclass, field

SEQS = (512, 1024, 2048, 4096, 8192, 16384)
T = 1e12

# FlashAttention-3 paper (Shah et al. 2024), H100 SXM5, TFLOP/s at SEQS:
# (kernel, direction, causal, head_dim) -> values
_H100_ATTN = {
    ("fa3", "fwd", False, 64): (333, 392, 460, 476, 496, 497),
    ("fa3", "fwd", True, 64): (197, 265, 371, 420, 460, 473),
    ("fa3", "fwd", False, 128): (467, 565, 625, 638, 646, 648),
    ("fa3", "fwd", True, 128): (292, 423, 521, 579, 602, 616),
    ("fa3", "bwd", False, 64): (272, 363, 422, 453, 472, 474),
    ("fa3", "bwd", False, 128): (316, 424, 501, 542, 559, 561),
    ("fa2", "fwd", False, 64): (282, 306, 318, 321, 322, 324),
    ("fa2", "fwd", True, 64): (180, 229, 262, 284, 295, 299),
    ("fa2", "fwd", False, 128): (309, 350, 362, 368, 370, 370),
    ("fa2", "fwd", True, 128): (191, 260, 298, 319, 333, 335),
    ("fa2", "bwd", False, 64): (198, 238, 264, 279, 287, 291),
    ("fa2", "bwd", False, 128): (214, 260, 291, 310, 318, 322),
}


def _with_causal_bwd(tab: dict) -> dict:
    """Add causal backward rows: non-causal backward x (causal / non-causal forward) per length."""
    out = dict(tab)
    for (k, d, c, hd), v in tab.items():
        if d == "bwd" and not c and (k, "fwd", True, hd) in tab:
            ratio = [a / b for a, b in zip(tab[(k, "fwd", True, hd)], tab[(k, "fwd", False, hd)])]
            out[(k, "bwd", True, hd)] = tuple(x * r for x, r in zip(v, ratio))
    return out


_H100_ATTN = _with_causal_bwd(_H100_ATTN)
# FlashAttention (v1) on the H100: FlashAttention-2's H100 curves x 0.40 / 0.73, the ratio of the two
# kernels' stated A100 peaks (see the docstring and the A100 FA1 table below)
_H100_ATTN.update({("fa1", *key[1:]): tuple(x * 0.40 / 0.73 for x in v)
                   for key, v in list(_H100_ATTN.items()) if key[0] == "fa2"})
# A100: FlashAttention-2's H100 curves scaled so the forward plateau is 73% of 312 TFLOP/s (see docstring)
_A100_FA2_SCALE = 0.73 * 312 / max(max(v) for (k, d, _, _), v in _H100_ATTN.items() if k == "fa2" and d == "fwd")
_A100_ATTN = {key: tuple(x * _A100_FA2_SCALE for x in v) for key, v in _H100_ATTN.items() if key[0] == "fa2"}
# FlashAttention (v1) on the A100: "only 25-40% of the theoretical maximum FLOPs/s" (FlashAttention-2
# paper, abstract and Sec. 1), against FlashAttention-2's 73%: the FA2 curves scaled by 0.40 / 0.73 (the
# upper end of the stated range; assumption: the same relative shape in length and direction)
_A100_ATTN.update({("fa1", *key[1:]): tuple(x * 0.40 / 0.73 for x in v) for key, v in list(_A100_ATTN.items())})


@dataclass(frozen=True)
class GpuPhysics:
    """Published kernel and collective rates of one GPU type (sources in the module docstring).
    Units: FLOP/s, bytes/s, seconds, bytes."""

    name: str
    mamf_bf16: float                 # achievable large-GEMM rate, FLOP/s
    hbm_fraction: float              # achieved / datasheet HBM bandwidth for streaming kernels
    launch_s: float                  # per-kernel launch (dispatch floor), s
    intra_busbw: float               # NCCL busbw inside a node (ring), bytes/s
    intra_allreduce_busbw: float     # all-reduce busbw inside a node (NVLS where the GPU has it)
    inter_busbw: float               # busbw between nodes per NIC (one per GPU) a group drives, bytes/s
    intra_latency: float
    inter_latency: float
    framework_bytes: float
    nccl_sm_share: float             # NCCL's CTAs / SMs while a collective runs (compute contention)
    attention: dict = field(default_factory=dict, repr=False)   # (kernel, dir, causal, hd) -> TFLOP/s at SEQS
    default_kernel: str = "fa2"
    sms: int = 0                     # streaming multiprocessors (GEMM waves: `wave_efficiency`)
    nccl_sm_share_inter: float = 0.0  # the same share for a group spanning nodes (channels per NIC)

    def attention_flops(self, direction: str, seq: int, head_dim: int, causal: bool,
                        kernel: str | None = None) -> float:
        """Fused-attention FLOP/s of ``direction`` (``"fwd"``/``"bwd"``) at ``seq`` tokens and
        ``head_dim``: the published value at the nearest tabulated head dimension (64 or 128),
        interpolated log-linearly in the sequence length, clamped at 512 and 16k.

        Raises:
            ValueError: no table for the kernel on this GPU.
        """
        k = kernel or self.default_kernel
        dims = sorted({hd for (kk, d, c, hd) in self.attention if kk == k and d == direction and c == causal})
        if not dims:
            raise ValueError(f"no {k!r} {direction} attention table for {self.name}; "
                             f"known kernels: {sorted({kk for kk, *_ in self.attention})}")
        hd = min(dims, key=lambda x: abs(math.log(x) - math.log(max(head_dim, 1))))
        v = self.attention[(k, direction, causal, hd)]
        if seq <= SEQS[0]:
            return v[0] * T
        if seq >= SEQS[-1]:
            return v[-1] * T
        i = bisect.bisect_right(SEQS, seq) - 1
        w = (math.log(seq) - math.log(SEQS[i])) / (math.log(SEQS[i + 1]) - math.log(SEQS[i]))
        return math.exp(math.log(v[i]) + w * (math.log(v[i + 1]) - math.log(v[i]))) * T

    def loss_bytes(self, logits: float) -> tuple[float, float]:
        """(forward, backward) bytes the loss moves over ``logits`` 16-bit logit elements
        (`LOSS_BYTES_PER_LOGIT`)."""
        return LOSS_BYTES_PER_LOGIT[0] * logits, LOSS_BYTES_PER_LOGIT[1] * logits

    def allreduce_latency_steps(self, n: int) -> float:
        """Latency steps of an n-rank all-reduce: min(ring 2(n-1), tree 2 ceil(log2 n))."""
        return 0.0 if n <= 1 else float(min(2 * (n - 1), 2 * math.ceil(math.log2(n))))


GIB = 2 ** 30
# Cross entropy on 16-bit logits as torch runs it under autocast (PyTorch AMP docs, "CUDA ops that can
# autocast to float32": log_softmax, nll_loss, cross_entropy): forward casts to fp32 (read 2, write 4)
# and takes log_softmax (read 4, write 4); backward log_softmax_backward (read 4 + 4, write 4) and the
# cast back (read 4, write 2): 14 and 18 bytes per logit element. Megatron-LM's vocab-parallel cross
# entropy also works on an fp32 copy of its logit shard (``output.float()``).
LOSS_BYTES_PER_LOGIT = (14.0, 18.0)
# flash-attn v1.0.3's xentropy kernel on 16-bit logits (module docstring, "Loss"): forward two reads of
# 2 B, backward one read and one write of 2 B, per logit element
FUSED_XENTROPY_BYTES_PER_LOGIT = (4.0, 4.0)

A100 = GpuPhysics("A100", mamf_bf16=267.9e12, hbm_fraction=0.85, launch_s=5e-6,
                  intra_busbw=200e9, intra_allreduce_busbw=200e9, inter_busbw=21e9,
                  intra_latency=5e-6, inter_latency=10e-6, framework_bytes=1 * GIB, nccl_sm_share=24 / 108,
                  attention=_A100_ATTN, sms=108, nccl_sm_share_inter=16 / 108)
H100 = GpuPhysics("H100", mamf_bf16=792.1e12, hbm_fraction=0.85, launch_s=5e-6,
                  intra_busbw=370e9, intra_allreduce_busbw=480e9, inter_busbw=42e9,
                  intra_latency=5e-6, inter_latency=10e-6, framework_bytes=1 * GIB, nccl_sm_share=24 / 132,
                  attention=_H100_ATTN, sms=132, nccl_sm_share_inter=16 / 132)
H200 = GpuPhysics("H200", mamf_bf16=792.1e12, hbm_fraction=0.85, launch_s=5e-6,
                  intra_busbw=370e9, intra_allreduce_busbw=475e9, inter_busbw=42e9,
                  intra_latency=5e-6, inter_latency=10e-6, framework_bytes=1 * GIB, nccl_sm_share=24 / 132,
                  attention=_H100_ATTN, sms=132, nccl_sm_share_inter=16 / 132)

GEMM_TILE = (256, 128)   # cuBLAS's largest thread-block tile (Matrix Multiplication Background, Sec. 2.3)


def wave_efficiency(m: float, n: float, sms: int, tile: tuple[int, int] = GEMM_TILE, *, k: float = 0.0,
                    max_split: int = 1, min_slice: int = 512) -> float:
    """Share of MAMF a GEMM with an ``m`` x ``n`` output reaches under tile and wave quantization
    (module docstring, "Dimension quantization"): (m n) / (waves x sms x tile area) with
    waves = ceil(tiles / sms), tiles = ceil(m / t0) ceil(n / t1), the better of the tile's two
    orientations. 1.0 where ``sms`` is 0 (no SM count known) or the output is empty.
    ``max_split`` > 1 (a sensitivity check, not the model; docs/planner.md): the reduction of
    length ``k`` may also be split into s <= ``max_split`` slices of at least ``min_slice``
    (split-K: s x tiles blocks), the best s taken; the partial sums' reduction is not charged."""
    if sms <= 0 or m <= 0 or n <= 0:
        return 1.0
    best = 0.0
    for s in range(1, max(1, max_split) + 1):
        if s > 1 and k / s < min_slice:
            break
        for t0, t1 in (tile, tile[::-1]):
            tiles = math.ceil(m / t0) * math.ceil(n / t1) * s
            waves = math.ceil(tiles / sms)
            best = max(best, m * n * s / (waves * sms * t0 * t1))
    return min(best, 1.0)


def layer_gemm_shapes(tokens: float, h: float, f: float, tp: int) -> dict[str, list[tuple]]:
    """The weight GEMMs of one transformer layer on a rank of a ``tp``-way Megatron split (Shoeybi
    et al. 2019, Sec. 3: QKV and the first MLP matmul column-parallel, dividing N, the attention
    output and the second MLP matmul row-parallel, dividing K), for ``tokens`` = T = b s tokens, as
    (M, K, N) of each product (output M x N, reduction K): forward (T, h, 3h/t), (T, h/t, h),
    (T, h, f/t), (T, f/t, h); backward per linear the input gradient (T, N, K) and the weight
    gradient (K, T, N) of its forward (M, K, N). With sequence parallelism the GEMMs see the
    gathered T tokens, the same shapes; ``tp`` = 1 is the unsplit layer. ``h``: model width,
    ``f``: FFN width. Returns {"fwd": [...], "bwd": [...]}."""
    fwd = [(tokens, h, 3 * h / tp), (tokens, h / tp, h), (tokens, h, f / tp), (tokens, f / tp, h)]
    bwd = [shape for (m, k, n) in fwd for shape in ((m, n, k), (k, m, n))]
    return {"fwd": fwd, "bwd": bwd}


def layer_wave_seconds(tokens: float, h: float, f: float, tp: int, sms: int, flops_s: float, mem_s: float,
                       max_split: int = 1) -> tuple[float, float]:
    """(forward, backward) seconds per micro-batch that tile and wave quantization add to one
    transformer layer's weight GEMMs (`layer_gemm_shapes`; ``tokens`` = T tokens per micro-batch)
    on a GPU with ``sms`` SMs. Each GEMM of F FLOPs and B bytes (16-bit operands:
    2 (M K + K N + M N)) takes max(F / (R e), B / W) by its own roofline (R = ``flops_s``, the
    rate the step model charges, MAMF on a built-in GPU; W = ``mem_s``, the measured HBM rate;
    e: its output's `wave_efficiency`) where the step model charges it max(F / R, B / W) inside
    the rank's sum; the result is the sum of the differences (never negative). (0, 0) where
    ``sms`` is 0. The step model memoizes it per (tokens, widths, TP degree) in the search's
    `memo.PlannerCache` (``waves``). ``max_split``: `wave_efficiency`'s split-K sensitivity
    check (1: the model)."""
    if sms <= 0:
        return 0.0, 0.0
    out = []
    for shapes in layer_gemm_shapes(tokens, h, f, tp).values():
        ex = 0.0
        for m, k, n in shapes:
            fl, byt = 2 * m * k * n, 2 * (m * k + k * n + m * n)
            base = max(fl / flops_s, byt / mem_s)
            e = wave_efficiency(m, n, sms, k=k, max_split=max_split)
            ex += max(0.0, max(fl / (flops_s * e), byt / mem_s) - base)
        out.append(ex)
    return out[0], out[1]


# built-in hardware profile name -> its physics (hardware.BUILTIN keys)
GPU_PHYSICS: dict[str, GpuPhysics] = {"A100-40GB": A100, "A100-80GB": A100, "H100-80GB-SXM": H100, "H200": H200}


def physics_for(hw) -> GpuPhysics | None:
    """The physics table of a built-in GPU profile (by name), None for the CPU and calibrated
    profiles (a calibrated JSON profile carries its own measured tables, ``hw.calibration``)."""
    if hw.calibration is not None:
        return None
    return GPU_PHYSICS.get(hw.name)


# ---- the cost model's GPU terms (called by cost.py for built-in GPU profiles) ------------------
def gpu_link(phys: GpuPhysics, hw, bw: float, op: str, n: int, steps: float,
             per_node: int = 1) -> tuple[float, float, float]:
    """(bus bandwidth, latency, latency steps) of ``op`` on a built-in GPU from its published NCCL
    figures (`gpu.GpuPhysics`): inside a node the measured NVLink busbw (all-reduce: with NVLink
    SHARP where the GPU has it), across nodes ``per_node`` (the group's members in one node) NICs'
    measured busbw, at most the NVLink one; all-reduce latency over min(ring, tree) steps.
    ``bw``: the profile's link for the group (intra or inter)."""
    intra = bw == hw.intra_bw and hw.intra_bw != hw.inter_bw
    nvl = phys.intra_allreduce_busbw if op == "all_reduce" else phys.intra_busbw
    if intra:
        b, lat = nvl, phys.intra_latency
    else:
        b, lat = min(nvl, max(1, per_node) * phys.inter_busbw), phys.inter_latency
    if op == "all_reduce":
        steps = phys.allreduce_latency_steps(n)
    return b, lat, steps


def gpu_load_times(ld, b: int, mem_s: float, flops_s: float, phys: GpuPhysics,
                   kernel: str | None = None, rates: dict | None = None) -> tuple[float, float]:
    """`cost._load_times` on a built-in GPU (``ld``: a `loads.RankLoad`; tables in this module):
    matmuls at the roofline of MAMF and
    the measured HBM rate; fused attention at the FlashAttention papers' rate for the model's head
    dimension and sequence length (``RankLoad.attn_shape``; a causal kernel executes half the
    FLOPs the profile counts, and its backward 2.5x the forward's FLOPs where the profile counts
    2x, as the papers count them); memory-bound operators at the measured HBM rate; each pass at
    least its kernel launches (a dispatch floor: the host enqueues ahead of the device).
    ``kernel``: the attention kernel's table (`GpuPhysics.default_kernel` when None). ``rates``: a
    memo table of the (forward, backward) `GpuPhysics.attention_flops` per (seq, head dim, causal,
    kernel) (`memo.PlannerCache.attn_rates`: one hardware per cache; the search prices ~10^4 loads
    of one shape); None: looked up every call."""
    af, ab = ld.attn_flops
    mf, mb_ = ld.fwd_flops - af, ld.bwd_flops - ab
    g_f = max(mf * b / flops_s, (ld.gemm_param_bytes[0] + ld.gemm_act_bytes[0] * b) / mem_s)
    g_b = max(mb_ * b / flops_s, (ld.gemm_param_bytes[1] + ld.gemm_act_bytes[1] * b) / mem_s)
    if af or ab:
        seq, hd, causal = ld.attn_shape or (16384, 128, False)
        half = 0.5 if causal else 1.0
        rkey = (seq, hd, causal, kernel)
        rate = rates.get(rkey) if rates is not None else None
        if rate is None:
            rate = (phys.attention_flops("fwd", seq, hd, causal, kernel),
                    phys.attention_flops("bwd", seq, hd, causal, kernel))
            if rates is not None:
                rates[rkey] = rate
        g_f += af * b * half / rate[0]
        g_b += ab * b * half * 1.25 / rate[1]
    # the loss on the last stage (not in the profile, whose backward starts from a sum): torch's
    # cross entropy under autocast runs in fp32 (`gpu.LOSS_BYTES_PER_LOGIT`), per logit element
    loss_f, loss_b = (phys.loss_bytes(ld.out / 2 * b) if ld.is_last else (0.0, 0.0))
    t_f = max(g_f + (ld.fwd_mem * b + loss_f) / mem_s, ld.fwd_ops * phys.launch_s)
    t_b = max(g_b + (ld.bwd_mem * b + loss_b) / mem_s, (ld.ops - ld.fwd_ops) * phys.launch_s)
    return t_f, t_b
