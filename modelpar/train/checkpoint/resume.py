"""The training loop's checkpoint policy (`TrainCheckpoints`, the hooks of `modelpar train`): which
checkpoint to resume (``--resume auto|PATH``), what must match between the saved run and this one,
what a resume carries onto another layout, when to save and what run metadata to record. Saving and
loading a rank's state: `modelpar.train.checkpoint.state`; the files: `modelpar.train.checkpoint.storage`.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
import torch.distributed as dist

from modelpar.train.checkpoint.state import Checkpointer, check_same_model, checkpoint_module, load_checkpoint
from modelpar.train.checkpoint.storage import (CheckpointError, _rank, _world, latest_checkpoint, list_checkpoints,
                                               read_checkpoint_meta, resolve_checkpoint)

# the run config fields that fix the model and the sample order: a resume refuses to change them
_MUST_MATCH = ("model", "model_config", "seed", "global_batch_size", "seq_len", "optimizer", "data", "tokenizer",
               "token_dtype")
# those that name files: the same file named another way (relative to another working directory) matches
_PATH_FIELDS = ("model", "data", "tokenizer")


def _hyper_parameters(opt) -> list[dict] | None:
    """Every param group's settings but its parameters (None without an optimizer)."""
    if opt is None:
        return None
    return [{k: v for k, v in g.items() if k != "params"} for g in opt.param_groups]


def resume_source(cfg, ckpt_dir: Path) -> Path | None:
    """The checkpoint ``cfg.resume`` names (``auto``: the latest in ``ckpt_dir``, None on a first
    attempt; a path: that checkpoint), None without ``--resume``.

    Raises:
        CheckpointError: a path that is no checkpoint (`resolve_checkpoint`).
    """
    r = cfg.resume
    if not r:
        return None
    if r == "auto":
        return latest_checkpoint(ckpt_dir)
    return resolve_checkpoint(r)


def _refuse_a_used_dir(ckpt_dir: Path) -> None:
    found = list_checkpoints(ckpt_dir)
    if found:
        raise ValueError(f"ckpt_dir {str(ckpt_dir)!r} already holds checkpoints ({found[-1][1].name} and "
                         f"{len(found) - 1} older); pass --resume auto to continue them, or another --ckpt-dir "
                         f"(nothing was overwritten)")


# what identifies the data behind --data (`modelpar.train.tokens`: text and token files)
_DATA_FINGERPRINT = ("num_files", "num_bytes", "files_sha256", "train_tokens", "val_tokens", "sha256")

# fields of a Hugging Face config that do not change the model a checkpoint fits
_HF_CONFIG_IGNORED = ("_name_or_path",)


def _hf_config_diffs(meta: dict, cfg) -> list[str]:
    """The fields (``hf_config.<field>: checkpoint X vs now Y``) in which the Hugging Face config this
    run builds differs from the one the checkpoint recorded (`modelpar.train.task.model_spec`): the
    same ``--model`` can name another model, a ``config.json`` or pretrained folder edited since, whose
    parameters may even keep their shapes (heads against head width). Dropout probabilities
    (``--dropout``, not part of the model's parameters) are not compared, nor is anything when the
    checkpoint was written under another transformers version (which may spell or default fields
    otherwise, and whose config could then not be matched by any flag): there only the parameters'
    names and shapes are checked (`check_same_model`)."""
    from modelpar.models.hf import is_drop_field

    saved = (meta.get("model_spec") or {}).get("hf_config")
    if not saved:
        return []
    from modelpar.train.task import model_spec

    now = model_spec(cfg).get("hf_config")
    if not now:
        return []                     # not a Hugging Face model now: `model` differs, named already
    if saved.get("transformers_version") != now.get("transformers_version"):
        return []
    now = json.loads(json.dumps(now, sort_keys=True, default=str))     # as the checkpoint holds it

    def compared(k: str) -> bool:
        v = saved[k]
        return k not in _HF_CONFIG_IGNORED and not is_drop_field(k, v)

    return [f"hf_config.{k}: checkpoint {saved[k]!r} vs now {now[k]!r}"
            for k in sorted(set(saved) & set(now)) if compared(k) and saved[k] != now[k]]


