"""The dispatch-level machinery of `modelpar.planner.profile`: storage lifetimes, per-block op and
byte counters, the fused-attention routing and the FLOP formulas torch's counter lacks."""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten
from torch.utils.module_tracker import ModuleTracker

from modelpar.planner.profile_lifetimes import _Lifetimes
from modelpar.stage_split import stage_rank

if TYPE_CHECKING:
    from modelpar.planner.profile import ModelProfile

_VIEW_OPS = {"view", "_unsafe_view", "t", "transpose", "expand", "detach", "permute", "unsqueeze",
             "squeeze", "slice", "select", "alias", "as_strided", "split", "unbind", "lift_fresh",
             "_reshape_alias", "reshape", "split_with_sizes", "chunk", "expand_as",
             "device", "sym_size", "sym_stride", "sym_numel", "sym_storage_offset", "dim", "is_contiguous"}


# not counted among a profile's calls (`BlockProfile.fwd_calls`) nor the calibration's
# (`modelpar.calibrate.micro.count_calls`): the profile's stand-in parameters and saved-tensor
# hooks add detaches a real step does not make (gpt-1m: 166 profiled, 77 real; every other call
# agrees, 481 both); ``prim::device``, a metadata query that reaches a dispatch mode only for tensor
# subclasses (the FakeTensors of a real-weights profile), not in a real step nor on meta
UNCOUNTED_CALLS = ("detach", "device")


