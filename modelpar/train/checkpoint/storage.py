"""Checkpoint format and storage: what a checkpoint folder holds, how it is written atomically, and
how its files are read back. Knows files and state dicts, not modules or optimizers (those:
`modelpar.train.checkpoint.state`).

A checkpoint is one folder ``CKPT_DIR/step-NNNNNNNN`` (the state after N optimizer steps):

- the model and optimizer state as `torch.distributed.checkpoint` (DCP) files: every tensor under its
  original name with its global shape, so DCP reshards it on load onto any layout;
- ``rng/rank-R.pt``: each rank's torch RNG state (restored on the same layout only);
- ``modelpar.json``: format tag (`FORMAT`, `VERSION`), step (= the data position: the samples of
  step s depend on (seed, s) only), the fields its writers add (`state.Checkpointer`: world size,
  every parameter's name and global shape, optimizer class; `resume.TrainCheckpoints`: the plan, the
  run config, the learning-rate schedule, the model config and spec, the ties), and a manifest of
  every file with its size (a truncated folder is detected on load);
- ``COMPLETE``: a marker written last.

Saving is atomic (`CheckpointWriter`): every file is written into ``CKPT_DIR/.tmp-step-NNNNNNNN``,
and rank 0 writes the metadata, then the marker, then renames the folder. A crash mid-save leaves
only a ``.tmp-*`` folder, which is never loaded and is removed by the next writer (one that holds the
marker, cut off only before its rename, is renamed into place by it instead). ``keep_last``
prunes older complete checkpoints after a successful save (marker first, so a half-removed folder is
never complete). With ``async_save`` the files are written by `dcp.async_save` on a separate gloo
process group while training goes on; rank 0 finishes (metadata, marker, rename, prune) when the
write has completed.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import time
import warnings
from pathlib import Path

import torch
import torch.distributed as dist

FORMAT = "modelpar-checkpoint"
VERSION = 1
META_FILE = "modelpar.json"
MARKER = "COMPLETE"
PREFIX = "step-"


class CheckpointError(ValueError):
    """A checkpoint folder that cannot be used; the message names the path and the problem."""


# ---- where checkpoints are ------------------------------------------------------------------------
def step_dir(ckpt_dir: str | os.PathLike, step: int) -> Path:
    """The folder of the checkpoint after ``step`` optimizer steps in ``ckpt_dir``."""
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
    """The newest complete checkpoint in ``ckpt_dir``; None if there is none."""
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
    """The validated ``modelpar.json`` of a checkpoint folder, with ``path`` (the resolved folder) added.

    Raises:
        CheckpointError: missing folder, no/invalid ``modelpar.json`` (not written by modelpar), a
            format version newer than `VERSION`, no ``COMPLETE`` marker (an interrupted save), or a
            file of the manifest missing or of the wrong size (a truncated copy).
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


# ---- process helpers (no process group: one process) ---------------------------------------------
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


@contextlib.contextmanager
def single_process_dcp():
    """Silence the one warning `torch.distributed.checkpoint` gives whenever it saves or loads without
    a process group ("torch.distributed is disabled, unavailable or uninitialized, assuming the intent
    is to load in a single process."): one process is a supported layout here (resume, export), not a
    mistake. Every other warning passes."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="torch.distributed is disabled, unavailable or uninitialized")
        yield


# ---- writing --------------------------------------------------------------------------------------
class CheckpointWriter:
    """Writes checkpoint folders into ``ckpt_dir`` atomically (collective: every rank calls `write`
    with the same step). Removes the ``.tmp-*`` folders of interrupted saves when built.

    Args:
        ckpt_dir: folder of ``step-*`` checkpoints, on a filesystem every rank sees.
        keep_last: complete checkpoints kept after each save (0: all).
        async_save: write with `dcp.async_save` (a background thread on its own gloo group).

    Raises:
        ValueError: ``keep_last`` < 0.
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
            self._finish_interrupted()
        _barrier()

    def _finish_interrupted(self) -> None:
        """Rank 0, before any save: a ``.tmp-*`` folder without the marker (a save interrupted while
        writing) is removed; one with it (every file, the metadata and the marker were written; only the
        rename was cut off) becomes its ``step-*`` folder unless that exists; the ``.old-*`` copy of a
        replaced checkpoint is removed."""
        for tmp in sorted(self.ckpt_dir.glob(".tmp-" + PREFIX + "*")):
            final = self.ckpt_dir / tmp.name[len(".tmp-"):]
            if (tmp / MARKER).exists() and (tmp / META_FILE).exists() and not final.exists():
                tmp.rename(final)
            else:
                shutil.rmtree(tmp, ignore_errors=True)
        for old in self.ckpt_dir.glob(".old-" + PREFIX + "*"):
            shutil.rmtree(old, ignore_errors=True)

    def write(self, state: dict, step: int, info: dict) -> Path:
        """Write ``state`` (a DCP state dict, tensors under their saved names) as the checkpoint of
        ``step``, with this rank's RNG state and ``info`` (JSON-able; rank 0's is written) in
        ``modelpar.json``, which gains ``format``, ``version``, ``step``, ``files`` and ``saved_at``.
        Returns the final folder (complete once this returns, or, with async_save, once `wait`
        returns); a complete checkpoint of the same step is replaced whole."""
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
        info = {**info, "format": FORMAT, "version": VERSION, "step": step}

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
        """Finish an async save in flight; collective."""
        self.wait()

    def _prune(self) -> None:
        if self.keep_last <= 0:
            return
        for _, p in list_checkpoints(self.ckpt_dir)[:-self.keep_last]:
            (p / MARKER).unlink(missing_ok=True)       # no longer complete before any data goes
            shutil.rmtree(p, ignore_errors=True)


# ---- reading --------------------------------------------------------------------------------------
def read_state(state: dict, path: str | os.PathLike) -> None:
    """Fill ``state`` (a DCP state dict whose tensors, DTensor shards included, have the shapes and
    placements wanted) in place from the checkpoint folder ``path`` (collective under a process
    group; DCP reads each rank's slice of every tensor, whatever the saving layout was)."""
    import torch.distributed.checkpoint as dcp

    with single_process_dcp():
        dcp.load(state, checkpoint_id=str(path), no_dist=not dist.is_initialized())


def read_whole(path: str | os.PathLike, prefix: str = "model.") -> dict[str, torch.Tensor]:
    """Every tensor of the checkpoint folder ``path`` whose saved name starts with ``prefix``, whole
    (the global shape, reassembled from the shards of any layout) on CPU, keyed by the name without
    the prefix. One process; memory: one copy of those tensors."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    md = dcp.FileSystemReader(str(path)).read_metadata()
    sd = {k[len(prefix):]: torch.empty(tuple(v.size), dtype=v.properties.dtype)
          for k, v in md.state_dict_metadata.items() if k.startswith(prefix) and isinstance(v, TensorStorageMetadata)}
    if sd:
        state = {prefix.rstrip("."): sd}
        with single_process_dcp():
            dcp.load(state, checkpoint_id=str(path), no_dist=True)
    return sd


def load_rng(path: str | os.PathLike) -> bool:
    """Set this rank's torch RNG state (CPU, and CUDA where saved and available) from the checkpoint
    folder ``path``; False when the folder holds none for this rank (another world size)."""
    f = Path(path) / "rng" / f"rank-{_rank()}.pt"
    if not f.exists():
        return False
    rng = torch.load(f, weights_only=True)
    torch.set_rng_state(rng["cpu"])
    if "cuda" in rng and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(rng["cuda"])
    return True
