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
  Megatron tensor-parallel split would shard (saved inside ``attn`` / ``mlp`` except by the colwise
  Linears q/k/v/up, whose input is replicated; Korthikanti et al. 2022, Sec. 4.1).

Note: on the meta device ``scaled_dot_product_attention`` takes its math path, which materialises the
(batch, heads, seq, seq) scores, as unfused attention does (e.g. Megatron-LM 2021). Real-device models
are profiled under FakeTensorMode on their own device type, so they see the kernels they would run.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any, Sequence

import torch
import torch.nn as nn
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten
from torch.utils.flop_counter import FlopCounterMode
from torch.utils.module_tracker import ModuleTracker

_VIEW_OPS = {"view", "_unsafe_view", "t", "transpose", "expand", "detach", "permute", "unsqueeze",
             "squeeze", "slice", "select", "alias", "as_strided", "split", "unbind", "lift_fresh",
             "_reshape_alias", "reshape", "split_with_sizes", "chunk", "expand_as",
             "device", "sym_size", "sym_stride", "sym_numel", "sym_storage_offset", "dim", "is_contiguous"}
_COLWISE = ("q", "k", "v", "up")        # Linears whose *input* stays replicated under TP
_TP_REGIONS = ("attn", "mlp")           # submodules a Megatron TP plan shards


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
        d["blocks"] = tuple(BlockProfile(**b) for b in d["blocks"])
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


def _nbytes(t: torch.Tensor) -> int:
    return t.untyped_storage().nbytes()


class _OpCounter(TorchDispatchMode):
    """Counts non-view ops and the bytes they read + write, per block and pass."""

    def __init__(self, tracker: ModuleTracker, names: dict[str, int], n: int):
        super().__init__()
        self.tracker, self.names = tracker, names
        self.mem = [[0, 0] for _ in range(n)]
        self.ops = [[0, 0] for _ in range(n)]

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        name = func.overloadpacket.__name__
        if name in _VIEW_OPS or name in _FLOP_OPS:
            return out
        idx = next((self.names[p] for p in self.tracker.parents if p in self.names), None)
        if idx is None:
            return out
        flat = [t for t in tree_flatten((args, kwargs, out))[0] if isinstance(t, torch.Tensor)]
        phase = 1 if self.tracker.is_bw else 0
        self.mem[idx][phase] += sum(t.numel() * t.element_size() for t in flat)
        self.ops[idx][phase] += 1
        return out


_FLOP_OPS = {"mm", "addmm", "bmm", "baddbmm", "convolution", "convolution_backward", "_convolution",
             "_scaled_dot_product_flash_attention", "_scaled_dot_product_efficient_attention",
             "_scaled_dot_product_cudnn_attention", "_scaled_dot_product_flash_attention_backward",
             "_scaled_dot_product_efficient_attention_backward",
             "_scaled_dot_product_cudnn_attention_backward",
             "_scaled_dot_product_flash_attention_for_cpu",
             "_scaled_dot_product_flash_attention_for_cpu_backward"}


def profile_model(model: nn.Module, example_input: torch.Tensor | Sequence[torch.Tensor], *,
                  dtype: torch.dtype = torch.float32,
                  blocks: Sequence[tuple[str, nn.Module]] | None = None) -> ModelProfile:
    """Profile one training forward + backward of ``model`` on ``example_input`` without weights.

    Args:
        model: any ``nn.Module``; its parameters may be on meta (profiled on meta) or real (profiled
            under FakeTensorMode). It is not modified.
        example_input: tensor (or tuple of tensors) with the batch in dim 0, e.g. tokens
            ``(batch, seq)`` int64 or features ``(batch, in)``; floating inputs are cast to ``dtype``.
        dtype: ``torch.float32`` or ``torch.bfloat16``: the dtype of parameters and activations.
        blocks: ``(name, submodule)`` pairs to attribute costs to; default `default_blocks`.

    Returns:
        ModelProfile with one BlockProfile per block, for the batch of ``example_input``.

    Raises:
        ValueError: unsupported dtype, an empty input, or a block that is not a submodule of model.
    """
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
    try:
        return _profile(model, inputs, dtype, blocks, names, fqn, on_meta)
    finally:
        if fake_mode is not None:
            fake_mode.__exit__(None, None, None)


def _profile(model, inputs, dtype, blocks, names, fqn, on_meta) -> ModelProfile:
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
    seen: dict[int, torch.Tensor] = {}        # storage key -> a tensor that keeps it alive
    block_of = {m: i for i, (_, m) in enumerate(blocks)}
    current: list[int] = []                   # stack of active block indices
    sub_stack: list[str] = []                 # fqn of innermost active submodule

    def pre(mod, args):
        if mod in block_of:
            i = block_of[mod]
            current.append(i)
            in_bytes[i] = sum(_nbytes(a) for a in tree_flatten(args)[0] if isinstance(a, torch.Tensor))
        sub_stack.append(fqn.get(mod, ""))

    def post(mod, args, out):
        sub_stack.pop()
        if mod in block_of:
            current.pop()
            out_bytes[block_of[mod]] = sum(_nbytes(o) for o in tree_flatten(out)[0]
                                           if isinstance(o, torch.Tensor))

    def pack(t: torch.Tensor):
        if not current:
            return t
        key = t.untyped_storage()._cdata
        if key in param_keys or key in seen:
            return t
        seen[key] = t
        i = current[-1]
        b = _nbytes(t)
        saved[i] += b
        path = sub_stack[-1].split(".") if sub_stack else []
        if any(r in path for r in _TP_REGIONS) and path[-1] not in _COLWISE:
            saved_tp[i] += b
        return t

    handles = [m.register_forward_pre_hook(pre) for m in model.modules()]
    handles += [m.register_forward_hook(post) for m in model.modules()]
    tracker = ModuleTracker()
    counter = _OpCounter(tracker, names, n)
    # FlopCounterMode attributes backward FLOPs to modules only if it saw their forward: one counter
    # spans both passes, a nested one the forward alone; backward = all - forward.
    all_fc, fwd_fc = FlopCounterMode(display=False), FlopCounterMode(display=False)
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

    fwd_counts, all_counts = fwd_fc.get_flop_counts(), all_fc.get_flop_counts()
    rows = []
    for (name, mod), (mod_name, i) in zip(blocks, names.items()):
        bp = [p for p in mod.parameters()]
        rows.append(BlockProfile(
            name=name, num_params=sum(p.numel() for p in bp),
            param_bytes=sum(p.numel() for p in bp) * torch.empty((), dtype=dtype).element_size(),
            fwd_flops=int(sum(fwd_counts.get(mod_name, {}).values())),
            bwd_flops=int(sum(all_counts.get(mod_name, {}).values())
                          - sum(fwd_counts.get(mod_name, {}).values())),
            fwd_mem_bytes=counter.mem[i][0], bwd_mem_bytes=counter.mem[i][1],
            fwd_ops=counter.ops[i][0], bwd_ops=counter.ops[i][1],
            saved_bytes=saved[i], saved_tp_sharded_bytes=saved_tp[i],
            input_bytes=in_bytes[i], output_bytes=out_bytes[i]))
    x0 = inputs[0]
    tokens = x0.shape[1] if (x0.dim() == 2 and not x0.is_floating_point()) else 1
    return ModelProfile(blocks=tuple(rows), dtype="bf16" if dtype == torch.bfloat16 else "fp32",
                        batch_size=int(x0.shape[0]), tokens_per_sample=int(tokens), arch=_arch_of(model))
