"""Checkpoint export (``modelpar export``): the model of a checkpoint (any layout) as one safetensors
file (`export_checkpoint`), or, for a Hugging Face model, as a folder that
``transformers.AutoModelForCausalLM.from_pretrained(folder)`` loads (`export_hf_folder`).

Both read the checkpoint's model tensors whole in one process (`read_model_state`: DCP reassembles
the shards of any layout, `modelpar.train.checkpoint.storage.read_whole`), with tied parameters
(case C13) held once. The state dict stays in the canonical layout of the plain model: a
layout-specific permutation is undone by the function that maps modelpar names to the model's own
(`modelpar.models.hf.hf_state_dict` for Hugging Face models), the one place such a mapping lives.
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import torch

from modelpar.train.checkpoint.state import drop_tied_aliases
from modelpar.train.checkpoint.storage import CheckpointError, read_checkpoint_meta, read_whole


def read_model_state(path: str | os.PathLike) -> tuple[dict, dict[str, torch.Tensor], dict[str, str]]:
    """``(meta, state, aliases)`` of a checkpoint: its metadata, its model tensors whole (CPU, the
    plain model's names, each tied parameter once under its first name) and ``{alias: name}`` of the
    ties dropped.

    Raises:
        CheckpointError: see `read_checkpoint_meta`; a checkpoint without model tensors.
    """
    meta = read_checkpoint_meta(path)
    sd = read_whole(meta["path"], "model.")
    if not sd:
        raise CheckpointError(f"checkpoint {meta['path']!r} holds no model tensors")
    aliases = drop_tied_aliases(sd, meta.get("tied_parameters", []))    # saved once, under the first name held
    return meta, sd, aliases


def export_checkpoint(path: str | os.PathLike, out: str | os.PathLike) -> dict[str, torch.Tensor]:
    """Write the model of a checkpoint (any layout) as one consolidated safetensors file, loadable by
    ``model.load_state_dict(safetensors.torch.load_file(out))`` on the plain model. One process.

    Tied parameters (case C13, listed in the checkpoint's ``tied_parameters``) are written under every
    name (each alias a copy, as the run folder's ``model.safetensors``), so the strict
    ``load_state_dict`` loads the file into a model that ties them (the tie kept: both names load the
    one parameter) or into one that does not; the aliases are recorded in the file's metadata
    (``modelpar_tied``, JSON ``{alias: name}``). (``safetensors.torch.load_model`` expects shared
    tensors once and reports the aliases as unexpected: pass it ``strict=False``.)

    Raises:
        CheckpointError: see `read_checkpoint_meta`.
    """
    from safetensors.torch import save_file

    meta, sd, aliases = read_model_state(path)
    sd = {**sd, **{alias: sd[name].clone() for alias, name in aliases.items()}}
    out = Path(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_name(out.name + ".tmp")
    extra = {"modelpar_tied": json.dumps(aliases, sort_keys=True)} if aliases else {}
    save_file({k: v.contiguous() for k, v in sd.items()}, str(tmp),
              metadata={"format": "pt", "modelpar_step": str(meta["step"]), "modelpar_model": str(meta.get("model")),
                        **extra})
    tmp.replace(out)
    return sd


def checkpoint_model_spec(meta: dict) -> dict:
    """The model spec a checkpoint recorded (`modelpar.train.task.model_spec`); ``{}`` for checkpoints
    written before modelpar recorded it."""
    return meta.get("model_spec") or {}


def export_hf_folder(path: str | os.PathLike, out: str | os.PathLike) -> tuple[Path, dict[str, torch.Tensor]]:
    """Write the Hugging Face model of a checkpoint as a transformers folder: ``config.json`` and
    ``model.safetensors`` (transformers' ``save_pretrained``: tied weights saved once), plus the run's
    ``tokenizer.json`` when it trained with one. Needs no ``--model``: the checkpoint records the
    model's whole config (``model_spec.hf_config``). One process; the model is built once on CPU
    (memory: one copy of the weights besides the loaded state).

    Returns:
        ``(folder, state dict as saved, transformers' names)``.

    Raises:
        CheckpointError: not a Hugging Face model's checkpoint, or its tensors do not fill the model
            (names listed).
    """
    from modelpar.models.hf import HFModel, hf_state_dict, require_transformers, task_of

    meta, sd, aliases = read_model_state(path)
    spec = checkpoint_model_spec(meta)
    if spec.get("kind") != "hf" or not spec.get("hf_config"):
        raise CheckpointError(f"checkpoint {meta['path']!r} is not of a Hugging Face model (model "
                              f"{meta.get('model')!r}); export it as one safetensors file (--format safetensors)")
    transformers = require_transformers()
    raw = dict(spec["hf_config"])
    cfg = transformers.AutoConfig.for_model(raw.pop("model_type"), **{k: v for k, v in raw.items()
                                                                      if k not in ("transformers_version",)})
    auto = transformers.AutoModelForCausalLM if task_of(cfg) == "lm" else transformers.AutoModelForImageClassification
    model = HFModel(auto.from_config(cfg), task_of(cfg))
    state = hf_state_dict(model, sd)               # canonical layout, transformers' names
    missing, unexpected = model.hf.load_state_dict(state, strict=False)
    tied_aliases = {a[3:] if a.startswith("hf.") else a for a in aliases}
    missing = [m for m in missing if m not in tied_aliases]
    if missing or unexpected:
        raise CheckpointError(f"checkpoint {meta['path']!r} does not fit {type(model.hf).__name__}: missing "
                              f"{missing[:5]}, unexpected {list(unexpected)[:5]}")
    out = Path(out)
    tmp = out.with_name(out.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    model.hf.save_pretrained(str(tmp), safe_serialization=True)
    tok = spec.get("tokenizer")
    if tok and os.path.isfile(tok):
        shutil.copy(tok, tmp / "tokenizer.json")
    (tmp / "modelpar_export.json").write_text(json.dumps(
        {"checkpoint": meta["path"], "step": meta["step"], "model": meta.get("model"),
         "model_config": spec.get("model_config"), "tokenizer": tok or "bytes", "tied": aliases}, indent=1) + "\n")
    if out.exists():
        shutil.rmtree(out)
    tmp.rename(out)
    return out, state