def _seq_len_meant(cfg, seq_len: int) -> str:
    """``seq_len`` as said, and, for 0 (the model's own), the length it means (`task.lm_shape`)."""
    if seq_len:
        return repr(seq_len)
    import dataclasses

    from modelpar.train.task import lm_shape

    shape = lm_shape(dataclasses.replace(cfg, seq_len=0))
    return f"0 (= {shape.seq_len})" if shape is not None else "0"


def _same_seq_len(saved: int, cfg) -> bool:
    """The same sample length, 0 (the model's own: the same model, `model` and `model_config` being
    compared too) resolved where only one side gave a length."""
    if saved == cfg.seq_len or saved and cfg.seq_len:
        return saved == cfg.seq_len
    return _seq_len_meant(cfg, 0) == f"0 (= {saved or cfg.seq_len})"


def _where(value) -> str | None:
    """The absolute path a file field (`_PATH_FIELDS`: ``--data``, ``--tokenizer``, ``--model``'s
    ``hf:FOLDER``, ``config.json`` or ``file.py:factory``) names on this host, None where it names no
    file or folder here (a built-in model or dataset name, an empty field)."""
    if not isinstance(value, str) or not value:
        return None
    prefix, path, suffix = "", value, ""
    if value.startswith("hf:"):
        prefix, path = "hf:", value[3:]
    elif ":" in value and value.rsplit(":", 1)[0].endswith(".py"):
        path, fn = value.rsplit(":", 1)
        suffix = ":" + fn
    p = Path(path).expanduser()
    return f"{prefix}{p.resolve()}{suffix}" if path and p.exists() else None


def _same_field(k: str, saved, now, saved_paths: dict) -> bool:
    """Whether field ``k`` holds the same value: as written, or (a file field) naming the file the saved
    run named, written from another working directory or with ``~`` (``saved_paths``: the saved run's
    `_where` of each file field, recorded from this commit on)."""
    return saved == now or (k in _PATH_FIELDS and k in saved_paths and _where(now) == saved_paths[k])


def _field_diffs(k: str, saved, now) -> list[str]:
    """``k: checkpoint X vs now Y``; for two dicts (``model_config``) one such line per key that differs
    (``model_config.num_key_value_heads: checkpoint 2 vs now 4``; ``unset`` where a side lacks it)."""
    if not (isinstance(saved, dict) and isinstance(now, dict)):
        return [f"{k}: checkpoint {saved!r} vs now {now!r}"]
    return [f"{k}.{f}: checkpoint {saved.get(f, 'unset')!r} vs now {now.get(f, 'unset')!r}"
            for f in sorted(set(saved) | set(now), key=str) if saved.get(f, _UNSET) != now.get(f, _UNSET)]


_UNSET = object()


def _run_diffs(meta: dict, cfg) -> list[str]:
    """``field: checkpoint X vs now Y`` of every field that fixes the model and the sample order."""
    saved_cfg, paths = meta.get("train_config", {}), meta.get("paths") or {}
    diffs = [d for k in _MUST_MATCH
             if k in saved_cfg and k != "seq_len" and not _same_field(k, saved_cfg[k], getattr(cfg, k), paths)
             for d in _field_diffs(k, saved_cfg[k], getattr(cfg, k))]
    if "seq_len" in saved_cfg and not _same_seq_len(saved_cfg["seq_len"], cfg):
        diffs.append(f"seq_len: checkpoint {_seq_len_meant(cfg, saved_cfg['seq_len'])} vs now "
                     f"{_seq_len_meant(cfg, cfg.seq_len)}")
    if not any(d.startswith(("model:", "model_config")) for d in diffs):
        diffs += _hf_config_diffs(meta, cfg)
    return diffs


