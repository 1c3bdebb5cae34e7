"""Checkpoint state adaptation: a rank's live modules and optimizer (any plan) <-> the one canonical
state every checkpoint holds, and the collective save (`Checkpointer`) and load (`load_checkpoint`)
built on it. The files themselves: `modelpar.train.checkpoint.storage`.

The canonical state is the plain model's: every parameter under its original name with its global
shape, whatever the layout.

- Layouts: taken with ``get_state_dict`` / put back with ``set_state_dict``
  (torch.distributed.checkpoint.state_dict), so FSDP and TP shards (DTensors), DDP replicas and
  pipeline stages are all saved under the original names and resharded by DCP on load; optimizer
  state is flattened per parameter name (``flatten_optimizer_state_dict``), so it reshards too.
- Fused projections permuted for TP (GPT-2's q|k|v, `modelpar.parallel.hf_tp`): saved in the
  original order, put back in this layout's.
- Tied parameters (case C13): held once, under the tie's first name, whichever copy a rank holds.
- A model check: every parameter's name and global shape must match the checkpoint's.
"""

from __future__ import annotations

import os
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn as nn

from modelpar.parallel.hf_tp import canonical_state, permuted_params, restore_layout
from modelpar.train.checkpoint.storage import (CheckpointError, CheckpointWriter, _world, read_checkpoint_meta,
                                               load_rng, read_state)


_WORLD = object()        # `checkpoint_module`'s default stage group: every rank


def checkpoint_module(modules: list[nn.Module], ties: list[tuple[str, ...]] | None = None, *,
                      stage_group=_WORLD) -> nn.Module:
    """One module holding this rank's parameters (and persistent buffers) under their original names,
    the same objects the optimizer holds (pipeline ranks may hold several stage modules). Build it
    right after `parallelize` and the optimizer.

    ``ties`` (`ParallelModel.ties`, case C13): a tied parameter is held under its first name whichever
    copy this rank has (a last pipeline stage's ``head.out.weight`` is stored as ``embed.tok.weight``),
    so a checkpoint names it once, the same on every layout, and resumes on any other.

    ``stage_group``: one rank of each pipeline stage, this one among them (this rank's pipeline group,
    ``ParallelModel.mesh.group("pp")``), over which `param_shapes` gathers the whole model's parameter
    list; None: this rank holds every stage (no pipeline; nothing gathered); the default: every rank.
    """
    holder = nn.Module()
    canonical = {alias: tie[0] for tie in ties or () for alias in tie[1:]}

    def owner_of(path: str) -> tuple[nn.Module, str]:
        owner = holder
        *heads, leaf = path.split(".")
        for h in heads:
            if not isinstance(getattr(owner, h, None), nn.Module):
                owner.add_module(h, nn.Module())
            owner = getattr(owner, h)
        return owner, leaf

    seen = set()
    for m in modules:
        for name, prm in m.named_parameters():
            if id(prm) not in seen:
                seen.add(id(prm))
                o, leaf = owner_of(canonical.get(name, name))
                o.register_parameter(leaf, prm)
        for mod_name, mod in m.named_modules():
            for b_name, buf in mod.named_buffers(recurse=False):
                if b_name not in mod._non_persistent_buffers_set:
                    o, leaf = owner_of(f"{mod_name}.{b_name}" if mod_name else b_name)
                    o.register_buffer(leaf, buf)
    holder._modelpar_perms = permuted_params(modules)    # GPT-2's fused q|k|v under TP: stored in original order
    holder._modelpar_stage_group = stage_group
    return holder


def _options():
    from torch.distributed.checkpoint.state_dict import StateDictOptions

    return StateDictOptions(flatten_optimizer_state_dict=True)