class _OpCounter(TorchDispatchMode):
    """Counts non-view ops and the bytes they read + write, per block and pass.

    An op runs in the block among the tracker's active modules; ``outside(is_bw)`` (when given)
    names the block of an op outside every block module (the rest of the model before / after its
    repeated blocks, see `modelpar.planner.profile.default_blocks`), or None to drop it; ``seen(i)``
    is told each block whose backward an op ran in. FLOPs are counted here too (torch's formulas,
    `FlopCounterMode`'s registry), for the blocks that are not modules."""

    def __init__(self, tracker: ModuleTracker, names: dict[str, int], n: int, param_keys: set | None = None,
                 param_shapes=frozenset(), gather_keys: set | None = None, lifetimes: _Lifetimes | None = None,
                 outside=None, seen=None, tp_split=None):
        super().__init__()
        # a set: `__torch_dispatch__` adds the parameters' dtype copies (the caller's `pack` sees them)
        self.tracker, self.names, self.param_keys = tracker, names, param_keys if param_keys is not None else set()
        self.lifetimes = lifetimes
        self.outside, self.seen = outside, seen
        self.param_shapes = param_shapes        # shapes (and transposes) of 2-D parameters
        # storages of matmul modules' inputs (`profile._profile`'s ``gather_keys``): a copy of one (autocast's
        # bf16 input) joins them
        self.gather_keys = gather_keys if gather_keys is not None else set()
        self.gemm_bytes = [[0, 0, 0, 0] for _ in range(n)]     # param fwd, param bwd, act fwd, act bwd
        self.mem = [[0, 0] for _ in range(n)]
        self.ops = [[0, 0] for _ in range(n)]
        self.calls = [[0, 0] for _ in range(n)]      # every aten call, views and matmuls included
        self.gemms = [[0, 0] for _ in range(n)]
        self.attn = [[0, 0, 0] for _ in range(n)]    # fwd FLOPs, bwd FLOPs, forward calls
        self.flops = [[0, 0] for _ in range(n)]
        self.shapes = [[{}, {}] for _ in range(n)]     # per pass: {(layout, M, K, N, batch dim): calls}
        # forward FLOPs a TP split leaves whole on every rank (``tp_split(parents)`` False: `TPSplitScopes`),
        # all, then fused attention's; in forward only: the tracker's backward parents keep modules whose
        # backward ended (a module whose inputs need no gradient), so backward shares the forward's split
        self.tp_split, self.tp_whole = tp_split, [[0, 0] for _ in range(n)]
        self.registry = None
        if outside is not None or tp_split is not None:
            from torch.utils.flop_counter import FlopCounterMode
            self.registry = FlopCounterMode(display=False, custom_mapping=_FLOP_FORMULAS).flop_registry

    @staticmethod
    def track(keys: set, t: torch.Tensor) -> None:
        """Add ``t``'s storage to ``keys`` until it is freed (its address may then be reused by an
        unrelated tensor, which must not be taken for it)."""
        import weakref
        st = t.untyped_storage()
        if st._cdata not in keys:
            keys.add(st._cdata)
            weakref.finalize(st, keys.discard, st._cdata)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        name = func.overloadpacket.__name__
        idx = next((self.names[p] for p in self.tracker.parents if p in self.names), None)
        in_block = idx is not None
        if idx is None and self.outside is not None:
            idx = self.outside(self.tracker.is_bw)
        if idx is not None and name not in UNCOUNTED_CALLS:     # `BlockProfile.fwd_calls`
            self.calls[idx][1 if self.tracker.is_bw else 0] += 1
        if name in _VIEW_OPS:
            return out
        if in_block and self.seen is not None and self.tracker.is_bw:
            self.seen(idx)
        if idx is None:
            return out
        whole = False
        if self.registry is not None and func.overloadpacket in self.registry:
            f = int(self.registry[func.overloadpacket](*args, **(kwargs or {}), out_val=out))
            self.flops[idx][1 if self.tracker.is_bw else 0] += f
            whole = self.tp_split is not None and not self.tracker.is_bw and not self.tp_split(self.tracker.parents)
            if whole:
                self.tp_whole[idx][0] += f
        if self.lifetimes is not None and self.tracker.is_bw:
            self.lifetimes.backward_op(idx, (args, kwargs), out, name == "_to_copy")
        if name in _FLOP_OPS:
            ph = 1 if self.tracker.is_bw else 0
            self.gemms[idx][ph] += 1
            if "scaled_dot_product" in name:
                q, k, v = args[ph:ph + 3]          # backward ops take grad_out first
                self.attn[idx][ph] += _sdpa_flops(q.shape, k.shape, v.shape) * (2 if ph else 1)
                if whole:
                    self.tp_whole[idx][1] += _sdpa_flops(q.shape, k.shape, v.shape)
                self.attn[idx][2] += 1 - ph
                key = _sdpa_shape(name, args, kwargs or {}, ph)
                if key is not None:
                    d = self.shapes[idx][ph]
                    d[key] = d.get(key, 0) + 1
            ins = [t for t in tree_flatten((args, kwargs))[0] if isinstance(t, torch.Tensor)]
            outs = [t for t in tree_flatten(out)[0] if isinstance(t, torch.Tensor)]
            reads_param = any(t.untyped_storage()._cdata in self.param_keys for t in ins)
            for t in ins + outs:
                nb = t.numel() * t.element_size()
                # a parameter (or its transposed view) reads the same storage; a weight gradient
                # (a parameter-shaped product of two activations) is written once per micro-batch,
                # not once per sample, so it counts with the parameter bytes too
                param_like = (t.untyped_storage()._cdata in self.param_keys
                              or (not reads_param and any(t is o for o in outs)
                                  and tuple(t.shape) in self.param_shapes))
                self.gemm_bytes[idx][ph if param_like else 2 + ph] += nb
            if name in ("mm", "addmm"):
                key = _mm_shape(args[-2:] if name == "addmm" else args[:2], out, self.param_keys, self.param_shapes)
                if key is not None:
                    d = self.shapes[idx][ph]
                    d[key] = d.get(key, 0) + 1
            return out
        phase = 1 if self.tracker.is_bw else 0
        self.ops[idx][phase] += 1
        if name == "_to_copy" and isinstance(args[0], torch.Tensor):
            # a copy of a parameter (autocast's bf16 weight copy): a parameter from here on (later
            # matmuls read it as one, `pack` does not count it as an activation), and its traffic is
            # once per micro-batch, not per sample (`cost.StepForm`'s cast term prices it); so is
            # backward's copy of a weight gradient into the parameters' dtype (parameter-shaped)
            src = args[0].untyped_storage()._cdata
            if src in self.gather_keys:
                self.track(self.gather_keys, out)
            if src in self.param_keys:
                self.track(self.param_keys, out)
                return out
            if phase and (out.dim() == 1 or tuple(out.shape) in self.param_shapes):
                return out
        flat = [t for t in tree_flatten((args, kwargs, out))[0] if isinstance(t, torch.Tensor)]
        self.mem[idx][phase] += sum(t.numel() * t.element_size() for t in flat)
        return out


SDPA_LAYOUT = "SDPA"    # `BlockProfile.gemm_shapes`' tag of a causal fused-attention call


