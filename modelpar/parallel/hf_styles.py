"""torch `ParallelStyle`s of the Hugging Face TP plans (`modelpar.parallel.hf_tp`): transformers' ``Conv1D``
split by columns or rows, and hidden states re-laid over the sequence at a module's entry."""

from __future__ import annotations

import torch
import torch.nn as nn
from torch.distributed.tensor.parallel import ParallelStyle

from modelpar.parallel.hf_tp import (COLWISE_GATHER, CONV1D_COLWISE, CONV1D_COLWISE_QKV, CONV1D_ROWWISE,
                                     CONV1D_ROWWISE_SEQ, GATHER_SEQ_HIDDEN, MLA_ROPE_GRAD_SUM, REPLICATED_GRAD_SUM,
                                     ROWWISE_SPLIT, SHARD_SEQ_INPUT)


def make_hf_style(style: str):
    """The torch `ParallelStyle` of one of `STYLES`."""
    from torch.distributed.tensor import Replicate, Shard

    if style in (CONV1D_COLWISE, CONV1D_COLWISE_QKV):
        return Conv1DParallel(colwise=True, output_layout=Shard(-1))
    if style == CONV1D_ROWWISE:
        return Conv1DParallel(colwise=False, output_layout=Replicate())
    if style == CONV1D_ROWWISE_SEQ:
        return Conv1DParallel(colwise=False, output_layout=Shard(1))
    if style == COLWISE_GATHER:
        from torch.distributed.tensor.parallel import ColwiseParallel

        return ColwiseParallel(output_layouts=Replicate())
    if style == ROWWISE_SPLIT:
        from torch.distributed.tensor.parallel import RowwiseParallel

        return RowwiseParallel(input_layouts=Replicate(), output_layouts=Replicate())
    if style == SHARD_SEQ_INPUT:
        return HiddenInput(Replicate(), Shard(1))
    if style == GATHER_SEQ_HIDDEN:
        return HiddenInput(Shard(1), Replicate())
    if style == REPLICATED_GRAD_SUM:
        return ReplicatedGradSum()
    if style == MLA_ROPE_GRAD_SUM:
        return MlaRopeGradSum()
    raise ValueError(f"TP style {style!r} is not a Hugging Face style")


class Conv1DParallel(ParallelStyle):
    """Column / row split of a transformers ``Conv1D`` (``y = x @ W + b``, ``W`` of shape ``(in, out)``).

    colwise: ``W`` sharded on dim 1 (output features), ``b`` on dim 0, input replicated, output local
    ``(..., out / tp)``. rowwise: ``W`` sharded on dim 0 (input features), ``b`` replicated, input the
    local ``(..., in / tp)``, output all-reduced (``output_layout`` Replicate) or reduce-scattered over
    the sequence (``Shard(1)``). The arithmetic is DTensor's (``addmm`` on sharded operands).
    """

    def __init__(self, *, colwise: bool, output_layout):
        super().__init__()
        self.colwise, self.output_layout = colwise, output_layout

    def _apply(self, module: nn.Module, device_mesh):
        from torch.distributed.tensor import DTensor, Replicate, Shard, distribute_module, distribute_tensor

        colwise, out_layout = self.colwise, self.output_layout
        w_pl, b_pl = ([Shard(1)], [Shard(0)]) if colwise else ([Shard(0)], [Replicate()])

        def partition(_name, mod, mesh):
            mod.register_parameter("weight", nn.Parameter(distribute_tensor(mod.weight, mesh, w_pl, src_data_rank=None)))
            mod.register_parameter("bias", nn.Parameter(distribute_tensor(mod.bias, mesh, b_pl, src_data_rank=None)))

        def input_fn(_mod, inputs, mesh):
            x = inputs[0]
            if not isinstance(x, DTensor):
                x = DTensor.from_local(x, mesh, [Replicate()] if colwise else [Shard(-1)], run_check=False)
            want = [Replicate()] if colwise else [Shard(x.dim() - 1)]
            if tuple(x.placements) != tuple(want):
                x = x.redistribute(mesh, want)
            return (x, *inputs[1:])

        def output_fn(_mod, out, mesh):
            if tuple(out.placements) != (out_layout,):
                out = out.redistribute(mesh, [out_layout])
            return out.to_local()

        return distribute_module(module, device_mesh, partition, input_fn, output_fn)