def get_train_state(holder: nn.Module, opt: torch.optim.Optimizer | None) -> dict:
    """``{"model": ..., "optim": ...}`` of a `checkpoint_module` under original names (DTensor shards
    stay sharded; this layout's order of permuted projections). An optimizer that has not stepped yet
    is left out (taking its state dict would initialise it with a zero step, a side effect on
    training)."""
    from torch.distributed.checkpoint.state_dict import get_model_state_dict, get_state_dict

    if opt is None or not opt.state:
        return {"model": get_model_state_dict(holder, options=_options())}
    msd, osd = get_state_dict(holder, opt, options=_options())
    return {"model": msd, "optim": osd}


def param_shapes(holder: nn.Module) -> dict[str, list[int]]:
    """Every parameter of the whole model -> global shape (collective over ``holder``'s stage group).

    A DTensor's shape is the global one and DDP replicas are whole, so the ranks of one pipeline stage
    name the same parameters: the whole model is the union over one rank of each stage, this rank's
    pipeline group (`checkpoint_module`'s ``stage_group``; no gather without a pipeline). A holder made
    without one (library use) gathers over the world: ``all_gather_object`` pads every rank's pickle
    to the largest, so at 3,072 ranks each would receive ~3,072 copies of the parameter list."""
    local = {n: list(p.shape) for n, p in holder.named_parameters()}
    group = getattr(holder, "_modelpar_stage_group", _WORLD)
    if group is _WORLD:
        group = dist.group.WORLD if dist.is_initialized() else None
    if group is not None and dist.get_world_size(group) > 1:
        parts = [None] * dist.get_world_size(group)
        dist.all_gather_object(parts, local, group=group)
        for part in parts:
            local.update(part)
    return dict(sorted(local.items()))


def check_same_model(path: str, saved: dict, current: dict) -> None:
    """Raise `CheckpointError` naming the parameters missing, extra or of another shape when the
    checkpoint's ``{name: global shape}`` (``saved``) differs from the model's (``current``)."""
    missing = sorted(set(current) - set(saved))
    extra = sorted(set(saved) - set(current))
    shapes = [f"{k}: checkpoint {saved[k]} vs model {current[k]}" for k in sorted(set(saved) & set(current))
              if list(saved[k]) != list(current[k])]
    if missing or extra or shapes:
        parts = []
        if missing:
            parts.append(f"{len(missing)} parameter(s) of the model are not in it ({', '.join(missing[:5])})")
        if extra:
            parts.append(f"{len(extra)} of its parameter(s) are not in the model ({', '.join(extra[:5])})")
        if shapes:
            parts.append(f"{len(shapes)} shape(s) differ ({'; '.join(shapes[:3])})")
        raise CheckpointError(f"checkpoint {path!r} was written for another model: " + "; ".join(parts))


def drop_tied_aliases(sd: dict[str, torch.Tensor], ties: list[list[str]]) -> dict[str, str]:
    """In place: keep each tie of ``sd`` (whole tensors under the plain model's names) once, under its
    first name present (checkpoints written without ``ties`` hold every copy); returns the
    ``{alias: name}`` dropped."""
    aliases = {}
    for tie in ties:
        kept = [n for n in tie if n in sd]
        for alias in (n for n in tie if kept and n != kept[0]):
            sd.pop(alias, None)
            aliases[alias] = kept[0]
    return aliases


# ---- saving and loading a rank's state ------------------------------------------------------------
class Checkpointer:
    """Saves checkpoints of this rank's modules and optimizer into ``ckpt_dir`` (collective: every rank
    calls ``save`` with the same step), in the canonical state, through a
    `modelpar.train.checkpoint.storage.CheckpointWriter` (atomic; keep-last; async).

    Args:
        ckpt_dir: folder of ``step-*`` checkpoints, on a filesystem every rank sees.
        keep_last: complete checkpoints kept (0: all).
        async_save: write with `dcp.async_save` (a background thread on its own gloo group).

    Raises:
        ValueError: ``keep_last`` < 0.
    """

    def __init__(self, ckpt_dir: str | os.PathLike, *, keep_last: int = 3, async_save: bool = False):
        self.writer = CheckpointWriter(ckpt_dir, keep_last=keep_last, async_save=async_save)
        self.ckpt_dir = self.writer.ckpt_dir

    def save(self, holder: nn.Module, opt: torch.optim.Optimizer | None, step: int, *,
             meta: dict | None = None) -> Path:
        """Write the state after ``step`` optimizer steps of ``holder`` (a `checkpoint_module`) and
        ``opt``, with ``meta`` (JSON-able) added to ``modelpar.json``; returns the final folder
        (complete once this returns, or, with async_save, once the next `save` or `close` returns)."""
        state = canonical_state(get_train_state(holder, opt), getattr(holder, "_modelpar_perms", {}))
        info = {"world_size": _world(), "params": param_shapes(holder), "optimizer_state": "optim" in state,
                "optimizer": type(opt).__name__ if opt is not None else None, "torch": torch.__version__,
                **(meta or {})}
        return self.writer.write(state, step, info)

    def close(self) -> None:
        """Finish an async save in flight; collective."""
        self.writer.close()