def _sdpa_shape(name: str, args, kwargs: dict, ph: int) -> tuple | None:
    """``("SDPA", B x H, S, D, 0)`` of a causal CPU flash self-attention call, else None (masked,
    non-causal or cross attention, other kernels: those keep the calibrated rate of one shape).
    Query (B, H, S, D), key and value (B, H_kv, S, D) with H_kv dividing H (grouped-query attention
    does H query heads' work). The forward's ``is_causal`` is its 5th argument, the backward's its
    8th (after grad_out, query, key, value, out, logsumexp, dropout_p). The batch dimension is the
    first (B x H grows with the samples); `cost._load_times` prices the call at its S and D
    (`Hardware.attention_factor`)."""
    if name not in ("_scaled_dot_product_flash_attention_for_cpu", "_scaled_dot_product_flash_attention_for_cpu_backward"):
        return None
    q, k, v = args[ph:ph + 3]
    pos = 7 if ph else 4
    causal = kwargs.get("is_causal", args[pos] if len(args) > pos else False)
    if not causal or kwargs.get("attn_mask") is not None or q.dim() != 4 or k.shape != v.shape or k.dim() != 4:
        return None
    if (q.shape[0], q.shape[2], q.shape[3]) != (k.shape[0], k.shape[2], k.shape[3]) or q.shape[1] % k.shape[1]:
        return None         # cross attention, other widths; grouped-query heads (H_q a multiple of H_kv) kept
    b, h, s, d = (int(x) for x in q.shape)
    return (SDPA_LAYOUT, b * h, s, d, 0)


def _layout_char(t: torch.Tensor) -> str | None:
    """``"N"`` for a row-major 2-D operand, ``"T"`` for a transposed (column-major) view, None else.
    A stride of 0 (an expanded gradient: the profile's backward starts from a sum) counts as
    row-major, as the real loss's gradient is."""
    if t.dim() != 2:
        return None
    if t.stride(1) in (0, 1) or t.size(1) == 1:
        return "N"
    if t.stride(0) in (0, 1) or t.size(0) == 1:
        return "T"
    return None


def _mm_shape(ab, out, param_keys, param_shapes) -> tuple | None:
    """``(layout, M, K, N, batch dim)`` of a 2-D product ``a (M x K) @ b (K x N)``: the layout is
    each operand's `_layout_char` (a Linear's forward ``x @ W.T``: ``"NT"``; its input gradient
    ``dy @ W``: ``"NN"``; its weight gradient ``dy.T @ x``: ``"TN"``), the batch dim the index
    (0 = M, 1 = K, 2 = N) of the dimension that grows with the samples: the other operand's free
    dimension when one operand is a parameter, K when the product is a weight gradient (its output
    is parameter-shaped), else M. None for operands that are neither (odd strides)."""
    a, b = ab
    if not (isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor)) or a.dim() != 2 or b.dim() != 2:
        return None
    la, lb = _layout_char(a), _layout_char(b)
    if la is None or lb is None:
        return None
    pa = a.untyped_storage()._cdata in param_keys
    pb = b.untyped_storage()._cdata in param_keys
    if pb and not pa:
        dim = 0
    elif pa and not pb:
        dim = 2
    elif not pa and not pb and isinstance(out, torch.Tensor) and tuple(out.shape) in param_shapes:
        dim = 1
    else:
        dim = 0
    return (la + lb, int(a.shape[0]), int(a.shape[1]), int(b.shape[1]), dim)


class _ElementwiseBytes(TorchDispatchMode):
    """Sums inputs + outputs of non-view, non-matmul operators, the rule `_OpCounter` applies."""

    def __init__(self):
        super().__init__()
        self.nbytes = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        name = func.overloadpacket.__name__
        if name not in _VIEW_OPS and name not in _FLOP_OPS:
            flat = [t for t in tree_flatten((args, kwargs, out))[0] if isinstance(t, torch.Tensor)]
            self.nbytes += sum(t.numel() * t.element_size() for t in flat)
        return out


def count_elementwise_bytes(fn) -> int:
    """Bytes ``fn()`` moves through non-view, non-matmul operators, counted as the profile counts them
    (for calibrating the rate of that traffic against the same rule)."""
    mode = _ElementwiseBytes()
    with mode:
        fn()
    return mode.nbytes