def _refuse_another_runs_dir(cfg, ckpt_dir: Path, source: Path) -> None:
    """A resume with checkpointing on into a ``ckpt_dir`` other than the checkpoint's own folder: its
    saves would mix with the checkpoints there and keep-last would delete them, so (as a fresh run
    refuses a used folder) they must be this run's (the latest one's run compared, `_run_diffs`)."""
    if cfg.ckpt_every <= 0 or source.parent.resolve() == ckpt_dir.resolve():
        return
    latest = latest_checkpoint(ckpt_dir)
    if latest is None:
        return
    diffs = _run_diffs(read_checkpoint_meta(latest), cfg)
    if diffs:
        raise CheckpointError(f"ckpt_dir {str(ckpt_dir)!r} holds checkpoints of another run ({latest.name}: "
                              f"{'; '.join(diffs)}); this run's saves would mix with them and keep_last would "
                              f"delete them: pass another --ckpt-dir (nothing was overwritten)")


def _refuse_another_run(meta: dict, cfg) -> None:
    diffs = _run_diffs(meta, cfg)
    if diffs:
        raise CheckpointError(f"checkpoint {meta['path']!r} was written by a run that differs in what "
                              f"fixes the model and the sample order: {'; '.join(diffs)}")


def _whole_model_shapes(model, saved: dict) -> dict[str, list[int]]:
    """``{name: shape}`` of ``model``'s parameters as a checkpoint names them: a parameter held under
    several names (a tie) once, under a name the checkpoint holds if it holds one."""
    groups: dict[int, tuple[list[int], list[str]]] = {}
    for n, prm in model.named_parameters(remove_duplicate=False):
        groups.setdefault(id(prm), (list(prm.shape), []))[1].append(n)
    return {next((n for n in names if n in saved), names[0]): shape for shape, names in groups.values()}


def check_checkpoints_before_launch(cfg, model=None) -> None:
    """What `TrainCheckpoints` refuses on every rank, checked once before any process starts (one
    JSON read): a fresh run (checkpointing on, no --resume) into a ``ckpt_dir`` that holds checkpoints,
    a resume into another folder than the checkpoint's that holds another run's (`_refuse_another_runs_dir`),
    a checkpoint to resume that is not one or whose run differs in what fixes the model and the sample
    order (`_MUST_MATCH`), or one past ``cfg.steps``; with ``model`` (the whole model, on the meta
    device is enough), also one whose parameters (names, global shapes) are not the model's, as
    `load_checkpoint` would refuse it (a factory file edited since the save keeps its ``--model``).

    Raises:
        CheckpointError, ValueError: as `TrainCheckpoints` does, with its messages.
    """
    ckpt_dir = Path(cfg.ckpt_dir or Path(cfg.out_dir) / "checkpoints")
    source = resume_source(cfg, ckpt_dir)
    if source is None:
        if cfg.ckpt_every > 0:
            _refuse_a_used_dir(ckpt_dir)
        return
    meta = read_checkpoint_meta(source)
    _refuse_another_run(meta, cfg)
    _refuse_another_runs_dir(cfg, ckpt_dir, Path(meta["path"]))
    if model is not None and meta.get("params"):
        check_same_model(meta["path"], meta["params"], _whole_model_shapes(model, meta["params"]))
    if int(meta["step"]) > cfg.steps:
        raise ValueError(f"checkpoint {meta['path']!r} is at step {meta['step']}, past steps={cfg.steps}")