_STEP_IMPL = ("foreach", "fused", "capturable", "differentiable")    # torch optimizers' implementation flags


def load_checkpoint(holder: nn.Module, opt: torch.optim.Optimizer | None, path: str | os.PathLike, *,
                    restore_rng: bool = False) -> dict:
    """Load a checkpoint written under any plan and world size into this rank's parameters and
    optimizer (collective). DCP reads each rank's slice of every tensor, whatever the saving layout was.

    Args:
        holder: `checkpoint_module` of this rank's modules, already laid out.
        opt: the optimizer over them (fresh); its state and hyper-parameters are replaced.
        path: a checkpoint folder, or a folder of them (its latest complete one).
        restore_rng: also restore this rank's RNG state (only meaningful on the saving layout).

    Returns:
        The checkpoint's metadata (``step``, ``plan``, ``world_size``, ...).

    Raises:
        CheckpointError: missing, incomplete, truncated, foreign or other-model checkpoint, or state of
            another optimizer class; the same message on every rank.
    """
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_model_state_dict, set_state_dict

    err, meta = None, None
    try:
        meta = read_checkpoint_meta(path)
    except CheckpointError as e:
        err = str(e)
    if dist.is_initialized() and dist.get_world_size() > 1:   # rank 0's verdict, so every rank agrees
        box = [err, meta]
        dist.broadcast_object_list(box, src=0)
        err, meta = box
    if err is not None:
        raise CheckpointError(err)
    p = meta["path"]
    check_same_model(p, meta.get("params", {}), param_shapes(holder))
    with_optim = opt is not None and meta.get("optimizer_state", False)
    if with_optim and meta.get("optimizer") and meta["optimizer"] != type(opt).__name__:
        raise CheckpointError(f"checkpoint {p!r} holds {meta['optimizer']} state; this run uses "
                              f"{type(opt).__name__}")
    if with_optim:     # a fresh optimizer: get_state_dict creates its state, which DCP then fills
        msd, osd = get_state_dict(holder, opt, options=_options())
        plain = {"model": msd, "optim": osd}
    else:
        plain = get_train_state(holder, None)
    read_state(plain, p)
    restore_layout(plain, getattr(holder, "_modelpar_perms", {}))    # original order -> this layout's
    if with_optim:
        # the groups' hyper-parameters come from the checkpoint, but how the step runs is this layout's:
        # a checkpoint of fused AdamW (every parameter a plain tensor, or every one a DTensor) would
        # otherwise turn the fused kernel on for plain TP, whose groups mix both (torch refuses them)
        impl = [{k: g[k] for k in _STEP_IMPL if k in g} for g in opt.param_groups]
        set_state_dict(holder, opt, model_state_dict=plain["model"], optim_state_dict=plain["optim"],
                       options=_options())
        for g, kept in zip(opt.param_groups, impl):
            g.update(kept)
    else:
        set_model_state_dict(holder, plain["model"], options=_options())
        if opt is not None:
            opt.state.clear()          # saved before the first step: a fresh optimizer, as then
    if restore_rng:
        load_rng(p)
    return meta
