"""A task = model + data + loss, built the same way on every rank (and in the launcher, on meta)."""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn as nn
import torch.nn.functional as F

from modelpar.models import MLP_PRESETS, PRESETS
from modelpar.train.data import TensorBatches, TokenBatches, load_digits, load_text_corpus


def lm_loss(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Mean next-byte cross entropy, nats per byte. logits (b, t, V), targets (b, t)."""
    return F.cross_entropy(logits.float().flatten(0, 1), targets.flatten())


def classification_loss(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Mean cross entropy. logits (b, classes), targets (b,)."""
    return F.cross_entropy(logits.float(), targets)


@dataclass
class Task:
    name: str
    kind: str                        # "lm" | "classify"
    model: nn.Module
    train: object                    # TokenBatches | TensorBatches: .global_batch(seed, step, n)
    val: tuple[torch.Tensor, torch.Tensor]
    loss_fn: object
    tokens_per_sample: int
    data_info: dict


def build_model_for(cfg, device: str = "cpu") -> nn.Module:
    """The built-in model ``cfg.model`` with ``cfg.model_config`` overrides (`modelpar.models.spec`);
    ``cfg.seq_len`` and ``cfg.dropout`` win over both for GPT presets.

    Raises:
        ValueError: unknown name, a factory / hf: name (train runs built-in models), unknown fields.
    """
    from modelpar.models.spec import build_builtin

    kw = {}
    if cfg.model in PRESETS:
        kw["dropout"] = cfg.dropout
        if cfg.seq_len:
            kw["seq_len"] = cfg.seq_len
    return build_builtin(cfg.model, getattr(cfg, "model_config", None) or None, device=device, seed=cfg.seed, **kw)


def synthetic_classification(in_dim: int, classes: int, n: int = 4096, seed: int = 0):
    """Inputs N(0, 1), labels from a fixed random linear teacher: a learnable stand-in for the MLPs."""
    g = torch.Generator().manual_seed(seed + 99)
    x = torch.randn(n, in_dim, generator=g)
    w = torch.randn(in_dim, classes, generator=g)
    return x, (x @ w).argmax(-1)


def build_task(cfg, *, device: str = "cpu", load_data: bool = True) -> Task:
    """Build the model (``device="meta"`` allocates nothing) and, if asked, its data."""
    model = build_model_for(cfg, device=device)
    if cfg.model in PRESETS:
        seq = model.cfg.seq_len
        if not load_data:
            return Task(cfg.model, "lm", model, None, None, lm_loss, seq, {})
        train, val, info = load_text_corpus(cfg.data)
        tb, vb = TokenBatches(train, seq), TokenBatches(val, seq)
        return Task(cfg.model, "lm", model, tb, vb.at(vb.eval_batches(cfg.eval_samples)), lm_loss, seq,
                    info.to_dict())
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
    return torch.zeros(batch, 1, 8, 8)
