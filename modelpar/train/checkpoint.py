"""Distributed checkpoints: save on any layout, resume on any other, export one safetensors file.

A checkpoint is one folder ``CKPT_DIR/step-NNNNNNNN`` (the state after N optimizer steps):

- the model and optimizer state as `torch.distributed.checkpoint` (DCP) files, taken with
  ``get_state_dict`` / put back with ``set_state_dict`` (torch.distributed.checkpoint.state_dict), so
  FSDP and TP shards, DDP replicas and pipeline stages are all stored under the original parameter
  names with their global shapes, and DCP reshards them on load (optimizer state is flattened per
  parameter name, so it reshards too);
- ``rng/rank-R.pt``: each rank's torch RNG state (restored on the same layout only);
- ``modelpar.json``: format tag, step (= the data position: the samples of step s depend on
  (seed, s) only), the learning-rate schedule fields, the ParallelPlan, the world size, the model
  name and config, every parameter's name and global shape, and a manifest of every file with its
  size (a truncated folder is detected on load);
- ``COMPLETE``: a marker written last.

Saving is atomic: every file is written into ``CKPT_DIR/.tmp-step-NNNNNNNN``, and rank 0 writes the
metadata, then the marker, then renames the folder. A crash mid-save leaves only a ``.tmp-*`` folder,
which is never loaded and is removed by the next save. ``keep_last`` prunes older complete checkpoints
after a successful save. With ``async_save`` the files are written by `dcp.async_save` on a separate
gloo process group while training goes on; rank 0 finishes (metadata, marker, rename) when the
write has completed.
"""

from __future__ import annotations

import json
import os
import shutil
import time
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn as nn

from modelpar.parallel.hf_tp import canonical_state, permuted_params, restore_layout
from modelpar.train.dcp_quiet import single_process_dcp

FORMAT = "modelpar-checkpoint"
VERSION = 1
META_FILE = "modelpar.json"
MARKER = "COMPLETE"
PREFIX = "step-"


class CheckpointError(ValueError):
    """A checkpoint folder that cannot be used; the message names the path and the problem."""


# ---- where checkpoints are ------------------------------------------------------------------------
def step_dir(ckpt_dir: str | os.PathLike, step: int) -> Path:
    return Path(ckpt_dir) / f"{PREFIX}{step:08d}"


def list_checkpoints(ckpt_dir: str | os.PathLike) -> list[tuple[int, Path]]:
    """Complete checkpoints (marker present) in ``ckpt_dir`` as ``(step, folder)``, oldest first."""
    root = Path(ckpt_dir)
    if not root.is_dir():
        return []
    out = []
    for p in root.iterdir():
        if p.is_dir() and p.name.startswith(PREFIX) and p.name[len(PREFIX):].isdigit() and (p / MARKER).exists():
            out.append((int(p.name[len(PREFIX):]), p))
    return sorted(out)


def latest_checkpoint(ckpt_dir: str | os.PathLike) -> Path | None:
    found = list_checkpoints(ckpt_dir)
    return found[-1][1] if found else None


def resolve_checkpoint(path: str | os.PathLike) -> Path:
    """A checkpoint folder, or the latest complete one in a folder of checkpoints.

    Raises:
        CheckpointError: the path does not exist, or holds no complete checkpoint.
    """
    p = Path(path)
    if not p.exists():
        raise CheckpointError(f"checkpoint {str(p)!r} does not exist")
    if not p.is_dir():
        raise CheckpointError(f"checkpoint {str(p)!r} is a file; a checkpoint is a folder written by modelpar")
    if (p / META_FILE).exists() or (p / ".metadata").exists() or (p / MARKER).exists():
        return p
    latest = latest_checkpoint(p)
    if latest is not None:
        return latest
    partial = sorted(q.name for q in p.iterdir() if q.name.startswith((PREFIX, ".tmp-" + PREFIX)))
    if partial:
        raise CheckpointError(f"checkpoint folder {str(p)!r} holds no complete checkpoint (found {partial[:5]} "
                              f"without the {MARKER} marker: saves that were interrupted)")
    raise CheckpointError(f"{str(p)!r} is not a checkpoint written by modelpar (no {META_FILE}, no "
                          f"{PREFIX}* folders)")


