"""A task = model + data + loss, built the same way on every rank (and in the launcher, on meta).

Language models (token ids in, logits out) train on a token stream (`modelpar.train.tokens`): the
built-in GPT presets, Hugging Face causal LMs (``hf:<type>``, a config.json, a pretrained folder) and
factory models that declare themselves language models (the dict form with ``"task": "lm"``,
`modelpar.models.spec`). The MLPs and factory classifiers (an ``nn.Module``, or the dict form with
``"task": "classify"``) train on a synthetic teacher of their input shape and classes
(`modelpar.train.data.synthetic_inputs`), the CNN on scikit-learn's digits, a Hugging Face image
classifier (``hf:vit``, ...) on synthetic images of its own ``num_channels``, ``image_size`` and
``num_labels`` (`modelpar.train.data.synthetic_images`).
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import torch
import torch.nn as nn
import torch.nn.functional as F

from modelpar.models import MLP_PRESETS, PRESETS
from modelpar.train.data import TensorBatches, TokenBatches, load_digits

def lm_loss(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Mean next-token cross entropy, nats per token. logits (b, t, V), targets (b, t)."""
    return F.cross_entropy(logits.float().flatten(0, 1), targets.flatten())


def classification_loss(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Mean cross entropy. logits (b, classes), targets (b,)."""
    return F.cross_entropy(logits.float(), targets)


@dataclass
class Task:
    name: str
    kind: str                        # "lm" | "classify"
    model: nn.Module
    train: object                    # TokenBatches | TensorBatches: .global_batch / .global_rows(seed, step, n)
    val: tuple[torch.Tensor, torch.Tensor]
    loss_fn: object
    tokens_per_sample: int
    data_info: dict
    lm: "LMShape | None" = None      # language models: vocabulary, positions, sequence length
    input_shape: tuple | None = None  # classifiers with their own input shape (an HF image model: c, h, w)
    classes: int = 0                 # a factory classifier's classes (the labels drawn are < classes)


@dataclass(frozen=True)
class LMShape:
    """What the data checks need of a language model."""

    vocab: int
    max_positions: int | None        # None: no limit known
    seq_len: int                     # the run's sequence length


def has_weights(folder: str) -> bool:
    """A local pretrained folder: ``config.json`` next to ``*.safetensors`` or ``*.bin`` weights."""
    return os.path.isdir(folder) and os.path.isfile(os.path.join(folder, "config.json")) and any(
        f.endswith((".safetensors", ".bin")) for f in os.listdir(folder))


def _kind(cfg) -> str:
    from modelpar.models.spec import model_kind
    return model_kind(cfg.model)


def _factory(cfg, device: str = "cpu"):
    """``(model, LMShape or None, classifier (input shape, classes) or None)`` of a factory model, called
    once (`build_factory`: inside `one_factory_build`, the scope's one build). Two forms train: a language
    model ``{"model", "task": "lm", "vocab_size", "max_positions"}`` and a classifier (an ``nn.Module``, or
    ``{"model", "task": "classify", "input_shape", "num_classes"}``; the shapes default to the first and
    last ``nn.Linear``: float inputs ``(batch, *input_shape)`` to logits ``(batch, classes)``).

    Raises:
        ValueError: ``--dropout`` (a factory's dropout is its own); a malformed declaration; the
            ``batch_fn`` / ``loss_fn`` form (verify's, whose data train cannot draw); a classifier whose
            shapes are neither declared nor inferable.
    """
    from modelpar.models.spec import build_factory, infer_classifier_shapes

    um = build_factory(cfg.model)
    task, vocab, maxpos = um.extra.get("task"), um.extra.get("vocab_size"), um.extra.get("max_positions")
    if cfg.dropout:
        raise ValueError(f"--dropout {cfg.dropout} sets the dropout of the built-in GPT and of Hugging Face configs; "
                         f"--model {cfg.model!r} is a factory model, whose dropout is its own: set it in the factory")
    if um.batch_fn is not None or um.loss_fn is not None:
        raise ValueError(f"--model {cfg.model!r}: modelpar train runs a factory language model or classifier; a factory "
                         f"with its own batch_fn / loss_fn is modelpar verify's form (train draws its own data): "
                         f"return {{'model': m, 'task': 'lm', 'vocab_size': V}} or a classifier module")
    if task in (None, "classify"):
        shape, classes = um.extra.get("input_shape"), um.extra.get("num_classes", 0)
        if shape is not None and (not isinstance(shape, (list, tuple)) or not shape
                                  or not all(isinstance(d, int) and d > 0 for d in shape)):
            raise ValueError(f"--model {cfg.model!r}: 'input_shape' must be a non-empty list of positive ints "
                             f"(one sample's shape), got {shape!r}")
        if not isinstance(classes, int) or classes < 0:
            raise ValueError(f"--model {cfg.model!r}: 'num_classes' must be a positive int, got {classes!r}")
        got = infer_classifier_shapes(um.model, tuple(shape) if shape else None, classes)
        if got is None:
            raise ValueError(f"--model {cfg.model!r}: a factory classifier needs its input shape and classes: it has "
                             f"no nn.Linear to read them from; return {{'model': m, 'task': 'classify', "
                             f"'input_shape': [...], 'num_classes': K}}")
        return _on(um.model, device), None, got
    if task != "lm":
        raise ValueError(f"--model {cfg.model!r}: a factory model's 'task' is 'lm' or 'classify', got {task!r}")
    if not isinstance(vocab, int) or vocab < 1:
        raise ValueError(f"--model {cfg.model!r}: a factory language model must declare 'vocab_size' as a positive "
                         f"int, got {vocab!r}")
    if maxpos is not None and (not isinstance(maxpos, int) or maxpos < 1):
        raise ValueError(f"--model {cfg.model!r}: 'max_positions' must be a positive int, got {maxpos!r}")
    seq = cfg.seq_len or maxpos or 0
    if seq < 1:
        raise ValueError(f"--model {cfg.model!r}: a factory language model without 'max_positions' needs --seq-len")
    return _on(um.model, device), LMShape(vocab, maxpos, seq), None


def _on(model: nn.Module, device) -> nn.Module:
    """``model`` moved to ``device``; for the meta device a copy of it there (`parallel.stages.skeleton`),
    ``model`` left as it is (a build `modelpar.models.spec.one_factory_build` shares keeps its weights)."""
    if torch.device(device).type == "meta":
        from modelpar.parallel.stages import skeleton

        return skeleton(model)
    return model.to(device)


def lm_shape(cfg, model: nn.Module | None = None) -> LMShape | None:
    """The `LMShape` of ``cfg``'s model (None: not a language model). Reads the config, builds nothing
    for built-in and Hugging Face models (a factory is called unless ``model`` is given)."""
    kind = _kind(cfg)
    if kind == "builtin":
        if cfg.model not in PRESETS:
            return None
        gc = {**PRESETS[cfg.model].__dict__, **(cfg.model_config or {})}
        seq = cfg.seq_len or gc["seq_len"]
        return LMShape(int(gc["vocab_size"]), seq, seq)     # the GPT's positions are its seq_len
    if kind == "hf":
        from modelpar.models.hf import default_seq_len, facts, load_config

        f = facts(load_config(cfg.model, cfg.model_config or None))
        if f.task != "lm":
            return None
        maxpos = int(f.max_positions) if f.max_positions else None
        return LMShape(int(f.vocab), maxpos, cfg.seq_len or default_seq_len(maxpos))
    return _factory(cfg)[1]


def build_model_for(cfg, device: str = "cpu") -> nn.Module:
    """The model ``cfg.model`` names with ``cfg.model_config`` overrides (`modelpar.models.spec`):
    ``cfg.seq_len`` and ``cfg.dropout`` win for GPT presets; ``cfg.dropout`` sets every dropout of a
    Hugging Face config; a local pretrained folder loads its weights (not on ``device="meta"``).

    Raises:
        ValueError: unknown name or fields, a Hugging Face model that is neither a causal LM nor an
            image classifier, a factory of neither trainable form (see `_factory`).
    """
    from modelpar.models.spec import build_builtin

    kind = _kind(cfg)
    if kind == "hf":
        from modelpar.models.hf import build_hf, load_config, task_of

        task_of(load_config(cfg.model, cfg.model_config or None))     # a causal LM or an image classifier
        if getattr(cfg, "meta_init", False) and str(device) != "meta":     # materialised per shard later
            from modelpar.train.materialise import params_on_meta

            with params_on_meta():
                return build_hf(cfg.model, cfg.model_config or None, device=device, seed=cfg.seed,
                                dropout=cfg.dropout)
        load = has_weights(cfg.model) and str(device) != "meta"
        return build_hf(cfg.model, cfg.model_config or None, device=device, seed=cfg.seed, dropout=cfg.dropout,
                        load_weights=load)
    if kind == "factory":
        return _factory(cfg, device)[0]
    kw = {}
    if cfg.model in PRESETS:
        kw["dropout"] = cfg.dropout
        if cfg.seq_len:
            kw["seq_len"] = cfg.seq_len
        if getattr(cfg, "meta_init", False) and str(device) != "meta":     # materialised per shard later
            from modelpar.train.materialise import params_on_meta

            with params_on_meta():
                return build_builtin(cfg.model, getattr(cfg, "model_config", None) or None, device=device,
                                     seed=cfg.seed, **kw)
    return build_builtin(cfg.model, getattr(cfg, "model_config", None) or None, device=device, seed=cfg.seed, **kw)


def model_spec(cfg) -> dict:
    """What a checkpoint records to rebuild the model without ``--model``: the name, the overrides, the
    tokenization, and for a Hugging Face model its whole config (``hf_config``, the config's
    ``to_dict()``; `modelpar.train.checkpoint.export.export_hf_folder` writes it back)."""
    spec = {"kind": _kind(cfg), "model": cfg.model, "model_config": dict(cfg.model_config or {}),
            "tokenizer": os.path.abspath(cfg.tokenizer) if cfg.tokenizer else "",
            "token_dtype": cfg.token_dtype}
    if spec["kind"] == "hf":
        from modelpar.models.hf import load_config

        spec["hf_config"] = load_config(cfg.model, cfg.model_config or None, dropout=cfg.dropout).to_dict()
    return spec


def synthetic_classification(in_dim: int, classes: int, n: int = 4096, seed: int = 0):
    """Inputs N(0, 1), labels from a fixed random linear teacher: a learnable stand-in for the MLPs."""
    g = torch.Generator().manual_seed(seed + 99)
    x = torch.randn(n, in_dim, generator=g)
    w = torch.randn(in_dim, classes, generator=g)
    return x, (x @ w).argmax(-1)


def _check_no_token_options(cfg) -> None:
    if cfg.tokenizer or cfg.token_dtype:
        raise ValueError(f"tokenizer / token_dtype apply to language models; --model {cfg.model} is a classifier")


def unused_lm_options_note(cfg, kind: str) -> str:
    """A note naming ``--data`` / ``--seq-len`` when the model is a classifier (``kind``), which trains on
    synthetic inputs of its own shape and takes neither ("" otherwise). A note, not an error: a config
    file may set them for every model of a sweep."""
    given = [f for f, v in (("--data", cfg.data is not None), ("--seq-len", bool(cfg.seq_len))) if v]
    if kind != "classify" or not given:
        return ""
    return (f"{' and '.join(given)} apply to language models (text, tokens per sample); --model {cfg.model} is a "
            f"classifier, trained on synthetic inputs of its own shape: not used")


def build_task(cfg, *, device: str = "cpu", load_data: bool = True) -> Task:
    """Build the model and, if asked, its data. ``device="meta"``: a built-in or Hugging Face model
    allocates nothing; a factory runs as it is and its model is copied to the meta device (`_on`)."""
    classifier = None
    if _kind(cfg) == "factory":
        model, shape, classifier = _factory(cfg, device)      # the factory is called once
    else:
        model, shape = build_model_for(cfg, device=device), lm_shape(cfg)
        if _kind(cfg) == "hf" and shape is not None:       # what its forward never reaches, frozen (one line)
            from modelpar.models.hf_unused import freeze_unreached

            model.unreached_note = freeze_unreached(model, cfg.model, cfg.model_config or None, shape.seq_len)
    if shape is not None:
        seq = shape.seq_len
        if not load_data:
            return Task(cfg.model, "lm", model, None, None, lm_loss, seq, {}, shape)
        from modelpar.train.tokens import load_lm_data

        train, val, info = load_lm_data(cfg)
        tb, vb = TokenBatches(train, seq), TokenBatches(val, seq)
        return Task(cfg.model, "lm", model, tb, vb.at(vb.eval_batches(cfg.eval_samples)), lm_loss, seq, info, shape)
    _check_no_token_options(cfg)
    if classifier is not None:      # a factory classifier: synthetic inputs of its shape and classes
        from modelpar.train.data import synthetic_inputs

        in_shape, classes = classifier
        if not load_data:
            return Task(cfg.model, "classify", model, None, None, classification_loss, 1, {}, input_shape=in_shape,
                        classes=classes)
        train, val, info = synthetic_inputs(in_shape, classes, seed=cfg.seed, val=max(cfg.eval_samples, 1))
        return Task(cfg.model, "classify", model, train, val, classification_loss, 1, info, input_shape=in_shape,
                    classes=classes)
    if _kind(cfg) == "hf":          # an image classifier: synthetic images of its shape and labels
        from modelpar.models.hf import facts, load_config
        from modelpar.train.data import synthetic_images

        f = facts(load_config(cfg.model, cfg.model_config or None))
        shape = (int(f.num_channels or 3), int(f.image_size), int(f.image_size))
        if not load_data:
            return Task(cfg.model, "classify", model, None, None, classification_loss, 1, {}, input_shape=shape)
        train, val, info = synthetic_images(shape[0], shape[1], int(f.num_labels), seed=cfg.seed,
                                            val=max(cfg.eval_samples, 1))
        return Task(cfg.model, "classify", model, train, val, classification_loss, 1, info, input_shape=shape)
    if cfg.model in MLP_PRESETS:
        widths = MLP_PRESETS[cfg.model]
        if not load_data:
            return Task(cfg.model, "classify", model, None, None, classification_loss, 1, {})
        x, y = synthetic_classification(widths[0], widths[-1], seed=cfg.seed)
        n_val = max(cfg.eval_samples, 1)
        return Task(cfg.model, "classify", model, TensorBatches(x[n_val:], y[n_val:]), (x[:n_val], y[:n_val]),
                    classification_loss, 1, {"source": "synthetic teacher", "num_samples": len(x)})
    if not load_data:
        return Task(cfg.model, "classify", model, None, None, classification_loss, 1, {})
    train, val, info = load_digits()
    return Task(cfg.model, "classify", model, train, val, classification_loss, 1, info)


def example_input(task: Task, batch: int) -> torch.Tensor:
    """A zero input of the task's shape for ``batch`` samples (used for dry runs and checks)."""
    if task.kind == "lm":
        return torch.zeros(batch, task.tokens_per_sample, dtype=torch.long)
    if task.name in MLP_PRESETS:
        return torch.zeros(batch, MLP_PRESETS[task.name][0])
    if task.input_shape is not None:
        return torch.zeros(batch, *task.input_shape)
    return torch.zeros(batch, 1, 8, 8)