class TrainCheckpoints:
    """Checkpointing of one `modelpar.train.runner.train` run: resume, periodic saves, close.

    Resume carries the step (= data position, since the samples of step s come from (seed, s)), the
    model and optimizer state on any layout, and the learning-rate position (lr_at(step)). On the
    saving layout each rank's RNG state is restored too; on another layout the per-rank RNG streams
    cannot be mapped, so each rank is reseeded from (seed, step, rank) and a note says so (this only
    matters with dropout > 0).

    Saves go to ``cfg.ckpt_dir`` (default ``OUT_DIR/checkpoints``) every ``cfg.ckpt_every`` steps, at
    step 0 and at the last step, keeping the newest ``cfg.keep_last``. A fresh run refuses a
    ``ckpt_dir`` that already holds checkpoints, and a resume one that holds another run's (where it is
    not the checkpoint's own folder), so neither can prune another run's work.

    Raises:
        CheckpointError: the checkpoint to resume cannot be used (see `load_checkpoint`), or its run
            differs in a field of ``_MUST_MATCH`` or, for a Hugging Face model, of its config
            (`_hf_config_diffs`) (the differing fields named), or ``ckpt_dir`` is not the
            checkpoint's folder and holds another run's (`_refuse_another_runs_dir`).
        ValueError: a fresh run's ``ckpt_dir`` holds checkpoints; the checkpoint is past ``cfg.steps``.
    """

    def __init__(self, cfg, pm, opt, *, say=print, data_info: dict | None = None):
        self.cfg, self.pm, self.opt, self.say = cfg, pm, opt, say
        self.data_info = data_info       # what the data is (`modelpar.train.tokens`): recorded, compared on resume
        self.every = cfg.ckpt_every
        self.ckpt_dir = Path(cfg.ckpt_dir or Path(cfg.out_dir) / "checkpoints")
        self.start_step = 0
        self.loaded_step: int | None = None
        self.saver: Checkpointer | None = None
        self.holder = checkpoint_module(pm.modules, getattr(pm, "ties", None),   # before the first forward
                                        stage_group=pm.mesh.group("pp"))
        self.spec = None                 # the model spec (`task.model_spec`), taken at the first save
        source = resume_source(cfg, self.ckpt_dir)
        if source is not None:
            self._resume(source)
        else:
            if cfg.resume == "auto":     # the first attempt, or a --ckpt-dir that is not the run's: say which
                self.say(f"  --resume auto: no complete checkpoint in {self.ckpt_dir}, so starting at step 0")
            if self.every > 0:
                _refuse_a_used_dir(self.ckpt_dir)
        if self.every > 0:
            self.saver = Checkpointer(self.ckpt_dir, keep_last=cfg.keep_last, async_save=cfg.async_ckpt)

    def _resume(self, source: Path) -> None:
        cfg, pm = self.cfg, self.pm
        meta = read_checkpoint_meta(source) if _rank() == 0 else None
        if dist.is_initialized() and dist.get_world_size() > 1:
            box = [meta]
            dist.broadcast_object_list(box, src=0)
            meta = box[0]
        _refuse_another_run(meta, cfg)
        _refuse_another_runs_dir(cfg, self.ckpt_dir, Path(meta["path"]))
        same_layout = meta.get("plan") == pm.plan.to_dict() and meta.get("world_size") == _world()
        mine = _hyper_parameters(self.opt)
        meta = load_checkpoint(self.holder, self.opt, meta["path"], restore_rng=same_layout)
        self.start_step = self.loaded_step = int(meta["step"])
        if self.start_step > cfg.steps:
            raise ValueError(f"checkpoint {meta['path']!r} is at step {self.start_step}, past steps={cfg.steps}")
        old = f"{meta.get('plan_description', '?')} on {meta.get('world_size')} rank(s)"
        new = f"{pm.plan.describe()} on {_world()} rank(s)"
        self.say(f"  resumed from {meta['path']} at step {self.start_step} (saved under {old}; now {new})")
        self._keep_this_runs_settings(mine, meta)
        self._note_other_data(meta.get("data_info"))
        if not same_layout:
            torch.manual_seed((cfg.seed * 1_000_003 + self.start_step * 7919 + _rank()) % (2**63 - 1))
            if cfg.dropout > 0:
                self.say("  note: new layout, so per-rank dropout RNG streams were reseeded from (seed, step, rank)")

    def _keep_this_runs_settings(self, mine: list[dict] | None, meta: dict) -> None:
        """The optimizer's hyper-parameters are this run's (``--weight-decay``, the optimizer's own
        defaults; the lr is set every step from this run's schedule), its state (moments, step counts)
        the checkpoint's: loading the state put the saved groups' values back, which would silently
        override a changed ``--weight-decay``. Says which settings changed, the learning-rate schedule's
        included."""
        if mine is None:
            return
        changed = {}
        for g, kept in zip(self.opt.param_groups, mine):
            for k, v in kept.items():
                if k != "lr" and g.get(k) != v:
                    changed.setdefault(k, (g.get(k), v))
            g.update(kept)
        saved = meta.get("lr_schedule") or {}
        for k, v in saved.items():
            if getattr(self.cfg, k, v) != v:
                changed[k] = (v, getattr(self.cfg, k))
        if changed:
            self.say("  note: this run's training settings differ from the checkpoint's run, and apply from step "
                     f"{self.start_step} on: " + "; ".join(f"{k} {a!r} -> {b!r}" for k, (a, b) in sorted(changed.items())))

    def _note_other_data(self, saved: dict | None) -> None:
        """Say so when the data's fingerprint (sizes, hashes: `_DATA_FINGERPRINT`) differs from the
        checkpoint's run's: ``--data`` names the same path, but the samples of the steps to come are
        drawn by (seed, step) from what it holds now, not from what the saved run read."""
        if not saved or not self.data_info:
            return
        changed = [f"{k} {saved[k]!r} -> {self.data_info[k]!r}" for k in _DATA_FINGERPRINT
                   if k in saved and k in self.data_info and saved[k] != self.data_info[k]]
        if changed:
            self.say(f"  note: the data differs from the checkpoint's run's ({'; '.join(changed)}): the samples "
                     f"from step {self.start_step} on are drawn from it, not those the saved run would have read")

    def after_step(self, steps_done: int) -> None:
        """Collective. Save if ``steps_done`` is a multiple of ckpt_every (0 included) or the last step."""
        if self.saver is None or steps_done == self.loaded_step:
            return
        if steps_done % self.every == 0 or steps_done == self.cfg.steps:
            self._save(steps_done)

    def save_now(self, steps_done: int) -> str:
        """Collective. Save after ``steps_done`` steps unless `after_step` just did (a stop request,
        `StopRequest`), and finish the save; returns the checkpoint directory."""
        if self.saver is None:
            raise ValueError("save_now needs checkpointing on (ckpt_every > 0)")
        if steps_done != self.loaded_step and steps_done % self.every and steps_done != self.cfg.steps:
            self._save(steps_done)
        self.close()
        return str(self.ckpt_dir)

    def _save(self, steps_done: int) -> None:
        """Collective. Write the checkpoint after ``steps_done`` steps (its run metadata beside it)."""
        cfg = self.cfg
        meta = {"plan": self.pm.plan.to_dict(), "plan_description": self.pm.plan.describe(),
                "train_config": cfg.to_dict(), "model": cfg.model,
                "data_position": {"seed": cfg.seed, "next_step": steps_done,
                                  "global_batch_size": cfg.global_batch_size},
                "lr_schedule": {k: getattr(cfg, k) for k in ("lr", "min_lr", "warmup_steps", "steps")},
                "tied_parameters": [list(t) for t in getattr(self.pm, "ties", [])],
                "paths": {k: w for k in _PATH_FIELDS if (w := _where(getattr(cfg, k))) is not None}}
        if self.spec is None:
            from modelpar.train.task import model_spec

            self.spec = model_spec(cfg)
        meta["model_spec"] = self.spec
        if self.data_info:
            meta["data_info"] = self.data_info
        gpt_cfg = getattr(self._full_model_cfg(), "__dict__", None)
        if gpt_cfg:
            meta["model_config"] = {k: v for k, v in gpt_cfg.items() if isinstance(v, (int, float, str, bool))}
        self.saver.save(self.holder, self.opt, steps_done, meta=meta)

    def _full_model_cfg(self):
        for m in self.pm.modules:
            if hasattr(m, "cfg"):
                return m.cfg
        return None

    def close(self) -> None:
        """Finish an async save in flight; collective."""
        if self.saver is not None:
            self.saver.close()