def read_checkpoint_meta(path: str | os.PathLike) -> dict:
    """The validated ``modelpar.json`` of a checkpoint folder.

    Raises:
        CheckpointError: missing folder, no/invalid ``modelpar.json`` (not written by modelpar), no
            ``COMPLETE`` marker (an interrupted save), or a file of the manifest missing or of the wrong
            size (a truncated copy).
    """
    p = resolve_checkpoint(path)
    meta_path = p / META_FILE
    if not meta_path.exists():
        what = "a torch.distributed.checkpoint folder" if (p / ".metadata").exists() else "a folder"
        raise CheckpointError(f"checkpoint {str(p)!r} was not written by modelpar: it is {what} without "
                              f"{META_FILE}")
    try:
        meta = json.loads(meta_path.read_text())
    except (OSError, ValueError) as e:
        raise CheckpointError(f"checkpoint {str(p)!r}: {META_FILE} is unreadable or truncated ({e})") from None
    if not isinstance(meta, dict) or meta.get("format") != FORMAT:
        raise CheckpointError(f"checkpoint {str(p)!r}: {META_FILE} has format "
                              f"{meta.get('format') if isinstance(meta, dict) else None!r}, not {FORMAT!r}: "
                              f"not written by modelpar")
    if meta.get("version", 0) > VERSION:
        raise CheckpointError(f"checkpoint {str(p)!r} has format version {meta['version']}; this modelpar reads "
                              f"up to {VERSION}")
    if not (p / MARKER).exists():
        raise CheckpointError(f"checkpoint {str(p)!r} is incomplete: no {MARKER} marker (the save was "
                              f"interrupted)")
    for name, size in sorted(meta.get("files", {}).items()):
        f = p / name
        if not f.exists():
            raise CheckpointError(f"checkpoint {str(p)!r} is truncated: file {name} is missing")
        if f.stat().st_size != size:
            raise CheckpointError(f"checkpoint {str(p)!r} is truncated: file {name} has {f.stat().st_size} "
                                  f"bytes, {size} were written")
    meta["path"] = str(p)
    return meta


