"""Profile a model without allocating it: per-block parameters, FLOPs, memory traffic, saved bytes.

`profile_model` runs one forward and one backward of the model on the meta device (when its
parameters are on meta) or under ``FakeTensorMode`` (when they are real), through
``torch.func.functional_call`` with stand-in parameters of the requested dtype, so no weight is
allocated and the user's module is never modified. It records, per block:

- parameters (count, bytes at the profiled dtype);
- forward and backward FLOPs, from ``torch.utils.flop_counter.FlopCounterMode`` (matmul-class ops);
- bytes moved by the other (memory-bound) ops, inputs + outputs, views excluded;
- the number of dispatched non-view ops (for a per-op overhead term);
- bytes saved for backward, via ``torch.autograd.graph.saved_tensors_hooks``: every storage counted
  once, parameters excluded, attributed to the block whose forward saved it first; the part of it a
  tensor-parallel split would shard: what is saved between a colwise Linear's output and its rowwise
  partner, by modelpar's derived TP plan (for the GPT: the attention / MLP interior, not the inputs of
  q/k/v/up; Korthikanti et al. 2022, Sec. 4.1), and the parameters that split shards;
- the live bytes inside the block's backward at its busiest moment (`_Lifetimes`: storage lifetimes
  from weak references, as torch's MemTracker keeps them): what is there beyond the saved bytes of the
  block and the blocks before it (the gradient temporaries of its interior, less what autograd already
  released), the gradient that arrived from later blocks, and how many of its parameters have their
  gradient by then. The memory model places the in-backward peak with these.

Attention: ``attention="flash"`` (the default) profiles ``scaled_dot_product_attention`` as a fused
flash / memory-efficient kernel, which is what torch runs on CPUs (``_scaled_dot_product_flash_
attention_for_cpu``) and on current GPUs: it saves q, k, v, the output and the (batch, heads, seq)
log-sum-exp, O(seq) bytes per head (Dao et al., "FlashAttention", NeurIPS 2022, Sec. 3.1).
``attention="math"`` keeps torch's math path on the meta device, which materialises the (batch,
heads, seq, seq) scores and probabilities as unfused attention does (Megatron-LM 2021, Korthikanti et
al. 2022 Eq. 1). The FLOPs are the same either way (torch's counter counts both score products).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any, Sequence

import torch
import torch.nn as nn
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten
from torch.utils.flop_counter import FlopCounterMode
from torch.utils.module_tracker import ModuleTracker

from modelpar.plan import CORE_ATTR

_VIEW_OPS = {"view", "_unsafe_view", "t", "transpose", "expand", "detach", "permute", "unsqueeze",
             "squeeze", "slice", "select", "alias", "as_strided", "split", "unbind", "lift_fresh",
             "_reshape_alias", "reshape", "split_with_sizes", "chunk", "expand_as",
             "device", "sym_size", "sym_stride", "sym_numel", "sym_storage_offset", "dim", "is_contiguous"}


@dataclass(frozen=True)
class BlockProfile:
    """One pipeline-splittable block, for the profiled batch. Units: counts, FLOPs, bytes."""

    name: str
    num_params: int
    param_bytes: int
    fwd_flops: int
    bwd_flops: int
    fwd_mem_bytes: int          # bytes read + written by non-matmul, non-view forward ops
    bwd_mem_bytes: int
    fwd_ops: int                # non-view ops dispatched in forward
    bwd_ops: int
    saved_bytes: int            # bytes kept for backward (storages once, parameters excluded)
    saved_tp_sharded_bytes: int  # part of saved_bytes a TP split shards by the TP degree
    input_bytes: int            # the block's tensor inputs (what full checkpointing keeps)
    output_bytes: int           # the block's tensor outputs (what a pipeline stage sends)
    tp_sharded_params: int = 0  # parameters a TP split shards (colwise weight + bias, rowwise weight)
    # per parameter, in registration order: (numel, is a matrix (decayed by AdamW), TP-sharded)
    param_numels: tuple[tuple[int, bool, bool], ...] = ()
    fwd_gemms: int = 0          # matmul-class calls in forward (their mean size picks the FLOP/s)
    bwd_gemms: int = 0
    # bytes the matmul-class calls read + write: of parameters (once per micro-batch, whatever its
    # size) and of everything else (proportional to the batch); for the roofline's memory bound
    fwd_gemm_param_bytes: int = 0
    bwd_gemm_param_bytes: int = 0
    fwd_gemm_act_bytes: int = 0
    bwd_gemm_act_bytes: int = 0
    # fused attention kernels among the matmul-class calls: their FLOPs and calls (forward, backward),
    # timed at the calibrated attention rate rather than the GEMM curve
    fwd_attn_flops: int = 0
    bwd_attn_flops: int = 0
    attn_calls: int = 0
    # the busiest moments of the block's backward (see `_Lifetimes`), for the profiled batch, one per
    # trade-off between activations and gradients (early: the interior's gradients; later: weight
    # gradients made, activations freed): (live bytes beyond the saved bytes of this and earlier
    # blocks, i.e. gradient temporaries made by this block's backward less the saved tensors it already
    # freed (may be negative); live gradients made by later blocks' backward (the gradient w.r.t. this
    # block's output); elements of this block's parameters whose gradient AccumulateGrad has stored;
    # elements of weight gradients computed but not yet stored)
    bwd_peaks: tuple[tuple[int, int, int, int], ...] = ()
    # part of saved_bytes that is the block's own input (for a stage's first block that storage is
    # the batch or the pipeline's receive buffer, which the memory model counts there)
    saved_input_bytes: int = 0
    # part of saved_bytes that selective checkpointing frees: what the block's attention cores
    # (`modelpar.parallel.checkpointing.attention_cores`) save beyond their own inputs and beyond what
    # the block saves again outside them (a fused kernel: its log-sum-exp only, its output being the
    # output projection's saved input; the unfused math path: the (seq x seq) scores too); inside
    # the TP-sharded region (heads split), so sharded by the TP degree
    attn_core_saved_bytes: int = 0


@dataclass(frozen=True)
class ModelProfile:
    """Per-block profile of one forward/backward at ``batch_size`` samples and ``dtype``.

    ``arch`` carries shape facts the planner needs for divisibility (for a GPT: ``n_head``,
    ``d_model``, ``ffn``, ``n_layer``, ``vocab_size``, ``seq_len``); empty for other models.
    Per-sample quantities scale linearly with the micro-batch size (true for the FLOPs, traffic and
    activations of the models here: every term has one batch factor).
    """

    blocks: tuple[BlockProfile, ...]
    dtype: str                  # "fp32" or "bf16"
    batch_size: int             # samples in the profiled input
    tokens_per_sample: int      # sequence length for token models, 1 otherwise
    arch: dict[str, int] = dataclasses.field(default_factory=dict)

    @property
    def num_params(self) -> int:
        return sum(b.num_params for b in self.blocks)

    @property
    def fwd_flops_per_sample(self) -> float:
        return sum(b.fwd_flops for b in self.blocks) / self.batch_size

    @property
    def train_flops_per_sample(self) -> float:
        return sum(b.fwd_flops + b.bwd_flops for b in self.blocks) / self.batch_size

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> "ModelProfile":
        d = dict(d)
        d["blocks"] = tuple(BlockProfile(**{**b, "param_numels": tuple(tuple(x) for x in b.get("param_numels", ())),
                                            "bwd_peaks": tuple(tuple(x) for x in b.get("bwd_peaks", ()))})
                            for b in d["blocks"])
        return cls(**d)


def default_blocks(model: nn.Module) -> list[tuple[str, nn.Module]]:
    """The pipeline-splittable blocks: GPT -> embed, blocks.i, head; Sequential -> its children;
    anything else -> the whole model as one block."""
    if all(hasattr(model, a) for a in ("embed", "blocks", "head")):
        return ([("embed", model.embed)] + [(f"blocks.{i}", b) for i, b in enumerate(model.blocks)]
                + [("head", model.head)])
    if isinstance(model, nn.Sequential):
        return [(n, m) for n, m in model.named_children()]
    return [("model", model)]


def _arch_of(model: nn.Module) -> dict[str, int]:
    cfg = getattr(model, "cfg", None)
    if cfg is None or not hasattr(cfg, "n_head"):
        return {}
    return {"n_head": cfg.n_head, "d_model": cfg.d_model, "ffn": cfg.ffn, "n_layer": cfg.n_layer,
            "vocab_size": cfg.vocab_size, "seq_len": cfg.seq_len}


def _tp_styles(model: nn.Module, vocab_parallel: bool | None = None) -> dict[str, str]:
    """``{module path: "colwise" | "rowwise"}`` of the TP plan modelpar's runtime derives for ``model``
    ({} if none): `tensor.default_tp_plan`, whose GPT plan splits the token embedding (rowwise over
    the vocabulary: its weight is sharded) and the head (colwise over the vocabulary) unless
    ``vocab_parallel=False``."""
    from modelpar.parallel import tensor
    try:
        plan, _ = tensor.default_tp_plan(model, loss_parallel=vocab_parallel)
    except ValueError:
        return {}
    return tensor.tp_kinds(plan)      # Conv1D styles of HF models too (h-tp hook)


def _nbytes(t: torch.Tensor) -> int:
    return t.untyped_storage().nbytes()


class _Lifetimes:
    """Storage lifetimes over the profiled forward + backward, to find each block's in-backward peak.

    Storages are registered when first saved for backward (forward) or when a backward op creates
    them; a weak reference on the storage (meta and fake storages are freed like real ones) records
    when autograd drops it. Backward ops are recorded with their block. After the backward, the
    storages that became parameter gradients are known (post-accumulate-grad hooks) and the timeline
    is replayed: at each backward op of block i the live activation bytes are the saved storages
    still alive plus the non-gradient storages made in backward, split into those made by block i
    ("own") and by later blocks ("in": the gradient flowing into block i); the op with the most live
    bytes is block i's peak.
    """

    def __init__(self, n: int):
        self.n = n
        self.live: dict[int, int] = {}        # storage key -> serial, while alive
        self.size: list[int] = []             # serial -> bytes
        self.creator: list[int] = []          # serial -> block whose backward made it (-1: forward / none)
        self.events: list[tuple[int, int]] = []   # (+1 new / -1 free / 0 op, serial or block)
        self.saved: set[int] = set()          # serials saved for backward
        self.grad_block: dict[int, int] = {}  # serial -> block, for storages that became parameter grads

    def add(self, t: torch.Tensor, creator: int) -> int:
        import weakref
        st = t.untyped_storage()
        key = st._cdata
        s = self.live.get(key)
        if s is not None:
            return s
        s = len(self.size)
        self.size.append(st.nbytes())
        self.creator.append(creator)
        self.live[key] = s
        self.events.append((1, s))
        weakref.finalize(st, self._free, key, s)
        return s

    def _free(self, key: int, s: int) -> None:
        if self.live.get(key) == s:
            del self.live[key]
        self.events.append((-1, s))

    def backward_op(self, block: int, args, out) -> None:
        ins = {t.untyped_storage()._cdata for t in tree_flatten(args)[0] if isinstance(t, torch.Tensor)}
        for t in tree_flatten(out)[0]:
            if isinstance(t, torch.Tensor) and t.untyped_storage()._cdata not in ins:   # not in-place
                self.add(t, block)
        self.events.append((0, block))

    def grad(self, p: torch.Tensor, block: int) -> None:
        # a weight gradient is a temporary of its matmul until AccumulateGrad stores it as .grad
        if p.grad is not None:
            s = self.add(p.grad, -1)
            if s not in self.grad_block:
                self.grad_block[s] = block
                self.events.append((2, s))

    def block_peaks(self) -> list[list[tuple[int, int, int, int]]]:
        """Per block, the backward ops no other op of the block beats on both live activation bytes
        and live gradient bytes of the block's parameters: (own live bytes, incoming-gradient live
        bytes, stored gradient bytes, computed-not-yet-stored gradient bytes), by increasing gradient
        bytes."""
        saved, grad_block, size, creator = self.saved, self.grad_block, self.size, self.creator
        cur_saved = 0
        bw_total = 0
        bw_by = [0] * self.n
        grads_by = [0] * self.n
        pending_by = [0] * self.n
        fronts: list[list[tuple]] = [[] for _ in range(self.n)]   # (total, grads, own, in, stored, pending)
        alive: set[int] = set()
        stored: set[int] = set()              # gradients AccumulateGrad has stored

        def count(s: int, nb: int) -> None:
            nonlocal cur_saved, bw_total
            if s in stored:
                grads_by[grad_block[s]] += nb
            elif s in grad_block:
                pending_by[grad_block[s]] += nb
            elif s in saved:
                cur_saved += nb
            elif creator[s] >= 0:
                bw_total += nb
                bw_by[creator[s]] += nb

        for kind, x in self.events:
            if kind == 0:
                own = cur_saved + bw_by[x]
                tot = cur_saved + bw_total
                g = grads_by[x] + pending_by[x]
                f = fronts[x]
                if not any(e[0] >= tot and e[1] >= g for e in f):
                    f[:] = [e for e in f if not (tot >= e[0] and g >= e[1])] + [
                        (tot, g, own, tot - own, grads_by[x], pending_by[x])]
            elif kind == 2:                   # became a parameter's .grad
                if x in alive:
                    count(x, -size[x])
                    stored.add(x)
                    count(x, size[x])
                else:
                    stored.add(x)
            elif kind > 0:
                alive.add(x)
                count(x, size[x])
            elif x in alive:
                alive.discard(x)
                count(x, -size[x])
        return [[e[2:] for e in sorted(f, key=lambda e: e[1])] for f in fronts]


class _OpCounter(TorchDispatchMode):
    """Counts non-view ops and the bytes they read + write, per block and pass."""

    def __init__(self, tracker: ModuleTracker, names: dict[str, int], n: int, param_keys=frozenset(),
                 param_shapes=frozenset(), lifetimes: _Lifetimes | None = None):
        super().__init__()
        self.tracker, self.names, self.param_keys = tracker, names, param_keys
        self.lifetimes = lifetimes
        self.param_shapes = param_shapes        # shapes (and transposes) of 2-D parameters
        self.gemm_bytes = [[0, 0, 0, 0] for _ in range(n)]     # param fwd, param bwd, act fwd, act bwd
        self.mem = [[0, 0] for _ in range(n)]
        self.ops = [[0, 0] for _ in range(n)]
        self.gemms = [[0, 0] for _ in range(n)]
        self.attn = [[0, 0, 0] for _ in range(n)]    # fwd FLOPs, bwd FLOPs, forward calls

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        name = func.overloadpacket.__name__
        if name in _VIEW_OPS:
            return out
        idx = next((self.names[p] for p in self.tracker.parents if p in self.names), None)
        if idx is None:
            return out
        if self.lifetimes is not None and self.tracker.is_bw:
            self.lifetimes.backward_op(idx, (args, kwargs), out)
        if name in _FLOP_OPS:
            ph = 1 if self.tracker.is_bw else 0
            self.gemms[idx][ph] += 1
            if "scaled_dot_product" in name:
                from torch.utils.flop_counter import sdpa_flop_count
                q, k, v = args[ph:ph + 3]          # backward ops take grad_out first
                self.attn[idx][ph] += sdpa_flop_count(q.shape, k.shape, v.shape) * (2 if ph else 1)
                self.attn[idx][2] += 1 - ph
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
            return out
        flat = [t for t in tree_flatten((args, kwargs, out))[0] if isinstance(t, torch.Tensor)]
        phase = 1 if self.tracker.is_bw else 0
        self.mem[idx][phase] += sum(t.numel() * t.element_size() for t in flat)
        self.ops[idx][phase] += 1
        return out


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
    """Routes ``F.scaled_dot_product_attention`` (no mask, no dropout) to the fused CPU flash kernel,
    whose meta/fake implementation and saved tensors match a fused GPU kernel's (see module docstring)."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is torch.nn.functional.scaled_dot_product_attention:
            q, k, v = args[:3]
            mask = kwargs.get("attn_mask", args[3] if len(args) > 3 else None)
            drop = kwargs.get("dropout_p", args[4] if len(args) > 4 else 0.0)
            causal = kwargs.get("is_causal", args[5] if len(args) > 5 else False)
            if mask is None and not drop and q.shape[-1] == v.shape[-1] and q.dim() == 4:
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


