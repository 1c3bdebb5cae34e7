"""torch `ParallelStyle`s of the Hugging Face TP plans (`modelpar.parallel.hf_tp`): transformers' ``Conv1D``
split by columns or rows, and hidden states re-laid over the sequence at a module's entry."""

from __future__ import annotations

import torch
import torch.nn as nn
from torch.distributed.tensor.parallel import ParallelStyle

from modelpar.parallel.hf_tp import (COLWISE_GATHER, CONV1D_COLWISE, CONV1D_COLWISE_QKV, CONV1D_ROWWISE,
                                     CONV1D_ROWWISE_SEQ, GATHER_SEQ_HIDDEN, ROWWISE_SPLIT, SHARD_SEQ_INPUT)


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