# ---- state dicts ----------------------------------------------------------------------------------
def checkpoint_module(modules: list[nn.Module], ties: list[tuple[str, ...]] | None = None) -> nn.Module:
    """One module holding this rank's parameters (and persistent buffers) under their original names,
    the same objects the optimizer holds (pipeline ranks may hold several stage modules). Build it
    right after `parallelize` and the optimizer.

    ``ties`` (`ParallelModel.ties`, case C13): a tied parameter is held under its first name whichever
    copy this rank has (a last pipeline stage's ``head.out.weight`` is stored as ``embed.tok.weight``),
    so a checkpoint names it once, the same on every layout, and resumes on any other.
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
    return holder


def _options():
    from torch.distributed.checkpoint.state_dict import StateDictOptions

    return StateDictOptions(flatten_optimizer_state_dict=True)


def get_train_state(holder: nn.Module, opt: torch.optim.Optimizer | None) -> dict:
    """``{"model": ..., "optim": ...}`` of a `checkpoint_module` under original names (DTensor shards
    stay sharded). An optimizer that has not stepped yet is left out (taking its state dict would
    initialise it with a zero step, a side effect on training)."""
    from torch.distributed.checkpoint.state_dict import get_model_state_dict, get_state_dict

    if opt is None or not opt.state:
        return {"model": get_model_state_dict(holder, options=_options())}
    msd, osd = get_state_dict(holder, opt, options=_options())
    return {"model": msd, "optim": osd}


def _param_shapes(holder: nn.Module) -> dict[str, list[int]]:
    """Every parameter of the whole model (all ranks) -> global shape."""
    local = {n: list(p.shape) for n, p in holder.named_parameters()}     # a DTensor's shape is the global one
    if dist.is_initialized() and dist.get_world_size() > 1:
        parts = [None] * dist.get_world_size()
        dist.all_gather_object(parts, local)
        for part in parts:
            local.update(part)
    return dict(sorted(local.items()))


def _check_same_model(path: str, saved: dict, current: dict) -> None:
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


def _rank() -> int:
    return dist.get_rank() if dist.is_initialized() else 0


def _world() -> int:
    return dist.get_world_size() if dist.is_initialized() else 1


def _barrier(group=None) -> None:
    if dist.is_initialized() and dist.get_world_size() > 1:
        dist.barrier(group=group)


def _fsync_write(path: Path, text: str) -> None:
    with open(path, "w") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())


# ---- saving ---------------------------------------------------------------------------------------
class Checkpointer:
    """Saves checkpoints of this rank's modules and optimizer into ``ckpt_dir`` (collective: every rank
    calls ``save`` with the same step).

    Args:
        ckpt_dir: folder of ``step-*`` checkpoints, on a filesystem every rank sees.
        keep_last: complete checkpoints kept (0: all).
        async_save: write with `dcp.async_save` (a background thread on its own gloo group).
    """

    def __init__(self, ckpt_dir: str | os.PathLike, *, keep_last: int = 3, async_save: bool = False):
        if keep_last < 0:
            raise ValueError(f"keep_last must be >= 0, got {keep_last}")
        self.ckpt_dir = Path(ckpt_dir)
        self.keep_last = keep_last
        self.async_save = async_save
        self._pending = None            # (future, finish callable) of an async save in flight
        self._group = None
        if async_save and dist.is_initialized():
            self._group = dist.new_group(backend="gloo")   # DCP's own collectives, off the training group
        if _rank() == 0:
            self.ckpt_dir.mkdir(parents=True, exist_ok=True)
            for stale in self.ckpt_dir.glob(".tmp-" + PREFIX + "*"):   # interrupted saves: never complete
                shutil.rmtree(stale, ignore_errors=True)
        _barrier()

    def save(self, holder: nn.Module, opt: torch.optim.Optimizer | None, step: int, *,
             meta: dict | None = None) -> Path:
        """Write the state after ``step`` optimizer steps of ``holder`` (a `checkpoint_module`) and
        ``opt``; returns the final folder (complete once this returns, or, with async_save, once
        `wait` returns)."""
        import torch.distributed.checkpoint as dcp

        self.wait()
        final, tmp = step_dir(self.ckpt_dir, step), self.ckpt_dir / f".tmp-{PREFIX}{step:08d}"
        rank = _rank()
        if rank == 0:
            shutil.rmtree(tmp, ignore_errors=True)
            (tmp / "rng").mkdir(parents=True)
        _barrier()
        rng = {"cpu": torch.get_rng_state()}
        if torch.cuda.is_available():
            rng["cuda"] = torch.cuda.get_rng_state_all()
        torch.save(rng, tmp / "rng" / f"rank-{rank}.pt")
        state = canonical_state(get_train_state(holder, opt), getattr(holder, "_modelpar_perms", {}))
        info = {"format": FORMAT, "version": VERSION, "step": step, "world_size": _world(),
                "params": _param_shapes(holder), "optimizer_state": "optim" in state,
                "optimizer": type(opt).__name__ if opt is not None else None,
                "torch": torch.__version__, **(meta or {})}

        def finish() -> None:          # rank 0, after every rank's files are written
            if rank != 0:
                return
            info["files"] = {str(f.relative_to(tmp)): f.stat().st_size for f in sorted(tmp.rglob("*")) if f.is_file()}
            info["saved_at"] = time.strftime("%Y-%m-%dT%H:%M:%S")
            _fsync_write(tmp / META_FILE, json.dumps(info, indent=1, sort_keys=True) + "\n")
            _fsync_write(tmp / MARKER, f"{step}\n")                 # the marker, written last
            old = None
            if final.exists():         # a checkpoint of the same step from an earlier run: replace it whole
                old = self.ckpt_dir / f".old-{final.name}-{time.time_ns()}"
                final.rename(old)
            tmp.rename(final)
            if old is not None:
                shutil.rmtree(old, ignore_errors=True)
            self._prune()

        if self.async_save:
            fut = dcp.async_save(state, checkpoint_id=str(tmp), process_group=self._group)
            self._pending = (fut, finish)
        else:
            with single_process_dcp():
                dcp.save(state, checkpoint_id=str(tmp), no_dist=not dist.is_initialized())
            finish()
            _barrier()
        return final

    def wait(self) -> None:
        """Finish an async save in flight (no-op otherwise); collective."""
        if self._pending is None:
            return
        fut, finish = self._pending
        self._pending = None
        fut.result()
        finish()
        _barrier()

    def close(self) -> None:
        self.wait()

    def _prune(self) -> None:
        if self.keep_last <= 0:
            return
        for _, p in list_checkpoints(self.ckpt_dir)[:-self.keep_last]:
            (p / MARKER).unlink(missing_ok=True)       # no longer complete before any data goes
            shutil.rmtree(p, ignore_errors=True)


# ---- loading --------------------------------------------------------------------------------------
def load_checkpoint(holder: nn.Module, opt: torch.optim.Optimizer | None, path: str | os.PathLike, *,
                    restore_rng: bool = False) -> dict:
    """Load a checkpoint written under any plan and world size into this rank's parameters and
    optimizer (collective). DCP reads each rank's slice of every tensor, whatever the saving layout was.

    Args:
        holder: `checkpoint_module` of this rank's modules, already laid out.
        opt: the optimizer over them (fresh); its state and hyper-parameters are replaced.
        restore_rng: also restore this rank's RNG state (only meaningful on the saving layout).

    Returns:
        The checkpoint's metadata (``step``, ``plan``, ``world_size``, ...).

    Raises:
        CheckpointError: missing, incomplete, truncated, foreign or other-model checkpoint; the same
            message on every rank.
    """
    import torch.distributed.checkpoint as dcp
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
    _check_same_model(p, meta.get("params", {}), _param_shapes(holder))
    with_optim = opt is not None and meta.get("optimizer_state", False)
    if with_optim and meta.get("optimizer") and meta["optimizer"] != type(opt).__name__:
        raise CheckpointError(f"checkpoint {p!r} holds {meta['optimizer']} state; this run uses "
                              f"{type(opt).__name__}")
    if with_optim:     # a fresh optimizer: get_state_dict creates its state, which DCP then fills
        msd, osd = get_state_dict(holder, opt, options=_options())
        plain = {"model": msd, "optim": osd}
    else:
        plain = get_train_state(holder, None)
    with single_process_dcp():
        dcp.load(plain, checkpoint_id=p, no_dist=not dist.is_initialized())
    restore_layout(plain, getattr(holder, "_modelpar_perms", {}))    # original order -> this layout's
    if with_optim:
        set_state_dict(holder, opt, model_state_dict=plain["model"], optim_state_dict=plain["optim"],
                       options=_options())
    else:
        set_model_state_dict(holder, plain["model"], options=_options())
        if opt is not None:
            opt.state.clear()          # saved before the first step: a fresh optimizer, as then
    if restore_rng:
        f = Path(p) / "rng" / f"rank-{_rank()}.pt"
        if f.exists():
            rng = torch.load(f, weights_only=True)
            torch.set_rng_state(rng["cpu"])
            if "cuda" in rng and torch.cuda.is_available():
                torch.cuda.set_rng_state_all(rng["cuda"])
    return meta


# moved to their own modules (kept importable from here)
from modelpar.train.run_checkpoints import TrainCheckpoints  # noqa: E402,F401
from modelpar.train.export import export_checkpoint  # noqa: E402,F401