def _cpu_flash_fwd(q, k, v, *args, out_shape=None, **kwargs) -> int:
    from torch.utils.flop_counter import sdpa_flop_count
    return sdpa_flop_count(q, k, v)


def _cpu_flash_bwd(grad_out, q, k, v, *args, out_shape=None, **kwargs) -> int:
    # model FLOPs: the 4 products of an unfused backward (the fused kernel's recomputed scores are
    # not counted, as PaLM App. B counts no recomputation)
    from torch.utils.flop_counter import sdpa_flop_count
    return 2 * sdpa_flop_count(q, k, v)


# torch's counter has no formula for the CPU flash kernel (used on CPU and by attention="flash")
_FLOP_FORMULAS = {torch.ops.aten._scaled_dot_product_flash_attention_for_cpu: _cpu_flash_fwd,
                  torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward: _cpu_flash_bwd}


def profile_model(model: nn.Module, example_input: torch.Tensor | Sequence[torch.Tensor], *,
                  dtype: torch.dtype = torch.float32,
                  blocks: Sequence[tuple[str, nn.Module]] | None = None,
                  attention: str = "flash", vocab_parallel: bool | None = None) -> ModelProfile:
    """Profile one training forward + backward of ``model`` on ``example_input`` without weights.

    Args:
        model: any ``nn.Module``; its parameters may be on meta (profiled on meta) or real (profiled
            under FakeTensorMode). It is not modified.
        example_input: tensor (or tuple of tensors) with the batch in dim 0, e.g. tokens
            ``(batch, seq)`` int64 or features ``(batch, in)``; floating inputs are cast to ``dtype``.
        dtype: ``torch.float32`` or ``torch.bfloat16``: the dtype of parameters and activations.
        blocks: ``(name, submodule)`` pairs to attribute costs to; default `default_blocks`.
        attention: ``"flash"`` (fused kernel, O(seq) saved bytes), ``"math"`` (unfused, the
            (seq, seq) scores saved; see the module docstring) or ``"megatron"`` (Megatron-LM's
            unfused core attention with its fused softmax, `runtimes.MegatronAttention`).
        vocab_parallel: mark the GPT's token embedding and head TP-sharded as the runtime shards them
            under TP (None: the runtime's default, `modelpar.parallel.tensor.default_tp_plan`;
            False: both replicated, as ``parallelize(loss_parallel=False)``).

    Returns:
        ModelProfile with one BlockProfile per block, for the batch of ``example_input``.

    Raises:
        ValueError: unsupported dtype or attention, an empty input, or a block that is not a
            submodule of model.
    """
    if attention not in ("flash", "math", "megatron"):
        raise ValueError(f"profile_model attention must be 'flash', 'math' or 'megatron', got {attention!r}")
    if dtype not in (torch.float32, torch.bfloat16):
        raise ValueError(f"profile_model dtype must be torch.float32 or torch.bfloat16, got {dtype}")
    inputs = tuple(example_input) if isinstance(example_input, (tuple, list)) else (example_input,)
    if not inputs or inputs[0].dim() == 0:
        raise ValueError("profile_model needs an example_input with a batch dimension")
    blocks = list(blocks) if blocks is not None else default_blocks(model)
    root_name = type(model).__name__
    fqn = {m: n for n, m in model.named_modules()}
    for n, m in blocks:
        if m not in fqn:
            raise ValueError(f"block {n!r} is not a submodule of the model")
    names = {(f"{root_name}.{fqn[m]}" if fqn[m] else root_name): i for i, (_, m) in enumerate(blocks)}

    on_meta = all(p.device.type == "meta" for p in model.parameters())
    fake_mode = None
    if not on_meta:
        from torch._subclasses.fake_tensor import FakeTensorMode
        fake_mode = FakeTensorMode(allow_non_fake_inputs=True)
        fake_mode.__enter__()
    flash = _FlashAttention() if attention == "flash" else None
    if attention == "megatron":      # Megatron-LM's unfused core attention (`runtimes.MegatronAttention`)
        from modelpar.planner.runtimes import megatron_attention_mode
        flash = megatron_attention_mode()
    try:
        if flash is not None:
            flash.__enter__()
        return _profile(model, inputs, dtype, blocks, names, fqn, on_meta, vocab_parallel)
    finally:
        if flash is not None:
            flash.__exit__(None, None, None)
        if fake_mode is not None:
            fake_mode.__exit__(None, None, None)


