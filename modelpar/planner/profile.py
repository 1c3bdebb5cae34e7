"""Profile a model without allocating it: per-block parameters, FLOPs, memory traffic, saved bytes.

`profile_model` runs one forward and one backward of the model on the meta device (when its
parameters are on meta) or under ``FakeTensorMode`` (when they are real), through
``torch.func.functional_call`` with stand-in parameters of the requested dtype, so no weight is
allocated and the user's module is never modified. It records, per block:

- parameters (count, bytes at the profiled dtype);
- forward and backward FLOPs, from ``torch.utils.flop_counter.FlopCounterMode`` (matmul-class ops);
- bytes moved by the other (memory-bound) ops, inputs + outputs, views excluded;
- the number of dispatched non-view, non-matmul ops, and of all aten calls (per-op overhead terms);
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
from typing import Sequence

import torch
import torch.nn as nn
from torch.utils._pytree import tree_flatten
from torch.utils.flop_counter import FlopCounterMode
from torch.utils.module_tracker import ModuleTracker

from modelpar.plan import CORE_ATTR
from modelpar.planner.legality import tp_splits
from modelpar.planner.profile_blocks import (TPSplitScopes, _arch_of, _block_params, _checked_blocks,  # noqa: F401
                                             _param_rows, _tp_styles, default_blocks)
from modelpar.planner.records import GemmShape
from modelpar.planner.profile_types import BlockProfile, ModelProfile
from modelpar.planner.profile_lifetimes import _hook_partial_grads, _Lifetimes, _nbytes
from modelpar.planner.profile_ops import (_FLOP_FORMULAS, _FlashAttention, _OpCounter, _Outside,  # noqa: F401
                                          count_elementwise_bytes, tied_copies)

__all__ = ["BlockProfile", "ModelProfile", "count_elementwise_bytes", "default_blocks", "profile_model",
           "tied_copies"]


def profile_model(model: nn.Module, example_input: torch.Tensor | Sequence[torch.Tensor], *,
                  dtype: torch.dtype = torch.float32,
                  blocks: Sequence[tuple[str, nn.Module | None]] | None = None,
                  attention: str = "flash", vocab_parallel: bool | None = None,
                  autocast: bool = False) -> ModelProfile:
    """Profile one training forward + backward of ``model`` on ``example_input`` without weights.

    Args:
        model: any ``nn.Module``; its parameters may be on meta (profiled on meta) or real (profiled
            under FakeTensorMode). It is not modified.
        example_input: tensor (or tuple of tensors) with the batch in dim 0, e.g. tokens
            ``(batch, seq)`` int64 or features ``(batch, in)``; floating inputs are cast to ``dtype``.
        dtype: ``torch.float32`` or ``torch.bfloat16``: the dtype of parameters and activations.
        blocks: ``(name, submodule)`` pairs to attribute costs to; default `default_blocks`. The first
            and the last submodule may be None: everything the model runs before the first (after
            the last) named block, and the parameters of the modules it runs there, belong to it.
            A parameter reachable from two blocks (tied) is counted in the first only.
        attention: ``"flash"`` (fused kernel, O(seq) saved bytes), ``"math"`` (unfused, the
            (seq, seq) scores saved; see the module docstring) or ``"megatron"`` (Megatron-LM's
            unfused core attention with its fused softmax, `runtimes.MegatronAttention`).
        vocab_parallel: mark the GPT's token embedding and head TP-sharded as the runtime shards them
            under TP (None: the runtime's default, `modelpar.parallel.tensor.default_tp_plan`;
            False: both replicated, as ``parallelize(loss_parallel=False)``).
        autocast: with ``dtype=torch.bfloat16``, also profile the model as modelpar's runtime trains
            it in bf16 without FSDP (`ParallelPlan.precision`): fp32 parameters and floating inputs,
            the forward under ``torch.autocast`` (CPU's bf16 autocast on fake CPU tensors: its casting
            of matmuls, attention and norms is CUDA's), the backward outside it; the result's
            ``autocast`` field holds that profile. Autocast's bf16 weight copies are neither saved
            activations nor per-sample traffic there (the memory model counts them per parameter,
            the cost model's cast term their traffic). Measured on an H100 (docs/planner.md, "GPU
            check"): the bf16 profile missed ~8 B per token and width of every layer, the fp32
            residual's norm inputs and the per-Linear input casts. Where that second pass fails, a
            warning says so and ``autocast`` stays None.

    Returns:
        ModelProfile with one BlockProfile per block, for the batch of ``example_input``.

    Raises:
        ValueError: unsupported dtype or attention, an empty input, a block that is not a
            submodule of model, or a None block other than the first or the last; ``autocast``
            without ``dtype=torch.bfloat16``.
    """
    if autocast:
        if dtype != torch.bfloat16:
            raise ValueError(f"profile_model autocast needs dtype=torch.bfloat16, got {dtype}")
        base = profile_model(model, example_input, dtype=dtype, blocks=blocks, attention=attention,
                             vocab_parallel=vocab_parallel)
        try:
            variant = _profile_model(model, example_input, dtype, blocks, attention, vocab_parallel, True)
        except Exception as e:     # noqa: BLE001 -- a model CPU autocast cannot trace: the bf16 profile stands in
            import warnings
            warnings.warn(f"profile_model: the autocast profile of {type(model).__name__} failed "
                          f"({type(e).__name__}: {e}); its bf16 profile stands in for plans that autocast")
            return base
        return dataclasses.replace(base, autocast=variant)
    return _profile_model(model, example_input, dtype, blocks, attention, vocab_parallel, False)


def _profile_model(model, example_input, dtype, blocks, attention, vocab_parallel, autocast: bool) -> ModelProfile:
    if attention not in ("flash", "math", "megatron"):
        raise ValueError(f"profile_model attention must be 'flash', 'math' or 'megatron', got {attention!r}")
    if dtype not in (torch.float32, torch.bfloat16):
        raise ValueError(f"profile_model dtype must be torch.float32 or torch.bfloat16, got {dtype}")
    inputs = tuple(example_input) if isinstance(example_input, (tuple, list)) else (example_input,)
    if not inputs or inputs[0].dim() == 0:
        raise ValueError("profile_model needs an example_input with a batch dimension")
    blocks, fqn, names = _checked_blocks(model, blocks)

    on_meta = all(p.device.type == "meta" for p in model.parameters()) and not autocast
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
        return _profile(model, inputs, dtype, blocks, names, fqn, on_meta, vocab_parallel, autocast)
    finally:
        if flash is not None:
            flash.__exit__(None, None, None)
        if fake_mode is not None:
            fake_mode.__exit__(None, None, None)


def _profile(model, inputs, dtype, blocks, names, fqn, on_meta, vocab_parallel=None,
             autocast: bool = False) -> ModelProfile:
    # autocast: fake CPU tensors (CPU autocast applies to them; meta tensors bypass autocast)
    dev = "meta" if on_meta else ("cpu" if autocast else None)
    compute_dtype = dtype
    dtype = torch.float32 if autocast else dtype     # stand-ins: fp32 master weights under autocast

    def stand_in(t: torch.Tensor, grad: bool) -> torch.Tensor:
        d = dtype if t.is_floating_point() else t.dtype
        x = torch.empty(t.shape, dtype=d, device=dev or t.device)
        return x.requires_grad_(grad and t.is_floating_point())

    params = {n: stand_in(p, p.requires_grad) for n, p in model.named_parameters()}
    stand_of = {id(p): params[n] for n, p in model.named_parameters()}
    buffers = {n: stand_in(b, False) for n, b in model.named_buffers()}
    xs = tuple(stand_in(x, False) if x.is_floating_point() else torch.zeros(
        x.shape, dtype=x.dtype, device=dev or x.device) for x in inputs)
    param_keys = {p.untyped_storage()._cdata for p in params.values()}

    n = len(blocks)
    saved, saved_tp, in_bytes, out_bytes, saved_in, saved_g, wg, wg_tp = ([0] * n for _ in range(8))
    gather_keys: set[int] = set()             # input storages of matmul modules outside the sharded region
    in_keys: list[set[int]] = [set() for _ in range(n)]
    life = _Lifetimes(n)                      # storage lifetimes; also dedupes saved storages
    block_of = {m: i for i, (_, m) in enumerate(blocks) if m is not None}
    outside = _Outside(blocks)
    has_params = {m for m in model.modules() if next(m.parameters(recurse=False), None) is not None}
    trains = {m for m in has_params if any(q.requires_grad for q in m.parameters(recurse=False))}
    owner: dict[nn.Module, int] = {}          # modules outside the block modules -> None block running them
    current: list[int] = []                   # stack of active block indices
    sub_stack: list[str] = []                 # fqn of innermost active submodule
    styles = _tp_styles(model, vocab_parallel)
    sharded_region = [False]                  # inside a (colwise -> rowwise) TP pair
    core_saved = [0] * n
    core_inputs: list[set[int]] = []          # input storages of the active attention cores
    core_keys: dict[int, int] = {}            # storages first saved inside a core -> block
    if outside.pre:
        in_bytes[0] = sum(_nbytes(x) for x in xs)
        in_keys[0] = {x.untyped_storage()._cdata for x in xs}

    def pre(mod, args):
        if mod in block_of:
            i = block_of[mod]
            current.append(i)
            ins = [a for a in tree_flatten(args)[0] if isinstance(a, torch.Tensor)]
            in_bytes[i] = sum(_nbytes(a) for a in ins)
            in_keys[i] = {a.untyped_storage()._cdata for a in ins}
            if i == outside.first and outside.pre:
                out_bytes[0] = in_bytes[i]
        elif not current and mod in has_params and outside.fwd is not None:
            owner.setdefault(mod, outside.fwd)
        if getattr(type(mod), CORE_ATTR, False):
            core_inputs.append({a.untyped_storage()._cdata for a in tree_flatten(args)[0]
                                if isinstance(a, torch.Tensor)})
        if styles.get(fqn.get(mod, "")) == "colwise":    # its input is replicated: under autocast the
            sharded_region[0] = False                    # Linear casts it itself (k / v after q's output)
        if (isinstance(mod, nn.Linear) or type(mod).__name__ == "Conv1D") and not sharded_region[0] \
                and styles.get(fqn.get(mod, "")) != "rowwise":
            for a in tree_flatten(args)[0]:
                if isinstance(a, torch.Tensor):
                    counter.track(gather_keys, a)
        sub_stack.append(fqn.get(mod, ""))

    def post(mod, args, out):
        sub_stack.pop()
        if getattr(type(mod), CORE_ATTR, False):
            core_inputs.pop()
        style = styles.get(fqn.get(mod, ""))
        if style is not None:
            sharded_region[0] = style == "colwise"
        j = current[-1] if current else outside.fwd
        if mod in trains and j is not None:      # `BlockProfile.wgrad_bytes`
            b = sum(_nbytes(o) for o in tree_flatten(out)[0] if isinstance(o, torch.Tensor) and o.requires_grad)
            wg[j] += b
            wg_tp[j] += b if (style == "colwise" or (style is None and sharded_region[0])) else 0
        if mod in block_of:
            i = block_of[mod]
            current.pop()
            outs = [o for o in tree_flatten(out)[0] if isinstance(o, torch.Tensor)]
            out_bytes[i] = sum(_nbytes(o) for o in outs)
            if outside.active:
                outside.ended(i)
            if i == outside.last and outside.post:
                in_bytes[n - 1] = out_bytes[i]
                in_keys[n - 1] = {o.untyped_storage()._cdata for o in outs}

    def pack(t: torch.Tensor):
        i = current[-1] if current else outside.fwd
        if i is None:
            return t
        key = t.untyped_storage()._cdata
        if key in param_keys:
            return t
        serial = life.add(t, -1)
        if serial in life.saved:
            # saved inside an attention core and again by the block outside it (e.g. the fused
            # kernel's output, viewed as the output projection's input): recomputing the core frees
            # nothing of it
            owner_i = core_keys.pop(key, None) if not core_inputs else None
            if owner_i is not None:
                core_saved[owner_i] -= _nbytes(t)
            return t
        life.saved.add(serial)
        b = _nbytes(t)
        saved[i] += b
        if key in in_keys[i]:
            saved_in[i] += b
        if sharded_region[0]:         # between a colwise Linear's output and its rowwise partner
            saved_tp[i] += b
        elif key in gather_keys:
            saved_g[i] += b
        if core_inputs and key not in core_inputs[-1]:
            core_saved[i] += b
            core_keys[key] = i
        return t

    def hook_grads(bi: int, rows) -> None:      # which storages become parameter gradients, per block
        for _, _, p in rows:
            sp = stand_of.get(id(p))
            if sp is not None and sp.requires_grad:
                handles.append(sp.register_post_accumulate_grad_hook(lambda q, bi=bi: life.grad(q, bi)))

    handles = [m.register_forward_pre_hook(pre) for m in model.modules()]
    handles += [m.register_forward_hook(post) for m in model.modules()]
    for bi, rows in enumerate(_block_params(model, blocks, fqn, {}, block_of)):
        if blocks[bi][1] is not None:
            hook_grads(bi, rows)
    tracker = ModuleTracker()
    shapes = {tuple(p.shape) for p in params.values() if p.dim() == 2}
    # the same set as `pack`'s: under autocast the counter adds each bf16 weight copy to it
    counter = _OpCounter(tracker, names, n, param_keys, frozenset(shapes | {s[::-1] for s in shapes}), gather_keys,
                         lifetimes=life, outside=outside if outside.active else None,
                         seen=outside.seen if outside.active else None,
                         tp_split=TPSplitScopes(model, styles, type(model).__name__) if styles else None)
    # FlopCounterMode attributes backward FLOPs to modules only if it saw their forward: one counter
    # spans both passes, a nested one the forward alone; backward = all - forward.
    all_fc = FlopCounterMode(display=False, custom_mapping=_FLOP_FORMULAS)
    fwd_fc = FlopCounterMode(display=False, custom_mapping=_FLOP_FORMULAS)
    # the op counter above the FLOP counters (entered after them, per pass): FlopCounterMode decomposes ops
    # with a composite decomposition (silu_backward: sigmoid, rsub, mul, add); the runtime runs one kernel
    try:
        with tracker, all_fc:
            with fwd_fc, counter, torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t), \
                    torch.autocast("cpu", dtype=compute_dtype, enabled=autocast):
                out = torch.func.functional_call(model, {**params, **buffers}, xs)
            outs = [o for o in tree_flatten(out)[0] if isinstance(o, torch.Tensor) and o.requires_grad]
            if outside.post:
                out_bytes[n - 1] = sum(_nbytes(o) for o in tree_flatten(out)[0] if isinstance(o, torch.Tensor))
            block_params = _block_params(model, blocks, fqn, owner, block_of)
            for bi, rows in enumerate(block_params):
                if blocks[bi][1] is None:
                    hook_grads(bi, rows)
            handles += _hook_partial_grads(outs, life)
            # a reduction after the model, so the last block's backward hooks see a gradient arrive
            with counter:
                torch.autograd.backward([o.sum() for o in outs])
    finally:
        for h in handles:
            h.remove()

    del out, outs
    peaks = life.block_peaks()
    fwd_counts, all_counts = fwd_fc.get_flop_counts(), all_fc.get_flop_counts()
    mod_name = {i: k for k, i in names.items()}
    rows = []
    cum_saved = 0
    esize = torch.empty((), dtype=compute_dtype).element_size()   # parameter bytes at the compute dtype
    gsize = torch.empty((), dtype=dtype).element_size()           # gradients: the parameters' dtype
    counted: dict[int, int] = {}              # parameters already in an earlier block (ties once) -> it
    for i, ((name, mod), bparams) in enumerate(zip(blocks, block_params)):
        numels, tied, frozen, tied_frozen = _param_rows(bparams, styles, counted, i)
        count = sum(k for k, _, _ in numels)
        if mod is not None:
            fwd_f = int(sum(fwd_counts.get(mod_name[i], {}).values()))
            bwd_f = int(sum(all_counts.get(mod_name[i], {}).values())) - fwd_f
        else:
            fwd_f, bwd_f = counter.flops[i]
        rows.append(BlockProfile(
            name=name, num_params=count, param_bytes=count * esize, fwd_flops=fwd_f, bwd_flops=bwd_f,
            fwd_mem_bytes=counter.mem[i][0], bwd_mem_bytes=counter.mem[i][1],
            fwd_ops=counter.ops[i][0], bwd_ops=counter.ops[i][1],
            saved_bytes=saved[i], saved_tp_sharded_bytes=saved_tp[i],
            input_bytes=in_bytes[i], output_bytes=out_bytes[i],
            tp_sharded_params=sum(k for k, _, sh in numels if sh), param_numels=tuple(numels),
            fwd_gemms=counter.gemms[i][0], bwd_gemms=counter.gemms[i][1],
            fwd_gemm_param_bytes=counter.gemm_bytes[i][0], bwd_gemm_param_bytes=counter.gemm_bytes[i][1],
            fwd_gemm_act_bytes=counter.gemm_bytes[i][2], bwd_gemm_act_bytes=counter.gemm_bytes[i][3],
            fwd_attn_flops=counter.attn[i][0], bwd_attn_flops=counter.attn[i][1], attn_calls=counter.attn[i][2],
            tp_whole_flops=tuple(counter.tp_whole[i]),
            tp_rowwise=-1 if mod is None else sum(1 for q, st in styles.items()
                                                  if st == "rowwise" and q.startswith(fqn[mod] + ".")),
            bwd_peaks=tuple((own - cum_saved - saved[i], inn, g // gsize, pend // gsize)
                            for own, inn, g, pend in peaks[i]),
            saved_input_bytes=saved_in[i], attn_core_saved_bytes=core_saved[i], tied_numels=tuple(tied),
            frozen=frozen, tied_frozen=tied_frozen,
            wgrad_bytes=wg[i], wgrad_tp_sharded_bytes=wg_tp[i],
            saved_gathered_bytes=saved_g[i], fwd_calls=counter.calls[i][0], bwd_calls=counter.calls[i][1],
            gemm_shapes=tuple(GemmShape(ph, *k, c) for ph in (0, 1) for k, c in sorted(counter.shapes[i][ph].items()))))
        cum_saved += saved[i]
    x0 = inputs[0]
    tokens = x0.shape[1] if (x0.dim() == 2 and not x0.is_floating_point()) else 1
    return ModelProfile(blocks=tuple(rows), dtype="bf16" if compute_dtype == torch.bfloat16 else "fp32",
                        batch_size=int(x0.shape[0]), tokens_per_sample=int(tokens),
                        arch=_arch_of(model, int(tokens), vocab_parallel), tp_splits=tp_splits(model, styles))
