"""Parameters a Hugging Face model's own forward never reaches in modelpar's task, frozen on purpose.

``AutoModelForCausalLM`` maps many types to classes that hold more than the text path modelpar trains:
a multimodal model's vision tower and projector (Gemma 3, GIT, Fuyu, Phi-4-multimodal), the
cross-attention of an encoder-decoder's decoder run without an encoder (BART, mBART, Pegasus, Marian,
Blenderbot, PLBart as causal LMs). On one process those parameters get no gradient, so AdamW leaves
them as they are; on several ranks the first step refused them (case C1: "N trainable parameter(s)
got no gradient"), with advice (``requires_grad=False``) that a ``--model hf:...`` user has no way to
follow. modelpar builds these models, so it follows it itself: `freeze_unreached` finds the
parameters no gradient reaches from the logits of one forward at the run's sequence length, on the
meta device (no memory, no values: what is reached does not depend on the token ids), and freezes
them on every rank alike before the model is wrapped, which is what one process does to them.

What depends on the shapes is probed at the run's own: a part that runs only from some sequence length
on is reached at that length or not at all. A part that runs only for some token values is not
frozen by this test: on the meta device no value decides a branch (a forward whose path depends on
values cannot run there, and is then left as it is: the first-step check still names what it misses).
"""

from __future__ import annotations

import functools
import json
import re

import torch
import torch.nn as nn


def unreached_parameters(model: nn.Module, x: torch.Tensor) -> list[str]:
    """Names of the trainable parameters of ``model`` (all on the meta device) that get no gradient from
    ``model(x).float().logsumexp(-1).sum()``; every logit takes part in that sum, so a parameter the
    logits depend on gets a gradient. ``x``: a meta input of modelpar's task (token ids ``(batch, seq)``).
    The gradients made are dropped again (``.grad = None``)."""
    trainable = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
    for _, p in trainable:
        p.grad = None
    model(x).float().logsumexp(-1).sum().backward()
    out = [n for n, p in trainable if p.grad is None]
    for _, p in trainable:
        p.grad = None
    return out


def unreached_names(name: str, overrides: dict | None, seq_len: int) -> tuple[str, ...]:
    """`unreached_parameters` of the model ``name`` / ``overrides`` builds, on a meta copy at ``seq_len``
    tokens; () where its forward cannot run on the meta device. Memoized per (name, overrides, seq_len):
    a caller measuring memory computes it before its tracker starts, which would otherwise count the meta
    copy's parameters (meta storages report their size) as the model's."""
    return _unreached_names(name, json.dumps(overrides or {}, sort_keys=True, default=str), seq_len)


@functools.lru_cache(maxsize=32)
def _unreached_names(name: str, overrides_json: str, seq_len: int) -> tuple[str, ...]:
    from modelpar.models.hf import build_hf

    try:
        twin = build_hf(name, json.loads(overrides_json) or None, device="meta", seed=None, dropout=0.0)
    except Exception:       # noqa: BLE001 - as `_probe`
        return ()
    return _probe(twin, seq_len)


def _probe(model: nn.Module, seq_len: int) -> tuple[str, ...]:
    """`unreached_parameters` of the all-meta ``model`` on one sample of ``seq_len`` tokens; () where its
    forward cannot run on the meta device (the first-step check, case C1, stays the answer there)."""
    from modelpar.models.hf import example_input

    try:
        return tuple(unreached_parameters(model, example_input(model, 1, seq_len, device="meta")))
    except Exception:       # noqa: BLE001 - any failure of the model's own forward on meta
        return ()


def freeze_unreached(model: nn.Module, name: str, overrides: dict | None, seq_len: int) -> str | None:
    """Freeze (``requires_grad=False``) the parameters of the `HFModel` ``model`` that its causal-LM
    forward never reaches (`unreached_parameters`, on a meta copy built from the same config unless
    ``model`` is all on the meta device already); returns one line naming them (None where none are).

    ``name`` / ``overrides``: the ``--model`` and ``--model-config`` ``model`` was built from;
    ``seq_len``: the run's sequence length (tokens). Image classifiers are left as they are.
    A forward that cannot run on the meta device leaves the model as it is (None): the first step's
    check (case C1) still names a parameter without a gradient."""
    if getattr(model, "task", None) != "lm" or seq_len < 1:
        return None
    meta = all(t.device.type == "meta" for t in (*model.parameters(), *model.buffers()))
    names = _probe(model, seq_len) if meta else unreached_names(name, overrides, seq_len)
    if not names:
        return None
    params = dict(model.named_parameters())
    missing = [n for n in names if n not in params]
    assert not missing, f"the meta copy of {name} has parameters the model lacks: {missing[:3]}"
    for n in names:
        params[n].requires_grad_(False)
    model.unreached = tuple(names)
    numel = sum(params[n].numel() for n in names)
    groups = sorted({re.sub(r"\.\d+(?=\.|$)", ".*", m) for m in _whole_modules(model, set(names))})
    shown = ", ".join(groups[:4]) + (f", ... ({len(groups)} in all)" if len(groups) > 4 else "")
    return (f"--model {name}: {len(names)} parameter tensor(s) ({numel / 1e6:,.2f}M values) that its causal-LM "
            f"forward never reaches are frozen ({shown}): they get no gradient, so one process leaves them "
            f"unchanged too")


def _whole_modules(model: nn.Module, names: set[str]) -> set[str]:
    """The outermost modules all of whose parameters are in ``names`` (a parameter's own name where its
    module holds others too): what a note names instead of every tensor."""
    held = {}                       # module path -> its parameter names (recursively)
    for n, _ in model.named_parameters():
        parts = n.split(".")
        for i in range(1, len(parts)):
            held.setdefault(".".join(parts[:i]), set()).add(n)
    out = set()
    for n in names:
        parts, best = n.split("."), n
        for i in range(len(parts) - 1, 0, -1):
            path = ".".join(parts[:i])
            if held[path] <= names:
                best = path
            else:
                break
        out.add(best)
    return out