def _profile(model, inputs, dtype, blocks, names, fqn, on_meta, vocab_parallel=None) -> ModelProfile:
    dev = "meta" if on_meta else None

    def stand_in(t: torch.Tensor, grad: bool) -> torch.Tensor:
        d = dtype if t.is_floating_point() else t.dtype
        x = torch.empty(t.shape, dtype=d, device=dev or t.device)
        return x.requires_grad_(grad and t.is_floating_point())

    params = {n: stand_in(p, p.requires_grad) for n, p in model.named_parameters()}
    buffers = {n: stand_in(b, False) for n, b in model.named_buffers()}
    xs = tuple(stand_in(x, False) if x.is_floating_point() else torch.zeros(
        x.shape, dtype=x.dtype, device=dev or x.device) for x in inputs)
    param_keys = {p.untyped_storage()._cdata for p in params.values()}

    n = len(blocks)
    saved = [0] * n
    saved_tp = [0] * n
    in_bytes = [0] * n
    out_bytes = [0] * n
    saved_in = [0] * n
    in_keys: list[set[int]] = [set() for _ in range(n)]
    life = _Lifetimes(n)                      # storage lifetimes; also dedupes saved storages
    block_of = {m: i for i, (_, m) in enumerate(blocks)}
    current: list[int] = []                   # stack of active block indices
    sub_stack: list[str] = []                 # fqn of innermost active submodule
    styles = _tp_styles(model, vocab_parallel)
    sharded_region = [False]                  # inside a (colwise -> rowwise) TP pair
    core_saved = [0] * n
    core_inputs: list[set[int]] = []          # input storages of the active attention cores
    core_keys: dict[int, int] = {}            # storages first saved inside a core -> block

    def pre(mod, args):
        if mod in block_of:
            i = block_of[mod]
            current.append(i)
            ins = [a for a in tree_flatten(args)[0] if isinstance(a, torch.Tensor)]
            in_bytes[i] = sum(_nbytes(a) for a in ins)
            in_keys[i] = {a.untyped_storage()._cdata for a in ins}
        if getattr(type(mod), CORE_ATTR, False):
            core_inputs.append({a.untyped_storage()._cdata for a in tree_flatten(args)[0]
                                if isinstance(a, torch.Tensor)})
        sub_stack.append(fqn.get(mod, ""))

    def post(mod, args, out):
        sub_stack.pop()
        if getattr(type(mod), CORE_ATTR, False):
            core_inputs.pop()
        style = styles.get(fqn.get(mod, ""))
        if style is not None:
            sharded_region[0] = style == "colwise"
        if mod in block_of:
            current.pop()
            out_bytes[block_of[mod]] = sum(_nbytes(o) for o in tree_flatten(out)[0]
                                           if isinstance(o, torch.Tensor))

    def pack(t: torch.Tensor):
        if not current:
            return t
        key = t.untyped_storage()._cdata
        if key in param_keys:
            return t
        serial = life.add(t, -1)
        if serial in life.saved:
            # saved inside an attention core and again by the block outside it (e.g. the fused
            # kernel's output, viewed as the output projection's input): recomputing the core frees
            # nothing of it
            owner = core_keys.pop(key, None) if not core_inputs else None
            if owner is not None:
                core_saved[owner] -= _nbytes(t)
            return t
        life.saved.add(serial)
        i = current[-1]
        b = _nbytes(t)
        saved[i] += b
        if key in in_keys[i]:
            saved_in[i] += b
        if sharded_region[0]:         # between a colwise Linear's output and its rowwise partner
            saved_tp[i] += b
        if core_inputs and key not in core_inputs[-1]:
            core_saved[i] += b
            core_keys[key] = i
        return t

    handles = [m.register_forward_pre_hook(pre) for m in model.modules()]
    handles += [m.register_forward_hook(post) for m in model.modules()]
    for bi, (_, mod) in enumerate(blocks):    # which storages become parameter gradients, per block
        base = fqn[mod]
        for pn, _ in mod.named_parameters():
            sp = params.get(f"{base}.{pn}" if base else pn)
            if sp is not None and sp.requires_grad:
                handles.append(sp.register_post_accumulate_grad_hook(
                    lambda p, bi=bi: life.grad(p, bi)))
    tracker = ModuleTracker()
    shapes = {tuple(p.shape) for p in params.values() if p.dim() == 2}
    counter = _OpCounter(tracker, names, n, frozenset(param_keys), frozenset(shapes | {s[::-1] for s in shapes}),
                         lifetimes=life)
    # FlopCounterMode attributes backward FLOPs to modules only if it saw their forward: one counter
    # spans both passes, a nested one the forward alone; backward = all - forward.
    all_fc = FlopCounterMode(display=False, custom_mapping=_FLOP_FORMULAS)
    fwd_fc = FlopCounterMode(display=False, custom_mapping=_FLOP_FORMULAS)
    try:
        with tracker, counter, all_fc:
            with fwd_fc, torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
                out = torch.func.functional_call(model, {**params, **buffers}, xs)
            outs = [o for o in tree_flatten(out)[0] if isinstance(o, torch.Tensor) and o.requires_grad]
            # a reduction after the model, so the last block's backward hooks see a gradient arrive
            torch.autograd.backward([o.sum() for o in outs])
    finally:
        for h in handles:
            h.remove()

    del out, outs
    peaks = life.block_peaks()
    fwd_counts, all_counts = fwd_fc.get_flop_counts(), all_fc.get_flop_counts()
    rows = []
    cum_saved = 0
    esize = torch.empty((), dtype=dtype).element_size()
    for (name, mod), (mod_name, i) in zip(blocks, names.items()):
        bp = [p for p in mod.parameters()]
        base = fqn[mod]
        numels = []
        for pn, p in mod.named_parameters():
            owner, _, leaf = (f"{base}.{pn}" if base else pn).rpartition(".")
            st = styles.get(owner)
            numels.append((p.numel(), p.dim() >= 2, st == "colwise" or (st == "rowwise" and leaf == "weight")))
        rows.append(BlockProfile(
            name=name, num_params=sum(p.numel() for p in bp),
            param_bytes=sum(p.numel() for p in bp) * torch.empty((), dtype=dtype).element_size(),
            fwd_flops=int(sum(fwd_counts.get(mod_name, {}).values())),
            bwd_flops=int(sum(all_counts.get(mod_name, {}).values())
                          - sum(fwd_counts.get(mod_name, {}).values())),
            fwd_mem_bytes=counter.mem[i][0], bwd_mem_bytes=counter.mem[i][1],
            fwd_ops=counter.ops[i][0], bwd_ops=counter.ops[i][1],
            saved_bytes=saved[i], saved_tp_sharded_bytes=saved_tp[i],
            input_bytes=in_bytes[i], output_bytes=out_bytes[i],
            tp_sharded_params=sum(n for n, _, sh in numels if sh), param_numels=tuple(numels),
            fwd_gemms=counter.gemms[i][0], bwd_gemms=counter.gemms[i][1],
            fwd_gemm_param_bytes=counter.gemm_bytes[i][0], bwd_gemm_param_bytes=counter.gemm_bytes[i][1],
            fwd_gemm_act_bytes=counter.gemm_bytes[i][2], bwd_gemm_act_bytes=counter.gemm_bytes[i][3],
            fwd_attn_flops=counter.attn[i][0], bwd_attn_flops=counter.attn[i][1], attn_calls=counter.attn[i][2],
            bwd_peaks=tuple((own - cum_saved - saved[i], inn, g // esize, pend // esize)
                            for own, inn, g, pend in peaks[i]),
            saved_input_bytes=saved_in[i], attn_core_saved_bytes=core_saved[i]))
        cum_saved += saved[i]
    x0 = inputs[0]
    tokens = x0.shape[1] if (x0.dim() == 2 and not x0.is_floating_point()) else 1
    return ModelProfile(blocks=tuple(rows), dtype="bf16" if dtype == torch.bfloat16 else "fp32",
                        batch_size=int(x0.shape[0]), tokens_per_sample=int(tokens), arch=_arch_of(model))