class _FlashAttention(TorchFunctionMode):
    """Routes F.scaled_dot_product_attention (no mask, no dropout) to the CPU flash kernel (module docstring)."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is torch.nn.functional.scaled_dot_product_attention:
            q, k, v = args[:3]
            mask = kwargs.get("attn_mask", args[3] if len(args) > 3 else None)
            drop = kwargs.get("dropout_p", args[4] if len(args) > 4 else 0.0)
            causal = kwargs.get("is_causal", args[5] if len(args) > 5 else False)
            if mask is None and not drop and q.shape[-1] == v.shape[-1] and q.dim() == 4:
                if torch.is_autocast_enabled("cpu"):     # autocast's rule for sdpa, which this call bypasses
                    q, k, v = (t.to(torch.get_autocast_dtype("cpu")) for t in (q, k, v))
                return torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(
                    q, k, v, 0.0, bool(causal), scale=kwargs.get("scale"))[0]
        return func(*args, **kwargs)


_FLOP_OPS = {"mm", "addmm", "bmm", "baddbmm", "convolution", "convolution_backward", "_convolution",
             "_scaled_dot_product_flash_attention", "_scaled_dot_product_efficient_attention",
             "_scaled_dot_product_cudnn_attention", "_scaled_dot_product_flash_attention_backward",
             "_scaled_dot_product_efficient_attention_backward",
             "_scaled_dot_product_cudnn_attention_backward",
             "_scaled_dot_product_flash_attention_for_cpu",
             "_scaled_dot_product_flash_attention_for_cpu_backward"}


def _sdpa_flops(q, k, v) -> int:
    """FLOPs of attention's two products on shapes ``(batch, heads, seq, head dim)``, grouped-query
    attention included (fewer key / value heads than query heads: every query head still multiplies
    with a full key / value head, so the FLOPs are those of ``k`` and ``v`` expanded to the query's
    heads). torch 2.11's ``sdpa_flop_count`` asserts equal head counts (a Hugging Face Llama with
    ``num_key_value_heads`` < ``num_attention_heads`` failed there; 2.13 accepts it), so the shapes
    are expanded here."""
    from torch.utils.flop_counter import sdpa_flop_count
    if len(q) == 4 and len(k) == 4 and k[1] != q[1]:
        k, v = (k[0], q[1], *k[2:]), (v[0], q[1], *v[2:])
    return sdpa_flop_count(q, k, v)


def _cpu_flash_fwd(q, k, v, *args, out_shape=None, **kwargs) -> int:
    return _sdpa_flops(q, k, v)


def _cpu_flash_bwd(grad_out, q, k, v, *args, out_shape=None, **kwargs) -> int:
    # model FLOPs: the 4 products of an unfused backward (the fused kernel's recomputed scores are
    # not counted, as PaLM App. B counts no recomputation)
    return 2 * _sdpa_flops(q, k, v)


# torch's counter has no formula for the CPU flash kernel (used on CPU and by attention="flash")
_FLOP_FORMULAS = {torch.ops.aten._scaled_dot_product_flash_attention_for_cpu: _cpu_flash_fwd,
                  torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward: _cpu_flash_bwd}


class _Outside:
    """Where an op outside every block module goes, when the first / last block is the rest of the
    model (None in `profile_model`'s blocks): forward, the first block until a block module ran,
    then the block that last finished (the last block once the last module block finished);
    backward, the reverse (the last block until a block module's backward ran, then the block seen
    last, the first block once the first module block's backward ran). None: dropped, as before."""

    def __init__(self, blocks):
        n = len(blocks)
        named = [i for i, (_, m) in enumerate(blocks) if m is not None]
        self.pre = blocks[0][1] is None
        self.post = blocks[-1][1] is None and n > 1
        self.first, self.last, self.n = named[0], named[-1], n
        self.fwd = 0 if self.pre else None
        self.bwd = n - 1 if self.post else None

    @property
    def active(self) -> bool:
        return self.pre or self.post

    def ended(self, i: int) -> None:                 # forward of block module i finished
        self.fwd = self.n - 1 if (i == self.last and self.post) else i

    def seen(self, i: int) -> None:                  # backward op in block module i
        self.bwd = 0 if (i == self.first and self.pre) else i

    def __call__(self, is_bw: bool):
        return self.bwd if is_bw else self.fwd


def tied_copies(profile: ModelProfile, ranges: list[tuple[int, int]], pp: int, tp: int,
                schedule: str = "1f1b") -> list[list[tuple]]:
    """Per pipeline rank, the parameter copies it holds beyond the blocks' own (`BlockProfile.tied_numels`):
    a tie whose owner block is on another rank's stage, as (elements after the TP split, is a matrix,
    held by an embed / head block (an FSDP root parameter), trainable (not `BlockProfile.tied_frozen`)).
    ``ranges``: the stages' block ranges (`loads.stage_ranges`), stage s on rank s mod ``pp``, or under a
    V ``schedule`` on the rank `modelpar.stage_split.stage_rank` names (rank 0 holds the first and last stage)."""
    held: list[set[int]] = [set() for _ in range(pp)]
    for s, (a, b) in enumerate(ranges):
        held[stage_rank(s, pp, schedule) if pp > 1 else 0].update(range(a, b))
    n = len(profile.blocks)
    out: list[list[tuple]] = [[] for _ in range(pp)]
    for r in range(pp):
        for i in sorted(held[r]):
            bl = profile.blocks[i]
            for j, (owner, k, mat, sh) in enumerate(bl.tied_numels):
                if owner not in held[r]:
                    out[r].append((k / tp if sh else k, mat, bool(profile.arch) and i in (0, n - 1),
                                   not (bl.tied_frozen and bl.tied_frozen[j])))
    return out