class ReplicatedGradSum(ParallelStyle):
    """A module whose parameters are replicated over the TP ranks but whose input is this rank's part of
    the activations (Qwen3's per-head ``q_norm`` / ``k_norm`` between the colwise q / k and the rowwise o
    projections: ``(batch, seq, local heads, head_dim)``), so each rank's parameter gradient covers its
    own heads only and the whole gradient is their sum.

    The parameters become Replicate DTensors and the input a DTensor sharded on dim 0 (any dimension the
    module does not reduce over would do: DTensor then computes the parameter gradient as a partial sum),
    the output is handed back local; a hook after accumulation all-reduces the gradient into the
    parameter's Replicate layout (under FSDP, FSDP's own reduction does it). No communication in forward.
    """

    def _apply(self, module: nn.Module, device_mesh):
        from torch.distributed.tensor import DTensor, Replicate, Shard, distribute_module

        def partition(_name, mod, mesh):
            for n, p in list(mod.named_parameters(recurse=False)):
                q = nn.Parameter(DTensor.from_local(p.data, mesh, [Replicate()], run_check=False),
                                 requires_grad=p.requires_grad)
                mod.register_parameter(n, q)
                if q.requires_grad:
                    q.register_post_accumulate_grad_hook(_grad_like_param)

        def input_fn(_mod, inputs, mesh):
            x = inputs[0]
            if torch.is_tensor(x) and not isinstance(x, DTensor):
                x = DTensor.from_local(x, mesh, [Shard(0)], run_check=False)
            return (x, *inputs[1:])

        def output_fn(_mod, out, _mesh):
            return out.to_local() if isinstance(out, DTensor) else out

        return distribute_module(module, device_mesh, partition, input_fn, output_fn)


class MlaRopeGradSum(ParallelStyle):
    """Multi-head latent attention's ``kv_a_proj_with_mqa`` (DeepSeek-V2, Sec. 2.1.3; DeepSeek-V3), left
    replicated: output ``(batch, seq, kv_lora_rank + r)`` with ``r`` = ``qk_rope_head_dim`` (the module's
    ``mla_rope_dim``, set by `hf_tp.prepare_modules`). Its first ``kv_lora_rank`` features go through a norm
    into the colwise ``kv_b_proj``, whose backward sums their gradient over the TP ranks; the last ``r``
    are the rotary key every head shares and reach this rank's heads only, so their gradient is partial
    and is summed here: an identity in forward whose backward all-reduces (Megatron-LM's ``f``, Shoeybi et
    al. 2019, Sec. 3), as DTensor's Replicate -> local with a Partial gradient. The parameters stay plain
    tensors with whole gradients on every rank (transformers' ``mla_kv_a_proj`` style).

    Raises:
        ValueError: (at apply) the module has no ``mla_rope_dim``, or it is not below the output width.
    """

    def _apply(self, module: nn.Module, device_mesh):
        from torch.distributed.tensor import DTensor, Partial, Replicate

        r = getattr(module, "mla_rope_dim", None)
        width = getattr(module, "out_features", None)
        if not isinstance(r, int) or width is None or not 0 < r < width:
            raise ValueError(f"mla_rope_grad_sum needs an nn.Linear wider than its rotary width (mla_rope_dim: "
                             f"the attention's qk_rope_head_dim); got {type(module).__name__} with "
                             f"out_features={width}, mla_rope_dim={r}")

        def hook(_mod, _args, out):
            latent, rope = out.split([out.shape[-1] - r, r], dim=-1)
            rope = DTensor.from_local(rope, device_mesh, [Replicate()], run_check=False).to_local(
                grad_placements=[Partial()])
            return torch.cat([latent, rope], dim=-1)

        module.register_forward_hook(hook)
        return module


def _grad_like_param(p) -> None:
    """A partial (per-rank) gradient of a replicated parameter summed into the parameter's layout."""
    g = p.grad
    if hasattr(g, "placements") and tuple(g.placements) != tuple(p.placements):
        p.grad = g.redistribute(p.device_mesh, p.placements)


class HiddenInput(ParallelStyle):
    """Re-lay the hidden states a module receives (its first positional argument, or ``hidden_states=``)
    from ``src`` to ``dst`` placement over the sequence (a slice, or an all-gather; autograd runs the
    dual collective), handing the module a local tensor."""

    def __init__(self, src, dst):
        super().__init__()
        self.src, self.dst = src, dst

    def _apply(self, module: nn.Module, device_mesh):
        from torch.distributed.tensor import DTensor

        src, dst = self.src, self.dst

        def relay(x):
            if not torch.is_tensor(x):
                return x
            if not isinstance(x, DTensor):
                x = DTensor.from_local(x, device_mesh, [src], run_check=False)
            return x.redistribute(device_mesh, [dst]).to_local()

        def pre(_mod, args, kwargs):
            if args:
                return (relay(args[0]), *args[1:]), kwargs
            if "hidden_states" in kwargs:
                return args, {**kwargs, "hidden_states": relay(kwargs["hidden_states"])}
            return args, kwargs

        module.register_forward_pre_hook(pre, with_kwargs=True)
        return module
